// The reference the attention kernels are held against: one masked S x S softmax per
// segment, plain autograd ops (tests and bench/foundation_bench.cpp).
#pragma once

#include <torch/types.h>

#include <vector>

namespace dhp::testing {

// q, k, v: (S, H, D); cu_seqlens as for nn::varlen_attention. Returns (S, H, D).
torch::Tensor varlen_attention_naive(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     const std::vector<int64_t>& cu_seqlens, bool causal);

}  // namespace dhp::testing
