// ZeRO-3 (fully sharded data parallelism) for any module whose forward runs through named
// stages (nn::StageRunner): every parameter is cut into `group.size()` flat slices (padded
// to a multiple of the group), rank r keeps slice r as a leaf tensor (the optimizer's
// parameter), and the module's own parameters hold no storage between uses.
//
// Stage `unit` runs as one autograd node:
//   forward:  all-gather the unit's slices into its parameters, run fn(x) without
//             recording, free the gathered parameters;
//   backward: all-gather again, recompute fn(x) with autograd, take the gradients of the
//             parameters and of x, reduce-scatter the parameter gradients (sum over the
//             group, each rank receives its slice) into the slices' .grad, free everything.
// So activations are recomputed per stage (ZeRO-3 implies checkpointing here) and at most
// one unit's full parameters and gradients are alive at a time.
// Parameters that do not require grad when sharded (frozen) keep slices without gradient:
// gathered for the forward, left out of the backward's reduce-scatter.
// Every rank of the group must run the same stages in the same order (collectives); each
// rank feeds its own data (data parallelism), and the slice gradients are the sums over the
// group, so no further gradient reduction is needed.
//
// Overlap (set_overlap(true); parallel.overlap): communication runs beside the compute.
//   - Prefetch: Zero3 learns which unit followed which, in forward and in backward (the
//     model's stage order; the same on every rank, since every rank runs the same stages),
//     and starts gathering the next unit's parameters when a unit starts computing; at most
//     two gathers are in flight. A prefetched gather serves that unit's next forward or
//     backward; finish() (before the optimizer step changes the slices) waits for and drops
//     those not used.
//   - The backward's reduce-scatter is started, not waited for: it lands during the next
//     unit's backward, and when the backward ends (a callback of autograd's engine) the
//     slices landed in it are added to the slices' .grad, summed first as their gradient
//     accumulators would have (a unit run twice, as tied embeddings are, adds both parts
//     before .grad); the backward hands autograd no slice gradient then.
// Both change no number: the same gathers and the same sums, added in the same order.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dhp/dist/comm.h"
#include "dhp/nn/layers.h"
#include "dhp/optim/adamw.h"

namespace dhp::parallel {

class Zero3 {
 public:
  // Shards `params` (a module's parameters, in order, with their decay flags); each goes to
  // the longest unit that prefixes its name (followed by '.'). Throws dhp::Error when one
  // matches no unit.
  Zero3(const std::vector<optim::NamedParam>& params, const std::vector<std::string>& units, dist::Group group);

  // fn(x) with unit `unit`'s parameters present (see above). x may be any tensor (token
  // ids included); gradients flow to x when it requires them.
  torch::Tensor run(const std::string& unit, const nn::StageFn& fn, const torch::Tensor& x);
  // A StageRunner that runs every stage through run().
  nn::StageRunner runner();

  // This rank's slices, named like the parameters (for the optimizer and clipping).
  std::vector<optim::NamedParam> shards() const;
  // Every sharded parameter in full, on every rank (collective; for parity checks,
  // evaluation and checkpoints).
  std::map<std::string, torch::Tensor> full_parameters();
  int64_t gathers() const { return gathers_; }  // all-gathers issued so far
  void set_overlap(bool on) { overlap_ = on; }
  // Lands every reduce-scatter in flight into the slices' .grad and drops the prefetched
  // gathers (waiting for them). Collective; call before reading gradients or stepping.
  void finish();
  int64_t prefetch_hits() const { return hits_; }  // gathers served by a prefetch

 private:
  struct Param {
    std::string name;
    torch::Tensor param;  // the module's parameter: empty storage unless gathered
    torch::Tensor shard;  // (chunk) this rank's slice, a leaf requiring grad
    std::vector<int64_t> shape;
    int64_t numel = 0, chunk = 0;
    bool decay = false;
    bool trainable = true;  // false: frozen (the parameter did not require grad when sharded)
  };
  struct Unit {
    std::vector<size_t> params;
    int64_t width = 0;  // sum of the params' chunks
  };
  enum class Pass { kForward, kBackward };
  void gather(const Unit& u);
  void release(const Unit& u);
  // Learns that `u` runs now in `pass` and starts gathering the unit that followed it last time.
  void prefetch_after(const Unit& u, Pass pass);
  // Starts the reduce-scatter of `grads` (full gradients of `params`); it lands later.
  void start_reduce_scatter(const std::vector<size_t>& params, const std::vector<torch::Tensor>& grads);
  void land_reductions(size_t keep);  // lands all but the newest `keep` (into landed_)
  void flush_landed();                // landed_ into the slices' .grad
  std::vector<size_t> trained(const Unit& u) const;  // the unit's trainable parameters
  // Full gradients of `params` (undefined = zero) -> this rank's slice sums. Collective.
  std::vector<torch::Tensor> reduce_scatter(const std::vector<size_t>& params, const std::vector<torch::Tensor>& grads) const;
  // The send rows of that reduce-scatter, (ws, width): row j goes to rank j.
  torch::Tensor scatter_rows(const std::vector<size_t>& params, const std::vector<torch::Tensor>& grads) const;
  // Rank r's slices from the received rows.
  std::vector<torch::Tensor> slices_of(const std::vector<size_t>& params, const torch::Tensor& recv) const;
  friend struct Zero3Stage;

  std::vector<Param> params_;
  std::map<std::string, Unit> units_;
  dist::Group group_;
  int64_t gathers_ = 0, hits_ = 0;
  bool overlap_ = false;
  std::map<const Unit*, dist::Work> prefetched_;             // gathers in flight, by unit
  std::map<const Unit*, const Unit*> after_[2];              // by pass: the unit that followed
  const Unit* last_ = nullptr;                               // the unit that ran last, and in which pass
  Pass last_pass_ = Pass::kForward;
  struct Reduction {
    std::vector<size_t> params;
    dist::Work work;
  };
  std::vector<Reduction> reductions_;  // reduce-scatters in flight, in start order
  std::map<size_t, torch::Tensor> landed_;  // by parameter: slices landed in the running backward, summed
  bool flush_queued_ = false;               // the running backward will flush landed_ when it ends
};

}  // namespace dhp::parallel
