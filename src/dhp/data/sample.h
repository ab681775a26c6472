// A tokenised sample before packing, and packing samples into the model's Batch; the
// Qwen processor's patch layout (patchify). Every dataset (shapes.h, llava.h) makes these.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dhp/models/qwen2_5_vl/model.h"

namespace dhp::data {

// One tokenised sample before packing.
struct Sample {
  torch::Tensor pixel_values;        // (N, C*T*P*P) fp32, processor order; undefined if none
  std::vector<qwen::GridTHW> grids;  // per image or video, in order of appearance
  // Per grid: seconds per temporal patch of a video (temporal_patch_size / sample fps), 0 for
  // an image; empty when the sample has no video.
  std::vector<float> second_per_grid_t;
  std::vector<int64_t> ids;          // (L)
  std::vector<int64_t> labels;       // (L): the token itself where it is answer text, else -100
  std::string answer;                // reference answer text
};

// Next-token targets the sample contributes once packed (labels after the first position).
inline int64_t num_targets(const Sample& s) {
  int64_t n = 0;
  for (size_t i = 1; i < s.labels.size(); ++i) n += s.labels[i] != -100;
  return n;
}

// Qwen's image normalisation constants (OpenAI CLIP mean / std).
constexpr float kImageMean[3] = {0.48145466f, 0.4578275f, 0.40821073f};
constexpr float kImageStd[3] = {0.26862954f, 0.26130258f, 0.27577711f};

// Normalised image (C, H, W) fp32, H and W multiples of patch*merge -> patches
// (grid_t*grid_h*grid_w, C*T*P*P) in the Hugging Face processor's order, the still image
// repeated over temporal_patch_size frames. Returns the grid in `grid`.
torch::Tensor patchify(const torch::Tensor& image, const qwen::VisionConfig& cfg,
                       qwen::GridTHW& grid);
// Normalised frames (F, C, H, W) fp32 -> patches (F/T * grid_h * grid_w, C*T*P*P), T =
// temporal_patch_size consecutive frames per temporal patch (the last frame repeated when F
// is not a multiple of T, as the processor pads), in the processor's order.
torch::Tensor patchify_frames(const torch::Tensor& frames, const qwen::VisionConfig& cfg, qwen::GridTHW& grid);

// Packs samples into one Batch (ids concatenated, targets shifted inside each sample,
// M-RoPE positions per sample, cu_seqlens).
qwen::Batch collate(const std::vector<Sample>& samples, const qwen::ModelConfig& cfg);

}  // namespace dhp::data
