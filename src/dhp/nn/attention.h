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
//
// On CUDA in bf16/fp16 (libtorch 2.4+), the same call can run the packed-sequence flash
// kernel libtorch ships (at::_flash_attention_forward with cumulative lengths; its backward
// comes with autograd): no score matrix, GQA without expanding k and v.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dhp::nn {

// Which kernel computes the attention (training.attention). kDhp: dhp's own (any device and
// dtype). kFlash: libtorch's flash kernel; inputs it cannot take are an error. kAuto: flash
// where flash_unsupported() is empty, else dhp's (on CUDA the reason is logged once); a
// first flash call that fails (a libtorch without the kernels, an unsupported GPU) makes
// auto use dhp's kernel from then on.
enum class AttentionKernel { kAuto, kDhp, kFlash };
// "auto", "dhp" or "flash"; throws dhp::Error naming `key` otherwise.
AttentionKernel parse_attention_kernel(const std::string& value, const std::string& key);

struct VarlenAttentionOptions {
  // Causal mask inside each segment (text decoder) or full (vision).
  bool causal = false;
  // Query/key block length of the blockwise path; also the longest segment batched densely.
  int64_t block_size = 256;
  AttentionKernel kernel = AttentionKernel::kAuto;
};

// Why the flash kernel cannot take q (S, H, D) with k (S, Hk, D): "" when it can. It needs a
// CUDA libtorch 2.4+, CUDA tensors, bf16 or fp16, a head size that is a multiple of 8 up to
// 256, and Hk dividing H.
std::string flash_unsupported(const torch::Tensor& q, const torch::Tensor& k);

// q: (S, H, D); k, v: (S, Hk, D) with Hk dividing H (GQA: query head h attends with kv head
// h / (H / Hk)). cu_seqlens: S+1 style offsets, cu[0] == 0, strictly increasing,
// cu.back() == S. Returns (S, H, D). Differentiable in q, k, v. Softmax scale 1/sqrt(D).
torch::Tensor varlen_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const std::vector<int64_t>& cu_seqlens,
                               const VarlenAttentionOptions& options = {});

// Checks cu_seqlens against a sequence of `total` tokens; throws dhp::Error naming `what`.
void check_cu_seqlens(const std::vector<int64_t>& cu_seqlens, int64_t total, const char* what);

}  // namespace dhp::nn
