// Sequence parallelism for the vision tower (Ulysses): the window-ordered patch sequence
// is split across the SP ranks on window boundaries (ragged shards, balanced by patches);
// window blocks run locally on each shard with no communication; full-attention blocks
// use ulysses_attention over whole images; each rank merges its own rows and the merged
// embeddings are all-gathered (ragged) and put back in processor order.
// Parameters stay replicated; their gradients are partial per rank and must be summed
// over the SP group (all_reduce_grads) before the optimizer step. With the tower's
// activation checkpointing on, each block is recomputed in backward (Ulysses all-to-alls
// included, in the same order on every SP rank).
#pragma once

#include <vector>

#include "dhp/dist/comm.h"
#include "dhp/models/qwen2_5_vl/model.h"

namespace dhp::parallel {

// Shard sizes in patches (window-ordered) for `sp` ranks: contiguous runs of whole windows,
// shard r ending at the last window boundary not past (r+1)/sp of the patches (at least one
// window each). Throws dhp::Error when there are fewer windows than ranks.
std::vector<int64_t> window_shards(const std::vector<int64_t>& cu_window_seqlens, int64_t sp);

// Replaces the model's vision forward by the sequence-parallel one over `sp`.
// Call on every SP rank with identically initialised models.
void parallelize_vision_sp(qwen::Qwen2_5_VLImpl& model, const dist::Group& sp, int64_t block_size = 256);

// (n_local, C) [ragged shards in rank order] -> (sum n, C) on every rank.
// forward: all-gather-v; backward: this rank's rows of the gradient.
torch::Tensor gather_rows(const torch::Tensor& x, const dist::Group& group, const std::vector<int64_t>& rows);

}  // namespace dhp::parallel
