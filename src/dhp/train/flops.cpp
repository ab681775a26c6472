#include "dhp/train/flops.h"

#include <set>

namespace dhp::train {
namespace {

// sum over segments of (visible query-key pairs)
double attention_pairs(const std::vector<int64_t>& cu, bool causal) {
  double pairs = 0;
  for (size_t i = 0; i + 1 < cu.size(); ++i) {
    const double s = static_cast<double>(cu[i + 1] - cu[i]);
    pairs += causal ? s * (s + 1) / 2 : s * s;
  }
  return pairs;
}

}  // namespace

double vision_forward_flops(const qwen::VisionConfig& c, const qwen::VisionPlan& plan) {
  const double N = static_cast<double>(plan.num_patches), h = static_cast<double>(c.hidden_size);
  const double I = static_cast<double>(c.intermediate_size);
  double f = 2 * N * static_cast<double>(c.patch_dim()) * h;
  const std::set<int64_t> full(c.fullatt_block_indexes.begin(), c.fullatt_block_indexes.end());
  for (int64_t i = 0; i < c.depth; ++i) {
    f += 2 * N * h * (3 * h + h + 3 * I);
    f += 4 * h * attention_pairs(full.count(i) ? plan.cu_seqlens : plan.cu_window_seqlens, false);
  }
  const double unit = static_cast<double>(c.spatial_merge_size * c.spatial_merge_size);
  const double merged = unit * h, M = N / unit;
  f += 2 * M * merged * merged + 2 * M * merged * static_cast<double>(c.out_hidden_size);
  return f;
}

double text_forward_flops(const qwen::TextConfig& c, const std::vector<int64_t>& cu, int64_t targets) {
  const double L = static_cast<double>(cu.back()), h = static_cast<double>(c.hidden_size);
  const double kv = static_cast<double>(c.num_kv_heads * c.head_dim());
  const double I = static_cast<double>(c.intermediate_size);
  const double per_layer = 2 * L * (h * h + 2 * h * kv + h * h + 3 * h * I) + 4 * h * attention_pairs(cu, true);
  return static_cast<double>(c.num_layers) * per_layer +
         2 * static_cast<double>(targets) * h * static_cast<double>(c.vocab_size);
}

namespace {

double training_flops(const qwen::ModelConfig& cfg, const std::vector<int64_t>& cu,
                      const std::vector<qwen::GridTHW>& grids, int64_t targets, bool vision_forward_only) {
  const double text = text_forward_flops(cfg.text, cu, targets);
  const double vision = grids.empty() ? 0.0 : vision_forward_flops(cfg.vision, qwen::make_vision_plan(grids, cfg.vision));
  return 3 * text + (vision_forward_only ? 1 : 3) * vision;
}

}  // namespace

double training_flops(const qwen::ModelConfig& cfg, const qwen::Batch& b, bool vision_forward_only) {
  return training_flops(cfg, b.cu_seqlens, b.grid_thw, b.num_target_tokens(), vision_forward_only);
}

double training_flops(const qwen::ModelConfig& cfg, const std::vector<data::Sample>& samples,
                      bool vision_forward_only) {
  std::vector<int64_t> cu{0};
  std::vector<qwen::GridTHW> grids;
  int64_t targets = 0;
  for (const auto& s : samples) {
    cu.push_back(cu.back() + static_cast<int64_t>(s.ids.size()));
    grids.insert(grids.end(), s.grids.begin(), s.grids.end());
    targets += data::num_targets(s);
  }
  return training_flops(cfg, cu, grids, targets, vision_forward_only);
}

double vision_sample_flops(const qwen::ModelConfig& cfg, const data::Sample& s) {
  return s.grids.empty() ? 0.0 : vision_forward_flops(cfg.vision, qwen::make_vision_plan(s.grids, cfg.vision));
}

double text_sample_flops(const qwen::ModelConfig& cfg, const data::Sample& s) {
  return text_forward_flops(cfg.text, {0, static_cast<int64_t>(s.ids.size())}, data::num_targets(s));
}

}  // namespace dhp::train
