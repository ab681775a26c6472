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
const char* kDirections[] = {"left", "right", "up", "down"};

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

// One channel of a pixel: the shape's colour or the background, plus noise, clipped to [0, 1].
float shade(bool in, int colour, int c, float bg, std::normal_distribution<float>& noise, std::mt19937_64& rng) {
  const float v = (in ? kRGB[colour][c] : bg) + noise(rng);
  return std::min(1.f, std::max(0.f, v));
}

}  // namespace

ShapesVocab::ShapesVocab() {
  words_ = {"<pad>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "user", "assistant", "what", "is", "in", "the", "image", "?", "a",
            "top", "bottom", "left", "right", "\n"};
  for (auto c : kColours) words_.push_back(c);
  for (auto s : kShapes) words_.push_back(s);
  // Appended so that the image task's ids stay as they were: <|video_pad|> is 27 (the demo
  // preset's video_token_id), then the moving-shapes words.
  for (auto w : {"<|video_pad|>", "video", "moving", "up", "down"}) words_.push_back(w);
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
  DHP_CHECK(options.frames >= 0 && options.frames % 2 == 0 && options.frames <= 256, "data.frames=", options.frames,
            " must be an even number in [0, 256] (0: still images)");
  DHP_CHECK(options.fps > 0, "the clips' fps ", options.fps, " must be > 0");
  DHP_CHECK(vocab_.size() <= model.text.vocab_size, "the shapes task needs a vocabulary of ",
            vocab_.size(), " but model.text.vocab_size=", model.text.vocab_size);
  DHP_CHECK(model.image_token_id == vocab_.id("<|image_pad|>") && model.video_token_id == vocab_.id("<|video_pad|>") &&
                model.vision_start_token_id == vocab_.id("<|vision_start|>") &&
                model.vision_end_token_id == vocab_.id("<|vision_end|>"),
            "the shapes task needs the demo special token ids (image ", vocab_.id("<|image_pad|>"), ", video ",
            vocab_.id("<|video_pad|>"), ", vision_start ", vocab_.id("<|vision_start|>"), ", vision_end ",
            vocab_.id("<|vision_end|>"), "); the model config has ", model.image_token_id, ", ", model.video_token_id,
            ", ", model.vision_start_token_id, ", ", model.vision_end_token_id);
}

int64_t ShapesDataset::num_answers() const { return 4 * kNumShapes * 4; }  // 4 places or 4 directions

Sample ShapesDataset::get(int64_t index, bool pixels) const {
  return video() ? generate_clip(index, pixels, nullptr) : generate(index, pixels, nullptr);
}

Sample ShapesDataset::render_frames(int64_t index, std::vector<Image>& frames) const {
  DHP_CHECK(video(), "render_frames: the shapes task has no frames (data.frames = 0)");
  return generate_clip(index, true, &frames);
}

