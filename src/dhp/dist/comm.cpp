#include "dhp/dist/comm.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

#include "dhp/core/build_config.h"

// DHP_WITH_NCCL comes from CMakeLists.txt: 1 when the libtorch found is a CUDA build whose
// c10d has NCCL (its torch_cuda target carries USE_C10D_NCCL); the CPU build never sees NCCL.
#if DHP_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <algorithm>
#include <functional>
#include <mutex>

#include "dhp/core/error.h"
#include "dhp/core/torch_version.h"

namespace dhp::dist {

struct Store::Impl {
  c10::intrusive_ptr<c10d::Store> store;
};

struct Group::Impl {
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
#if DHP_WITH_NCCL
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> nccl;
#endif
  std::chrono::milliseconds timeout{0};
  std::mutex mu;                              // guards pending (copies of a Group share it)
  std::vector<std::function<void()>> pending;  // waits of queued sends

  // Runs f on the backend's process group (the same c10d calls exist on both).
  template <class F>
  auto with_pg(F&& f) {
#if DHP_WITH_NCCL
    if (nccl) return f(*nccl);
#endif
    return f(*gloo);
  }
};

namespace {

thread_local CommStats tls_stats;

// Adds the wall time of one collective to this thread's statistics.
struct CommTimer {
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  int64_t bytes;
  explicit CommTimer(const torch::Tensor& t) : bytes(t.numel() * static_cast<int64_t>(t.element_size())) {}
  explicit CommTimer(int64_t b) : bytes(b) {}
  ~CommTimer() {
    tls_stats.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    tls_stats.calls += 1;
    tls_stats.bytes += bytes;
  }
};

// Gloo (libtorch 1.13) has no bfloat16 (nor int16): bf16 tensors travel as fp16 bit
// patterns where the data only moves, and 16-bit floats are summed in fp32 (better than
// a 16-bit sum anyway). NCCL takes them as they are.
bool is_half(const torch::Tensor& t) {
  return t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kHalf;
}
torch::Tensor as_bits(const torch::Tensor& t) {
  return t.scalar_type() == torch::kBFloat16 ? t.view(torch::kHalf) : t;
}

}  // namespace

CommStats comm_stats() { return tls_stats; }

bool nccl_available() {
#if DHP_WITH_NCCL
  return true;
#else
  return false;
#endif
}

Backend backend_for(const torch::Device& device) { return device.is_cuda() ? Backend::kNccl : Backend::kGloo; }

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
#if DHP_TORCH_AT_LEAST(2, 3)
  // libtorch 2.x's TCPStore defaults to a libuv server, which Debian's build (and any built
  // without libuv) refuses at the rendezvous; the classic server works in every build.
  o.useLibUV = false;
#endif
  return Store(std::make_shared<Store::Impl>(Store::Impl{c10::make_intrusive<c10d::TCPStore>(host, o)}));
}

Group::Group() = default;

Group::Group(const Store& store, const std::string& name, std::vector<int64_t> ranks, int64_t global_rank,
             std::chrono::milliseconds timeout, Backend backend)
    : ranks_(std::move(ranks)), name_(name) {
  auto it = std::find(ranks_.begin(), ranks_.end(), global_rank);
  DHP_CHECK(it != ranks_.end(), "group '", name, "': rank ", global_rank, " is not a member");
  rank_ = static_cast<int64_t>(it - ranks_.begin());
  if (ranks_.size() == 1) return;
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("dhp/" + name, store.impl()->store);
  impl_ = std::make_shared<Impl>();
  impl_->timeout = timeout;
  if (backend == Backend::kNccl) {
#if DHP_WITH_NCCL
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = timeout;
    impl_->nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, static_cast<int>(rank_),
                                                              static_cast<int>(size()), opts);
#else
    DHP_FAIL("group '", name, "': NCCL was asked for (CUDA tensors) but this dhp was built against a libtorch ",
             "without NCCL; rebuild against a CUDA libtorch");
#endif
  } else {
    auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    opts->threads = 1;
    impl_->gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, static_cast<int>(rank_),
                                                              static_cast<int>(size()), opts);
  }
  // Every member is connected before any returns, so none can close its side of a pair
  // while another is still connecting.
  barrier();
}

void Group::all_reduce_sum_(torch::Tensor& t) const {
  if (!impl_) return;
  TORCH_INTERNAL_ASSERT(t.is_contiguous());
  if (impl_->gloo && is_half(t)) {
    auto wide = t.to(torch::kFloat32);
    all_reduce_sum_(wide);
    t.copy_(wide);
    return;
  }
  CommTimer timer(t);
  std::vector<torch::Tensor> v{t};
  impl_->with_pg([&](auto& pg) { pg.allreduce(v)->wait(); });
}

void Group::all_reduce_max_(torch::Tensor& t) const {
  if (!impl_) return;
  TORCH_INTERNAL_ASSERT(t.is_contiguous());
  if (impl_->gloo && is_half(t)) {
    auto wide = t.to(torch::kFloat32);
    all_reduce_max_(wide);
    t.copy_(wide);
    return;
  }
  CommTimer timer(t);
  std::vector<torch::Tensor> v{t};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::MAX;
  impl_->with_pg([&](auto& pg) { pg.allreduce(v, o)->wait(); });
}

