#include "dhp/data/shapes.h"

#include <torch/torch.h>

#include <cmath>
#include <random>
#include <sstream>

#include "dhp/core/error.h"

namespace dhp::data {
namespace {

const char* kColours[] = {"red", "green", "blue", "yellow"};
const float kRGB[][3] = {{0.9f, 0.1f, 0.1f}, {0.1f, 0.75f, 0.2f}, {0.15f, 0.25f, 0.95f}, {0.95f, 0.85f, 0.1f}};
const char* kShapes[] = {"square", "triangle", "cross"};
constexpr int kNumShapes = 3;
const char* kPlaces[] = {"top left", "top right", "bottom left", "bottom right"};

// Is pixel (x, y) inside a shape of kind `s` centred at (cx, cy) with radius r?
bool inside(int s, float x, float y, float cx, float cy, float r) {
  const float dx = x - cx, dy = y - cy;
  switch (s) {
    case 0: return std::abs(dx) <= r && std::abs(dy) <= r;
    case 1: {  // upward triangle: apex at top, base at bottom
      if (dy < -r || dy > r) return false;
      const float half = r * (dy + r) / (2 * r);
      return std::abs(dx) <= half;
    }
    default: return (std::abs(dx) <= r && std::abs(dy) <= r * 0.3f) ||
                    (std::abs(dy) <= r && std::abs(dx) <= r * 0.3f);
  }
}

}  // namespace

ShapesVocab::ShapesVocab() {
  words_ = {"<pad>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "user", "assistant", "what", "is", "in", "the", "image", "?", "a",
            "top", "bottom", "left", "right", "\n"};
  for (auto c : kColours) words_.push_back(c);
  for (auto s : kShapes) words_.push_back(s);
}

int64_t ShapesVocab::id(const std::string& w) const {
  for (size_t i = 0; i < words_.size(); ++i) {
    if (words_[i] == w) return static_cast<int64_t>(i);
  }
  DHP_FAIL("shapes vocabulary has no word '", w, "'");
}

const std::string& ShapesVocab::word(int64_t id) const {
  DHP_CHECK(id >= 0 && id < size(), "token id ", id, " outside the shapes vocabulary of ", size());
  return words_[id];
}

std::vector<int64_t> ShapesVocab::encode(const std::string& text) const {
  std::istringstream is(text);
  std::vector<int64_t> ids;
  std::string w;
  while (is >> w) ids.push_back(id(w));
  return ids;
}

std::string ShapesVocab::decode(const std::vector<int64_t>& ids) const {
  std::string s;
  for (auto i : ids) s += (s.empty() ? "" : " ") + word(i);
  return s;
}

ShapesDataset::ShapesDataset(const qwen::ModelConfig& model, ShapesOptions options)
    : model_(model), options_(options) {
  const int64_t unit = model.vision.patch_size * model.vision.spatial_merge_size;
  DHP_CHECK(options.min_side >= unit && options.max_side >= options.min_side,
            "data.min_side=", options.min_side, " and data.max_side=", options.max_side,
            " must satisfy ", unit, " <= min_side <= max_side");
  DHP_CHECK(vocab_.size() <= model.text.vocab_size, "the shapes task needs a vocabulary of ",
            vocab_.size(), " but model.text.vocab_size=", model.text.vocab_size);
  DHP_CHECK(model.image_token_id == vocab_.id("<|image_pad|>") &&
                model.vision_start_token_id == vocab_.id("<|vision_start|>") &&
                model.vision_end_token_id == vocab_.id("<|vision_end|>"),
            "the shapes task needs the demo special token ids (image ", vocab_.id("<|image_pad|>"),
            ", vision_start ", vocab_.id("<|vision_start|>"), ", vision_end ",
            vocab_.id("<|vision_end|>"), "); the model config has ", model.image_token_id, ", ",
            model.vision_start_token_id, ", ", model.vision_end_token_id);
}

int64_t ShapesDataset::num_answers() const { return 4 * kNumShapes * 4; }

Sample ShapesDataset::get(int64_t index, bool pixels) const { return generate(index, pixels, nullptr); }

Sample ShapesDataset::render(int64_t index, std::vector<uint8_t>& rgb, int64_t& width, int64_t& height) const {
  Sample s = generate(index, true, &rgb);
  height = s.grids[0][1] * model_.vision.patch_size;
  width = s.grids[0][2] * model_.vision.patch_size;
  return s;
}

Sample ShapesDataset::generate(int64_t index, bool pixels, std::vector<uint8_t>* rgb) const {
  std::mt19937_64 rng(options_.seed * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(index) * 7919 + 1);
  auto uni = [&](double a, double b) { return std::uniform_real_distribution<double>(a, b)(rng); };
  auto pick = [&](int64_t n) { return static_cast<int>(std::uniform_int_distribution<int64_t>(0, n - 1)(rng)); };
  const int64_t unit = model_.vision.patch_size * model_.vision.spatial_merge_size;
  const int64_t lo = (options_.min_side + unit - 1) / unit, hi = options_.max_side / unit;
  const int64_t H = unit * (lo + pick(std::max<int64_t>(1, hi - lo + 1)));
  const int64_t W = unit * (lo + pick(std::max<int64_t>(1, hi - lo + 1)));
  const int colour = pick(4), shape = pick(kNumShapes), place = pick(4);
  const float r = static_cast<float>(std::min(H, W)) * static_cast<float>(uni(0.2, 0.26));
  const float qx = (place % 2 == 0 ? 0.25f : 0.75f) * W, qy = (place < 2 ? 0.25f : 0.75f) * H;
  const float cx = qx + static_cast<float>(uni(-0.06, 0.06)) * W;
  const float cy = qy + static_cast<float>(uni(-0.06, 0.06)) * H;
  const float bg = static_cast<float>(uni(0.3, 0.7));

  Sample s;
  qwen::GridTHW grid{1, H / model_.vision.patch_size, W / model_.vision.patch_size};
  if (pixels) {  // the rendering draws from rng last, so skipping it changes nothing else
    auto img = torch::empty({3, H, W}, torch::kFloat32);
    auto a = img.accessor<float, 3>();
    if (rgb) rgb->assign(static_cast<size_t>(H * W * 3), 0);
    std::normal_distribution<float> noise(0.f, 0.03f);
    for (int64_t y = 0; y < H; ++y) {
      for (int64_t x = 0; x < W; ++x) {
        const bool in = inside(shape, x + 0.5f, y + 0.5f, cx, cy, r);
        for (int c = 0; c < 3; ++c) {
          float v = (in ? kRGB[colour][c] : bg) + noise(rng);
          v = std::min(1.f, std::max(0.f, v));
          a[c][y][x] = (v - kImageMean[c]) / kImageStd[c];
          if (rgb) (*rgb)[static_cast<size_t>((y * W + x) * 3 + c)] = static_cast<uint8_t>(std::lround(v * 255.f));
        }
      }
    }
    s.pixel_values = patchify(img, model_.vision, grid);
  }
  s.grids = {grid};
  const int64_t m = model_.vision.spatial_merge_size;
  const int64_t n_img = grid[0] * grid[1] * grid[2] / (m * m);

  s.answer = std::string("a ") + kColours[colour] + " " + kShapes[shape] + " " + kPlaces[place];
  auto push = [&](const std::vector<int64_t>& ids, bool label) {
    for (auto i : ids) {
      s.ids.push_back(i);
      s.labels.push_back(label ? i : -100);
    }
  };
  push(vocab_.encode("<|im_start|> user \n <|vision_start|>"), false);
  push(std::vector<int64_t>(n_img, vocab_.id("<|image_pad|>")), false);
  push(vocab_.encode("<|vision_end|> what is in the image ? <|im_end|> \n <|im_start|> assistant \n"), false);
  push(vocab_.encode(s.answer + " <|im_end|>"), true);
  return s;
}

}  // namespace dhp::data
