// ModuleStrategy: one object per module of a model on this rank, owning everything that
// differs between parallel strategies for its whole lifecycle: applying itself to the
// module, the gradient reduction, its share of the global gradient norm, the optimizer
// step, zero_grad, gathering full parameters, checkpoint pieces, and what it holds
// (parameter and optimizer-state elements). The driver (train/parallel_model.h) holds one
// per module and never asks which kind it is.
//
// The strategies know layers, groups and tensors, never a model: a model offers each of its
// modules as a ModuleTarget (models/qwen2_5_vl/parallelize.h), whose methods do the
// model-specific work (which linears become column- or row-parallel, which stages ZeRO-3
// gathers around, where sequence parallelism splits).
//
// The classes (strategy.cpp):
//   none / dp  ReplicatedStrategy      whole parameters; gradients summed over the data
//                                      group (bucketed all-reduce, started during the last
//                                      backward: GradReducer), AdamW; or ZeRO-1
//   sp         SequenceParallelStrategy  as dp, after target.sequence_parallel(sp group);
//                                      ZeRO-1 by default (layout.zero)
//   tp         TensorParallelStrategy  target.tensor_parallel(tp group): sharded linears;
//                                      replicated over dp like dp (optionally ZeRO-1)
//   zero3      FullyShardedStrategy    target.fully_shard(dp group): flat parameter slices,
//                                      gradients reduce-scattered in backward (with overlap:
//                                      the next unit prefetched, reduce-scatters landing
//                                      later), AdamW on slices
// Collective: every method that says so must be called by every rank of the module, in
// the same order. Not thread-safe.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dhp/dist/layout.h"
#include "dhp/dist/process_groups.h"
#include "dhp/nn/layers.h"
#include "dhp/optim/adamw.h"
#include "dhp/parallel/checkpoint_piece.h"
#include "dhp/parallel/tensor_parallel.h"
#include "dhp/parallel/zero3.h"

namespace dhp::parallel {

// One module of a model, as its strategy sees it. Implemented by the model. A method for a
// strategy the module does not support throws dhp::Error.
class ModuleTarget {
 public:
  virtual ~ModuleTarget() = default;
  virtual const std::string& name() const = 0;  // "vision", "text"
  // Is parameter `name` (single-process name) one of this module's?
  virtual bool owns(const std::string& name) const = 0;
  // The module's parameters on this rank in the model's order, with their decay flags.
  virtual std::vector<optim::NamedParam> parameters() = 0;
  // Megatron tensor parallelism over `tp`: replaces linears by sharded ones; returns the cuts.
  virtual TpShardMap tensor_parallel(const dist::Group& tp) = 0;
  // Ulysses sequence parallelism over `sp`.
  virtual void sequence_parallel(const dist::Group& sp) = 0;
  // ZeRO-3 over `group`: every parameter sliced, the module's stages run through the result.
  virtual std::unique_ptr<Zero3> fully_shard(const dist::Group& group) = 0;
};

// How a strategy communicates its gradients (parallel.overlap, parallel.bucket_mb,
// parallel.buckets_in_flight).
struct CommOptions {
  bool overlap = true;              // data-parallel and ZeRO-1 reductions start during the last backward
  int64_t bucket_bytes = 25 << 20;  // gradients per reduction (ZeRO-1: also its state's layout)
  int64_t buckets_in_flight = 2;    // reductions started and not yet landed at once
};

// What the gradient reduction of a module did on this rank so far.
struct ReductionCounts {
  int64_t buckets = 0;  // bucket reductions started
  int64_t early = 0;    // of them, started during a backward (overlapped with compute)
  int64_t prefetched = 0;  // ZeRO-3 gathers served by a prefetch
};

// What a strategy holds on this rank, in elements (parameter accounting).
struct HeldElements {
  int64_t parameters = 0;       // parameter elements (a TP shard, a ZeRO-3 slice, or all)
  int64_t trainable = 0;        // those of them that train (requires_grad; fine-tuning freezes the others)
  int64_t optimizer_state = 0;  // fp32 masters (non-fp32 models only) and the two moments, of trainable ones
};

class ModuleStrategy {
 public:
  virtual ~ModuleStrategy() = default;
  dist::Strategy kind() const { return layout_.strategy; }
  const dist::ModuleLayout& layout() const { return layout_; }

  // Applies the strategy to `target` (once, on every rank of the module; collective) and
  // takes the parameters this rank holds. `target` must outlive the strategy. Parameters
  // that do not require gradients (frozen: qwen::apply_freezing, the same on every rank) are
  // held and gathered like the others but get no gradient reduction, no share of the norm,
  // no optimizer state, and no checkpoint piece that is saved (CheckpointPiece::frozen).
  virtual void apply(ModuleTarget& target) = 0;
  // Builds the optimizer state over those parameters (ranks that train).
  virtual void make_optimizer(const optim::AdamWOptions& options) = 0;
  virtual void zero_grad() = 0;
  // Sums gradients over the module's data group (collective) and returns this rank's share
  // of the squared global gradient norm: summed over the job, every element counted once.
  // A 0-dim fp64 tensor on the gradients' device (read once a step, by the caller).
  virtual torch::Tensor reduce_gradients() = 0;
  // The next backward is the step's last of this module on this rank (parallel_model.cpp
  // says when): reductions that overlap it (CommOptions::overlap) may start as its gradients
  // complete; reduce_gradients() waits for them.
  virtual void arm_reduction() {}
  virtual ReductionCounts reduction_counts() const { return {}; }
  virtual void scale_gradients(double factor) = 0;  // clipping
  virtual void step(double lr) = 0;
  virtual void set_step_count(int64_t n) = 0;  // resuming: bias corrections continue from n
  // Every parameter of the module in full by single-process name, on this rank's device
  // (collective over the module).
  virtual std::map<std::string, torch::Tensor> full_parameters() = 0;
  // What this rank holds of every parameter and optimizer-state tensor (checkpoint.h);
  // `full_shapes`: single-process shapes by parameter name.
  virtual std::vector<CheckpointPiece> checkpoint_pieces(
      const std::map<std::string, std::vector<int64_t>>& full_shapes) = 0;
  virtual HeldElements held() const = 0;
  // True when this rank's parameters are the single-process ones, whole and unsliced.
  virtual bool whole_parameters() const = 0;
  // True when the data-parallel replicas share collectives inside the forward (ZeRO-3's
  // gathers), so every replica must run every micro-batch.
  virtual bool replicas_run_together() const { return false; }
  // fn(x) with the parameters of stage `unit` present (ZeRO-3 gathers them around it).
  virtual torch::Tensor run_unit(const std::string& unit, const nn::StageFn& fn, const torch::Tensor& x) {
    (void)unit;
    return fn(x);
  }

  // (Abstract: make_strategy builds the concrete classes.)
  ModuleStrategy(dist::ModuleLayout layout, dist::ProcessGroups groups, CommOptions comm)
      : layout_(std::move(layout)), groups_(std::move(groups)), comm_(comm) {}

 protected:
  dist::ModuleLayout layout_;
  dist::ProcessGroups groups_;
  CommOptions comm_;
};

// The strategy object of `layout` (validated) on this rank's `groups` (member == true).
std::unique_ptr<ModuleStrategy> make_strategy(const dist::ModuleLayout& layout, const dist::ProcessGroups& groups,
                                              const CommOptions& comm = {});

}  // namespace dhp::parallel