torch::Tensor Group::reduce_scatter_sum(const torch::Tensor& flat) const {
  DHP_CHECK(flat.dim() == 1 && flat.numel() % size() == 0, "reduce_scatter_sum on group '", name_,
            "': needs a 1-D tensor whose length is a multiple of the ", size(), " members, got shape ",
            flat.sizes());
  const int64_t n = flat.numel() / size();
  if (!impl_) return flat.to(torch::kFloat32);
  // All-to-all (Gloo in libtorch 1.13 has no reduce-scatter): chunk j goes to member j,
  // which then holds every member's copy of its chunk and adds them up.
  const std::vector<int64_t> rows(static_cast<size_t>(size()), n);
  auto parts = all_to_all(flat, rows, rows).view({size(), n});
  // A copy even for fp32 input, so that the received buffer is freed on return.
  auto sum = parts[0].to(torch::kFloat32, /*non_blocking=*/false, /*copy=*/true);
  for (int64_t j = 1; j < size(); ++j) sum.add_(parts[j]);
  return sum;
}

torch::Tensor Group::all_gather(const torch::Tensor& t, int64_t dim) const {
  if (!impl_) return t;
  const bool bits = impl_->gloo && is_half(t);
  auto in = bits ? as_bits(t.contiguous()) : t.contiguous();
  CommTimer timer(in);
  std::vector<torch::Tensor> inputs{in};
  std::vector<std::vector<torch::Tensor>> outputs(1);
  for (int64_t i = 0; i < size(); ++i) outputs[0].push_back(torch::empty_like(in));
  impl_->with_pg([&](auto& pg) { pg.allgather(outputs, inputs)->wait(); });
  auto out = torch::cat(outputs[0], dim);
  return bits ? out.view(t.scalar_type()) : out;
}

torch::Tensor Group::all_to_all(const torch::Tensor& t, const std::vector<int64_t>& send_rows,
                                const std::vector<int64_t>& recv_rows) const {
  DHP_CHECK(static_cast<int64_t>(send_rows.size()) == size() && static_cast<int64_t>(recv_rows.size()) == size(),
            "all_to_all on group '", name_, "': ", send_rows.size(), " send and ", recv_rows.size(),
            " receive splits for ", size(), " members");
  if (!impl_) return t;
  const bool bits = impl_->gloo && is_half(t);
  auto in = bits ? as_bits(t.contiguous()) : t.contiguous();
  int64_t total = 0;
  for (auto r : recv_rows) total += r;
  auto shape = in.sizes().vec();
  shape[0] = total;
  auto out = torch::empty(shape, in.options());
  CommTimer timer(in);
  auto send = send_rows, recv = recv_rows;
  impl_->with_pg([&](auto& pg) { pg.alltoall_base(out, in, recv, send)->wait(); });
  return bits ? out.view(t.scalar_type()) : out;
}

void Group::barrier() const {
  if (!impl_) return;
  impl_->with_pg([&](auto& pg) { pg.barrier()->wait(); });
}

void Group::send(const torch::Tensor& t, int64_t dst, int64_t tag) const {
  DHP_CHECK(dst >= 0 && dst < size() && dst != rank_, "send on group '", name_, "': bad destination member ", dst,
            " (this is member ", rank_, " of ", size(), ")");
  DHP_CHECK(t.is_contiguous(), "send on group '", name_, "': the tensor must be contiguous");
  CommTimer timer(t);
  auto keep = std::make_shared<std::vector<torch::Tensor>>(1, impl_->gloo ? as_bits(t) : t);
  auto work = impl_->with_pg([&](auto& pg) { return pg.send(*keep, static_cast<int>(dst), static_cast<int>(tag)); });
  const auto timeout = impl_->timeout;
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->pending.push_back([work, keep, timeout] { work->wait(timeout); });
}

void Group::recv(torch::Tensor& t, int64_t src, int64_t tag) const {
  DHP_CHECK(src >= 0 && src < size() && src != rank_, "recv on group '", name_, "': bad source member ", src,
            " (this is member ", rank_, " of ", size(), ")");
  DHP_CHECK(t.is_contiguous(), "recv on group '", name_, "': the tensor must be contiguous");
  CommTimer timer(t);
  std::vector<torch::Tensor> v{impl_->gloo ? as_bits(t) : t};
  auto work = impl_->with_pg([&](auto& pg) { return pg.recv(v, static_cast<int>(src), static_cast<int>(tag)); });
  work->wait(impl_->timeout);
}

void Group::exchange(const std::vector<std::pair<torch::Tensor, int64_t>>& sends,
                     const std::vector<std::pair<torch::Tensor, int64_t>>& recvs, int64_t tag) const {
  if (sends.empty() && recvs.empty()) return;
#if DHP_WITH_NCCL
  if (impl_->nccl) {
    auto keep = std::make_shared<std::vector<std::vector<torch::Tensor>>>();
    for (const auto& [t, dst] : sends) keep->push_back({t});
    std::vector<std::vector<torch::Tensor>> into;
    for (const auto& [t, src] : recvs) into.push_back({t});
    CommTimer timer(int64_t{0});
    impl_->nccl->startCoalescing();
    for (size_t i = 0; i < sends.size(); ++i) impl_->nccl->send((*keep)[i], static_cast<int>(sends[i].second), 0);
    for (size_t i = 0; i < recvs.size(); ++i) impl_->nccl->recv(into[i], static_cast<int>(recvs[i].second), 0);
    auto work = impl_->nccl->endCoalescing();
    // The current stream waits for the batch; the host does not block.
    work->wait();
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->pending.push_back([work, keep] { work->wait(); });
    return;
  }
#endif
  for (const auto& [t, dst] : sends) send(t, dst, tag);
  for (const auto& [t, src] : recvs) {
    auto into = t;
    recv(into, src, tag);
  }
}

void Group::wait_sends() const {
  if (!impl_) return;
  std::vector<std::function<void()>> pending;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    pending.swap(impl_->pending);
  }
  CommTimer timer(int64_t{0});
  for (auto& w : pending) w();
}

}  // namespace dhp::dist
