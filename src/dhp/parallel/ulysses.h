// DeepSpeed-Ulysses sequence parallelism for attention. The packed sequence is split into
// contiguous, possibly unequal shards, one per SP rank in rank order. Before attention an
// all-to-all turns sequence shards with all heads into the whole sequence with H/sp heads;
// after it the inverse all-to-all turns it back. Attention segments (cu_seqlens) refer to
// the whole sequence, so a full-attention layer attends over whole images.
// Collective over the SP group; a group of one is the plain local computation.
#pragma once

#include <torch/types.h>

#include <vector>

#include "dhp/dist/comm.h"
#include "dhp/nn/attention.h"

namespace dhp::parallel {

// (S_local, H, D) [sequence-sharded] -> (S_total, H/sp, D) [head-sharded].
// forward: all-to-all seq -> heads; backward: all-to-all heads -> seq.
// shard_rows[i] = rows of SP rank i (sum = S_total).
torch::Tensor seq_to_heads(const torch::Tensor& x, const dist::Group& group, const std::vector<int64_t>& shard_rows);
// (S_total, H/sp, D) [head-sharded] -> (S_local, H, D) [sequence-sharded]; the dual.
torch::Tensor heads_to_seq(const torch::Tensor& x, const dist::Group& group, const std::vector<int64_t>& shard_rows);

// Attention over the whole sequence from sequence shards: seq_to_heads on q, k, v, the
// local attention `core` with the global cu_seqlens on H/sp heads, heads_to_seq back.
// q, k, v: (S_local, H, D) [sharded] -> (S_local, H, D) [sharded].
torch::Tensor ulysses_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                const std::vector<int64_t>& cu_seqlens, bool causal, const dist::Group& group,
                                const std::vector<int64_t>& shard_rows, const nn::VarlenAttentionOptions& attention);

}  // namespace dhp::parallel
