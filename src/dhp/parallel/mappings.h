// Collectives as autograd functions whose forward and backward are duals (Megatron's
// mappings). Each is a no-op for a group of one. All members of `group` must call them
// in the same order (they are collectives).
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/types.h>

#include "dhp/dist/comm.h"

namespace dhp::parallel {

// forward: identity; backward: all-reduce(sum) over the group. Input of a column-parallel
// layer: every TP rank's partial input gradient is summed.
torch::Tensor copy_to_group(const torch::Tensor& x, const dist::Group& group);
// forward: all-reduce(sum); backward: identity. Output of a row-parallel layer.
torch::Tensor reduce_from_group(const torch::Tensor& x, const dist::Group& group);
// forward: all-gather along `dim` (equal shards); backward: this rank's slice of the gradient.
torch::Tensor gather_from_group(const torch::Tensor& x, const dist::Group& group, int64_t dim);
// forward: this rank's slice along `dim` (size divisible by the group); backward: all-gather.
torch::Tensor scatter_to_group(const torch::Tensor& x, const dist::Group& group, int64_t dim);

// A Group inside an IValue, for autograd functions' ctx->saved_data (libtorch 1.13 and 2.x).
c10::IValue group_capsule(const dist::Group& group);
const dist::Group& group_of(const c10::IValue& capsule);

}  // namespace dhp::parallel
