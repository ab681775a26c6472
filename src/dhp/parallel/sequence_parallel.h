// Sequence parallelism's pieces that know no model: splitting a window-ordered sequence
// across ranks on segment boundaries (ragged shards, balanced by rows), and gathering the
// ranks' rows back (an autograd function). The Qwen2.5-VL tower's
// use of them is in models/qwen2_5_vl/parallelize.h.
#pragma once

#include <torch/types.h>

#include <vector>

#include "dhp/dist/comm.h"

namespace dhp::parallel {

// Shard sizes in rows for `sp` ranks of a sequence cut into segments at `cu` (offsets,
// cu.back() = total): contiguous runs of whole segments, shard r ending at the last
// boundary not past (r+1)/sp of the rows (at least one segment each). Throws dhp::Error
// when there are fewer segments than ranks.
std::vector<int64_t> window_shards(const std::vector<int64_t>& cu_window_seqlens, int64_t sp);

// (n_local, C) [ragged shards in rank order] -> (sum n, C) on every rank.
// forward: all-gather-v; backward: this rank's rows of the gradient.
torch::Tensor gather_rows(const torch::Tensor& x, const dist::Group& group, const std::vector<int64_t>& rows);

}  // namespace dhp::parallel
