#include "dhp/parallel/parallelize.h"

#include <torch/torch.h>

#include "dhp/core/error.h"
#include "dhp/parallel/mappings.h"
#include "dhp/parallel/tensor_parallel.h"
#include "dhp/parallel/vocab_parallel.h"

namespace dhp::parallel {
namespace {

// Replaces parent.name (a Linear held in `member`) by its column-parallel shard; records
// the cut under prefix + name.
void column(TpShardMap& map, const std::string& prefix, torch::nn::Module& parent, const std::string& name,
            dhp::nn::Linear& member, const dist::Group& g, int64_t parts = 1) {
  auto p = std::make_shared<ColumnParallelLinearImpl>(*member, g, parts);
  parent.replace_module(name, p);
  member = dhp::nn::Linear(std::static_pointer_cast<dhp::nn::LinearImpl>(p));
  map[prefix + name + ".weight"] = {0, parts};
  if (p->bias.defined()) map[prefix + name + ".bias"] = {0, parts};
}

void row(TpShardMap& map, const std::string& prefix, torch::nn::Module& parent, const std::string& name,
         dhp::nn::Linear& member, const dist::Group& g) {
  auto p = std::make_shared<RowParallelLinearImpl>(*member, g);
  parent.replace_module(name, p);
  member = dhp::nn::Linear(std::static_pointer_cast<dhp::nn::LinearImpl>(p));
  map[prefix + name + ".weight"] = {1, 1};
}

void swiglu(TpShardMap& map, const std::string& prefix, dhp::nn::SwiGLUImpl& mlp, const dist::Group& g) {
  column(map, prefix, mlp, "gate_proj", mlp.gate_proj, g);
  column(map, prefix, mlp, "up_proj", mlp.up_proj, g);
  row(map, prefix, mlp, "down_proj", mlp.down_proj, g);
}

}  // namespace

TpShardMap parallelize_text_tp(qwen::Qwen2_5_VLImpl& model, const dist::Group& tp) {
  TpShardMap map;
  if (tp.size() == 1) return map;
  const auto& t = model.cfg.text;
  DHP_CHECK(t.num_heads % tp.size() == 0 && t.num_kv_heads % tp.size() == 0 && t.vocab_size % tp.size() == 0,
            "text tp=", tp.size(), " must divide num_heads=", t.num_heads, ", num_kv_heads=", t.num_kv_heads,
            " and vocab_size=", t.vocab_size);
  for (size_t i = 0; i < model.model->layers->size(); ++i) {
    auto* layer = model.model->layers->ptr<qwen::DecoderLayerImpl>(i).get();
    const std::string pre = "model.layers." + std::to_string(i) + ".";
    auto& attn = *layer->self_attn;
    column(map, pre + "self_attn.", attn, "q_proj", attn.q_proj, tp);
    column(map, pre + "self_attn.", attn, "k_proj", attn.k_proj, tp);
    column(map, pre + "self_attn.", attn, "v_proj", attn.v_proj, tp);
    row(map, pre + "self_attn.", attn, "o_proj", attn.o_proj, tp);
    swiglu(map, pre + "mlp.", *layer->mlp, tp);
  }
  // Vocabulary-parallel embedding and lm_head (tied: the same shard serves both): keep
  // rows [start, start + V/tp); the hooks never materialise full logits.
  const int64_t start = tp.rank() * (t.vocab_size / tp.size());
  {
    torch::NoGradGuard no_grad;
    auto& emb = model.model->embed_tokens->weight;
    emb.set_data(shard_of(emb, 0, tp, "vocab-parallel embed_tokens"));
    if (model.lm_head) model.lm_head->weight.set_data(shard_of(model.lm_head->weight, 0, tp, "vocab-parallel lm_head"));
  }
  map["model.embed_tokens.weight"] = {0, 1};
  if (model.lm_head) map["lm_head.weight"] = {0, 1};
  auto* m = &model;
  dist::Group g = tp;
  model.embed_tokens_fn = [m, g, start](const torch::Tensor& ids) {
    return vocab_parallel_embedding(ids, m->model->embed_tokens->weight, start, g);
  };
  model.loss_sum_fn = [m, g, start](const torch::Tensor& h, const torch::Tensor& tgt) {
    auto logits = torch::matmul(copy_to_group(h, g), m->lm_head_weight().t());  // (n, V/tp) [sharded]
    return vocab_parallel_cross_entropy(logits, tgt, start, g).sum();
  };
  return map;
}

TpShardMap parallelize_vision_tp(qwen::Qwen2_5_VLImpl& model, const dist::Group& tp) {
  TpShardMap map;
  if (tp.size() == 1) return map;
  const auto& v = model.cfg.vision;
  DHP_CHECK(v.num_heads % tp.size() == 0 && v.intermediate_size % tp.size() == 0,
            "vision tp=", tp.size(), " must divide num_heads=", v.num_heads, " and intermediate_size=",
            v.intermediate_size);
  auto& vt = *model.visual;
  for (size_t i = 0; i < vt.blocks->size(); ++i) {
    auto* block = vt.blocks->ptr<qwen::VisionBlockImpl>(i).get();
    const std::string pre = "visual.blocks." + std::to_string(i) + ".";
    auto& attn = *block->attn;
    column(map, pre + "attn.", attn, "qkv", attn.qkv, tp, /*parts=*/3);
    row(map, pre + "attn.", attn, "proj", attn.proj, tp);
    swiglu(map, pre + "mlp.", *block->mlp, tp);
  }
  auto& merger = *vt.merger;
  column(map, "visual.merger.mlp.", *merger.mlp, "0", merger.fc1, tp);
  row(map, "visual.merger.mlp.", *merger.mlp, "2", merger.fc2, tp);
  return map;
}

}  // namespace dhp::parallel
