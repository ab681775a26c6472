#include "dhp/data/sample.h"

#include <torch/torch.h>

#include "dhp/core/error.h"

namespace dhp::data {

torch::Tensor patchify(const torch::Tensor& image, const qwen::VisionConfig& cfg,
                       qwen::GridTHW& grid) {
  const int64_t C = image.size(0), H = image.size(1), W = image.size(2);
  const int64_t P = cfg.patch_size, m = cfg.spatial_merge_size, T = cfg.temporal_patch_size;
  DHP_CHECK(C == cfg.in_channels && H % (P * m) == 0 && W % (P * m) == 0,
            "patchify: image (", C, ", ", H, ", ", W, ") must have ", cfg.in_channels,
            " channels and sides multiple of ", P * m);
  const int64_t gh = H / P, gw = W / P;
  auto frames = image.unsqueeze(0).expand({T, C, H, W});  // still image repeated over time
  auto x = frames.reshape({1, T, C, gh / m, m, P, gw / m, m, P})
               .permute({0, 3, 6, 4, 7, 2, 1, 5, 8})
               .reshape({gh * gw, C * T * P * P})
               .contiguous();
  grid = {1, gh, gw};
  return x;
}

qwen::Batch collate(const std::vector<Sample>& samples, const qwen::ModelConfig& cfg) {
  DHP_CHECK(!samples.empty(), "collate: no samples");
  qwen::Batch b;
  std::vector<int64_t> ids, targets;
  std::vector<torch::Tensor> pixels, positions;
  b.cu_seqlens.assign(1, 0);
  for (const auto& s : samples) {
    DHP_CHECK(!s.ids.empty() && s.ids.size() == s.labels.size(), "collate: sample with ",
              s.ids.size(), " ids and ", s.labels.size(), " labels");
    ids.insert(ids.end(), s.ids.begin(), s.ids.end());
    for (size_t i = 0; i < s.ids.size(); ++i) targets.push_back(i + 1 < s.ids.size() ? s.labels[i + 1] : -100);
    positions.push_back(qwen::rope_index(s.ids, s.grids, cfg));
    if (s.pixel_values.defined()) pixels.push_back(s.pixel_values);
    b.grid_thw.insert(b.grid_thw.end(), s.grids.begin(), s.grids.end());
    b.cu_seqlens.push_back(b.cu_seqlens.back() + static_cast<int64_t>(s.ids.size()));
  }
  b.input_ids = torch::tensor(ids, torch::kInt64);
  b.targets = torch::tensor(targets, torch::kInt64);
  b.position_ids = torch::cat(positions, 1);
  if (!pixels.empty()) b.pixel_values = torch::cat(pixels, 0);
  return b;
}

}  // namespace dhp::data
