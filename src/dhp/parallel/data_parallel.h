// Data-parallel gradient reduction: sums the gradients of `params` over `group` in
// flat buckets of about `bucket_bytes` (one all-reduce per bucket, never one per
// parameter: Gloo costs ~1 ms per call on loopback). Collective over the group; every
// member must pass the same parameters in the same order. Parameters without a gradient
// on every member are skipped consistently only if they lack it everywhere.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

#include "dhp/dist/comm.h"

namespace dhp::parallel {

// Returns the number of all-reduce calls made.
int64_t all_reduce_grads(const std::vector<torch::Tensor>& params, const dist::Group& group,
                         int64_t bucket_bytes = 25 << 20);

}  // namespace dhp::parallel
