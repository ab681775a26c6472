// Megatron tensor-parallel linears: subclasses of dhp::nn::LinearImpl, so they replace a
// model's Linear in place. Parameters keep the names "weight" and "bias" and hold this
// rank's shard; they are cut from the full layer, so a
// sharded model starts from exactly the single-process weights.
//
//   ColumnParallelLinear: weight (out/tp, in) rows [r*out/tp, (r+1)*out/tp), bias likewise.
//     forward: y_shard = copy_to(x) W_shard^T + b_shard       (S, in) -> (S, out/tp) [sharded]
//   RowParallelLinear: weight (out, in/tp) columns of this rank, bias (out) replicated.
//     forward: y = reduce_from(x_shard W_shard^T) + b         (S, in/tp) [sharded] -> (S, out)
// Collective: every member of the TP group must run the forward and backward.
#pragma once

#include <torch/nn/module.h>

#include <map>
#include <string>

#include "dhp/dist/comm.h"
#include "dhp/nn/layers.h"

namespace dhp::parallel {

class ColumnParallelLinearImpl : public dhp::nn::LinearImpl {
 public:
  // weight, bias: shards; bias undefined when the full layer has none. `parts` > 1: the
  // output is `parts` stacked blocks (a fused qkv: parts = 3) and each block is split, so
  // rank r holds rows r of q, of k and of v. A LoRA adapter: B cut like the weight, A whole
  // (its gradient is partial per rank: TpShard::partial_grad).
  ColumnParallelLinearImpl(const dhp::nn::LinearImpl& full, dist::Group group, int64_t parts = 1);
  torch::Tensor forward(const torch::Tensor& x) override;
  dist::Group group;
  int64_t parts = 1;
};
TORCH_MODULE(ColumnParallelLinear);

class RowParallelLinearImpl : public dhp::nn::LinearImpl {
 public:
  // weight: shard; bias: full (added once, after the reduction). A LoRA adapter: A cut like
  // the weight (input columns), B whole (its gradient is partial per rank), its term summed
  // by the layer's own all-reduce.
  RowParallelLinearImpl(const dhp::nn::LinearImpl& full, dist::Group group);
  torch::Tensor forward(const torch::Tensor& x_shard) override;
  dist::Group group;
};
TORCH_MODULE(RowParallelLinear);

// Rows [rank*n/size, (rank+1)*n/size) of dim `dim`; throws dhp::Error naming `what` when
// the group size does not divide it.
torch::Tensor shard_of(const torch::Tensor& full, int64_t dim, const dist::Group& group, const char* what);
// As shard_of, but dim `dim` is `parts` stacked blocks, each split across the group.
torch::Tensor shard_of_parts(const torch::Tensor& full, int64_t dim, int64_t parts, const dist::Group& group,
                             const char* what);

// How a tensor-parallel parameter is cut from the full one: along `dim` (-1: replicated),
// with `parts` stacked blocks each split (see ColumnParallelLinear). Inverse: unshard().
struct TpShard {
  int64_t dim = -1;
  int64_t parts = 1;
  // Replicated (dim -1), but each rank's gradient is a partial sum over the TP group (a LoRA
  // adapter's whole half beside a sharded weight: A of a column-parallel layer, B of a
  // row-parallel one): the strategy sums it over the TP group before the step.
  bool partial_grad = false;
};
// The full tensor from every rank's shard (all-gather over `group`), on every rank.
torch::Tensor unshard(const torch::Tensor& shard, const TpShard& how, const dist::Group& group);

// How each tensor-parallel parameter (single-process name) is cut; others are replicated.
using TpShardMap = std::map<std::string, TpShard>;

// Replaces child `name` of `parent` (a Linear also held in `member`) by its column-parallel
// shard over `group` (`parts` stacked blocks, see ColumnParallelLinear) and records the
// cuts of its parameters in `map` under `prefix` + name + ".weight" / ".bias".
void make_column_parallel(TpShardMap& map, const std::string& prefix, torch::nn::Module& parent,
                          const std::string& name, dhp::nn::Linear& member, const dist::Group& group,
                          int64_t parts = 1);
// The same with a row-parallel shard (the bias stays replicated).
void make_row_parallel(TpShardMap& map, const std::string& prefix, torch::nn::Module& parent, const std::string& name,
                       dhp::nn::Linear& member, const dist::Group& group);
// A SwiGLU MLP: gate and up column-parallel, down row-parallel.
void make_swiglu_parallel(TpShardMap& map, const std::string& prefix, dhp::nn::SwiGLUImpl& mlp,
                          const dist::Group& group);

}  // namespace dhp::parallel
