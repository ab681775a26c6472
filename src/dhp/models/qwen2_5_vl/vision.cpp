#include "dhp/models/qwen2_5_vl/vision.h"

#include <torch/torch.h>

#include <algorithm>
#include <set>
#include <tuple>

#include "dhp/core/error.h"
#include "dhp/nn/attention.h"

namespace dhp::qwen {

void window_index(const std::vector<GridTHW>& grids, const VisionConfig& cfg,
                  std::vector<int64_t>& index, std::vector<int64_t>& cu) {
  const int64_t m = cfg.spatial_merge_size;
  const int64_t win = cfg.window_size / m / cfg.patch_size;  // merged units per window side
  const int64_t unit = m * m;
  index.clear();
  cu.assign(1, 0);
  int64_t base = 0;
  for (const auto& g : grids) {
    const int64_t t = g[0], gh = g[1], gw = g[2];
    DHP_CHECK(t > 0 && gh > 0 && gw > 0 && gh % m == 0 && gw % m == 0, "image grid (t=", t,
              ", h=", gh, ", w=", gw, ") must be positive with h and w multiples of ",
              "spatial_merge_size=", m);
    const int64_t lh = gh / m, lw = gw / m;
    const int64_t nwh = (lh + win - 1) / win, nww = (lw + win - 1) / win;
    for (int64_t ti = 0; ti < t; ++ti) {
      for (int64_t wy = 0; wy < nwh; ++wy) {
        for (int64_t wx = 0; wx < nww; ++wx) {
          int64_t count = 0;
          for (int64_t y = wy * win; y < std::min(lh, (wy + 1) * win); ++y) {
            for (int64_t x = wx * win; x < std::min(lw, (wx + 1) * win); ++x) {
              index.push_back(base + ti * lh * lw + y * lw + x);
              ++count;
            }
          }
          // Empty windows repeat the previous offset; HF removes those with unique_consecutive.
          if (count > 0) cu.push_back(cu.back() + count * unit);
        }
      }
    }
    base += t * lh * lw;
  }
}

torch::Tensor vision_pos_ids(const std::vector<GridTHW>& grids, int64_t m) {
  std::vector<int64_t> ids;
  for (const auto& g : grids) {
    const int64_t t = g[0], gh = g[1], gw = g[2];
    for (int64_t ti = 0; ti < t; ++ti) {
      for (int64_t by = 0; by < gh / m; ++by) {
        for (int64_t bx = 0; bx < gw / m; ++bx) {
          for (int64_t dy = 0; dy < m; ++dy) {
            for (int64_t dx = 0; dx < m; ++dx) {
              ids.push_back(by * m + dy);
              ids.push_back(bx * m + dx);
            }
          }
        }
      }
    }
  }
  return torch::tensor(ids, torch::kInt64).view({-1, 2});
}

std::vector<int64_t> inverse_permutation(const std::vector<int64_t>& perm) {
  std::vector<int64_t> inv(perm.size(), -1);
  for (size_t i = 0; i < perm.size(); ++i) {
    TORCH_INTERNAL_ASSERT(perm[i] >= 0 && perm[i] < static_cast<int64_t>(perm.size()) &&
                          inv[perm[i]] == -1);
    inv[perm[i]] = static_cast<int64_t>(i);
  }
  return inv;
}

VisionPlan make_vision_plan(const std::vector<GridTHW>& grids, const VisionConfig& cfg) {
  DHP_CHECK(!grids.empty(), "make_vision_plan: no images");
  VisionPlan p;
  window_index(grids, cfg, p.window_index, p.cu_window_seqlens);
  p.cu_seqlens.assign(1, 0);
  for (const auto& g : grids) {
    for (int64_t ti = 0; ti < g[0]; ++ti) p.cu_seqlens.push_back(p.cu_seqlens.back() + g[1] * g[2]);
  }
  p.num_patches = p.cu_seqlens.back();
  p.pos_ids = vision_pos_ids(grids, cfg.spatial_merge_size);
  return p;
}

torch::Tensor reorder_units(const torch::Tensor& x, const std::vector<int64_t>& index,
                            int64_t unit) {
  auto idx = torch::tensor(index, torch::TensorOptions().dtype(torch::kInt64).device(x.device()));
  auto shape = x.sizes().vec();
  std::vector<int64_t> grouped{x.size(0) / unit, unit};
  grouped.insert(grouped.end(), shape.begin() + 1, shape.end());
  return x.reshape(grouped).index_select(0, idx).reshape(shape);
}

AttentionCore local_attention_core(const dhp::nn::VarlenAttentionOptions& options) {
  return [options](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                   const std::vector<int64_t>& cu, bool causal) {
    auto o = options;
    o.causal = causal;
    return dhp::nn::varlen_attention(q, k, v, cu, o);
  };
}

VisionAttentionImpl::VisionAttentionImpl(const VisionConfig& cfg) : num_heads(cfg.num_heads) {
  qkv = register_module("qkv", dhp::nn::make_linear(cfg.hidden_size, 3 * cfg.hidden_size, true));
  proj = register_module("proj", dhp::nn::make_linear(cfg.hidden_size, cfg.hidden_size, true));
}

torch::Tensor VisionAttentionImpl::forward(const torch::Tensor& x, const VisionAttnInputs& in) {
  const int64_t S = x.size(0);
  // (S, 3*C) -> (S, 3, H_local, D); H_local < num_heads when qkv is column-parallel.
  auto qkv_out = qkv(x);
  const int64_t D = in.cos.size(1);
  auto parts = qkv_out.view({S, 3, -1, D}).unbind(1);
  auto q = dhp::nn::apply_rotary(parts[0], in.cos, in.sin);
  auto k = dhp::nn::apply_rotary(parts[1], in.cos, in.sin);
  auto o = in.core(q, k, parts[2], in.cu, /*causal=*/false);  // (S, H_local, D)
  return proj(o.reshape({S, -1}));
}

VisionBlockImpl::VisionBlockImpl(const VisionConfig& cfg) {
  norm1 = register_module("norm1", dhp::nn::RMSNorm(cfg.hidden_size, 1e-6));
  norm2 = register_module("norm2", dhp::nn::RMSNorm(cfg.hidden_size, 1e-6));
  attn = register_module("attn", VisionAttention(cfg));
  mlp = register_module("mlp", dhp::nn::SwiGLU(cfg.hidden_size, cfg.intermediate_size, true));
}

torch::Tensor VisionBlockImpl::forward(const torch::Tensor& x, const VisionAttnInputs& in) {
  auto h = x + attn->forward(norm1(x), in);
  return h + mlp(norm2(h));
}

PatchMergerImpl::PatchMergerImpl(const VisionConfig& cfg)
    : merged_dim(cfg.hidden_size * cfg.spatial_merge_size * cfg.spatial_merge_size) {
  ln_q = register_module("ln_q", dhp::nn::RMSNorm(cfg.hidden_size, 1e-6));
  mlp = register_module("mlp", std::make_shared<torch::nn::Module>());
  fc1 = mlp->register_module("0", dhp::nn::make_linear(merged_dim, merged_dim, true));
  fc2 = mlp->register_module("2", dhp::nn::make_linear(merged_dim, cfg.out_hidden_size, true));
}

torch::Tensor PatchMergerImpl::forward(const torch::Tensor& x) {
  return fc2(torch::gelu(fc1(ln_q(x).reshape({-1, merged_dim}))));  // exact (erf) GELU
}

PatchEmbedImpl::PatchEmbedImpl(const VisionConfig& cfg) {
  proj = register_module("proj", std::make_shared<ProjHolder>());
  proj->weight = proj->register_parameter(
      "weight", torch::zeros({cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size,
                              cfg.patch_size, cfg.patch_size}));
}

torch::Tensor PatchEmbedImpl::forward(const torch::Tensor& patches) {
  const auto& w = proj->weight;
  DHP_CHECK(patches.dim() == 2 && patches.size(1) == w[0].numel(),
            "vision patches must be (N, ", w[0].numel(), "), got ", patches.sizes());
  return torch::matmul(patches.to(w.scalar_type()), w.view({w.size(0), -1}).t());
}

VisionTransformerImpl::VisionTransformerImpl(const VisionConfig& c) : cfg(c) {
  patch_embed = register_module("patch_embed", PatchEmbed(cfg));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < cfg.depth; ++i) blocks->push_back(VisionBlock(cfg));
  merger = register_module("merger", PatchMerger(cfg));
}

