#include "dhp/models/qwen2_5_vl/text.h"

#include <torch/torch.h>

namespace dhp::qwen {

std::pair<torch::Tensor, torch::Tensor> mrope_cos_sin(const torch::Tensor& position_ids,
                                                      const TextConfig& cfg) {
  const int64_t D = cfg.head_dim(), half = D / 2;
  auto inv = dhp::nn::rope_inv_freq(D, cfg.rope_theta).to(position_ids.device());  // (half)
  auto freqs = position_ids.to(torch::kFloat32).unsqueeze(-1) * inv;                 // (3, L, half)
  // axis of each rotary pair: the first mrope_section[0] pairs use t, the next h, then w.
  std::vector<int64_t> axis;
  for (int64_t a = 0; a < 3; ++a) {
    for (int64_t i = 0; i < cfg.mrope_section[a]; ++i) axis.push_back(a);
  }
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(axis.size()) == half);
  auto idx = torch::tensor(axis, torch::kInt64).to(position_ids.device());
  auto L = position_ids.size(1);
  auto sel = freqs.permute({1, 2, 0}).gather(2, idx.view({1, half, 1}).expand({L, half, 1})).squeeze(-1);
  auto emb = torch::cat({sel, sel}, -1);  // (L, D)
  return {emb.cos(), emb.sin()};
}

TextAttentionImpl::TextAttentionImpl(const TextConfig& cfg) : head_dim(cfg.head_dim()) {
  const int64_t kv = cfg.num_kv_heads * head_dim;
  q_proj = register_module("q_proj", dhp::nn::make_linear(cfg.hidden_size, cfg.num_heads * head_dim, true));
  k_proj = register_module("k_proj", dhp::nn::make_linear(cfg.hidden_size, kv, true));
  v_proj = register_module("v_proj", dhp::nn::make_linear(cfg.hidden_size, kv, true));
  o_proj = register_module("o_proj", dhp::nn::make_linear(cfg.num_heads * head_dim, cfg.hidden_size, false));
}

torch::Tensor TextAttentionImpl::forward(const torch::Tensor& x, const TextAttnInputs& in) {
  const int64_t L = x.size(0);
  auto q = q_proj(x).view({L, -1, head_dim});  // (L, H[local], D)
  auto k = k_proj(x).view({L, -1, head_dim});  // (L, KV[local], D)
  auto v = v_proj(x).view({L, -1, head_dim});
  q = dhp::nn::apply_rotary(q, in.cos, in.sin);
  k = dhp::nn::apply_rotary(k, in.cos, in.sin);
  // GQA: k and v keep their kv heads (query head h uses kv head h / (H / KV)); the kernel
  // expands them only where it needs to (nn::varlen_attention).
  auto o = in.core(q, k, v, in.cu, /*causal=*/true);
  return o_proj(o.reshape({L, -1}));
}

DecoderLayerImpl::DecoderLayerImpl(const TextConfig& cfg) {
  input_layernorm = register_module("input_layernorm", dhp::nn::RMSNorm(cfg.hidden_size, cfg.rms_norm_eps));
  self_attn = register_module("self_attn", TextAttention(cfg));
  post_attention_layernorm =
      register_module("post_attention_layernorm", dhp::nn::RMSNorm(cfg.hidden_size, cfg.rms_norm_eps));
  mlp = register_module("mlp", dhp::nn::SwiGLU(cfg.hidden_size, cfg.intermediate_size, false));
}

torch::Tensor DecoderLayerImpl::forward(const torch::Tensor& x, const TextAttnInputs& in) {
  auto h = x + self_attn->forward(input_layernorm(x), in);
  return h + mlp(post_attention_layernorm(h));
}

TextModelImpl::TextModelImpl(const TextConfig& c) : cfg(c) {
  embed_tokens = register_module("embed_tokens", dhp::nn::Embedding(cfg.vocab_size, cfg.hidden_size));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < cfg.num_layers; ++i) layers->push_back(DecoderLayer(cfg));
  norm = register_module("norm", dhp::nn::RMSNorm(cfg.hidden_size, cfg.rms_norm_eps));
}

torch::Tensor TextModelImpl::forward(torch::Tensor h, const TextAttnInputs& in) {
  for (size_t i = 0; i < layers->size(); ++i) {
    auto layer = layers->ptr<DecoderLayerImpl>(i);
    if (runner) {
      h = runner("model.layers." + std::to_string(i), [layer, in](const torch::Tensor& x) { return layer->forward(x, in); }, h);
    } else if (activation_checkpointing && (h.requires_grad() || dhp::nn::has_trainable_parameters(*layer))) {
      h = dhp::nn::checkpoint([layer, in](const torch::Tensor& x) { return layer->forward(x, in); }, h);
    } else {
      h = layer->forward(h, in);
    }
  }
  return stage("model.norm", [this](const torch::Tensor& x) { return norm(x); }, h);
}

torch::Tensor TextModelImpl::stage(const std::string& name, const dhp::nn::StageFn& fn, const torch::Tensor& x) {
  return runner ? runner(name, fn, x) : fn(x);
}

}  // namespace dhp::qwen
