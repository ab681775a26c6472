#include "dhp/dist/comm.h"

#include <torch/csrc/distributed/c10d/FileStore.hpp>
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
#if DHP_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#endif

#include <algorithm>
#include <functional>
#include <mutex>

#include "dhp/core/error.h"
#include "dhp/core/torch_version.h"

namespace dhp::dist {

struct Store::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  Transport transport;
};

struct Group::Impl {
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
#if DHP_WITH_NCCL
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> nccl;
#endif
  std::chrono::milliseconds timeout{0};
  torch::Device device{torch::kCPU};          // the group's tensors' device (NCCL: its CUDA device)
  std::mutex mu;                              // guards pending (copies of a Group share it)
  std::vector<std::function<void()>> pending;  // waits of queued sends
  std::string name;                            // the group's, for errors

  // Runs f (communication of this group); a failure of the backend (a peer gone, a timeout)
  // becomes a CommError naming the group.
  template <class F>
  auto guarded(F&& f) {
    try {
      return f();
    } catch (const CommError&) {
      throw;
    } catch (const std::exception& e) {
      throw CommError("group '" + name + "': " + e.what());
    }
  }
  // Runs f on the backend's process group (the same c10d calls exist on both), guarded.
  template <class F>
  auto with_pg(F&& f) {
    return guarded([&] {
#if DHP_WITH_NCCL
      if (nccl) return f(*nccl);
#endif
      return f(*gloo);
    });
  }
};

