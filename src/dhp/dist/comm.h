// Communication: stores for rendezvous and Group, a communicator over a subset of the
// job's global ranks. The only place that touches c10d: Gloo for CPU tensors, NCCL for
// CUDA tensors when built against a CUDA libtorch (DHP_WITH_NCCL, see CMakeLists.txt); the
// header is free of c10d types so that version-specific calls stay in comm.cpp.
//
// Contract: every collective must be called by all members of the group, in the same order.
// Under Gloo it is blocking; under NCCL it is ordered on the current CUDA stream and the host
// does not wait (a result is ready for the stream's next kernels; reading it on the host
// synchronizes). A Group of one (the default) makes every collective a local no-op.
// A collective that does not complete within the group's timeout throws (Gloo) or aborts the
// communicator (NCCL's watchdog). A Group is not thread-safe; distinct Groups may be used from
// distinct threads.
// Gloo takes host tensors: a Gloo group given CUDA tensors (several ranks sharing one GPU,
// where NCCL refuses) stages them through host copies, correct and slow.
#pragma once

#include <torch/types.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dhp/core/error.h"
#include "dhp/dist/transport.h"

namespace dhp::dist {

// Communication that failed because a peer or the store went away or did not answer in
// time: a consequence of a failure elsewhere more often than a cause (the launcher tells
// them apart when it names the rank that failed).
class CommError : public Error {
 public:
  using Error::Error;
};

// Shared key-value store all ranks of a job meet through (opaque handle), and the transport
// its Groups connect over (loopback unless made otherwise).
class Store {
 public:
  struct Impl;
  explicit Store(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  const std::shared_ptr<Impl>& impl() const { return impl_; }

  void set(const std::string& key, const std::string& value) const;
  // Waits for the key up to the store's timeout (throws after it).
  std::string get(const std::string& key) const;
  // The value if the key is there now, else nullopt (no waiting).
  std::optional<std::string> try_get(const std::string& key) const;
  // Adds n to a counter (created at 0) and returns the new value: the first caller gets n.
  int64_t add(const std::string& key, int64_t n) const;
  // The same store seen under `prefix` (keys of one attempt of a restarted job).
  Store prefixed(const std::string& prefix) const;
  const Transport& transport() const;

 private:
  std::shared_ptr<Impl> impl_;
};

// In-process store shared by threads (tests run ranks as threads).
Store make_hash_store();
// TCP store on host:port: `is_master` listens (on every interface: c10d's TCPStore binds the
// wildcard address), the others connect; `world_size` counts the clients the master waits
// for (0: do not wait). Its Groups use `transport`.
Store make_tcp_store(const std::string& host, int port, int64_t world_size, bool is_master,
                     std::chrono::milliseconds timeout, Transport transport = {});

// File store: the ranks of one host meet through a file (no socket at all); `world_size`
// processes open it. dhp's own launcher uses it for jobs on one host.
Store make_file_store(const std::string& path, int64_t world_size);

// Start-up check that every rank runs the same job: each rank posts `fingerprint` (dhp's
// version and the resolved config's hash) with its host; rank 0 compares them and every
// rank throws dhp::Error naming the ranks and hosts that differ from rank 0.
void check_same_job(const Store& store, int64_t rank, int64_t world, const std::string& fingerprint,
                    const std::string& host);

// Time, calls and bytes sent (input sizes) of the collectives this thread has run (ranks are
// processes or, in tests, threads); differences between two reads measure a step. Work on
// a CUDA stream (NCCL) is timed with CUDA events, from the stream reaching the call to the
// stream passing it (host timers would see only the enqueue); a read waits for those events.
struct CommStats {
  double seconds = 0;
  int64_t calls = 0;
  int64_t bytes = 0;
};
CommStats comm_stats();

// Which c10d backend a Group runs on: Gloo (CPU tensors) or NCCL (CUDA tensors; only in a
// build with DHP_WITH_NCCL, otherwise asking for it throws).
enum class Backend { kGloo, kNccl };
// True when this build can create NCCL groups.
bool nccl_available();

// A collective started without waiting (Group::start_*):
// the backend runs it beside the caller's compute (Gloo on its worker thread; NCCL on its own
// stream). wait() blocks until it completed and returns its result; it counts in comm_stats()
// of the waiting thread as one call, its bytes, and the time wait() blocked (the part of the
// communication that compute did not hide); a second wait() returns an undefined tensor.
// Move-only. A Work destroyed unwaited is abandoned (the backend keeps its tensors alive): only
// on the way out of a failed step, after which the group is not used again.
class Work {
 public:
  Work() = default;  // done: wait() returns an undefined tensor
  Work(Work&& other) noexcept;
  Work& operator=(Work&& other) noexcept;
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;
  ~Work();
  torch::Tensor wait();
  bool waited() const { return !finish_; }
  // This work, with f applied to its result by wait() (f's time counts as waiting).
  Work then(std::function<torch::Tensor(torch::Tensor)> f) &&;

