#include "dhp/parallel/ulysses.h"

#include <torch/torch.h>

#include "dhp/core/error.h"
#include "dhp/nn/attention.h"
#include "dhp/parallel/mappings.h"

namespace dhp::parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void check_shards(const dist::Group& g, const std::vector<int64_t>& rows, int64_t heads, const char* what) {
  DHP_CHECK(static_cast<int64_t>(rows.size()) == g.size(), what, ": ", rows.size(), " shard sizes for an SP group of ",
            g.size());
  DHP_CHECK(heads % g.size() == 0, what, ": sp=", g.size(), " does not divide the ", heads, " heads");
}

// (S_local, H, D) -> (S_total, H/sp, D)
torch::Tensor seq_to_heads_impl(const torch::Tensor& x, const dist::Group& g, const std::vector<int64_t>& rows) {
  const int64_t sp = g.size(), S = x.size(0), H = x.size(1), D = x.size(2), h = H / sp;
  TORCH_INTERNAL_ASSERT(S == rows[g.rank()]);
  // send chunk j = heads [j*h, (j+1)*h) of all local rows: (sp, S, h, D)
  auto send = x.view({S, sp, h, D}).transpose(0, 1).contiguous().view({sp * S, h * D});
  auto out = g.all_to_all(send, std::vector<int64_t>(sp, S), rows);  // (S_total, h*D), rank order
  return out.view({-1, h, D});
}

// (S_total, H/sp, D) -> (S_local, H, D)
torch::Tensor heads_to_seq_impl(const torch::Tensor& x, const dist::Group& g, const std::vector<int64_t>& rows) {
  const int64_t sp = g.size(), h = x.size(1), D = x.size(2), S = rows[g.rank()];
  auto out = g.all_to_all(x.contiguous().view({x.size(0), h * D}), rows, std::vector<int64_t>(sp, S));
  // received chunk i = head chunk i of my rows: (sp, S, h, D) -> (S, sp*h, D)
  return out.view({sp, S, h, D}).transpose(0, 1).contiguous().view({S, sp * h, D});
}

template <bool kSeqToHeads>
struct AllToAllFn : torch::autograd::Function<AllToAllFn<kSeqToHeads>> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const dist::Group& g,
                               const std::vector<int64_t>& rows) {
    ctx->saved_data["group"] = group_capsule(g);
    ctx->saved_data["rows"] = rows;
    return kSeqToHeads ? seq_to_heads_impl(x, g, rows) : heads_to_seq_impl(x, g, rows);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& g = group_of(ctx->saved_data["group"]);
    const auto rows = ctx->saved_data["rows"].toIntVector();
    auto dx = kSeqToHeads ? heads_to_seq_impl(grads[0], g, rows) : seq_to_heads_impl(grads[0], g, rows);
    return {dx, torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor seq_to_heads(const torch::Tensor& x, const dist::Group& g, const std::vector<int64_t>& rows) {
  check_shards(g, rows, x.size(1), "seq_to_heads");
  DHP_CHECK(x.size(0) == rows[g.rank()], "seq_to_heads: rank ", g.rank(), " holds ", x.size(0),
            " rows but its shard is ", rows[g.rank()]);
  return g.size() == 1 ? x : AllToAllFn<true>::apply(x, g, rows);
}

torch::Tensor heads_to_seq(const torch::Tensor& x, const dist::Group& g, const std::vector<int64_t>& rows) {
  DHP_CHECK(static_cast<int64_t>(rows.size()) == g.size(), "heads_to_seq: ", rows.size(),
            " shard sizes for an SP group of ", g.size());
  return g.size() == 1 ? x : AllToAllFn<false>::apply(x, g, rows);
}

torch::Tensor ulysses_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                const std::vector<int64_t>& cu, bool causal, const dist::Group& g,
                                const std::vector<int64_t>& rows, const nn::VarlenAttentionOptions& attention) {
  auto o = attention;
  o.causal = causal;
  auto out = dhp::nn::varlen_attention(seq_to_heads(q, g, rows), seq_to_heads(k, g, rows), seq_to_heads(v, g, rows),
                                       cu, o);  // (S_total, H/sp, D)
  return heads_to_seq(out, g, rows);
}

}  // namespace dhp::parallel
