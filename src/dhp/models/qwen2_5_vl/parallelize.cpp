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
  Target(Qwen2_5_VLImpl& model, std::string name, int64_t attention_block)
      : model_(model), name_(std::move(name)), block_(attention_block) {}
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
    parallelize_vision_sp(model_, sp, block_);
  }
  std::unique_ptr<parallel::Zero3> fully_shard(const dist::Group& group) override {
    return parallelize_zero3(model_, vision() ? "visual" : "text", group);
  }

 private:
  bool vision() const { return name_ == "vision"; }
  Qwen2_5_VLImpl& model_;
  std::string name_;
  int64_t block_;
};

}  // namespace

std::vector<std::string> module_names() { return {"vision", "text"}; }

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

std::vector<std::unique_ptr<parallel::ModuleTarget>> module_targets(Qwen2_5_VLImpl& model, int64_t attention_block) {
  std::vector<std::unique_ptr<parallel::ModuleTarget>> out;
  for (const auto& name : module_names()) out.push_back(std::make_unique<Target>(model, name, attention_block));
  return out;
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
  // rows [start, start + V/tp); the hooks never materialise full logits.
  const int64_t start = tp.rank() * (t.vocab_size / tp.size());
  {
    torch::NoGradGuard no_grad;
    auto& emb = model.model->embed_tokens->weight;
    emb.set_data(parallel::shard_of(emb, 0, tp, "vocab-parallel embed_tokens"));
    if (model.lm_head) model.lm_head->weight.set_data(parallel::shard_of(model.lm_head->weight, 0, tp, "vocab-parallel lm_head"));
  }
  map["model.embed_tokens.weight"] = {0, 1};
  if (model.lm_head) map["lm_head.weight"] = {0, 1};
  auto* m = &model;
  dist::Group g = tp;
  model.embed_tokens_fn = [m, g, start](const torch::Tensor& ids) {
    return parallel::vocab_parallel_embedding(ids, m->model->embed_tokens->weight, start, g);
  };
  model.loss_sum_fn = [m, g, start](const torch::Tensor& h, const torch::Tensor& tgt) {
    auto logits = torch::matmul(parallel::copy_to_group(h, g), m->lm_head_weight().t());  // (n, V/tp) [sharded]
    return parallel::vocab_parallel_cross_entropy(logits, tgt, start, g).sum();
  };
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

void parallelize_vision_sp(Qwen2_5_VLImpl& model, const dist::Group& sp, int64_t block_size) {
  if (sp.size() == 1) return;
  const auto& vc = model.cfg.vision;
  DHP_CHECK(vc.num_heads % sp.size() == 0, "vision sp=", sp.size(), " does not divide vision num_heads=", vc.num_heads);
  auto* vt = model.visual.get();
  dist::Group g = sp;
  model.vision_fn = [vt, g, block_size](const torch::Tensor& patches, const VisionPlan& plan) {
    const auto& c = vt->cfg;
    const int64_t unit = c.spatial_merge_size * c.spatial_merge_size;
    const auto rows = parallel::window_shards(plan.cu_window_seqlens, g.size());
    int64_t lo = 0;
    for (int64_t i = 0; i < g.rank(); ++i) lo += rows[i];
    const int64_t hi = lo + rows[g.rank()];
    // My patches: window-ordered rows [lo, hi) = merged units window_index[lo/unit, hi/unit).
    std::vector<int64_t> mine;
    for (int64_t u = lo / unit; u < hi / unit; ++u)
      for (int64_t k = 0; k < unit; ++k) mine.push_back(plan.window_index[u] * unit + k);
    auto idx = torch::tensor(mine, torch::kInt64);
    auto h = vt->patch_embed(patches.index_select(0, idx));  // (S_local, hidden) [sharded]
    auto [cos, sin] = vt->rotary(plan);
    cos = cos.narrow(0, lo, hi - lo);
    sin = sin.narrow(0, lo, hi - lo);
    const auto win_cu = parallel::local_segments(plan.cu_window_seqlens, lo, hi);
    const std::set<int64_t> full(c.fullatt_block_indexes.begin(), c.fullatt_block_indexes.end());
    for (int64_t i = 0; i < c.depth; ++i) {
      auto block = vt->blocks->ptr<VisionBlockImpl>(i);
      const bool is_full = full.count(i) > 0;
      VisionAttnInputs in{cos, sin, is_full ? plan.cu_seqlens : win_cu};
      // A full-attention block attends through Ulysses; the swap lives inside the function so
      // that a checkpointed block's recomputation in backward uses it too.
      auto run = [block, in, is_full, g, rows, block_size](const torch::Tensor& x) {
        const auto saved = block->attn->core;
        struct Restore {
          VisionBlockImpl* b;
          decltype(saved) core;
          ~Restore() { b->attn->core = core; }
        } restore{block.get(), saved};
        if (is_full) {
          block->attn->core = [g, rows, block_size](const torch::Tensor& q, const torch::Tensor& k,
                                                   const torch::Tensor& v, const std::vector<int64_t>& cu,
                                                   bool causal) {
            return parallel::ulysses_attention(q, k, v, cu, causal, g, rows, block_size);
          };
        }
        return block->forward(x, in);
      };
      h = vt->activation_checkpointing && torch::GradMode::is_enabled() ? dhp::nn::checkpoint(run, h) : run(h);
    }
    auto merged = vt->merger(h);  // (S_local/unit, out) window order [sharded]
    std::vector<int64_t> merged_rows;
    for (auto r : rows) merged_rows.push_back(r / unit);
    auto all = parallel::gather_rows(merged, g, merged_rows);  // (N/unit, out) window order
    return reorder_units(all, inverse_permutation(plan.window_index), 1);
  };
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
  parallel::Zero3* zp = z.get();
  auto* m = &model;
  model.model->runner = z->runner();
  model.embed_tokens_fn = [zp, m](const torch::Tensor& ids) {
    return zp->run("model.embed_tokens", [m](const torch::Tensor& x) { return m->model->embed_tokens(x); }, ids);
  };
  const std::string head = model.lm_head ? "lm_head" : "model.embed_tokens";
  model.loss_sum_fn = [zp, m, head](const torch::Tensor& h, const torch::Tensor& tgt) {
    return zp->run(head, [m, tgt](const torch::Tensor& x) { return m->local_loss_sum(x, tgt); }, h);
  };
  return z;
}

}  // namespace dhp::qwen
