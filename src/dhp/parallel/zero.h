// ZeRO-1: AdamW whose fp32 master weights and moments are sharded across a group. The
// parameters are viewed as one flat vector (padded to a multiple of the group size); rank
// r owns the contiguous slice r of it, updates only that slice from the (already summed)
// gradients, and the updated slices are all-gathered back into every rank's parameters.
// Same math as train::AdamW element for element. Collective: every member calls step().
#pragma once

#include <vector>

#include "dhp/dist/comm.h"
#include "dhp/train/optim.h"

namespace dhp::parallel {

class Zero1AdamW {
 public:
  Zero1AdamW(std::vector<train::NamedParam> params, train::AdamWOptions options, dist::Group group);
  // Gradients must already be summed over the data/sequence-parallel group.
  void step(double lr);
  void zero_grad();
  int64_t state_numel() const { return master_.numel(); }  // this rank's slice
  int64_t total_numel() const { return total_; }

 private:
  torch::Tensor flat_grads() const;  // (padded) fp32
  std::vector<train::NamedParam> params_;
  train::AdamWOptions options_;
  dist::Group group_;
  int64_t total_ = 0, padded_ = 0, lo_ = 0, n_ = 0;
  torch::Tensor master_, exp_avg_, exp_avg_sq_, decay_;  // (n_) fp32, this rank's slice
  int64_t step_ = 0;
};

}  // namespace dhp::parallel