namespace {

thread_local CommStats tls_stats;

#if DHP_WITH_CUDA
// A call's span on its CUDA stream, read (and the host synchronized) by comm_stats().
struct StreamSpan {
  std::shared_ptr<at::cuda::CUDAEvent> start, end;
};
thread_local std::vector<StreamSpan> tls_spans;
#endif

// Adds one call to this thread's statistics: its wall time, or, for work ordered on a CUDA
// stream (`stream` = that device), the stream's time between two events.
struct CommTimer {
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  int64_t bytes;
#if DHP_WITH_CUDA
  StreamSpan span;
  c10::DeviceIndex index = -1;
#endif
  CommTimer(int64_t b, const torch::Device& stream) : bytes(b) {
#if DHP_WITH_CUDA
    if (stream.is_cuda()) {
      index = stream.index();
      span.start = std::make_shared<at::cuda::CUDAEvent>(cudaEventDefault);
      span.start->record(at::cuda::getCurrentCUDAStream(index));
    }
#else
    (void)stream;
#endif
  }
  ~CommTimer() {
    tls_stats.calls += 1;
    tls_stats.bytes += bytes;
#if DHP_WITH_CUDA
    if (span.start) {
      span.end = std::make_shared<at::cuda::CUDAEvent>(cudaEventDefault);
      span.end->record(at::cuda::getCurrentCUDAStream(index));
      tls_spans.push_back(std::move(span));
      return;
    }
#endif
    tls_stats.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
};

int64_t bytes_of(const torch::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

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

CommStats comm_stats() {
#if DHP_WITH_CUDA
  for (auto& s : tls_spans) {
    s.end->synchronize();
    tls_stats.seconds += static_cast<double>(s.start->elapsed_time(*s.end)) / 1e3;
  }
  tls_spans.clear();
#endif
  return tls_stats;
}

bool nccl_available() {
#if DHP_WITH_NCCL
  return true;
#else
  return false;
#endif
}


Store make_hash_store() {
  return Store(std::make_shared<Store::Impl>(Store::Impl{c10::make_intrusive<c10d::HashStore>(), {}}));
}

Store make_tcp_store(const std::string& host, int port, int64_t world_size, bool is_master,
                     std::chrono::milliseconds timeout, Transport transport) {
  c10d::TCPStoreOptions o;
  o.port = static_cast<uint16_t>(port);
  o.isServer = is_master;
  if (world_size > 0) o.numWorkers = static_cast<std::size_t>(world_size);
  o.waitWorkers = world_size > 0;
  o.timeout = timeout;
#if DHP_TORCH_AT_LEAST(2, 3)
  // libtorch 2.x's TCPStore defaults to a libuv server, which Debian's build (and any built
  // without libuv) refuses at the rendezvous; the classic server works in every build.
  o.useLibUV = false;
#endif
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(host, o);
  } catch (const std::exception& e) {
    DHP_FAIL(is_master ? "cannot host" : "cannot reach", " the job's store at ", host, ":", port,
             " (MASTER_ADDR:MASTER_PORT) within ", timeout.count() / 1000, " s: ", e.what());
  }
  return Store(std::make_shared<Store::Impl>(Store::Impl{store, std::move(transport)}));
}

namespace {
// A store call; a failure (the store's host gone, a timeout) becomes a CommError.
template <class F>
auto store_call(const std::string& key, F&& f) {
  try {
    return f();
  } catch (const std::exception& e) {
    throw CommError("the job's store (key '" + key + "'): " + e.what());
  }
}
}  // namespace

Store make_file_store(const std::string& path, int64_t world_size) {
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::FileStore>(path, static_cast<int>(world_size));
  } catch (const std::exception& e) {
    DHP_FAIL("cannot open the job's store file ", path, ": ", e.what());
  }
  return Store(std::make_shared<Store::Impl>(Store::Impl{store, {}}));
}

void Store::set(const std::string& key, const std::string& value) const {
  store_call(key, [&] { impl_->store->set(key, std::vector<uint8_t>(value.begin(), value.end())); });
}

std::string Store::get(const std::string& key) const {
  const auto v = store_call(key, [&] { return impl_->store->get(key); });
  return std::string(v.begin(), v.end());
}

std::optional<std::string> Store::try_get(const std::string& key) const {
  if (!store_call(key, [&] { return impl_->store->check({key}); })) return std::nullopt;
  return get(key);
}

int64_t Store::add(const std::string& key, int64_t n) const {
  return store_call(key, [&] { return impl_->store->add(key, n); });
}

Store Store::prefixed(const std::string& prefix) const {
  return Store(std::make_shared<Impl>(Impl{c10::make_intrusive<c10d::PrefixStore>(prefix, impl_->store), impl_->transport}));
}

const Transport& Store::transport() const { return impl_->transport; }

void check_same_job(const Store& store, int64_t rank, int64_t world, const std::string& fingerprint,
                    const std::string& host) {
  if (world <= 1) return;
  store.set("dhp/same-job/" + std::to_string(rank), host + "\n" + fingerprint);
  if (rank == 0) {
    std::string differ;
    int64_t count = 0;
    for (int64_t r = 1; r < world; ++r) {
      const auto v = store.get("dhp/same-job/" + std::to_string(r));
      const auto nl = v.find('\n');
      if (v.substr(nl + 1) == fingerprint) continue;
      if (++count <= 8) differ += "\n  rank " + std::to_string(r) + " on " + v.substr(0, nl) + ": " + v.substr(nl + 1);
    }
    std::string verdict;
    if (count > 0) {
      verdict = std::to_string(count) + " rank(s) run another dhp or another config than rank 0 (on " + host +
                ": " + fingerprint + "):" + differ + (count > 8 ? "\n  ..." : "") +
                "\nevery host must run the same dhp build with the same config and --set overrides";
    }
    store.set("dhp/same-job/verdict", verdict);
    DHP_CHECK(verdict.empty(), verdict);
    return;
  }
  const auto verdict = store.get("dhp/same-job/verdict");
  DHP_CHECK(verdict.empty(), verdict);
}

Group::Group() = default;

void Group::set_members(const std::string& name, std::vector<int64_t> ranks, int64_t global_rank) {
  ranks_ = std::move(ranks);
  name_ = name;
  auto it = std::find(ranks_.begin(), ranks_.end(), global_rank);
  DHP_CHECK(it != ranks_.end(), "group '", name, "': rank ", global_rank, " is not a member");
  rank_ = static_cast<int64_t>(it - ranks_.begin());
}

Group Group::unconnected(const std::string& name, std::vector<int64_t> ranks, int64_t global_rank) {
  Group g;
  g.set_members(name, std::move(ranks), global_rank);
  return g;
}

Backend Group::backend() const {
#if DHP_WITH_NCCL
  if (impl_ && impl_->nccl) return Backend::kNccl;
#endif
  return Backend::kGloo;
}

bool Group::alone(const char* what) const {
  if (impl_) return false;
  DHP_CHECK(size() == 1, "group '", name_, "' (", size(), " members) is not connected: no communicator was made ",
            "for it because no strategy was meant to use it, yet ", what, " was called on it");
  return true;
}

Group::Group(const Store& store, const std::string& name, std::vector<int64_t> ranks, int64_t global_rank,
             std::chrono::milliseconds timeout, Backend backend, torch::Device device) {
  set_members(name, std::move(ranks), global_rank);
  if (ranks_.size() == 1 && backend != Backend::kNccl) return;  // NCCL: connected even alone (a smoke test)
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("dhp/" + name, store.impl()->store);
  impl_ = std::make_shared<Impl>();
  impl_->name = name;
  impl_->timeout = timeout;
  impl_->device = device;
  if (backend == Backend::kNccl) {
#if DHP_WITH_NCCL
    DHP_CHECK(device.is_cuda() && device.has_index(), "group '", name, "': NCCL needs this rank's CUDA device, got ",
              device.str());
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = timeout;
    impl_->nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, static_cast<int>(rank_),
                                                              static_cast<int>(size()), opts);
#if DHP_TORCH_AT_LEAST(2, 3)
    // One communicator over the members, made now on every member: point-to-point batches
    // (exchange) run on it instead of making a communicator per pair on first use.
    impl_->nccl->setBoundDeviceId(device);
    impl_->nccl->eagerConnectSingleDevice(device);
#endif
#else
    DHP_FAIL("group '", name, "': NCCL was asked for (CUDA tensors) but this dhp was built against a libtorch ",
             "without NCCL; rebuild against a CUDA libtorch");
#endif
  } else {
    auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
    const auto& transport = store.transport();
    if (transport.interfaces.empty()) {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(transport.address));
    } else {
      for (const auto& i : transport.interfaces)
        opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(i));
    }
    opts->threads = 1;
    impl_->gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, static_cast<int>(rank_),
                                                              static_cast<int>(size()), opts);
  }
  // Every member is connected before any returns, so none can close its side of a pair
  // while another is still connecting.
  barrier();
}

