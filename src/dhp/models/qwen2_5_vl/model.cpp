#include "dhp/models/qwen2_5_vl/model.h"

#include <map>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "dhp/core/error.h"

namespace dhp::qwen {

int64_t Batch::num_target_tokens() const { return targets.ne(-100).sum().item<int64_t>(); }

Batch to_device(Batch b, const torch::Device& device) {
  for (torch::Tensor* t : {&b.pixel_values, &b.input_ids, &b.targets, &b.position_ids}) {
    if (t->defined() && t->device() != device) *t = t->to(device);
  }
  return b;
}

torch::Tensor rope_index(const std::vector<int64_t>& ids, const std::vector<GridTHW>& grids, const ModelConfig& cfg,
                         const std::vector<float>& second_per_grid_t) {
  DHP_CHECK(second_per_grid_t.empty() || second_per_grid_t.size() == grids.size(), "rope_index: ",
            second_per_grid_t.size(), " second_per_grid_t values for ", grids.size(), " vision grids");
  const int64_t m = cfg.vision.spatial_merge_size;
  const float tps = static_cast<float>(cfg.vision.tokens_per_second);
  const int64_t L = static_cast<int64_t>(ids.size());
  std::vector<int64_t> t(L), h(L), w(L);
  int64_t next = 0;  // first free position
  size_t item = 0;
  int64_t i = 0;
  while (i < L) {
    if (!cfg.is_vision_pad(ids[i])) {
      t[i] = h[i] = w[i] = next++;
      ++i;
      continue;
    }
    const int64_t pad = ids[i];
    const bool video = pad == cfg.video_token_id;
    const char* what = video ? "video" : "image";
    const char* token = video ? "<|video_pad|>" : "<|image_pad|>";
    DHP_CHECK(item < grids.size(), "rope_index: more vision runs than the ", grids.size(), " grids");
    const auto& g = grids[item];
    const int64_t gt = g[0], gh = g[1] / m, gw = g[2] / m, n = gt * gh * gw;
    DHP_CHECK(video || gt == 1, "rope_index: item ", item, " is an image (", token, ") but its grid has t=", gt);
    DHP_CHECK(i + n <= L, "rope_index: ", what, " ", item, " needs ", n, " ", token,
              " tokens but the sequence ends after ", L - i);
    // Hugging Face multiplies a float32 tensor: (t * second_per_grid_t) * tokens_per_second, then .long().
    const float spg = video ? (second_per_grid_t.empty() ? 1.0f : second_per_grid_t[item]) : 0.0f;
    DHP_CHECK(!video || (std::isfinite(spg) && spg > 0), "rope_index: video ", item, " has second_per_grid_t ",
              spg, " (must be > 0)");
    int64_t max_pos = next - 1;
    for (int64_t k = 0; k < n; ++k) {
      DHP_CHECK(ids[i + k] == pad, "rope_index: ", what, " ", item, " needs ", n, " consecutive ", token,
                " tokens, found ", k);
      const float time = static_cast<float>(static_cast<float>(k / (gh * gw)) * spg) * tps;
      t[i + k] = next + static_cast<int64_t>(time);
      h[i + k] = next + (k / gw) % gh;
      w[i + k] = next + k % gw;
      max_pos = std::max({max_pos, t[i + k], h[i + k], w[i + k]});
    }
    ++item;
    next = max_pos + 1;
    i += n;
  }
  DHP_CHECK(item == grids.size(), "rope_index: ", grids.size(), " vision grids but ", item,
            " image or video runs in the sequence");
  auto out = torch::empty({3, L}, torch::kInt64);
  std::copy(t.begin(), t.end(), out[0].data_ptr<int64_t>());
  std::copy(h.begin(), h.end(), out[1].data_ptr<int64_t>());
  std::copy(w.begin(), w.end(), out[2].data_ptr<int64_t>());
  return out;
}

Qwen2_5_VLImpl::Qwen2_5_VLImpl(const ModelConfig& c) : cfg(c) {
  cfg.validate();
  visual = register_module("visual", VisionTransformer(cfg.vision));
  model = register_module("model", TextModel(cfg.text));
  if (!cfg.text.tie_word_embeddings) {
    lm_head = register_module("lm_head", dhp::nn::make_linear(cfg.text.hidden_size, cfg.text.vocab_size, false));
  }
  loss_head = register_module("loss_head", dhp::nn::CrossEntropyHead());
}

torch::Tensor Qwen2_5_VLImpl::encode_images(const Batch& batch) {
  if (batch.grid_thw.empty()) return torch::Tensor();
  return visual->forward(batch.pixel_values, make_vision_plan(batch.grid_thw, cfg.vision));
}

void Qwen2_5_VLImpl::set_activation_checkpointing(bool on) {
  visual->activation_checkpointing = on;
  model->activation_checkpointing = on;
}

void Qwen2_5_VLImpl::set_attention(const dhp::nn::VarlenAttentionOptions& options) {
  visual->attention = options;
  model->attention = options;
}

torch::Tensor Qwen2_5_VLImpl::lm_head_weight() const {
  return lm_head ? lm_head->weight : model->embed_tokens->weight;
}

torch::Tensor Qwen2_5_VLImpl::embed(const Batch& batch, const torch::Tensor& vision_embeds) {
  auto emb = model->stage("model.embed_tokens", [this](const torch::Tensor& ids) { return model->embed_tokens(ids); },
                          batch.input_ids);  // (L, C)
  auto pos = batch.input_ids.eq(cfg.image_token_id).logical_or(batch.input_ids.eq(cfg.video_token_id)).nonzero().squeeze(-1);
  auto vis = vision_embeds.defined() ? vision_embeds : encode_images(batch);  // (N/4, C)
  if (!vis.defined() || vis.size(0) == 0) {
    DHP_CHECK(pos.numel() == 0, "batch has ", pos.numel(), " <|image_pad|> / <|video_pad|> tokens but no images or videos");
    return emb;
  }
  DHP_CHECK(vis.size(0) == pos.numel(), "batch has ", pos.numel(),
            " <|image_pad|> / <|video_pad|> tokens but its images and videos give ", vis.size(0), " vision embeddings");
  return emb.index_copy(0, pos, vis.to(emb.scalar_type()));
}

std::pair<torch::Tensor, torch::Tensor> Qwen2_5_VLImpl::hidden_at_targets(const Batch& batch,
                                                                           const torch::Tensor& vision_embeds) {
  auto [cos, sin] = mrope_cos_sin(batch.position_ids, cfg.text);
  const auto dtype = model->embed_tokens->weight.scalar_type();
  TextAttnInputs in{cos.to(dtype), sin.to(dtype), batch.cu_seqlens, local_attention_core(model->attention)};
  auto h = model->forward(embed(batch, vision_embeds), in);  // (L, C)
  auto sel = batch.targets.ne(-100).nonzero().squeeze(-1);
  return {h.index_select(0, sel), batch.targets.index_select(0, sel)};
}

torch::Tensor Qwen2_5_VLImpl::target_logits(const Batch& batch) {
  auto h = hidden_at_targets(batch).first;
  return torch::matmul(h, lm_head_weight().t()).to(torch::kFloat32);
}

Qwen2_5_VLImpl::Output Qwen2_5_VLImpl::forward(const Batch& batch, const torch::Tensor& vision_embeds) {
  auto [h, tgt] = hidden_at_targets(batch, vision_embeds);
  Output out;
  out.num_tokens = tgt.numel();
  if (out.num_tokens == 0) {
    out.loss_sum = h.sum().to(torch::kFloat32) * 0;
    return out;
  }
  // The head's stage: lm_head's, or the embedding's when tied (ZeRO-3 gathers that weight).
  const auto loss = [this, tgt = tgt](const torch::Tensor& x) { return loss_head(x, tgt, lm_head_weight()); };
  out.loss_sum = model->stage(lm_head ? "lm_head" : "model.embed_tokens", loss, h);
  return out;
}

int64_t apply_freezing(torch::nn::Module& model, const Freezing& freezing, const ModelConfig& cfg) {
  int64_t frozen = 0;
  for (auto& kv : model.named_parameters(true)) {
    if (freezing.trainable(kv.key(), cfg)) continue;
    kv.value().set_requires_grad(false);
    ++frozen;
  }
  return frozen;
}

std::vector<std::string> apply_lora(Qwen2_5_VLImpl& model, const LoraSpec& spec, uint64_t seed) {
  std::vector<std::string> done;
  if (!spec.on()) return done;
  const auto wanted = adapted_linears(model.cfg, spec);
  std::map<std::string, std::shared_ptr<torch::nn::Module>> modules;
  for (const auto& kv : model.named_modules("", /*include_self=*/false)) modules[kv.key()] = kv.value();
  torch::NoGradGuard no_grad;
  for (const auto& l : wanted) {
    auto it = modules.find(l.name);
    DHP_CHECK(it != modules.end(), "LoRA: the model has no module ", l.name);
    auto* linear = dynamic_cast<dhp::nn::LinearImpl*>(it->second.get());
    DHP_CHECK(linear != nullptr, "LoRA: ", l.name, " is not a linear layer");
    linear->add_lora({spec.rank, spec.alpha, spec.dropout});
    const double bound = 1.0 / std::sqrt(static_cast<double>(linear->lora_a.size(1)));
    auto gen = at::make_generator<at::CPUGeneratorImpl>(name_seed(seed, l.name + ".lora_A.weight"));
    auto a = torch::empty(linear->lora_a.sizes(), torch::kFloat32);
    a.uniform_(-bound, bound, gen);
    linear->lora_a.copy_(a);
    done.push_back(l.name);
  }
  return done;
}

uint64_t name_seed(uint64_t seed, const std::string& name) {
  uint64_t h = 1469598103934665603ULL ^ (seed * 0x9E3779B97F4A7C15ULL);
  for (unsigned char c : name) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

bool is_norm(const std::string& name) {
  return name.find("norm") != std::string::npos || name.find("ln_q") != std::string::npos;
}

bool decays(const std::string& name, const torch::Tensor& p) {
  return p.dim() >= 2 && !is_norm(name);
}

void init_parameters(torch::nn::Module& module, uint64_t seed, double std) {
  torch::NoGradGuard no_grad;
  for (auto& kv : module.named_parameters(/*recurse=*/true)) {
    const std::string& name = kv.key();
    auto& p = kv.value();
    const bool is_bias = name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
    if (is_norm(name)) {
      p.fill_(1.0);
    } else if (is_bias || p.dim() < 2) {
      p.zero_();
    } else {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(name_seed(seed, name));
      auto w = torch::empty(p.sizes(), torch::kFloat32);
      w.normal_(0.0, std, gen);
      p.copy_(w);
    }
  }
}

}  // namespace dhp::qwen
