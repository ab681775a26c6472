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

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const dhp::nn::LinearImpl& full, dist::Group g)
    : group(std::move(g)) {
  weight = register_parameter("weight", shard_of(full.weight, 0, group, "ColumnParallelLinear weight"));
  if (full.bias.defined()) bias = register_parameter("bias", shard_of(full.bias, 0, group, "ColumnParallelLinear bias"));
}

torch::Tensor ColumnParallelLinearImpl::forward(const torch::Tensor& x) {
  return torch::nn::functional::linear(copy_to_group(x, group), weight, bias);
}

RowParallelLinearImpl::RowParallelLinearImpl(const dhp::nn::LinearImpl& full, dist::Group g) : group(std::move(g)) {
  weight = register_parameter("weight", shard_of(full.weight, 1, group, "RowParallelLinear weight"));
  if (full.bias.defined()) bias = register_parameter("bias", full.bias.detach().clone());
}

torch::Tensor RowParallelLinearImpl::forward(const torch::Tensor& x_shard) {
  auto y = reduce_from_group(torch::matmul(x_shard, weight.t()), group);
  return bias.defined() ? y + bias : y;
}

}  // namespace dhp::parallel
