#include "dhp/parallel/vision_sp.h"

#include <torch/torch.h>

#include <set>

#include "dhp/core/error.h"
#include "dhp/nn/layers.h"
#include "dhp/parallel/ulysses.h"

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

// Window offsets restricted to [lo, hi), shifted to start at 0.
std::vector<int64_t> local_cu(const std::vector<int64_t>& cu, int64_t lo, int64_t hi) {
  std::vector<int64_t> out;
  for (auto c : cu) {
    if (c >= lo && c <= hi) out.push_back(c - lo);
  }
  TORCH_INTERNAL_ASSERT(out.size() >= 2 && out.front() == 0 && out.back() == hi - lo);
  return out;
}

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

void parallelize_vision_sp(qwen::Qwen2_5_VLImpl& model, const dist::Group& sp, int64_t block_size) {
  if (sp.size() == 1) return;
  const auto& vc = model.cfg.vision;
  DHP_CHECK(vc.num_heads % sp.size() == 0, "vision sp=", sp.size(), " does not divide vision num_heads=", vc.num_heads);
  auto* vt = model.visual.get();
  dist::Group g = sp;
  model.vision_fn = [vt, g, block_size](const torch::Tensor& patches, const qwen::VisionPlan& plan) {
    const auto& c = vt->cfg;
    const int64_t unit = c.spatial_merge_size * c.spatial_merge_size;
    const auto rows = window_shards(plan.cu_window_seqlens, g.size());
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
    const auto win_cu = local_cu(plan.cu_window_seqlens, lo, hi);
    const std::set<int64_t> full(c.fullatt_block_indexes.begin(), c.fullatt_block_indexes.end());
    for (int64_t i = 0; i < c.depth; ++i) {
      auto block = vt->blocks->ptr<qwen::VisionBlockImpl>(i);
      const bool is_full = full.count(i) > 0;
      qwen::VisionAttnInputs in{cos, sin, is_full ? plan.cu_seqlens : win_cu};
      // A full-attention block attends through Ulysses; the swap lives inside the function so
      // that a checkpointed block's recomputation in backward uses it too.
      auto run = [block, in, is_full, g, rows, block_size](const torch::Tensor& x) {
        const auto saved = block->attn->core;
        struct Restore {
          qwen::VisionBlockImpl* b;
          decltype(saved) core;
          ~Restore() { b->attn->core = core; }
        } restore{block.get(), saved};
        if (is_full) {
          block->attn->core = [g, rows, block_size](const torch::Tensor& q, const torch::Tensor& k,
                                                   const torch::Tensor& v, const std::vector<int64_t>& cu,
                                                   bool causal) {
            return ulysses_attention(q, k, v, cu, causal, g, rows, block_size);
          };
        }
        return block->forward(x, in);
      };
      h = vt->activation_checkpointing && torch::GradMode::is_enabled() ? dhp::nn::checkpoint(run, h) : run(h);
    }
    auto merged = vt->merger(h);  // (S_local/unit, out) window order [sharded]
    std::vector<int64_t> merged_rows;
    for (auto r : rows) merged_rows.push_back(r / unit);
    auto all = gather_rows(merged, g, merged_rows);  // (N/unit, out) window order
    return qwen::reorder_units(all, qwen::inverse_permutation(plan.window_index), 1);
  };
}

}  // namespace dhp::parallel
