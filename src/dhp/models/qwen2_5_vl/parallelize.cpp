#include "dhp/models/qwen2_5_vl/parallelize.h"

#include <torch/torch.h>

#include <set>

#include "dhp/core/error.h"
#include "dhp/nn/layers.h"
#include "dhp/parallel/mappings.h"
#include "dhp/parallel/sequence_parallel.h"
#include "dhp/parallel/ulysses.h"
#include "dhp/parallel/vocab_parallel.h"

namespace dhp::qwen {
namespace {

bool is_vision_param(const std::string& name) { return name.rfind("visual.", 0) == 0; }
bool is_text_param(const std::string& name) { return name.rfind("model.", 0) == 0 || name.rfind("lm_head.", 0) == 0; }

// The parameters of `model` that `owns` selects, in the model's order, with decay flags.
std::vector<optim::NamedParam> parameters_of(Qwen2_5_VLImpl& model, bool (*owns)(const std::string&)) {
  std::vector<optim::NamedParam> out;
  for (auto& kv : model.named_parameters(true)) {
    if (owns(kv.key())) out.push_back({kv.key(), kv.value(), decays(kv.key(), kv.value())});
  }
  return out;
}

// One module of the model as a strategy target: its parameters by name prefix, and the
// parallelizations above; those a module lacks throw naming the module.
class Target : public parallel::ModuleTarget {
 public:
  Target(Qwen2_5_VLImpl& model, std::string name, const nn::VarlenAttentionOptions& attention)
      : model_(model), name_(std::move(name)), attention_(attention) {}
  const std::string& name() const override { return name_; }
  bool owns(const std::string& param) const override { return vision() ? is_vision_param(param) : is_text_param(param); }
  std::vector<optim::NamedParam> parameters() override {
    return parameters_of(model_, vision() ? is_vision_param : is_text_param);
  }
  parallel::TpShardMap tensor_parallel(const dist::Group& tp) override {
    return vision() ? parallelize_vision_tp(model_, tp) : parallelize_text_tp(model_, tp);
  }
  void sequence_parallel(const dist::Group& sp) override {
    DHP_CHECK(vision(), "the ", name_, " module has no sequence-parallel strategy (only vision has)");
    parallelize_vision_sp(model_, sp, attention_);
  }
  std::unique_ptr<parallel::Zero3> fully_shard(const dist::Group& group) override {
    return parallelize_zero3(model_, vision() ? "visual" : "text", group);
  }

