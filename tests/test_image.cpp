// Qwen2-VL image preprocessing against Pillow + numpy following transformers' steps
// (tests/data/images/expected.safetensors, made by scripts/image_reference.py): decoded
// pixels of PNG (RGB, grey, grey+alpha, RGBA, palette with transparency) and JPEG (with an
// EXIF rotation), the resized image exactly, and pixel_values and grid_thw; smart_resize
// on a table of sizes (half-way roundings, tiny and huge images, extreme aspect ratios);
// the patch order on a hand-checked case; bad files named.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include "dhp/core/error.h"
#include "dhp/data/image.h"
#include "dhp/io/safetensors.h"

namespace {

const std::string kDir = std::string(DHP_TEST_DATA) + "/images/";

// Values as transformers' smart_resize gives them (scripts/image_reference.py).
TEST(SmartResize, TableOfSizes) {
  struct Row {
    int64_t h, w, min, max, want_h, want_w;
  };
  const Row rows[] = {
      {70, 70, 3136, 12845056, 56, 56},        // 2.5 -> 2 (halves to even; std::round gives 84)
      {98, 98, 3136, 12845056, 112, 112},      // 3.5 -> 4
      {42, 42, 3136, 12845056, 56, 56},        // 1.5 -> 2, then 56x56 = min_pixels
      {10, 10, 3136, 12845056, 56, 56},        // tiny: scaled up to min_pixels
      {1, 200, 3136, 12845056, 28, 812},       // aspect 200 is allowed; scaled up to min_pixels
      {480, 640, 3136, 12845056, 476, 644},
      {1080, 1920, 3136, 1003520, 728, 1316},  // max_pixels of 1280 tokens
      {4000, 3000, 3136, 12845056, 4004, 2996},  // 107.14 -> 107
      {100, 75, 3136, 12845056, 112, 84},
      {200, 300, 3136, 12544, 84, 112},
  };
  for (const auto& r : rows) {
    const auto [h, w] = dhp::data::smart_resize(r.h, r.w, 28, r.min, r.max);
    EXPECT_EQ(h, r.want_h) << r.h << "x" << r.w;
    EXPECT_EQ(w, r.want_w) << r.h << "x" << r.w;
    EXPECT_EQ(h % 28, 0);
    EXPECT_EQ(w % 28, 0);
  }
  EXPECT_THROW(dhp::data::smart_resize(1, 201, 28, 3136, 12845056), dhp::Error);
  EXPECT_THROW(dhp::data::smart_resize(0, 10, 28, 3136, 12845056), dhp::Error);
}

TEST(Preprocess, MatchesPillowAndNumpyExactly) {
  dhp::io::SafetensorsReader want(kDir + "expected.safetensors");
  int cases = 0;
  for (const auto& t : want.tensors()) {
    const auto dot = t.name.rfind(".resized");
    if (dot == std::string::npos) continue;
    const std::string name = t.name.substr(0, dot);
    const auto range = want.read(name + ".pixels");
    dhp::data::ImageOptions o;
    o.min_pixels = range[0].item<int64_t>();
    o.max_pixels = range[1].item<int64_t>();
    const auto img = dhp::data::load_image(kDir + name);
    const auto got = dhp::data::preprocess(img, o);
    const auto resized = want.read(name + ".resized");
    ASSERT_EQ(got.resized.height, resized.size(0)) << name;
    ASSERT_EQ(got.resized.width, resized.size(1)) << name;
    auto mine = torch::from_blob(const_cast<uint8_t*>(got.resized.rgb.data()), resized.sizes(), torch::kUInt8);
    const auto diff = (mine.to(torch::kInt32) - resized.to(torch::kInt32)).abs();
    EXPECT_EQ(diff.max().item<int>(), 0) << name << ": " << diff.gt(0).sum().item<int64_t>() << " values differ";
    const auto grid = want.read(name + ".grid");
    EXPECT_EQ(got.grid[0], grid[0].item<int64_t>());
    EXPECT_EQ(got.grid[1], grid[1].item<int64_t>());
    EXPECT_EQ(got.grid[2], grid[2].item<int64_t>());
    const auto pv = want.read(name + ".pixel_values");
    ASSERT_EQ(got.pixel_values.sizes(), pv.sizes()) << name;
    EXPECT_TRUE(torch::equal(got.pixel_values, pv)) << name << ": max difference "
                                                   << (got.pixel_values - pv).abs().max().item<double>();
    ++cases;
  }
  EXPECT_EQ(cases, 8);
}

// 56x56 image whose pixel (y, x) has value y in red, x in green: the first patch row is the
// top-left 14x14 patch, the second its right neighbour inside the same 2x2 merge window, the
// third the one below it; within a row: channel, then frame, then 14x14 row-major.
TEST(Preprocess, PatchOrderIsMergeWindowMajor) {
  dhp::data::Image img;
  img.width = img.height = 56;
  for (int y = 0; y < 56; ++y)
    for (int x = 0; x < 56; ++x) img.rgb.insert(img.rgb.end(), {static_cast<uint8_t>(y), static_cast<uint8_t>(x), 0});
  dhp::data::ImageOptions o;
  o.mean = {0, 0, 0};
  o.std = {1, 1, 1};
  const auto p = dhp::data::preprocess(img, o);
  ASSERT_EQ(p.pixel_values.sizes(), (c10::IntArrayRef{16, 3 * 2 * 14 * 14}));
  auto val = [&](int64_t row, int64_t ch, int64_t frame, int64_t py, int64_t px) {
    return std::lround(p.pixel_values[row][((ch * 2 + frame) * 14 + py) * 14 + px].item<float>() * 255);
  };
  // Row 1 = merge window (0,0), patch (0,1): x starts at 14. Row 2 = patch (1,0): y at 14.
  // Row 4 = merge window (0,1): x starts at 28.
  EXPECT_EQ(val(0, 0, 0, 3, 5), 3);
  EXPECT_EQ(val(0, 1, 1, 3, 5), 5);
  EXPECT_EQ(val(1, 1, 0, 0, 0), 14);
  EXPECT_EQ(val(2, 0, 0, 0, 0), 14);
  EXPECT_EQ(val(3, 0, 0, 0, 0), 14);
  EXPECT_EQ(val(3, 1, 0, 0, 0), 14);
  EXPECT_EQ(val(4, 1, 0, 0, 0), 28);
  EXPECT_EQ(val(8, 0, 0, 0, 0), 28);  // second row of merge windows
  EXPECT_EQ(p.grid, (std::array<int64_t, 3>{1, 4, 4}));
}

TEST(Decode, BadFilesAreNamed) {
  auto expect_error = [](const std::string& bytes, const std::string& why) {
    try {
      dhp::data::decode_image(bytes, "x.img");
      ADD_FAILURE() << why;
    } catch (const dhp::Error& e) {
      EXPECT_NE(std::string(e.what()).find("x.img"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  };
  expect_error("", "empty file");
  expect_error("GIF89a....", "not a JPEG or PNG");
  const auto jpg = dhp::io::read_file(kDir + "rgb_down.jpg");
  expect_error(jpg.substr(0, 200), "corrupt JPEG");
  const auto png = dhp::io::read_file(kDir + "rgb_up.png");
  expect_error(png.substr(0, 100), "corrupt PNG");
  std::string flipped = png;
  flipped[40] ^= 0x55;  // inside IHDR/IDAT: a CRC mismatch
  expect_error(flipped, "corrupt PNG");
  EXPECT_THROW(dhp::data::load_image(kDir + "missing.png"), dhp::Error);
}

}  // namespace