 private:
  friend class Group;
  std::function<torch::Tensor()> finish_;  // waits and makes the result
  int64_t bytes_ = 0;
};

class Group {
 public:
  Group();  // the group of one: this rank alone
  // Collective over the members: creates the group's connections and returns once every
  // member has (a barrier). `name` must be unique per
  // group in the job and identical on every member; `ranks` are global ranks in group order.
  // `device`: where the group's tensors live; NCCL binds its communicator to that CUDA
  // device (created here, eagerly, so that later point-to-point batches reuse it). A Gloo
  // group of one has no communicator; an NCCL group of one has one (the one-GPU smoke test).
  Group(const Store& store, const std::string& name, std::vector<int64_t> ranks, int64_t global_rank,
        std::chrono::milliseconds timeout, Backend backend = Backend::kGloo,
        torch::Device device = torch::Device(torch::kCPU));
  // A group that is not connected (no communicator is made: no strategy uses it): it knows
  // its members and this rank's position, and every communication on it throws.
  static Group unconnected(const std::string& name, std::vector<int64_t> ranks, int64_t global_rank);
  // Has this group a communicator (or is it the group of one)?
  bool connected() const { return impl_ != nullptr || size() == 1; }
  Backend backend() const;

  int64_t rank() const { return rank_; }  // position of this rank in ranks()
  int64_t size() const { return static_cast<int64_t>(ranks_.size()); }
  const std::vector<int64_t>& ranks() const { return ranks_; }
  const std::string& name() const { return name_; }

  // Sum over the members, in place. Any shape; contiguous fp32/bf16/int64.
  void all_reduce_sum_(torch::Tensor& t) const;
  // all_reduce_sum_ started now and finished by the Work's wait(), which returns `t` summed.
  // `t` must not be touched until then. Where Gloo would stage the tensor (a CUDA or a 16-bit
  // tensor) it runs at once and the Work is done.
  Work start_all_reduce_sum(torch::Tensor t) const;
  // Element-wise maximum over the members, in place.
  void all_reduce_max_(torch::Tensor& t) const;
  // Reduce-scatter of a 1-D tensor whose length is a multiple of size(): member r gets the
  // sum over members of chunk r, in fp32 (summed in member order, so every run adds the
  // same numbers the same way). Moves each element once ((size-1)/size of the input per
  // member, in the input's dtype), half an all-reduce's traffic.
  torch::Tensor reduce_scatter_sum(const torch::Tensor& flat) const;
  // reduce_scatter_sum started now; the Work's wait() returns this member's fp32 chunk.
  Work start_reduce_scatter_sum(const torch::Tensor& flat) const;
  // Concatenation along `dim` of every member's tensor (same shapes), in group order.
  torch::Tensor all_gather(const torch::Tensor& t, int64_t dim) const;
  // all_gather started now; the Work's wait() returns the concatenation.
  Work start_all_gather(const torch::Tensor& t, int64_t dim) const;
  // Along dim 0: send rows [sum(send[:j]), +send[j]) to member j, receive recv[j] rows from j.
  torch::Tensor all_to_all(const torch::Tensor& t, const std::vector<int64_t>& send_rows,
                           const std::vector<int64_t>& recv_rows) const;
  // all_to_all started now; the Work's wait() returns the received rows.
  Work start_all_to_all(const torch::Tensor& t, const std::vector<int64_t>& send_rows,
                        const std::vector<int64_t>& recv_rows) const;
  void barrier() const;

  // Point-to-point (local, not collective: only the two members involved call it).
  // send: queues `t` (contiguous) for member `dst` and returns at once; `t` is kept alive
  // until wait_sends(). Each send must be matched by a recv on `dst` with the same `tag`
  // (>= 0); messages between one pair with one tag arrive in the order sent.
  void send(const torch::Tensor& t, int64_t dst, int64_t tag) const;
  // Receives into `t` (contiguous, the sent shape) from member `src`; blocks until the data
  // arrived, or throws after the group's timeout.
  void recv(torch::Tensor& t, int64_t src, int64_t tag) const;
  // Posts `sends` (each queued as by send()) and `recvs` (tensor, source member) as one
  // batch, then waits for the receives. Under NCCL the batch is one coalesced group, which
  // progresses all its messages together: two members that both send to and receive from each
  // other in one exchange cannot block each other (train/transfers.h). Under Gloo: send()s
  // then recv()s.
  void exchange(const std::vector<std::pair<torch::Tensor, int64_t>>& sends,
                const std::vector<std::pair<torch::Tensor, int64_t>>& recvs, int64_t tag) const;
  // Blocks until every send queued on this Group (by any copy of it) has been received.
  void wait_sends() const;

 private:
  // True when there is nothing to communicate (a group of one); throws on an unconnected group.
  bool alone(const char* what) const;
  void check_reduce_scatter(const torch::Tensor& flat) const;
  static Work done(torch::Tensor result);  // a Work already complete, returning `result`
  // Sets the members and this rank's index among them (throws when `global_rank` is not one).
  void set_members(const std::string& name, std::vector<int64_t> ranks, int64_t global_rank);
  struct Impl;
  std::shared_ptr<Impl> impl_;
  std::vector<int64_t> ranks_{0};
  int64_t rank_ = 0;
  std::string name_ = "self";
};

}  // namespace dhp::dist
