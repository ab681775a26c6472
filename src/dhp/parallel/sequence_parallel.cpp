#include "dhp/parallel/sequence_parallel.h"

#include <torch/torch.h>

#include "dhp/core/error.h"

namespace dhp::parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct GatherRows : torch::autograd::Function<GatherRows> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const dist::Group& g,
                               const std::vector<int64_t>& rows) {
    ctx->saved_data["rank"] = g.rank();
    ctx->saved_data["rows"] = rows;
    // all-gather-v as an all-to-all: send my rows to everyone, receive every rank's rows.
    std::vector<torch::Tensor> copies(static_cast<size_t>(g.size()), x);
    return g.all_to_all(torch::cat(copies, 0), std::vector<int64_t>(g.size(), x.size(0)), rows);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto rows = ctx->saved_data["rows"].toIntVector();
    const int64_t r = ctx->saved_data["rank"].toInt();
    int64_t off = 0;
    for (int64_t i = 0; i < r; ++i) off += rows[i];
    return {grads[0].narrow(0, off, rows[r]), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor gather_rows(const torch::Tensor& x, const dist::Group& g, const std::vector<int64_t>& rows) {
  DHP_CHECK(static_cast<int64_t>(rows.size()) == g.size() && x.size(0) == rows[g.rank()],
            "gather_rows: rank ", g.rank(), " holds ", x.size(0), " rows, shards say ",
            rows.size() > static_cast<size_t>(g.rank()) ? rows[g.rank()] : -1);
  return g.size() == 1 ? x : GatherRows::apply(x.contiguous(), g, rows);
}

std::vector<int64_t> window_shards(const std::vector<int64_t>& cu, int64_t sp) {
  const int64_t windows = static_cast<int64_t>(cu.size()) - 1;
  DHP_CHECK(windows >= sp, "vision sp=", sp, " needs at least one attention window per rank, but the batch has ",
            windows, " windows");
  const int64_t total = cu.back();
  std::vector<int64_t> rows;
  int64_t w = 0, start = 0;
  for (int64_t r = 0; r < sp; ++r) {
    const int64_t left_ranks = sp - r - 1;
    const int64_t target = total * (r + 1) / sp;
    // take at least one window; stop at the target, leaving one window per remaining rank
    int64_t end = w + 1;
    while (end < windows - left_ranks && cu[end + 1] <= target) ++end;
    if (r == sp - 1) end = windows;
    rows.push_back(cu[end] - start);
    start = cu[end];
    w = end;
  }
  return rows;
}

}  // namespace dhp::parallel
