#include "dhp/parallel/vocab_parallel.h"

#include <torch/torch.h>

#include "dhp/parallel/mappings.h"
#include "dhp/parallel/tensor_parallel.h"

namespace dhp::parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct VocabParallelCE : torch::autograd::Function<VocabParallelCE> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits, const torch::Tensor& targets,
                               int64_t vocab_start, const dist::Group& g) {
    auto x = logits.to(torch::kFloat32);
    const int64_t n = x.size(0), v = x.size(1);
    auto max = std::get<0>(x.max(1)).contiguous();  // (n)
    g.all_reduce_max_(max);
    auto shifted = x - max.unsqueeze(1);
    auto exp = shifted.exp();
    auto sum = exp.sum(1).contiguous();
    g.all_reduce_sum_(sum);
    auto local = targets - vocab_start;
    auto mine = (local >= 0) & (local < v);
    auto idx = local.clamp(0, v - 1);
    auto tgt = shifted.gather(1, idx.unsqueeze(1)).squeeze(1) * mine.to(torch::kFloat32);
    tgt = tgt.contiguous();
    g.all_reduce_sum_(tgt);
    auto softmax = exp / sum.unsqueeze(1);  // this rank's columns of the softmax
    ctx->save_for_backward({softmax, idx, mine});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    (void)n;
    return sum.log() - tgt;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    auto d = s[0].clone();
    d.scatter_add_(1, s[1].unsqueeze(1), -s[2].to(torch::kFloat32).unsqueeze(1));
    d.mul_(grads[0].unsqueeze(1));
    const auto dtype = static_cast<torch::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {d.to(dtype), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor vocab_parallel_embedding(const torch::Tensor& ids, const torch::Tensor& weight, int64_t vocab_start,
                                       const dist::Group& g) {
  const int64_t v = weight.size(0);
  auto local = ids - vocab_start;
  auto mine = (local >= 0) & (local < v);
  auto rows = torch::embedding(weight, local.clamp(0, v - 1)) * mine.unsqueeze(1).to(weight.scalar_type());
  return reduce_from_group(rows, g);
}

torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                           int64_t vocab_start, const dist::Group& g) {
  return VocabParallelCE::apply(logits, targets, vocab_start, g);
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(const nn::EmbeddingImpl& full, dist::Group g)
    : group(std::move(g)) {
  vocab_start = group.rank() * (full.weight.size(0) / group.size());
  torch::NoGradGuard no_grad;
  weight = register_parameter("weight", shard_of(full.weight.detach(), 0, group, "vocab-parallel embed_tokens"),
                              full.weight.requires_grad());
}

torch::Tensor VocabParallelEmbeddingImpl::forward(const torch::Tensor& ids) {
  return vocab_parallel_embedding(ids, weight, vocab_start, group);
}

VocabParallelCrossEntropyHeadImpl::VocabParallelCrossEntropyHeadImpl(dist::Group g, int64_t start)
    : group(std::move(g)), vocab_start(start) {}

torch::Tensor VocabParallelCrossEntropyHeadImpl::forward(const torch::Tensor& h, const torch::Tensor& targets,
                                                         const torch::Tensor& weight) {
  auto logits = torch::matmul(copy_to_group(h, group), weight.t());  // (n, V/tp) [sharded]
  return vocab_parallel_cross_entropy(logits, targets, vocab_start, group).sum();
}

}  // namespace dhp::parallel
