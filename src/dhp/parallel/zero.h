// ZeRO-1: AdamW whose fp32 master weights and moments are sharded across a group. The
// parameters are viewed as one flat vector (padded to a multiple of the group size); rank
// r owns the contiguous slice r of it. The step reduce-scatters the local gradients (each
// rank receives only the sum of its own slice, in fp32, sent in the gradients' dtype),
// updates its slice, and all-gathers the updated slices back into every rank's parameters
// in the parameters' dtype. Same math as optim::AdamW on the summed gradients, element for
// element (per-group rates and decay, AdamWOptions::groups, as per-element tensors). Collective: every member calls reduce_gradients() and step() in the same order.
#pragma once

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
             std::vector<bool> in_norm = {});
  // Sums the local gradients (.grad, undefined = zero) over the group into this rank's
  // slice. Collective. step() calls it when it was not called since the last step.
  void reduce_gradients();
  // Sum of squares of this rank's slice of the summed gradients (after reduce_gradients()):
  // summed over the group's ranks it is the squared gradient norm. A 0-dim fp64 tensor on
  // the parameters' device (no host sync).
  torch::Tensor grad_sq_norm() const;
  // Multiplies the summed gradients (this rank's slice) by `factor` (clipping).
  void scale_gradients(double factor);
  void step(double lr);
  void zero_grad();
  int64_t state_numel() const { return master_.numel(); }  // this rank's slice
  int64_t total_numel() const { return total_; }
  // This rank's slice: elements [slice_begin(), slice_begin() + state_numel()) of the
  // parameters laid end to end (in constructor order; past total_numel() is padding).
  // The tensors are writable in place (checkpoint loading).
  int64_t slice_begin() const { return lo_; }
  const torch::Tensor& master() const { return master_; }
  const torch::Tensor& exp_avg() const { return exp_avg_; }
  const torch::Tensor& exp_avg_sq() const { return exp_avg_sq_; }
  const std::vector<optim::NamedParam>& params() const { return params_; }
  int64_t step_count() const { return step_; }
  void set_step_count(int64_t n) { step_ = n; }

 private:
  torch::Tensor flat_grads() const;  // (padded) in the parameters' dtype
  std::vector<optim::NamedParam> params_;
  optim::AdamWOptions options_;
  dist::Group group_;
  torch::ScalarType dtype_ = torch::kFloat32;  // the parameters' (common) dtype, else fp32
  int64_t total_ = 0, padded_ = 0, lo_ = 0, n_ = 0;
  torch::Tensor master_, exp_avg_, exp_avg_sq_;  // (n_) fp32, this rank's slice
  // Weight decay per element, one of two ways: with every parameter on the defaults, decay_
  // (the 0/1 mask of options.weight_decay; lr_scale_ and weight_decay_ undefined); otherwise
  // (options.groups give some parameter other settings) lr_scale_ and weight_decay_, the
  // per-element scale and decay (decay_ undefined).
  torch::Tensor decay_, lr_scale_, weight_decay_;
  std::vector<std::pair<int64_t, int64_t>> norm_ranges_;  // [begin, end) of the slice counted in the norm
  torch::Tensor grad_;  // (n_) fp32 summed gradients of the slice; undefined until reduced
  int64_t step_ = 0;
};

}  // namespace dhp::parallel