std::pair<torch::Tensor, torch::Tensor> VisionTransformerImpl::rotary(const VisionPlan& plan,
                                                                      const torch::Device& device, int64_t lo,
                                                                      int64_t hi) const {
  // Rotary over h and w, each with head_dim/4 frequencies of base theta over dim head_dim/2,
  // computed on `device` for rows [lo, hi) of the window order only.
  const int64_t half = cfg.head_dim() / 2;
  auto inv = dhp::nn::rope_inv_freq(half, cfg.rope_theta).to(device);  // (head_dim/4)
  auto pos = reorder_units(plan.pos_ids.to(device), plan.window_index, cfg.spatial_merge_size * cfg.spatial_merge_size)
                 .narrow(0, lo, hi - lo)
                 .to(torch::kFloat32);                                // (hi - lo, 2)
  auto freqs = (pos.unsqueeze(-1) * inv).reshape({pos.size(0), -1});  // (hi - lo, head_dim/2)
  auto emb = torch::cat({freqs, freqs}, -1);                          // (hi - lo, head_dim)
  return {emb.cos(), emb.sin()};
}

torch::Tensor VisionTransformerImpl::stage(const std::string& name, const dhp::nn::StageFn& fn,
                                           const torch::Tensor& x) {
  return runner ? runner(name, fn, x) : fn(x);
}

