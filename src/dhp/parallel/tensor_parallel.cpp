#include "dhp/parallel/tensor_parallel.h"

#include <torch/torch.h>

#include "dhp/core/error.h"
#include "dhp/parallel/mappings.h"

namespace dhp::parallel {

torch::Tensor shard_of(const torch::Tensor& full, int64_t dim, const dist::Group& g, const char* what) {
  DHP_CHECK(full.size(dim) % g.size() == 0, what, ": dim ", dim, " of size ", full.size(dim),
            " is not divisible by the tensor-parallel size ", g.size());
  const int64_t n = full.size(dim) / g.size();
  return full.detach().narrow(dim, g.rank() * n, n).clone();
}

torch::Tensor shard_of_parts(const torch::Tensor& full, int64_t dim, int64_t parts, const dist::Group& g,
                             const char* what) {
  if (parts == 1) return shard_of(full, dim, g, what);
  DHP_CHECK(full.size(dim) % (parts * g.size()) == 0, what, ": dim ", dim, " of size ", full.size(dim), " is not ",
            parts, " blocks divisible by the tensor-parallel size ", g.size());
  std::vector<int64_t> blocked(full.sizes().begin(), full.sizes().end());
  blocked[dim] = full.size(dim) / parts;
  blocked.insert(blocked.begin() + dim, parts);  // (..., parts, n/parts, ...)
  auto shard = shard_of(full.reshape(blocked), dim + 1, g, what);
  std::vector<int64_t> out(full.sizes().begin(), full.sizes().end());
  out[dim] /= g.size();
  return shard.reshape(out);
}

torch::Tensor unshard(const torch::Tensor& shard, const TpShard& how, const dist::Group& g) {
  if (how.dim < 0 || g.size() == 1) return shard;
  if (how.parts == 1) return g.all_gather(shard.contiguous(), how.dim);
  std::vector<int64_t> blocked(shard.sizes().begin(), shard.sizes().end());
  blocked[how.dim] /= how.parts;
  blocked.insert(blocked.begin() + how.dim, how.parts);
  auto full = g.all_gather(shard.reshape(blocked).contiguous(), how.dim + 1);
  std::vector<int64_t> out(shard.sizes().begin(), shard.sizes().end());
  out[how.dim] *= g.size();
  return full.reshape(out);
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const dhp::nn::LinearImpl& full, dist::Group g, int64_t p)
    : group(std::move(g)), parts(p) {
  // A frozen layer's shards stay frozen (requires_grad carried over).
  weight = register_parameter("weight", shard_of_parts(full.weight, 0, parts, group, "ColumnParallelLinear weight"),
                              full.weight.requires_grad());
  if (full.bias.defined())
    bias = register_parameter("bias", shard_of_parts(full.bias, 0, parts, group, "ColumnParallelLinear bias"),
                              full.bias.requires_grad());
  // An adapter follows its weight: B split by output rows like it, A whole on every rank.
  if (full.has_lora()) {
    register_lora(full.lora_a.detach().clone(),
                  shard_of_parts(full.lora_b, 0, parts, group, "ColumnParallelLinear lora_B"), full.lora_scale,
                  full.lora_dropout, full.lora_a.requires_grad());
  }
}

torch::Tensor ColumnParallelLinearImpl::forward(const torch::Tensor& x) {
  const auto xc = copy_to_group(x, group);
  auto y = torch::nn::functional::linear(xc, weight, bias);
  return has_lora() ? y + lora_delta(xc) : y;  // this rank's output columns of the adapter too
}

RowParallelLinearImpl::RowParallelLinearImpl(const dhp::nn::LinearImpl& full, dist::Group g) : group(std::move(g)) {
  weight = register_parameter("weight", shard_of(full.weight, 1, group, "RowParallelLinear weight"),
                              full.weight.requires_grad());
  if (full.bias.defined()) bias = register_parameter("bias", full.bias.detach().clone(), full.bias.requires_grad());
  // An adapter follows its weight: A split by input columns like it, B whole on every rank.
  if (full.has_lora()) {
    register_lora(shard_of(full.lora_a, 1, group, "RowParallelLinear lora_A"), full.lora_b.detach().clone(),
                  full.lora_scale, full.lora_dropout, full.lora_a.requires_grad());
  }
}

torch::Tensor RowParallelLinearImpl::forward(const torch::Tensor& x_shard) {
  // The adapter's term is linear in the input shards too: summed by the same all-reduce.
  auto partial = torch::matmul(x_shard, weight.t());
  if (has_lora()) partial = partial + lora_delta(x_shard);
  auto y = reduce_from_group(partial, group);
  return bias.defined() ? y + bias : y;
}

void make_column_parallel(TpShardMap& map, const std::string& prefix, torch::nn::Module& parent,
                          const std::string& name, dhp::nn::Linear& member, const dist::Group& g, int64_t parts) {
  auto p = std::make_shared<ColumnParallelLinearImpl>(*member, g, parts);
  parent.replace_module(name, p);
  member = dhp::nn::Linear(std::static_pointer_cast<dhp::nn::LinearImpl>(p));
  map[prefix + name + ".weight"] = {0, parts};
  if (p->bias.defined()) map[prefix + name + ".bias"] = {0, parts};
  if (p->has_lora()) {
    map[prefix + name + ".lora_B.weight"] = {0, parts};
    map[prefix + name + ".lora_A.weight"] = {-1, 1, /*partial_grad=*/true};
  }
}

void make_row_parallel(TpShardMap& map, const std::string& prefix, torch::nn::Module& parent, const std::string& name,
                       dhp::nn::Linear& member, const dist::Group& g) {
  auto p = std::make_shared<RowParallelLinearImpl>(*member, g);
  parent.replace_module(name, p);
  member = dhp::nn::Linear(std::static_pointer_cast<dhp::nn::LinearImpl>(p));
  map[prefix + name + ".weight"] = {1, 1};
  if (p->has_lora()) {
    map[prefix + name + ".lora_A.weight"] = {1, 1};
    map[prefix + name + ".lora_B.weight"] = {-1, 1, /*partial_grad=*/true};
  }
}

void make_swiglu_parallel(TpShardMap& map, const std::string& prefix, dhp::nn::SwiGLUImpl& mlp, const dist::Group& g) {
  make_column_parallel(map, prefix, mlp, "gate_proj", mlp.gate_proj, g);
  make_column_parallel(map, prefix, mlp, "up_proj", mlp.up_proj, g);
  make_row_parallel(map, prefix, mlp, "down_proj", mlp.down_proj, g);
}

}  // namespace dhp::parallel