// Gloo's reductions run on host tensors, 16-bit floats widened to fp32 (see is_half).
bool gloo_stages(const torch::Tensor& t) { return !t.is_cpu() || is_half(t); }
torch::Tensor gloo_copy(const torch::Tensor& t) {
  return t.to(torch::TensorOptions().device(torch::kCPU).dtype(is_half(t) ? torch::kFloat32 : t.scalar_type()));
}

void Group::all_reduce_sum_(torch::Tensor& t) const {
  if (alone("all_reduce_sum_")) return;
  TORCH_INTERNAL_ASSERT(t.is_contiguous());
  if (impl_->gloo && gloo_stages(t)) {
    auto host = gloo_copy(t);
    all_reduce_sum_(host);
    t.copy_(host);
    return;
  }
  CommTimer timer(bytes_of(t), t.device());
  std::vector<torch::Tensor> v{t};
  impl_->with_pg([&](auto& pg) { pg.allreduce(v)->wait(); });
}

void Group::all_reduce_max_(torch::Tensor& t) const {
  if (alone("all_reduce_max_")) return;
  TORCH_INTERNAL_ASSERT(t.is_contiguous());
  if (impl_->gloo && gloo_stages(t)) {
    auto host = gloo_copy(t);
    all_reduce_max_(host);
    t.copy_(host);
    return;
  }
  CommTimer timer(bytes_of(t), t.device());
  std::vector<torch::Tensor> v{t};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::MAX;
  impl_->with_pg([&](auto& pg) { pg.allreduce(v, o)->wait(); });
}

