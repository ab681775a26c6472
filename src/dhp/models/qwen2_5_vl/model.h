// Qwen2_5_VLForConditionalGeneration: vision tower + text decoder + lm_head, with Hugging
// Face's parameter names (visual.*, model.*, lm_head.*). Vision embeddings replace the
// <|image_pad|> and <|video_pad|> token embeddings in order.
#pragma once

#include <torch/nn/module.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dhp/models/qwen2_5_vl/config.h"
#include "dhp/models/qwen2_5_vl/freezing.h"
#include "dhp/models/qwen2_5_vl/lora.h"
#include "dhp/models/qwen2_5_vl/text.h"
#include "dhp/models/qwen2_5_vl/vision.h"

namespace dhp::qwen {

// One packed batch: samples concatenated, no padding.
struct Batch {
  torch::Tensor pixel_values;       // (N_patches, C*T*P*P) fp32, processor order; undefined if no image
  std::vector<GridTHW> grid_thw;    // per image or video, in order of appearance (a video: t > 1)
  torch::Tensor input_ids;          // (L) int64
  torch::Tensor targets;            // (L) int64: next-token target per position, -100 = no loss
  torch::Tensor position_ids;       // (3, L) int64, M-RoPE
  std::vector<int64_t> cu_seqlens;  // sample offsets in the packed sequence (num_samples + 1)
  int64_t num_samples() const { return static_cast<int64_t>(cu_seqlens.size()) - 1; }
  int64_t num_target_tokens() const;
};

// The batch with its tensors on `device` (the host-side lists stay as they are); the batch
// itself when they are there already.
Batch to_device(Batch b, const torch::Device& device);

// M-RoPE position ids of one sample, as Hugging Face's get_rope_index does: text runs get
// consecutive positions on all three axes; a vision item of grid (t, h, w), a run of
// <|image_pad|> or <|video_pad|> tokens placed after a text run, gets (t', h_i, w_i) over the
// merged grid offset by the next free position, and text after it starts at max + 1. The
// temporal index t' of temporal patch t is 0 for an image and, for a video,
// int(t * second_per_grid_t * tokens_per_second) computed in float32 as transformers 4.49 and
// vLLM do (the product truncated, not the interval first). grids: one per run, in order;
// second_per_grid_t: one per grid (ignored for images), or empty when no run is a video.
// ids: (L) int64 -> (3, L) int64.
torch::Tensor rope_index(const std::vector<int64_t>& ids, const std::vector<GridTHW>& grids, const ModelConfig& cfg,
                         const std::vector<float>& second_per_grid_t = {});

class Qwen2_5_VLImpl : public torch::nn::Module {
 public:
  explicit Qwen2_5_VLImpl(const ModelConfig& cfg);

  // Sum of the cross-entropy over target tokens (not averaged) and the hidden states.
  struct Output {
    torch::Tensor loss_sum;  // () fp32
    int64_t num_tokens = 0;  // target tokens
  };
  // vision_embeds: the batch's image embeddings (N/4, C) when computed elsewhere (parallel
  // drivers); undefined: encoded here.
  Output forward(const Batch& batch, const torch::Tensor& vision_embeds = {});
  // The batch's image embeddings (N/4, C) in order; undefined without images.
  torch::Tensor encode_images(const Batch& batch);
  // Embeddings with vision rows in place of <|image_pad|> and <|video_pad|>: (L, C).
  torch::Tensor embed(const Batch& batch, const torch::Tensor& vision_embeds = {});
  // Final hidden states (n, C) at the target positions and their targets (n).
  std::pair<torch::Tensor, torch::Tensor> hidden_at_targets(const Batch& batch, const torch::Tensor& vision_embeds = {});
  // Logits (n, vocab) of the target positions only (local lm_head; not vocab-parallel).
  torch::Tensor target_logits(const Batch& batch);
  // lm_head weight (vocab, C): embed_tokens' when tied.
  torch::Tensor lm_head_weight() const;

  void set_activation_checkpointing(bool on);
  // The attention kernel's block size and choice in both towers (training.attention_block,
  // training.attention).
  void set_attention(const dhp::nn::VarlenAttentionOptions& options);

  // Submodules by Hugging Face's names; parallel strategies replace them (and the linears
  // inside) from outside (models/qwen2_5_vl/parallelize.h), or set the towers' stage
  // runners and the vision tower's sequence split.
  VisionTransformer visual{nullptr};
  TextModel model{nullptr};
  dhp::nn::Linear lm_head{nullptr};  // null when tied
  // The loss over lm_head_weight(): summed cross-entropy of the full logits, or a
  // vocabulary-parallel one. No parameters (registered as "loss_head").
  dhp::nn::CrossEntropyHead loss_head{nullptr};
  ModelConfig cfg;
};
TORCH_MODULE(Qwen2_5_VL);

// Deterministic initialisation from a seed, one generator per parameter seeded by
// (seed, parameter name): the same weights whatever later shards them. Norm weights 1,
// biases 0, other weights N(0, initializer_range).
void init_parameters(torch::nn::Module& module, uint64_t seed, double std);

// Marks the parameters `freezing` does not train as not requiring gradients (before any
// strategy takes them: strategies keep frozen parameters out of gradients, reductions, the
// norm, the optimizer and checkpoints). Returns how many tensors it froze.
int64_t apply_freezing(torch::nn::Module& model, const Freezing& freezing, const ModelConfig& cfg);

// Adds `spec`'s adapters (lora.h) to the model's linears (nothing when off): A uniform in
// +-1/sqrt(in) from one generator per parameter name seeded by `seed` (as init_parameters),
// B zero, both in the linear's dtype and on its device. Call on the single-process model,
// before strategies shard it. Returns the adapted module names.
std::vector<std::string> apply_lora(Qwen2_5_VLImpl& model, const LoraSpec& spec, uint64_t seed);

// 64-bit FNV-1a of a string mixed with a seed.
uint64_t name_seed(uint64_t seed, const std::string& name);

// True for parameters that get weight decay (matrices; not norms, biases or 1-D tensors).
bool decays(const std::string& name, const torch::Tensor& p);

}  // namespace dhp::qwen
