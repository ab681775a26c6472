// Single-process gradient norm and clipping: the reference the tests hold the parallel
// model's global norm (ParallelModel::finish_step) against.
#pragma once

#include <vector>

#include "dhp/optim/adamw.h"

namespace dhp::testing {

// Global L2 norm of all gradients (fp32 accumulation).
double grad_norm(const std::vector<optim::NamedParam>& params);
// Scales gradients so their global norm is at most max_norm; returns the norm before.
double clip_grad_norm(const std::vector<optim::NamedParam>& params, double max_norm);

}  // namespace dhp::testing