torch::Tensor VisionTransformerImpl::embed(const torch::Tensor& patches, const VisionPlan& plan, int64_t lo,
                                           int64_t hi) {
  const int64_t unit = cfg.spatial_merge_size * cfg.spatial_merge_size;
  const auto fn = [this](const torch::Tensor& x) { return patch_embed(x); };
  if (!split) return reorder_units(stage("visual.patch_embed", fn, patches), plan.window_index, unit);
  // Rows [lo, hi) of the window order are the merged units window_index[lo/unit, hi/unit).
  std::vector<int64_t> mine;
  for (int64_t u = lo / unit; u < hi / unit; ++u)
    for (int64_t k = 0; k < unit; ++k) mine.push_back(plan.window_index[u] * unit + k);
  auto idx = torch::tensor(mine, torch::kInt64).to(patches.device());
  return stage("visual.patch_embed", fn, patches.index_select(0, idx));
}

namespace {

// Segment offsets `cu` restricted to rows [lo, hi) (both on boundaries), shifted to start at 0.
std::vector<int64_t> segments_within(const std::vector<int64_t>& cu, int64_t lo, int64_t hi) {
  std::vector<int64_t> out;
  for (auto c : cu) {
    if (c >= lo && c <= hi) out.push_back(c - lo);
  }
  TORCH_INTERNAL_ASSERT(out.size() >= 2 && out.front() == 0 && out.back() == hi - lo);
  return out;
}

}  // namespace

torch::Tensor VisionTransformerImpl::forward(const torch::Tensor& patches, const VisionPlan& plan) {
  DHP_CHECK(patches.size(0) == plan.num_patches, "vision: ", patches.size(0),
            " patch rows but the image grids give ", plan.num_patches);
  int64_t lo = 0, hi = plan.num_patches;  // this rank's rows of the window order
  if (split) std::tie(lo, hi) = split->rows(plan);
  auto h = embed(patches, plan, lo, hi);  // (S, hidden) window order [sharded with a split]
  const auto [cos, sin] = rotary(plan, h.device(), lo, hi);
  const auto windows = split ? segments_within(plan.cu_window_seqlens, lo, hi) : plan.cu_window_seqlens;
  const AttentionCore local = local_attention_core(attention);
  const AttentionCore whole_images = split ? split->full_attention() : local;
  const std::set<int64_t> full(cfg.fullatt_block_indexes.begin(), cfg.fullatt_block_indexes.end());
  for (int64_t i = 0; i < cfg.depth; ++i) {
    const bool is_full = full.count(i) > 0;
    VisionAttnInputs in{cos, sin, is_full ? plan.cu_seqlens : windows, is_full ? whole_images : local};
    auto block = blocks->ptr<VisionBlockImpl>(i);
    // The inputs travel with the function, so a recomputation in backward attends the same way.
    const dhp::nn::StageFn fn = [block, in](const torch::Tensor& x) { return block->forward(x, in); };
    if (runner) h = runner("visual.blocks." + std::to_string(i), fn, h);
    else if (activation_checkpointing && (h.requires_grad() || dhp::nn::has_trainable_parameters(*block)))
      h = dhp::nn::checkpoint(fn, h);  // (a frozen block before any trainable one records nothing: no need)
    else h = fn(h);
  }
  auto merged = stage("visual.merger", [this](const torch::Tensor& x) { return merger(x); }, h);  // (S/unit, out)
  if (split) merged = split->gather(merged);  // (N/unit, out) window order
  return reorder_units(merged, inverse_permutation(plan.window_index), 1);
}

}  // namespace dhp::qwen
