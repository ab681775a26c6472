#include "dhp/parallel/parallelize.h"

#include <torch/torch.h>

#include "dhp/core/error.h"
#include "dhp/parallel/mappings.h"
#include "dhp/parallel/tensor_parallel.h"
#include "dhp/parallel/vocab_parallel.h"

namespace dhp::parallel {
namespace {

// Replaces parent.name (a Linear held in `member`) by `replacement`.
template <class Parallel>
void swap_linear(torch::nn::Module& parent, const std::string& name, dhp::nn::Linear& member, const dist::Group& g) {
  auto p = std::make_shared<typename Parallel::ContainedType>(*member, g);
  parent.replace_module(name, p);
  member = dhp::nn::Linear(std::static_pointer_cast<dhp::nn::LinearImpl>(p));
}

}  // namespace

void parallelize_text_tp(qwen::Qwen2_5_VLImpl& model, const dist::Group& tp) {
  if (tp.size() == 1) return;
  const auto& t = model.cfg.text;
  DHP_CHECK(t.num_heads % tp.size() == 0 && t.num_kv_heads % tp.size() == 0 && t.vocab_size % tp.size() == 0,
            "text tp=", tp.size(), " must divide num_heads=", t.num_heads, ", num_kv_heads=", t.num_kv_heads,
            " and vocab_size=", t.vocab_size);
  for (auto& l : *model.model->layers) {
    auto* layer = l->as<qwen::DecoderLayerImpl>();
    auto& attn = *layer->self_attn;
    swap_linear<ColumnParallelLinear>(attn, "q_proj", attn.q_proj, tp);
    swap_linear<ColumnParallelLinear>(attn, "k_proj", attn.k_proj, tp);
    swap_linear<ColumnParallelLinear>(attn, "v_proj", attn.v_proj, tp);
    swap_linear<RowParallelLinear>(attn, "o_proj", attn.o_proj, tp);
    auto& mlp = *layer->mlp;
    swap_linear<ColumnParallelLinear>(mlp, "gate_proj", mlp.gate_proj, tp);
    swap_linear<ColumnParallelLinear>(mlp, "up_proj", mlp.up_proj, tp);
    swap_linear<RowParallelLinear>(mlp, "down_proj", mlp.down_proj, tp);
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
  auto* m = &model;
  dist::Group g = tp;
  model.embed_tokens_fn = [m, g, start](const torch::Tensor& ids) {
    return vocab_parallel_embedding(ids, m->model->embed_tokens->weight, start, g);
  };
  model.loss_sum_fn = [m, g, start](const torch::Tensor& h, const torch::Tensor& tgt) {
    auto logits = torch::matmul(copy_to_group(h, g), m->lm_head_weight().t());  // (n, V/tp) [sharded]
    return vocab_parallel_cross_entropy(logits, tgt, start, g).sum();
  };
}

}  // namespace dhp::parallel