namespace {
// Member r's sum of the `size` chunks of `parts` (size x n, as received by the all-to-all of a
// reduce-scatter), in fp32, added in member order. A copy even for fp32 input, so that the
// received buffer is freed on return.
torch::Tensor sum_chunks(const torch::Tensor& parts) {
  auto sum = parts[0].to(torch::kFloat32, /*non_blocking=*/false, /*copy=*/true);
  for (int64_t j = 1; j < parts.size(0); ++j) sum.add_(parts[j]);
  return sum;
}
}  // namespace

void Group::check_reduce_scatter(const torch::Tensor& flat) const {
  DHP_CHECK(flat.dim() == 1 && flat.numel() % size() == 0, "reduce_scatter_sum on group '", name_,
            "': needs a 1-D tensor whose length is a multiple of the ", size(), " members, got shape ",
            flat.sizes());
}

torch::Tensor Group::reduce_scatter_sum(const torch::Tensor& flat) const {
  check_reduce_scatter(flat);
  const int64_t n = flat.numel() / size();
  if (alone("reduce_scatter_sum")) return flat.to(torch::kFloat32);
  // All-to-all (Gloo in libtorch 1.13 has no reduce-scatter): chunk j goes to member j,
  // which then holds every member's copy of its chunk and adds them up.
  const std::vector<int64_t> rows(static_cast<size_t>(size()), n);
  return sum_chunks(all_to_all(flat, rows, rows).view({size(), n}));
}

Work& Work::operator=(Work&& other) noexcept {
  if (this != &other) {
    finish_ = std::move(other.finish_);
    other.finish_ = nullptr;
    bytes_ = other.bytes_;
  }
  return *this;
}
Work::Work(Work&& other) noexcept : finish_(std::move(other.finish_)), bytes_(other.bytes_) { other.finish_ = nullptr; }

Work::~Work() = default;

