// Applying parallel strategies to a plain Qwen2.5-VL model from outside, by replacing
// submodules by name (parameter names, and so checkpoint keys, do not change). The model's
// modules as the strategies of parallel/strategy.h see them (module_targets), the numbers
// their layouts must divide (module_dims), and the parallelizations themselves.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dhp/dist/comm.h"
#include "dhp/dist/layout.h"
#include "dhp/models/qwen2_5_vl/model.h"
#include "dhp/parallel/strategy.h"
#include "dhp/parallel/tensor_parallel.h"
#include "dhp/parallel/zero3.h"

namespace dhp::qwen {

// The model's modules in order, as the job's module list has them: "vision" (the tower
// with its merger: visual.*), then "text" (the decoder and lm_head: model.*, lm_head.*).
// The first feeds the second: its output rows replace the <|image_pad|> embeddings.
std::vector<std::string> module_names();
// The parameter-name prefixes of the parts fine-tuning settings name (training.lr_vision,
// ...): "vision" (visual.*: the tower's blocks and patch embedding), "merger"
// (visual.merger.*, which wins over vision's shorter prefix), "text" (model.*, lm_head*).
std::vector<std::pair<std::string, std::string>> part_prefixes();
// The numbers each module's layout must divide, and the strategies it supports.
std::vector<dist::ModuleDims> module_dims(const ModelConfig& cfg);
// The modules of `model` as strategy targets, in module_names() order. `attention`: the
// attention kernel's options (sequence parallelism's Ulysses attention). `model` must
// outlive them.
std::vector<std::unique_ptr<parallel::ModuleTarget>> module_targets(Qwen2_5_VLImpl& model,
                                                                   const nn::VarlenAttentionOptions& attention);

// How the decoder takes the encoders' output (encoder: an index of module_names(), every
// module but the last). The rows encoder `encoder` produces for a sample of token ids: one
// per token its output replaces (vision: <|image_pad|>).
int64_t encoder_rows(const ModelConfig& cfg, int64_t encoder, const std::vector<int64_t>& ids);
// Encoder `encoder`'s output rows of a batch (rows, hidden), in order; undefined when the
// batch has nothing for it.
torch::Tensor encode(Qwen2_5_VLImpl& model, int64_t encoder, const Batch& batch);
// The decoder's forward (loss) and its hidden states at the target positions, given every
// encoder's rows of the batch in module order.
Qwen2_5_VLImpl::Output decode(Qwen2_5_VLImpl& model, const Batch& batch, const std::vector<torch::Tensor>& rows);
std::pair<torch::Tensor, torch::Tensor> decode_hidden(Qwen2_5_VLImpl& model, const Batch& batch,
                                                      const std::vector<torch::Tensor>& rows);

// Megatron tensor parallelism for the text decoder over `tp`: q/k/v and gate/up become
// column-parallel (query heads, kv heads and the MLP width split across ranks), o and down
// row-parallel; embed_tokens and lm_head are cut to this rank's vocabulary rows, with a
// vocab-parallel embedding and cross-entropy (no full logits). Norms stay replicated.
// Call on every TP rank, on identically initialised models. Throws dhp::Error when tp does
// not divide heads, kv heads, vocabulary or the MLP width.
// Returns how each sharded parameter (by name) was cut; parameters not listed are replicated.
parallel::TpShardMap parallelize_text_tp(Qwen2_5_VLImpl& model, const dist::Group& tp);

// Megatron tensor parallelism for the vision tower over `tp`: the fused qkv column-parallel
// by heads (q, k and v each split), proj row-parallel, gate/up column- and down
// row-parallel, the merger's first linear column- and second row-parallel. Patch embedding
// and norms stay replicated (computed on every rank). The output is replicated.
parallel::TpShardMap parallelize_vision_tp(Qwen2_5_VLImpl& model, const dist::Group& tp);

// Sequence parallelism for the vision tower (Ulysses): the window-ordered patch sequence
// is split across the SP ranks on window boundaries (ragged shards, balanced by patches);
// window blocks run locally on each shard with no communication; full-attention blocks
// use ulysses_attention over whole images; each rank merges its own rows and the merged
// embeddings are all-gathered (ragged) and put back in processor order.
// Parameters stay replicated; their gradients are partial per rank and must be summed
// over the SP group before the optimizer step. With the tower's activation checkpointing
// on, each block is recomputed in backward (Ulysses all-to-alls included, in the same
// order on every SP rank). Call on every SP rank with identically initialised models.
void parallelize_vision_sp(Qwen2_5_VLImpl& model, const dist::Group& sp, const nn::VarlenAttentionOptions& attention = {});

// ZeRO-3 for one module over `group`: scope "visual" (stages patch_embed, blocks.<i>,
// merger) or "text" (embed_tokens, layers.<i>, norm and the lm_head, which is
// embed_tokens' stage when tied). Installs the stage runner and hooks; the returned object
// must outlive the model's use.
std::unique_ptr<parallel::Zero3> parallelize_zero3(Qwen2_5_VLImpl& model, const std::string& scope,
                                                   const dist::Group& group);

}  // namespace dhp::qwen
