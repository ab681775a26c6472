// Variable-length attention over packed sequences.
//
// The packed sequence holds independent segments given by cu_seqlens (block-diagonal
// attention; causal inside a segment or not). One function serves the vision windows,
// whole images and text samples.
//
// Memory: never materialises S x S for a long segment. Segments longer than
// `block_size` run blockwise with an online softmax (flash-attention style): forward saves
// the output and the logsumexp, backward recomputes each block. Extra memory is
// O(S x block_size x heads). Segments of at most `block_size` tokens are batched in
// buckets of similar length (one batched matmul for all 64-patch windows), not looped.
// Math in fp32 whatever the input dtype; outputs and gradients in the input dtype.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace dhp::nn {

struct VarlenAttentionOptions {
  // Causal mask inside each segment (text decoder) or full (vision).
  bool causal = false;
  // Query/key block length of the blockwise path; also the longest segment batched densely.
  int64_t block_size = 256;
};

// q, k, v: (S, H, D), same number of heads (expand GQA kv heads before calling).
// cu_seqlens: S+1 style offsets, cu[0] == 0, strictly increasing, cu.back() == S.
// Returns (S, H, D). Differentiable in q, k, v. Softmax scale 1/sqrt(D).
torch::Tensor varlen_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const std::vector<int64_t>& cu_seqlens,
                               const VarlenAttentionOptions& options = {});

// Checks cu_seqlens against a sequence of `total` tokens; throws dhp::Error naming `what`.
void check_cu_seqlens(const std::vector<int64_t>& cu_seqlens, int64_t total, const char* what);

}  // namespace dhp::nn
