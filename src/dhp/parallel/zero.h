// ZeRO-1: AdamW whose fp32 master weights and moments are sharded across a group. The
// parameters are laid end to end in buckets (runs of consecutive parameters of about
// `bucket_bytes`, each padded to a multiple of the group size); rank r owns chunk r of every
// bucket, and its state is those chunks end to end. One bucket (bucket_bytes <= 0) is the
// classic layout: rank r owns the contiguous slice r of the whole flat vector. Buckets let the
// reduction start bucket by bucket during backward (start_bucket / land_bucket, driven by a
// GradReducer, data_parallel.h). The step reduce-scatters the local gradients (each rank
// receives only the sums of its own chunks, in fp32, sent in the gradients' dtype), updates
// its chunks, and all-gathers the updated chunks back into every rank's parameters in the
// parameters' dtype. Same math as optim::AdamW on the summed gradients, element for element,
// whatever the buckets (per-group rates and decay, AdamWOptions::groups, as per-element
// tensors). Collective: every member calls reduce_gradients() (or starts and lands every
// bucket) and step() in the same order.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "dhp/dist/comm.h"
#include "dhp/optim/adamw.h"

namespace dhp::parallel {

class Zero1AdamW {
 public:
  // `in_norm[i]`: whether parameter i's elements count in grad_sq_norm() (a parameter
  // replicated across tensor-parallel ranks counts on one of them only); empty = all.
  Zero1AdamW(std::vector<optim::NamedParam> params, optim::AdamWOptions options, dist::Group group,
             std::vector<bool> in_norm = {}, int64_t bucket_bytes = 0);
  // Sums the local gradients (.grad, undefined = zero) over the group into this rank's
  // chunks, bucket by bucket with at most `in_flight` started and not landed. Collective.
  // step() calls it when it was not called since the last step.
  void reduce_gradients(int64_t in_flight = 2);
  // The buckets: [begin, end) runs of the parameters (in constructor order).
  const std::vector<std::pair<size_t, size_t>>& buckets() const { return runs_; }
  // Starts the reduce-scatter of bucket b's local gradients (on `group`: the optimizer's own
  // or another connection of the same members); land_bucket() takes its result. Every bucket
  // must be landed before grad_sq_norm() or step().
  dist::Work start_bucket(size_t b, const dist::Group& group) const;
  void land_bucket(size_t b, dist::Work& work);
  // Sum of squares of this rank's chunks of the summed gradients (after reduce_gradients()):
  // summed over the group's ranks it is the squared gradient norm. A 0-dim fp64 tensor on
  // the parameters' device (no host sync).
  torch::Tensor grad_sq_norm() const;
  // Multiplies the summed gradients (this rank's chunks) by `factor` (clipping).
  void scale_gradients(double factor);
  void step(double lr);
  void zero_grad();
  int64_t state_numel() const { return master_.numel(); }  // this rank's chunks
  int64_t total_numel() const { return total_; }
  // Which elements of parameter i this rank holds: [param_begin, +n) of the flattened
  // parameter, at [state_begin, +n) of master(), exp_avg() and exp_avg_sq() (n = 0: none;
  // a parameter never spans two buckets, so it is one run). The tensors are writable in place
  // (checkpoint loading).
  struct Held {
    int64_t param_begin = 0, state_begin = 0, n = 0;
  };
  Held held(size_t i) const;
  const torch::Tensor& master() const { return master_; }
  const torch::Tensor& exp_avg() const { return exp_avg_; }
  const torch::Tensor& exp_avg_sq() const { return exp_avg_sq_; }
  const std::vector<optim::NamedParam>& params() const { return params_; }
  int64_t step_count() const { return step_; }
  void set_step_count(int64_t n) { step_ = n; }

 private:
  struct Bucket {
    int64_t begin = 0;   // where it starts among the parameters laid end to end
    int64_t padded = 0;  // its elements, padded to a multiple of the group size
    int64_t state = 0;   // where this rank's chunk (padded / size) starts in the state
  };
  torch::Tensor flat_grads(size_t b) const;
  bool all_landed() const;  // bucket b's (padded) in the parameters' dtype
  // This rank's chunks of `per_param` (one flat tensor per parameter), end to end.
  torch::Tensor chunks_of(const std::vector<torch::Tensor>& per_param) const;
  std::vector<optim::NamedParam> params_;
  optim::AdamWOptions options_;
  dist::Group group_;
  torch::ScalarType dtype_ = torch::kFloat32;  // the parameters' (common) dtype, else fp32
  std::vector<std::pair<size_t, size_t>> runs_;  // the buckets' parameters
  std::vector<Bucket> buckets_;
  std::vector<int64_t> offsets_;  // where each parameter starts among them laid end to end
  int64_t total_ = 0, n_ = 0;
  torch::Tensor master_, exp_avg_, exp_avg_sq_;  // (n_) fp32, this rank's chunks
  // Weight decay per element, one of two ways: with every parameter on the defaults, decay_
  // (the 0/1 mask of options.weight_decay; lr_scale_ and weight_decay_ undefined); otherwise
  // (options.groups give some parameter other settings) lr_scale_ and weight_decay_, the
  // per-element scale and decay (decay_ undefined).
  torch::Tensor decay_, lr_scale_, weight_decay_;
  std::vector<std::pair<int64_t, int64_t>> norm_ranges_;  // [begin, end) of the chunks counted in the norm
  torch::Tensor grad_;  // (n_) fp32 summed gradients of the chunks; undefined until reduced
  std::vector<bool> landed_;  // per bucket: its part of grad_ is there
  int64_t step_ = 0;
};

}  // namespace dhp::parallel
