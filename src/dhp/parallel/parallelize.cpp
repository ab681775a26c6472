#include "dhp/parallel/parallelize.h"

#include <torch/torch.h>

#include "dhp/core/error.h"
#include "dhp/parallel/tensor_parallel.h"

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
  DHP_CHECK(t.num_heads % tp.size() == 0 && t.num_kv_heads % tp.size() == 0, "text tp=", tp.size(),
            " must divide num_heads=", t.num_heads, " and num_kv_heads=", t.num_kv_heads);
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
}

}  // namespace dhp::parallel
