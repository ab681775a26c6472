// Applying parallel strategies to a plain Qwen2.5-VL model from outside, by replacing
// submodules by name (parameter names, and so checkpoint keys, do not change).
#pragma once

#include "dhp/dist/comm.h"
#include "dhp/models/qwen2_5_vl/model.h"

namespace dhp::parallel {

// Megatron tensor parallelism for the text decoder over `tp`: q/k/v and gate/up become
// column-parallel (query heads, kv heads and the MLP width split across ranks), o and down
// row-parallel; embed_tokens and lm_head are cut to this rank's vocabulary rows, with a
// vocab-parallel embedding and cross-entropy (no full logits). Norms stay replicated.
// Call on every TP rank, on identically initialised models. Throws dhp::Error when tp does
// not divide heads, kv heads, vocabulary or the MLP width.
void parallelize_text_tp(qwen::Qwen2_5_VLImpl& model, const dist::Group& tp);

}  // namespace dhp::parallel
