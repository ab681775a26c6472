// The built-in synthetic task: images of coloured shapes with a question and a caption
// answer ("a red triangle top left"), tokenised with a small word vocabulary laid out like
// Qwen's chat template. Needs no download; each sample is a pure function of (seed, index).
// With `frames` > 0 it is the moving task: clips in which a shape crosses the frame in one of
// four directions ("a red square moving left"); the direction shows only across frames.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "dhp/data/image.h"
#include "dhp/data/sample.h"
#include "dhp/models/qwen2_5_vl/model.h"

namespace dhp::data {

// Word-level vocabulary of the shapes task. Ids 0..5 are <pad>, <|im_start|>, <|im_end|>,
// <|vision_start|>, <|vision_end|>, <|image_pad|> (the demo preset's special ids).
class ShapesVocab {
 public:
  ShapesVocab();
  int64_t id(const std::string& word) const;  // throws dhp::Error on an unknown word
  const std::string& word(int64_t id) const;
  int64_t size() const { return static_cast<int64_t>(words_.size()); }
  std::vector<int64_t> encode(const std::string& text) const;  // space-separated words
  std::string decode(const std::vector<int64_t>& ids) const;

 private:
  std::vector<std::string> words_;
};

struct ShapesOptions {
  int64_t min_side = 112;  // image side range in pixels (rounded to multiples of 28)
  int64_t max_side = 224;
  uint64_t seed = 0;
  int64_t frames = 0;      // > 0: the moving task, clips of this many frames (even)
  double fps = 2.0;        // the clips' frame rate (second_per_grid_t = temporal_patch_size / fps)
};

class ShapesDataset {
 public:
  ShapesDataset(const qwen::ModelConfig& model, ShapesOptions options);
  // Deterministic sample `index` of this dataset's seed. pixels=false: everything but the
  // image's pixel values (grids, ids, labels, answer are the same), for ranks that do not
  // encode it.
  Sample get(int64_t index, bool pixels = true) const;
  // get(index) plus its image as 8-bit RGB (height x width x 3), for writing it to disk.
  Sample render(int64_t index, std::vector<uint8_t>& rgb, int64_t& width, int64_t& height) const;
  // The moving task: get(index) plus its frames as 8-bit RGB images.
  Sample render_frames(int64_t index, std::vector<Image>& frames) const;
  bool video() const { return options_.frames > 0; }
  // Number of distinct answers (chance accuracy = 1 / num_answers()).
  int64_t num_answers() const;
  const ShapesVocab& vocab() const { return vocab_; }

 private:
  Sample generate(int64_t index, bool pixels, std::vector<uint8_t>* rgb) const;
  Sample generate_clip(int64_t index, bool pixels, std::vector<Image>* frames) const;
  int64_t pick_side(std::mt19937_64& rng) const;  // a side in [min_side, max_side], a multiple of patch * merge
  void converse(Sample& s, bool video) const;      // the question and s.answer as ids and labels
  qwen::ModelConfig model_;
  ShapesOptions options_;
  ShapesVocab vocab_;
};

}  // namespace dhp::data