torch::Tensor Work::wait() {
  if (!finish_) return torch::Tensor();
  auto finish = std::move(finish_);
  finish_ = nullptr;
  const auto t0 = std::chrono::steady_clock::now();
  auto out = finish();
  if (bytes_ > 0) {
    tls_stats.calls += 1;
    tls_stats.bytes += bytes_;
    tls_stats.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return out;
}

Work Group::done(torch::Tensor result) {
  Work w;
  w.finish_ = [result] { return result; };
  return w;
}

Work Group::start_all_reduce_sum(torch::Tensor t) const {
  if (alone("start_all_reduce_sum")) return done(t);
  TORCH_INTERNAL_ASSERT(t.is_contiguous());
  // Gloo sums a host fp32 copy (as all_reduce_sum_ does), copied back by wait().
  auto on = impl_->gloo && gloo_stages(t) ? gloo_copy(t) : t;
  std::vector<torch::Tensor> v{on};
  auto work = impl_->with_pg([&](auto& pg) { return pg.allreduce(v); });
  Work w;
  w.bytes_ = bytes_of(on);
  w.finish_ = [work, t, on, impl = impl_]() mutable {
    impl->guarded([&] { work->wait(); });
    if (!on.is_same(t)) t.copy_(on);
    return t;
  };
  return w;
}

Work Work::then(std::function<torch::Tensor(torch::Tensor)> f) && {
  Work w;
  w.bytes_ = bytes_;
  w.finish_ = [prev = std::move(finish_), f = std::move(f)] { return f(prev ? prev() : torch::Tensor()); };
  finish_ = nullptr;
  return w;
}

namespace {
// A tensor as a backend moves it (data only, nothing summed): Gloo takes host memory and no
// bf16, so there a CUDA tensor goes through a host copy and 16-bit floats travel as fp16 bit
// patterns; back() gives a received tensor the original's dtype and device.
struct Moved {
  torch::Tensor in;
  torch::Device device;
  torch::ScalarType dtype;
  bool bits;
  Moved(const torch::Tensor& t, bool gloo)
      : device(t.device()), dtype(t.scalar_type()), bits(gloo && is_half(t)) {
    in = gloo ? t.to(torch::kCPU).contiguous() : t.contiguous();
    if (bits) in = as_bits(in);
  }
  torch::Tensor back(const torch::Tensor& out) const { return (bits ? out.view(dtype) : out).to(device); }
};
}  // namespace

Work Group::start_reduce_scatter_sum(const torch::Tensor& flat) const {
  check_reduce_scatter(flat);
  if (alone("start_reduce_scatter_sum")) return done(flat.to(torch::kFloat32));
  const int64_t n = flat.numel() / size(), members = size();
  const std::vector<int64_t> rows(static_cast<size_t>(size()), n);
  return start_all_to_all(flat, rows, rows).then([members, n](torch::Tensor parts) {
    return sum_chunks(parts.view({members, n}));
  });
}

Work Group::start_all_to_all(const torch::Tensor& t, const std::vector<int64_t>& send_rows,
                             const std::vector<int64_t>& recv_rows) const {
  DHP_CHECK(static_cast<int64_t>(send_rows.size()) == size() && static_cast<int64_t>(recv_rows.size()) == size(),
            "all_to_all on group '", name_, "': ", send_rows.size(), " send and ", recv_rows.size(),
            " receive splits for ", size(), " members");
  if (alone("start_all_to_all")) return done(t);
  const Moved m(t, impl_->gloo.defined());
  int64_t total = 0;
  for (auto r : recv_rows) total += r;
  auto shape = m.in.sizes().vec();
  shape[0] = total;
  auto out = torch::empty(shape, m.in.options());
  auto send = send_rows, recv = recv_rows;
  auto in = m.in;
  auto work = impl_->with_pg([&](auto& pg) { return pg.alltoall_base(out, in, recv, send); });
  Work w;
  w.bytes_ = bytes_of(m.in);
  w.finish_ = [work, m, out, impl = impl_] {
    impl->guarded([&] { work->wait(); });
    return m.back(out);
  };
  return w;
}

Work Group::start_all_gather(const torch::Tensor& t, int64_t dim) const {
  if (alone("start_all_gather")) return done(t);
  const Moved m(t, impl_->gloo.defined());
  auto inputs = std::make_shared<std::vector<torch::Tensor>>(1, m.in);
  auto outputs = std::make_shared<std::vector<std::vector<torch::Tensor>>>(1);
  for (int64_t i = 0; i < size(); ++i) (*outputs)[0].push_back(torch::empty_like(m.in));
  auto work = impl_->with_pg([&](auto& pg) { return pg.allgather(*outputs, *inputs); });
  Work w;
  w.bytes_ = bytes_of(m.in);
  w.finish_ = [work, inputs, outputs, dim, m, impl = impl_] {
    impl->guarded([&] { work->wait(); });
    return m.back(torch::cat((*outputs)[0], dim));
  };
  return w;
}

torch::Tensor Group::all_gather(const torch::Tensor& t, int64_t dim) const {
  if (alone("all_gather")) return t;
  if (impl_->gloo && !t.is_cpu()) return all_gather(t.cpu(), dim).to(t.device());
  const bool bits = impl_->gloo && is_half(t);
  auto in = bits ? as_bits(t.contiguous()) : t.contiguous();
  CommTimer timer(bytes_of(in), in.device());
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
  if (alone("all_to_all")) return t;
  if (impl_->gloo && !t.is_cpu()) return all_to_all(t.cpu(), send_rows, recv_rows).to(t.device());
  const bool bits = impl_->gloo && is_half(t);
  auto in = bits ? as_bits(t.contiguous()) : t.contiguous();
  int64_t total = 0;
  for (auto r : recv_rows) total += r;
  auto shape = in.sizes().vec();
  shape[0] = total;
  auto out = torch::empty(shape, in.options());
  CommTimer timer(bytes_of(in), in.device());
  auto send = send_rows, recv = recv_rows;
  impl_->with_pg([&](auto& pg) { pg.alltoall_base(out, in, recv, send)->wait(); });
  return bits ? out.view(t.scalar_type()) : out;
}

void Group::barrier() const {
  if (alone("barrier")) return;
#if DHP_WITH_NCCL
  if (impl_->nccl) {
    // A one-element sum on the group's own device, then the host waits for it (NCCL's own
    // barrier guesses a device from the rank).
    auto t = torch::zeros({1}, torch::TensorOptions().dtype(torch::kFloat32).device(impl_->device));
    std::vector<torch::Tensor> v{t};
    impl_->guarded([&] { impl_->nccl->allreduce(v)->wait(); });
    (void)t.cpu();
    return;
  }
#endif
  impl_->guarded([&] { impl_->gloo->barrier()->wait(); });
}

void Group::send(const torch::Tensor& t, int64_t dst, int64_t tag) const {
  DHP_CHECK(dst >= 0 && dst < size() && dst != rank_, "send on group '", name_, "': bad destination member ", dst,
            " (this is member ", rank_, " of ", size(), ")");
  DHP_CHECK(t.is_contiguous(), "send on group '", name_, "': the tensor must be contiguous");
  if (alone("send")) return;
#if DHP_WITH_NCCL
  if (impl_->nccl) return exchange({{t, dst}}, {}, tag);  // a batch of one, on the group's communicator
#endif
  CommTimer timer(bytes_of(t), torch::kCPU);
  // Gloo reads host memory: a CUDA tensor is copied out first (the copy is what is kept).
  auto keep = std::make_shared<std::vector<torch::Tensor>>(1, as_bits(t.cpu()));
  auto work = impl_->gloo->send(*keep, static_cast<int>(dst), static_cast<int>(tag));
  const auto timeout = impl_->timeout;
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->pending.push_back([work, keep, timeout] { work->wait(timeout); });
}

void Group::recv(torch::Tensor& t, int64_t src, int64_t tag) const {
  DHP_CHECK(src >= 0 && src < size() && src != rank_, "recv on group '", name_, "': bad source member ", src,
            " (this is member ", rank_, " of ", size(), ")");
  DHP_CHECK(t.is_contiguous(), "recv on group '", name_, "': the tensor must be contiguous");
  if (alone("recv")) return;
#if DHP_WITH_NCCL
  if (impl_->nccl) return exchange({}, {{t, src}}, tag);
#endif
  if (!t.is_cpu()) {  // Gloo writes host memory
    auto host = torch::empty(t.sizes(), t.options().device(torch::kCPU));
    recv(host, src, tag);
    t.copy_(host);
    return;
  }
  CommTimer timer(bytes_of(t), torch::kCPU);
  std::vector<torch::Tensor> v{as_bits(t)};
  impl_->guarded([&] { impl_->gloo->recv(v, static_cast<int>(src), static_cast<int>(tag))->wait(impl_->timeout); });
}

void Group::exchange(const std::vector<std::pair<torch::Tensor, int64_t>>& sends,
                     const std::vector<std::pair<torch::Tensor, int64_t>>& recvs, int64_t tag) const {
  if (sends.empty() && recvs.empty()) return;
  if (alone("exchange")) return;
#if DHP_WITH_NCCL
  if (impl_->nccl) {
    auto keep = std::make_shared<std::vector<std::vector<torch::Tensor>>>();
    int64_t bytes = 0;
    for (const auto& [t, dst] : sends) {
      keep->push_back({t});
      bytes += bytes_of(t);
    }
    std::vector<std::vector<torch::Tensor>> into;
    for (const auto& [t, src] : recvs) into.push_back({t});
    CommTimer timer(bytes, impl_->device);
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
  CommTimer timer(0, torch::kCPU);
  impl_->guarded([&] {
    for (auto& w : pending) w();
  });
}

}  // namespace dhp::dist
