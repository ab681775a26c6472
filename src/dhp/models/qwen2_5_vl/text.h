// Qwen2.5 text decoder: token embeddings, decoder layers (GQA attention with q/k/v bias,
// M-RoPE, SwiGLU, RMSNorm), final norm. Works on packed sequences: samples concatenated,
// cu_seqlens marking them, causal attention inside each sample.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>

#include <string>
#include <vector>

#include "dhp/models/qwen2_5_vl/config.h"
#include "dhp/models/qwen2_5_vl/vision.h"
#include "dhp/nn/layers.h"

namespace dhp::qwen {

// M-RoPE cos/sin (L, head_dim) from position_ids (3, L): channel c of the rotary takes its
// angle from axis t, h or w according to mrope_section (repeated for both halves).
std::pair<torch::Tensor, torch::Tensor> mrope_cos_sin(const torch::Tensor& position_ids,
                                                      const TextConfig& cfg);

struct TextAttnInputs {
  torch::Tensor cos, sin;        // (L, head_dim)
  std::vector<int64_t> cu;       // per-sample offsets in the packed sequence
  AttentionCore core;            // causal attention over those segments
};

class TextAttentionImpl : public torch::nn::Module {
 public:
  explicit TextAttentionImpl(const TextConfig& cfg);
  torch::Tensor forward(const torch::Tensor& x, const TextAttnInputs& in);  // (L, C) -> (L, C)
  dhp::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  int64_t head_dim;
};
TORCH_MODULE(TextAttention);

class DecoderLayerImpl : public torch::nn::Module {
 public:
  explicit DecoderLayerImpl(const TextConfig& cfg);
  torch::Tensor forward(const torch::Tensor& x, const TextAttnInputs& in);
  dhp::nn::RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  TextAttention self_attn{nullptr};
  dhp::nn::SwiGLU mlp{nullptr};
};
TORCH_MODULE(DecoderLayer);

class TextModelImpl : public torch::nn::Module {
 public:
  explicit TextModelImpl(const TextConfig& cfg);
  // embeds (L, C) -> final-normed hidden states (L, C).
  torch::Tensor forward(torch::Tensor embeds, const TextAttnInputs& in);
  // fn(x) through the runner when there is one (the decoder's stages, its embedding and loss
  // head included: "model.embed_tokens", "model.layers.<i>", "model.norm", "lm_head").
  torch::Tensor stage(const std::string& name, const dhp::nn::StageFn& fn, const torch::Tensor& x);
  dhp::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  dhp::nn::RMSNorm norm{nullptr};
  TextConfig cfg;
  bool activation_checkpointing = false;
  dhp::nn::VarlenAttentionOptions attention;  // block and kernel (training.attention_block, training.attention)
  // Runs each stage when set (ZeRO-3); see VisionTransformer.
  dhp::nn::StageRunner runner;
};
TORCH_MODULE(TextModel);

}  // namespace dhp::qwen