 private:
  bool vision() const { return name_ == "vision"; }
  Qwen2_5_VLImpl& model_;
  std::string name_;
  nn::VarlenAttentionOptions attention_;
};

}  // namespace

std::vector<std::string> module_names() { return {"vision", "text"}; }

std::vector<std::pair<std::string, std::string>> part_prefixes() {
  return {{"vision", "visual."}, {"merger", "visual.merger."}, {"text", "model."}, {"text", "lm_head"}};
}

std::vector<dist::ModuleDims> module_dims(const ModelConfig& cfg) {
  using S = dist::Strategy;
  const auto& v = cfg.vision;
  const auto& t = cfg.text;
  dist::ModuleDims vision{"vision",
                          {S::kNone, S::kSequenceParallel, S::kTensorParallel, S::kZero3, S::kDataParallel},
                          {{"vision num_heads", v.num_heads}},
                          {{"vision num_heads", v.num_heads},
                           {"vision intermediate_size", v.intermediate_size},
                           {"merger width (hidden * merge^2)", v.hidden_size * v.spatial_merge_size * v.spatial_merge_size}}};
  dist::ModuleDims text{"text",
                        {S::kNone, S::kTensorParallel, S::kZero3, S::kDataParallel},
                        {},
                        {{"text num_heads", t.num_heads},
                         {"text num_kv_heads", t.num_kv_heads},
                         {"text intermediate_size", t.intermediate_size},
                         {"vocab_size", t.vocab_size}}};
  return {vision, text};
}

std::vector<std::unique_ptr<parallel::ModuleTarget>> module_targets(Qwen2_5_VLImpl& model,
                                                                   const nn::VarlenAttentionOptions& attention) {
  std::vector<std::unique_ptr<parallel::ModuleTarget>> out;
  for (const auto& name : module_names()) out.push_back(std::make_unique<Target>(model, name, attention));
  return out;
}

namespace {

// Qwen2.5-VL has one encoder, the vision tower, whose rows replace <|image_pad|> and <|video_pad|>.
void check_encoder(int64_t encoder) {
  DHP_CHECK(encoder == 0, "Qwen2.5-VL has one encoder (module 0, vision), not module ", encoder);
}

const torch::Tensor& vision_rows(const std::vector<torch::Tensor>& rows) {
  DHP_CHECK(rows.size() == 1, "Qwen2.5-VL's decoder takes the rows of one encoder, not ", rows.size());
  return rows.front();
}

}  // namespace

int64_t encoder_rows(const ModelConfig& cfg, int64_t encoder, const std::vector<int64_t>& ids) {
  check_encoder(encoder);
  int64_t n = 0;
  for (auto id : ids) n += cfg.is_vision_pad(id);
  return n;
}

torch::Tensor encode(Qwen2_5_VLImpl& model, int64_t encoder, const Batch& batch) {
  check_encoder(encoder);
  return model.encode_images(batch);
}

Qwen2_5_VLImpl::Output decode(Qwen2_5_VLImpl& model, const Batch& batch, const std::vector<torch::Tensor>& rows) {
  return model.forward(batch, vision_rows(rows));
}

std::pair<torch::Tensor, torch::Tensor> decode_hidden(Qwen2_5_VLImpl& model, const Batch& batch,
                                                      const std::vector<torch::Tensor>& rows) {
  return model.hidden_at_targets(batch, vision_rows(rows));
}

parallel::TpShardMap parallelize_text_tp(Qwen2_5_VLImpl& model, const dist::Group& tp) {
  parallel::TpShardMap map;
  if (tp.size() == 1) return map;
  const auto& t = model.cfg.text;
  DHP_CHECK(t.num_heads % tp.size() == 0 && t.num_kv_heads % tp.size() == 0 && t.vocab_size % tp.size() == 0,
            "text tp=", tp.size(), " must divide num_heads=", t.num_heads, ", num_kv_heads=", t.num_kv_heads,
            " and vocab_size=", t.vocab_size);
  for (size_t i = 0; i < model.model->layers->size(); ++i) {
    auto* layer = model.model->layers->ptr<DecoderLayerImpl>(i).get();
    const std::string pre = "model.layers." + std::to_string(i) + ".";
    auto& attn = *layer->self_attn;
    parallel::make_column_parallel(map, pre + "self_attn.", attn, "q_proj", attn.q_proj, tp);
    parallel::make_column_parallel(map, pre + "self_attn.", attn, "k_proj", attn.k_proj, tp);
    parallel::make_column_parallel(map, pre + "self_attn.", attn, "v_proj", attn.v_proj, tp);
    parallel::make_row_parallel(map, pre + "self_attn.", attn, "o_proj", attn.o_proj, tp);
    parallel::make_swiglu_parallel(map, pre + "mlp.", *layer->mlp, tp);
  }
  // Vocabulary-parallel embedding and lm_head (tied: the same shard serves both): keep
  // rows [start, start + V/tp); the loss head never materialises full logits.
  const int64_t start = tp.rank() * (t.vocab_size / tp.size());
  auto emb = std::make_shared<parallel::VocabParallelEmbeddingImpl>(*model.model->embed_tokens, tp);
  model.model->replace_module("embed_tokens", emb);
  model.model->embed_tokens = nn::Embedding(std::static_pointer_cast<nn::EmbeddingImpl>(emb));
  if (model.lm_head) {
    torch::NoGradGuard no_grad;
    model.lm_head->weight.set_data(parallel::shard_of(model.lm_head->weight, 0, tp, "vocab-parallel lm_head"));
  }
  map["model.embed_tokens.weight"] = {0, 1};
  if (model.lm_head) map["lm_head.weight"] = {0, 1};
  auto head = std::make_shared<parallel::VocabParallelCrossEntropyHeadImpl>(tp, start);
  model.replace_module("loss_head", head);
  model.loss_head = nn::CrossEntropyHead(std::static_pointer_cast<nn::CrossEntropyHeadImpl>(head));
  return map;
}

parallel::TpShardMap parallelize_vision_tp(Qwen2_5_VLImpl& model, const dist::Group& tp) {
  parallel::TpShardMap map;
  if (tp.size() == 1) return map;
  const auto& v = model.cfg.vision;
  DHP_CHECK(v.num_heads % tp.size() == 0 && v.intermediate_size % tp.size() == 0,
            "vision tp=", tp.size(), " must divide num_heads=", v.num_heads, " and intermediate_size=",
            v.intermediate_size);
  auto& vt = *model.visual;
  for (size_t i = 0; i < vt.blocks->size(); ++i) {
    auto* block = vt.blocks->ptr<VisionBlockImpl>(i).get();
    const std::string pre = "visual.blocks." + std::to_string(i) + ".";
    auto& attn = *block->attn;
    parallel::make_column_parallel(map, pre + "attn.", attn, "qkv", attn.qkv, tp, /*parts=*/3);
    parallel::make_row_parallel(map, pre + "attn.", attn, "proj", attn.proj, tp);
    parallel::make_swiglu_parallel(map, pre + "mlp.", *block->mlp, tp);
  }
  auto& merger = *vt.merger;
  parallel::make_column_parallel(map, "visual.merger.mlp.", *merger.mlp, "0", merger.fc1, tp);
  parallel::make_row_parallel(map, "visual.merger.mlp.", *merger.mlp, "2", merger.fc2, tp);
  return map;
}

namespace {

// Ulysses over `group`: this rank's rows are a run of whole windows (window_shards),
// full-attention blocks attend over whole images through the all-to-alls, and the merged
// rows are all-gathered (ragged) at the end.
class UlyssesSplit : public VisionSequenceSplit {
 public:
  UlyssesSplit(dist::Group group, int64_t merge_unit, const nn::VarlenAttentionOptions& attention)
      : group_(std::move(group)), unit_(merge_unit), attention_(attention) {}

