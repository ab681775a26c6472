// Images the way Qwen2-VL's Hugging Face processor sees them: decoded (JPEG via libjpeg,
// PNG via libpng: grey, RGB, palette, with or without alpha, 8 or 16 bits), EXIF
// orientation applied, transparency composited onto white (transformers' convert_to_rgb,
// with Pillow's integer arithmetic), resized by smart_resize's size with Pillow's bicubic
// filter (support widened by the scale when downscaling, fixed-point coefficients, 8-bit
// rounding between the horizontal and the vertical pass), rescaled by 1/255 and
// normalised in float32 as numpy does, repeated to the temporal patch size and cut into
// patches in the processor's merge-window order.
#pragma once

#include <torch/types.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "dhp/models/qwen2_5_vl/config.h"

namespace dhp::data {

// 8-bit RGB, row-major, height x width x 3.
struct Image {
  int64_t width = 0, height = 0;
  std::vector<uint8_t> rgb;
};

// Decodes a JPEG or PNG file (by its signature) to RGB with the EXIF orientation applied.
// Throws dhp::Error naming the file and the fault (missing, truncated, corrupt, unknown format).
Image load_image(const std::string& path);
Image decode_image(const std::string& bytes, const std::string& what);

// Writes `image` as an 8-bit RGB PNG (atomically: temporary name, then rename).
void save_png(const Image& image, const std::string& path);

// Qwen2-VL's smart_resize: sides that are multiples of `factor`, nearest to the original
// (Python's round: halves to even), scaled into [min_pixels, max_pixels] keeping the aspect
// ratio. Throws when the aspect ratio exceeds 200, as the processor does. The pixel bounds
// are real numbers: qwen-vl-utils' video budget (video.h) is a fraction.
std::pair<int64_t, int64_t> smart_resize(int64_t height, int64_t width, int64_t factor, double min_pixels,
                                         double max_pixels);

// Pillow's Image.resize(..., BICUBIC, reducing_gap=None) of an RGB image, exactly.
Image resize_bicubic(const Image& in, int64_t width, int64_t height);

struct ImageOptions {
  int64_t min_pixels = 3136;      // Qwen2.5-VL's preprocessor_config.json
  int64_t max_pixels = 12845056;
  int64_t patch_size = 14;
  int64_t merge_size = 2;
  int64_t temporal_patch_size = 2;
  std::array<float, 3> mean = {0.48145466f, 0.4578275f, 0.40821073f};  // shapes.h kImageMean
  std::array<float, 3> std = {0.26862954f, 0.26130258f, 0.27577711f};   // shapes.h kImageStd
};

struct Patches {
  torch::Tensor pixel_values;    // (grid_t * grid_h * grid_w, 3 * T * P * P) fp32
  std::array<int64_t, 3> grid{};  // (t, h, w) in patches
  Image resized;                  // the image after resizing (for comparisons)
};
Patches preprocess(const Image& image, const ImageOptions& o);
// The processor's rescale (x 1/255 in float64, stored as float32) and normalisation (float32)
// of an image already at its final size: (3, H, W) fp32.
torch::Tensor normalize(const Image& image, const ImageOptions& o);
// The patch geometry of `o` (patch, merge and temporal sizes, RGB) as the vision config
// patchify (sample.h) takes.
qwen::VisionConfig patch_layout(const ImageOptions& o);

}  // namespace dhp::data
