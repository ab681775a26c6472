// Applying parallel strategies to a plain Qwen2.5-VL model from outside, by replacing
// submodules by name (parameter names, and so checkpoint keys, do not change).
#pragma once

#include <map>
#include <string>

#include "dhp/dist/comm.h"
#include "dhp/models/qwen2_5_vl/model.h"
#include "dhp/parallel/tensor_parallel.h"

namespace dhp::parallel {

// Megatron tensor parallelism for the text decoder over `tp`: q/k/v and gate/up become
// column-parallel (query heads, kv heads and the MLP width split across ranks), o and down
// row-parallel; embed_tokens and lm_head are cut to this rank's vocabulary rows, with a
// vocab-parallel embedding and cross-entropy (no full logits). Norms stay replicated.
// Call on every TP rank, on identically initialised models. Throws dhp::Error when tp does
// not divide heads, kv heads, vocabulary or the MLP width.
// Returns how each sharded parameter (by name) was cut; parameters not listed are replicated.
using TpShardMap = std::map<std::string, TpShard>;
TpShardMap parallelize_text_tp(qwen::Qwen2_5_VLImpl& model, const dist::Group& tp);

// Megatron tensor parallelism for the vision tower over `tp`: the fused qkv column-parallel
// by heads (q, k and v each split), proj row-parallel, gate/up column- and down
// row-parallel, the merger's first linear column- and second row-parallel. Patch embedding
// and norms stay replicated (computed on every rank). The output is replicated.
TpShardMap parallelize_vision_tp(qwen::Qwen2_5_VLImpl& model, const dist::Group& tp);

}  // namespace dhp::parallel
