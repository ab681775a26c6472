// Data-parallel gradient reduction.
//
// all_reduce_grads: sums the gradients of `params` over `group` in flat buckets of about
// `bucket_bytes` (one all-reduce per bucket, never one per parameter: Gloo costs ~1 ms per
// call on loopback), at once. Collective over the group; every member must pass the same
// parameters in the same order.
//
// GradReducer: the same reduction (or any per-bucket one: ZeRO-1 reduce-scatters) started
// during the step's last backward, bucket by bucket, as soon as a bucket's gradients are
// complete (as PyTorch DDP does), and waited for at the end of the step (finish()).
//   - A bucket is a run of consecutive parameters; buckets start in reverse order (the last
//     parameters' gradients come first in backward), each only after the one before it, so
//     every member starts the same reductions in the same order whatever its data: a
//     parameter that got no gradient in this backward (unused, or a replica without input)
//     holds its bucket and those after it back until finish(), which starts them with zeros.
//   - It learns when a gradient is complete from a hook on each parameter's gradient
//     accumulator, which runs after the backward added to .grad. A parameter whose gradient
//     arrives in parts (used twice across re-entrant checkpoints, for instance) would start
//     its bucket early: so a reducer starts buckets during backward only after it has seen
//     one whole armed backward in which no parameter got its gradient twice (it counts; the
//     first step reduces at the end). If that ever happens after, finish() throws.
//   - The reductions run on their own group (nothing else may communicate on it between
//     arm() and finish(): its members must see the same calls in the same order).
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dhp/dist/comm.h"

namespace dhp::parallel {

// Returns the number of all-reduce calls made.
int64_t all_reduce_grads(const std::vector<torch::Tensor>& params, const dist::Group& group,
                         int64_t bucket_bytes = 25 << 20);

// Consecutive runs [begin, end) of items of `bytes` each: a run closes when it reached
// `bucket_bytes` (each run holds at least one item); bucket_bytes <= 0: one run of all.
std::vector<std::pair<size_t, size_t>> bucket_runs(const std::vector<int64_t>& bytes, int64_t bucket_bytes);

class GradReducer {
 public:
  // start(b): starts bucket b's reduction (its parameters' .grad as they are; undefined is
  // zero). land(b, work): waits for it and puts the result where it belongs. `names` name
  // the parameters in errors. At most `in_flight` buckets are started and not landed: the
  // next one starts after the oldest landed (their buffers are what a reduction holds).
  using Start = std::function<dist::Work(size_t bucket)>;
  using Land = std::function<void(size_t bucket, dist::Work& work)>;
  GradReducer(std::vector<torch::Tensor> params, std::vector<std::string> names,
              std::vector<std::pair<size_t, size_t>> buckets, Start start, Land land, bool overlap,
              int64_t in_flight = 2);
  ~GradReducer();
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  // The next backward is the step's last for these parameters: buckets may start during it.
  void arm();
  // Starts every bucket not started yet, in order, and lands them all (at most in_flight
  // apart).
  // Collective over the reducing group.
  void finish();
  // Buckets started during backward over all finish() calls so far, and in all.
  int64_t started_early() const { return early_; }
  int64_t started() const { return total_; }
  // The most buckets in flight at once so far.
  int64_t most_in_flight() const { return most_in_flight_; }
  // True once buckets may start during backward (overlap asked and a clean backward seen).
  bool overlapping() const { return verified_; }

 private:
  struct Hook;
  void ready(size_t param);      // param's gradient was just accumulated
  void start_next();             // the next bucket in order (after landing the oldest when full)
  void land_next();              // the oldest bucket in flight
  size_t bucket_at(size_t k) const;  // the k-th bucket to start: from the last
  std::vector<torch::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<std::pair<size_t, size_t>> buckets_;
  std::vector<size_t> bucket_of_;
  Start start_;
  Land land_;
  bool overlap_ = false, armed_ = false, verified_ = false, twice_ = false;
  std::vector<int64_t> fires_;        // gradients accumulated per parameter in the armed backward
  std::vector<int64_t> missing_;      // per bucket: its parameters with no gradient yet
  size_t next_ = 0;                   // buckets started so far (from the last)
  size_t landed_ = 0;                 // of them, landed
  int64_t in_flight_ = 2, most_in_flight_ = 0;
  std::vector<dist::Work> works_;     // by start order
  std::string late_;                  // a parameter whose gradient came after its bucket started
  std::vector<std::shared_ptr<void>> accumulators_;  // kept alive: the hooks live on them
  std::shared_ptr<GradReducer*> link_;               // the hooks' way back here, cleared when it goes
  int64_t early_ = 0, total_ = 0;
};

}  // namespace dhp::parallel
