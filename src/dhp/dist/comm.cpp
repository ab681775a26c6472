#include "dhp/dist/comm.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

#include <algorithm>

#include "dhp/core/error.h"

namespace dhp::dist {

struct Store::Impl {
  c10::intrusive_ptr<c10d::Store> store;
};

struct Group::Impl {
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;
};

namespace {

thread_local CommStats tls_stats;

// Adds the wall time of one collective to this thread's statistics.
struct CommTimer {
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  int64_t bytes;
  explicit CommTimer(const torch::Tensor& t) : bytes(t.numel() * static_cast<int64_t>(t.element_size())) {}
  ~CommTimer() {
    tls_stats.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    tls_stats.calls += 1;
    tls_stats.bytes += bytes;
  }
};

}  // namespace

CommStats comm_stats() { return tls_stats; }

Store make_hash_store() {
  return Store(std::make_shared<Store::Impl>(Store::Impl{c10::make_intrusive<c10d::HashStore>()}));
}

Store make_tcp_store(const std::string& host, int port, int64_t world_size, bool is_master,
                     std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions o;
  o.port = static_cast<uint16_t>(port);
  o.isServer = is_master;
  o.numWorkers = static_cast<std::size_t>(world_size);
  o.timeout = timeout;
  return Store(std::make_shared<Store::Impl>(Store::Impl{c10::make_intrusive<c10d::TCPStore>(host, o)}));
}

Group::Group() = default;

Group::Group(const Store& store, const std::string& name, std::vector<int64_t> ranks, int64_t global_rank,
             std::chrono::milliseconds timeout)
    : ranks_(std::move(ranks)), name_(name) {
  auto it = std::find(ranks_.begin(), ranks_.end(), global_rank);
  DHP_CHECK(it != ranks_.end(), "group '", name, "': rank ", global_rank, " is not a member");
  rank_ = static_cast<int64_t>(it - ranks_.begin());
  if (ranks_.size() == 1) return;
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
  opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  opts->threads = 1;
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("dhp/" + name, store.impl()->store);
  impl_ = std::make_shared<Impl>();
  impl_->pg = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, static_cast<int>(rank_),
                                                          static_cast<int>(size()), opts);
  // Every member is connected before any returns, so none can close its side of a pair
  // while another is still connecting.
  impl_->pg->barrier()->wait();
}

void Group::all_reduce_sum_(torch::Tensor& t) const {
  if (!impl_) return;
  TORCH_INTERNAL_ASSERT(t.is_contiguous());
  CommTimer timer(t);
  std::vector<torch::Tensor> v{t};
  impl_->pg->allreduce(v)->wait();
}

void Group::all_reduce_max_(torch::Tensor& t) const {
  if (!impl_) return;
  TORCH_INTERNAL_ASSERT(t.is_contiguous());
  CommTimer timer(t);
  std::vector<torch::Tensor> v{t};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::MAX;
  impl_->pg->allreduce(v, o)->wait();
}

torch::Tensor Group::all_gather(const torch::Tensor& t, int64_t dim) const {
  if (!impl_) return t;
  auto in = t.contiguous();
  CommTimer timer(in);
  std::vector<torch::Tensor> inputs{in};
  std::vector<std::vector<torch::Tensor>> outputs(1);
  for (int64_t i = 0; i < size(); ++i) outputs[0].push_back(torch::empty_like(in));
  impl_->pg->allgather(outputs, inputs)->wait();
  return torch::cat(outputs[0], dim);
}

torch::Tensor Group::all_to_all(const torch::Tensor& t, const std::vector<int64_t>& send_rows,
                                const std::vector<int64_t>& recv_rows) const {
  DHP_CHECK(static_cast<int64_t>(send_rows.size()) == size() && static_cast<int64_t>(recv_rows.size()) == size(),
            "all_to_all on group '", name_, "': ", send_rows.size(), " send and ", recv_rows.size(),
            " receive splits for ", size(), " members");
  if (!impl_) return t;
  auto in = t.contiguous();
  int64_t total = 0;
  for (auto r : recv_rows) total += r;
  auto shape = in.sizes().vec();
  shape[0] = total;
  auto out = torch::empty(shape, in.options());
  CommTimer timer(in);
  auto send = send_rows, recv = recv_rows;
  impl_->pg->alltoall_base(out, in, recv, send)->wait();
  return out;
}

void Group::barrier() const {
  if (!impl_) return;
  impl_->pg->barrier()->wait();
}

}  // namespace dhp::dist