Sample ShapesDataset::generate_clip(int64_t index, bool pixels, std::vector<Image>* out) const {
  std::mt19937_64 rng(options_.seed * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(index) * 7919 + 2);
  auto uni = [&](double a, double b) { return std::uniform_real_distribution<double>(a, b)(rng); };
  auto pick = [&](int64_t n) { return static_cast<int>(std::uniform_int_distribution<int64_t>(0, n - 1)(rng)); };
  const int64_t H = pick_side(rng), W = pick_side(rng);
  const int colour = pick(4), shape = pick(kNumShapes), dir = pick(4);
  const float r = static_cast<float>(std::min(H, W)) * static_cast<float>(uni(0.14, 0.18));
  // The shape crosses from one side to the other along its direction; across it, it stays put.
  const float across = static_cast<float>(uni(0.3, 0.7));
  const float from = static_cast<float>(uni(0.2, 0.3)), to = static_cast<float>(uni(0.7, 0.8));
  const float bg = static_cast<float>(uni(0.3, 0.7));
  const int64_t F = options_.frames;

  Sample s;
  qwen::GridTHW grid{F / model_.vision.temporal_patch_size, H / model_.vision.patch_size, W / model_.vision.patch_size};
  if (F % model_.vision.temporal_patch_size != 0) grid[0] += 1;
  if (pixels) {  // drawn from rng last, so skipping it changes nothing else
    auto clip = torch::empty({F, 3, H, W}, torch::kFloat32);
    auto a = clip.accessor<float, 4>();
    if (out) out->assign(static_cast<size_t>(F), Image{W, H, std::vector<uint8_t>(static_cast<size_t>(H * W * 3))});
    std::normal_distribution<float> noise(0.f, 0.03f);
    for (int64_t f = 0; f < F; ++f) {
      const float u = F > 1 ? static_cast<float>(f) / static_cast<float>(F - 1) : 0.f;
      const float along = dir % 2 == 0 ? to + (from - to) * u : from + (to - from) * u;  // left / up run backwards
      const float cx = (dir < 2 ? along : across) * W, cy = (dir < 2 ? across : along) * H;
      for (int64_t y = 0; y < H; ++y) {
        for (int64_t x = 0; x < W; ++x) {
          const bool in = inside(shape, x + 0.5f, y + 0.5f, cx, cy, r);
          for (int c = 0; c < 3; ++c) {
            const float v = shade(in, colour, c, bg, noise, rng);
            a[f][c][y][x] = (v - kImageMean[c]) / kImageStd[c];
            if (out) (*out)[static_cast<size_t>(f)].rgb[static_cast<size_t>((y * W + x) * 3 + c)] = static_cast<uint8_t>(std::lround(v * 255.f));
          }
        }
      }
    }
    s.pixel_values = patchify_frames(clip, model_.vision, grid);
  }
  s.grids = {grid};
  s.second_per_grid_t = {static_cast<float>(static_cast<double>(model_.vision.temporal_patch_size) / options_.fps)};
  s.answer = std::string("a ") + kColours[colour] + " " + kShapes[shape] + " moving " + kDirections[dir];
  converse(s, true);
  return s;
}

int64_t ShapesDataset::pick_side(std::mt19937_64& rng) const {
  const int64_t unit = model_.vision.patch_size * model_.vision.spatial_merge_size;
  const int64_t lo = (options_.min_side + unit - 1) / unit, hi = options_.max_side / unit;
  return unit * (lo + std::uniform_int_distribution<int64_t>(0, std::max<int64_t>(1, hi - lo + 1) - 1)(rng));
}

void ShapesDataset::converse(Sample& s, bool video) const {
  const auto& g = s.grids.at(0);
  const int64_t m = model_.vision.spatial_merge_size;
  auto push = [&](const std::vector<int64_t>& ids, bool label) {
    for (auto i : ids) {
      s.ids.push_back(i);
      s.labels.push_back(label ? i : -100);
    }
  };
  push(vocab_.encode("<|im_start|> user \n <|vision_start|>"), false);
  push(std::vector<int64_t>(g[0] * g[1] * g[2] / (m * m), vocab_.id(video ? "<|video_pad|>" : "<|image_pad|>")), false);
  push(vocab_.encode(std::string("<|vision_end|> what is in the ") + (video ? "video" : "image") +
                     " ? <|im_end|> \n <|im_start|> assistant \n"),
       false);
  push(vocab_.encode(s.answer + " <|im_end|>"), true);
}

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
  const int64_t H = pick_side(rng), W = pick_side(rng);
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
          const float v = shade(in, colour, c, bg, noise, rng);
          a[c][y][x] = (v - kImageMean[c]) / kImageStd[c];
          if (rgb) (*rgb)[static_cast<size_t>((y * W + x) * 3 + c)] = static_cast<uint8_t>(std::lround(v * 255.f));
        }
      }
    }
    s.pixel_values = patchify(img, model_.vision, grid);
  }
  s.grids = {grid};
  s.answer = std::string("a ") + kColours[colour] + " " + kShapes[shape] + " " + kPlaces[place];
  converse(s, false);
  return s;
}

}  // namespace dhp::data
