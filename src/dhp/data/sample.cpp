#include "dhp/data/sample.h"

#include <torch/torch.h>

#include "dhp/core/error.h"

namespace dhp::data {

torch::Tensor patchify(const torch::Tensor& image, const qwen::VisionConfig& cfg,
                       qwen::GridTHW& grid) {
  DHP_CHECK(image.dim() == 3, "patchify: an image is (C, H, W), got ", image.sizes());
  // A still image is its own frame repeated over the temporal patch.
  return patchify_frames(image.unsqueeze(0).expand({cfg.temporal_patch_size, -1, -1, -1}), cfg, grid);
}

torch::Tensor patchify_frames(const torch::Tensor& frames, const qwen::VisionConfig& cfg, qwen::GridTHW& grid) {
  DHP_CHECK(frames.dim() == 4 && frames.size(0) > 0, "patchify: frames are (F, C, H, W), got ", frames.sizes());
  const int64_t C = frames.size(1), H = frames.size(2), W = frames.size(3);
  const int64_t P = cfg.patch_size, m = cfg.spatial_merge_size, T = cfg.temporal_patch_size;
  DHP_CHECK(C == cfg.in_channels && H % (P * m) == 0 && W % (P * m) == 0,
            "patchify: frames (", C, ", ", H, ", ", W, ") must have ", cfg.in_channels,
            " channels and sides multiple of ", P * m);
  auto f = frames;
  if (const int64_t rest = f.size(0) % T; rest != 0) {  // the processor repeats the last frame
    f = torch::cat({f, f.narrow(0, f.size(0) - 1, 1).expand({T - rest, C, H, W})}, 0);
  }
  const int64_t gt = f.size(0) / T, gh = H / P, gw = W / P;
  auto x = f.reshape({gt, T, C, gh / m, m, P, gw / m, m, P})
               .permute({0, 3, 6, 4, 7, 2, 1, 5, 8})
               .reshape({gt * gh * gw, C * T * P * P})
               .contiguous();
  grid = {gt, gh, gw};
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
    positions.push_back(qwen::rope_index(s.ids, s.grids, cfg, s.second_per_grid_t));
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