  std::pair<int64_t, int64_t> rows(const VisionPlan& plan) override {
    rows_ = parallel::window_shards(plan.cu_window_seqlens, group_.size());
    int64_t lo = 0;
    for (int64_t i = 0; i < group_.rank(); ++i) lo += rows_[i];
    return {lo, lo + rows_[group_.rank()]};
  }

  AttentionCore full_attention() override {
    return [g = group_, rows = rows_, attention = attention_](const torch::Tensor& q, const torch::Tensor& k,
                                                 const torch::Tensor& v, const std::vector<int64_t>& cu, bool causal) {
      return parallel::ulysses_attention(q, k, v, cu, causal, g, rows, attention);
    };
  }

  torch::Tensor gather(const torch::Tensor& merged) override {
    std::vector<int64_t> merged_rows;
    for (auto r : rows_) merged_rows.push_back(r / unit_);
    return parallel::gather_rows(merged, group_, merged_rows);  // (N/unit, out) window order
  }

 private:
  dist::Group group_;
  int64_t unit_;
  nn::VarlenAttentionOptions attention_;
  std::vector<int64_t> rows_;  // every rank's rows of the current forward
};

}  // namespace

void parallelize_vision_sp(Qwen2_5_VLImpl& model, const dist::Group& sp, const nn::VarlenAttentionOptions& attention) {
  if (sp.size() == 1) return;
  const auto& vc = model.cfg.vision;
  DHP_CHECK(vc.num_heads % sp.size() == 0, "vision sp=", sp.size(), " does not divide vision num_heads=", vc.num_heads);
  model.visual->split = std::make_shared<UlyssesSplit>(sp, vc.spatial_merge_size * vc.spatial_merge_size, attention);
}

std::unique_ptr<parallel::Zero3> parallelize_zero3(Qwen2_5_VLImpl& model, const std::string& scope,
                                         const dist::Group& group) {
  std::vector<std::string> units;
  if (scope == "visual") {
    units = {"visual.patch_embed", "visual.merger"};
    for (size_t i = 0; i < model.visual->blocks->size(); ++i) units.push_back("visual.blocks." + std::to_string(i));
    auto z = std::make_unique<parallel::Zero3>(parameters_of(model, is_vision_param), units, group);
    model.visual->runner = z->runner();
    return z;
  }
  DHP_CHECK(scope == "text", "parallelize_zero3: scope must be visual or text, got '", scope, "'");
  units = {"model.embed_tokens", "model.norm"};
  for (size_t i = 0; i < model.model->layers->size(); ++i) units.push_back("model.layers." + std::to_string(i));
  if (model.lm_head) units.push_back("lm_head");
  auto z = std::make_unique<parallel::Zero3>(parameters_of(model, is_text_param), units, group);
  // The decoder's stages, the embedding and the loss head included, run through it.
  model.model->runner = z->runner();
  return z;
}

}  // namespace dhp::qwen
