// Video input: qwen-vl-utils' frame sampling and budget on hand-computed cases; FFmpeg
// decoding of clips in several containers and codecs (the right frames, by content; seeking;
// B-frames); preprocessing against scripts/video_reference.py (PyAV + torchvision);
// M-RoPE positions of a sample mixing an image and a video, by hand; bad files named and
// refused; LLaVA records with videos through the loader, a bad clip skipped and counted.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <array>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "dhp/core/error.h"
#include "dhp/data/llava.h"
#include "dhp/data/loader.h"
#include "dhp/data/shapes.h"
#include "dhp/data/video.h"
#include "dhp/io/safetensors.h"
#include "dhp/models/qwen2_5_vl/config.h"
#include "dhp/models/qwen2_5_vl/hf.h"
#include "dhp/models/qwen2_5_vl/model.h"
#include "errors.h"
#include "files.h"

namespace {

using dhp::data::VideoOptions;

int sh(const std::string& cmd) { return std::system((cmd + " > /dev/null 2>&1").c_str()); }

// ---------------------------------------------------------------------------------------
// Sampling and budget (qwen-vl-utils' formulas), by hand.

TEST(VideoSampling, FramesByFpsClampedAndEven) {
  VideoOptions o;
  EXPECT_EQ(dhp::data::smart_nframes(o, 300, 30.0), 20);  // 10 s at 2 fps
  // 100 frames at 29.97 fps: 6.673 frames -> 6 (even, rounded down).
  EXPECT_EQ(dhp::data::smart_nframes(o, 100, 29.97), 6);
  // 0.67 s: 1.33 frames -> the minimum of 4.
  EXPECT_EQ(dhp::data::smart_nframes(o, 20, 30.0), 4);
  // 5 frames: 4 is the even count inside; 3 frames: min 4 clamps to 3 -> 2.
  EXPECT_EQ(dhp::data::smart_nframes(o, 5, 30.0), 4);
  EXPECT_EQ(dhp::data::smart_nframes(o, 3, 30.0), 2);
  // One hour at 30 fps: 7200 at 2 fps, capped at 768.
  EXPECT_EQ(dhp::data::smart_nframes(o, 108000, 30.0), 768);
  o.fps = 0.5;  // 10 s -> 5 frames -> 4
  EXPECT_EQ(dhp::data::smart_nframes(o, 300, 30.0), 4);
  o.fps = 2.0;
  o.max_frames = 9;  // floored to 8
  EXPECT_EQ(dhp::data::smart_nframes(o, 300, 30.0), 8);
  VideoOptions n;
  n.nframes = 7;  // round(3.5) = 4 (halves to even) -> 8
  EXPECT_EQ(dhp::data::smart_nframes(n, 300, 30.0), 8);
  n.nframes = 5;  // round(2.5) = 2 -> 4
  EXPECT_EQ(dhp::data::smart_nframes(n, 300, 30.0), 4);
  n.nframes = 400;
  EXPECT_THROW(dhp::data::smart_nframes(n, 300, 30.0), dhp::Error);  // more than the video has
  EXPECT_THROW(dhp::data::smart_nframes(o, 1, 30.0), dhp::Error);    // fewer than 2 frames
}

TEST(VideoSampling, RangeAndIndices) {
  VideoOptions o;
  auto r = dhp::data::frame_range(o, 300, 30.0);
  EXPECT_EQ(r.first, 0);
  EXPECT_EQ(r.last, 299);
  o.start = 1.5;  // ceil(45) = 45
  o.end = 4.2;    // floor(126) = 126
  r = dhp::data::frame_range(o, 300, 30.0);
  EXPECT_EQ(r.first, 45);
  EXPECT_EQ(r.last, 126);
  EXPECT_EQ(r.count(), 82);
  EXPECT_EQ(dhp::data::smart_nframes(o, r.count(), 30.0), 4);  // 5.47 -> 4
  EXPECT_EQ(dhp::data::sample_indices(45, 126, 4), (std::vector<int64_t>{45, 72, 99, 126}));
  o.start = 1.01;  // ceil(30.3) = 31
  o.end = 100;     // clamped to the 10 s there are
  r = dhp::data::frame_range(o, 300, 30.0);
  EXPECT_EQ(r.first, 31);
  EXPECT_EQ(r.last, 299);
  o.start = 5;
  o.end = 5.01;  // frames 150 and 150: empty
  EXPECT_THROW(dhp::data::frame_range(o, 300, 30.0), dhp::Error);
  // round(linspace) in float32, halves to even.
  EXPECT_EQ(dhp::data::sample_indices(0, 9, 4), (std::vector<int64_t>{0, 3, 6, 9}));
  EXPECT_EQ(dhp::data::sample_indices(0, 10, 4), (std::vector<int64_t>{0, 3, 7, 10}));
  EXPECT_EQ(dhp::data::sample_indices(0, 5, 3), (std::vector<int64_t>{0, 2, 5}));
  EXPECT_EQ(dhp::data::sample_indices(0, 99, 6), (std::vector<int64_t>{0, 20, 40, 59, 79, 99}));
}

TEST(VideoSampling, FrameSizeWithinTheBudget) {
  VideoOptions o;
  // 640x360, 20 frames: the budget is VIDEO_MAX_PIXELS; round(360/28)*28 = 364, round(640/28)*28 = 644.
  EXPECT_EQ(dhp::data::video_frame_size(o, 360, 640, 20), std::make_pair(int64_t{364}, int64_t{644}));
  // total_pixels 2e6 over 20 frames: 200000 per frame; beta = sqrt(230400 / 200000).
  o.total_pixels = 2000000;
  EXPECT_EQ(dhp::data::video_frame_size(o, 360, 640, 20), std::make_pair(int64_t{308}, int64_t{588}));
  // A budget below 1.05 x min_pixels is raised to int(100352 * 1.05) = 105369.
  o.total_pixels = 100000;
  EXPECT_EQ(dhp::data::video_frame_size(o, 360, 640, 20), std::make_pair(int64_t{224}, int64_t{420}));
  // A record's max_pixels caps the budget; min_pixels upsizes small clips.
  VideoOptions c;
  c.requested_max_pixels = 50000;
  c.min_pixels = 3136;
  EXPECT_EQ(dhp::data::video_frame_size(c, 360, 640, 20), std::make_pair(int64_t{140}, int64_t{280}));
  VideoOptions up;
  EXPECT_EQ(dhp::data::video_frame_size(up, 120, 160, 6), std::make_pair(int64_t{280}, int64_t{392}));
}

// ---------------------------------------------------------------------------------------
// M-RoPE of a sample mixing text, an image and a video, by hand.

TEST(VideoRope, MixedImageAndVideoPositions) {
  auto c = dhp::qwen::preset("demo");  // merge 2, tokens_per_second 2
  const int64_t I = c.image_token_id, V = c.video_token_id, S = c.vision_start_token_id, E = c.vision_end_token_id;
  // text(1) S image(4x4 patches -> 2x2 tokens) E text(1) S video(3 x 4x4 -> 12 tokens) E text(1)
  std::vector<int64_t> ids = {10, S, I, I, I, I, E, 11, S};
  for (int k = 0; k < 12; ++k) ids.push_back(V);
  ids.push_back(E);
  ids.push_back(12);
  const std::vector<dhp::qwen::GridTHW> grids = {{1, 4, 4}, {3, 4, 4}};
  // 0.75 s per temporal patch: t' = int(t * 0.75 * 2) = 0, 1, 3 (truncating 0.75 first would give 0, 0, 0).
  auto pos = dhp::qwen::rope_index(ids, grids, c, {0.0f, 0.75f});
  std::vector<int64_t> t(pos[0].data_ptr<int64_t>(), pos[0].data_ptr<int64_t>() + pos.size(1));
  std::vector<int64_t> h(pos[1].data_ptr<int64_t>(), pos[1].data_ptr<int64_t>() + pos.size(1));
  std::vector<int64_t> w(pos[2].data_ptr<int64_t>(), pos[2].data_ptr<int64_t>() + pos.size(1));
  // text 0, 1; image at 2: t 2, h 2,2,3,3, w 2,3,2,3; E at 4; text 5; S 6; video at 7:
  // t 7,7,7,7, 8,8,8,8, 10,10,10,10; h 7,7,8,8 (x3); w 7,8,7,8 (x3); E at 11; text 12.
  EXPECT_EQ(t, (std::vector<int64_t>{0, 1, 2, 2, 2, 2, 4, 5, 6, 7, 7, 7, 7, 8, 8, 8, 8, 10, 10, 10, 10, 11, 12}));
  EXPECT_EQ(h, (std::vector<int64_t>{0, 1, 2, 2, 3, 3, 4, 5, 6, 7, 7, 8, 8, 7, 7, 8, 8, 7, 7, 8, 8, 11, 12}));
  EXPECT_EQ(w, (std::vector<int64_t>{0, 1, 2, 3, 2, 3, 4, 5, 6, 7, 8, 7, 8, 7, 8, 7, 8, 7, 8, 7, 8, 11, 12}));
  // float32 as transformers computes it: 2 / 1.7982 s per patch, t = 5 -> 5 * 1.1122233 * 2 = 11.12 -> 11.
  const float spg = static_cast<float>(2.0 / (6.0 / 100.0 * 29.97));
  std::vector<int64_t> long_ids = {S};
  for (int k = 0; k < 6 * 4; ++k) long_ids.push_back(V);
  long_ids.push_back(E);
  pos = dhp::qwen::rope_index(long_ids, {{6, 4, 4}}, c, {spg});
  EXPECT_EQ(pos[0][1 + 5 * 4].item<int64_t>(), 1 + 11);
  EXPECT_EQ(pos[0][1 + 3 * 4].item<int64_t>(), 1 + 6);  // 3 * 1.1122 * 2 = 6.67
  // A video's grid given to an image run, and a run that is too short, are refused.
  EXPECT_THROW(dhp::qwen::rope_index({S, I, I, I, I, E}, {{2, 4, 2}}, c, {0.0f}), dhp::Error);
  EXPECT_THROW(dhp::qwen::rope_index({S, V, V, E}, {{2, 4, 4}}, c, {1.0f}), dhp::Error);
}

// ---------------------------------------------------------------------------------------
// Decoding.

// Frames whose content names their index: a uniform grey level 10 + 7 i.
std::vector<dhp::data::Image> level_frames(int n, int w, int h) {
  std::vector<dhp::data::Image> out;
  for (int i = 0; i < n; ++i) {
    out.push_back({w, h, std::vector<uint8_t>(static_cast<size_t>(w * h * 3), static_cast<uint8_t>(10 + 7 * i))});
  }
  return out;
}

double mean_level(const dhp::data::Image& im) {
  double s = 0;
  for (auto v : im.rgb) s += v;
  return s / static_cast<double>(im.rgb.size());
}

TEST(VideoDecode, SampledFramesAreTheRightOnesInEveryContainer) {
  dhp::testing::TempDir dir("video_decode");
  const auto frames = level_frames(30, 64, 48);
  struct Case {
    const char* file;
    const char* codec;
  };
  std::vector<Case> cases = {{"a.avi", "mpeg4"}, {"a.mkv", "mjpeg"}, {"a.mov", "mpeg4"}};
  if (dhp::data::video_encoder_available("libx264")) cases.push_back({"a.mp4", "libx264"});
  ASSERT_GE(cases.size(), 3u);
  for (const auto& c : cases) {
    SCOPED_TRACE(c.file);
    const auto path = (dir.path() / c.file).string();
    dhp::data::write_video(path, frames, 10, c.codec);
    const auto info = dhp::data::probe_video(path);
    EXPECT_EQ(info.total_frames, 30);
    EXPECT_NEAR(info.fps, 10.0, 1e-6);
    EXPECT_EQ(info.width, 64);
    VideoOptions o;
    o.nframes = 6;
    o.min_pixels = 28 * 28;
    const auto v = dhp::data::read_video(path, o);
    ASSERT_EQ(v.plan.indices, (std::vector<int64_t>{0, 6, 12, 17, 23, 29}));
    ASSERT_EQ(v.frames.size(), 6u);
    EXPECT_EQ(v.plan.width, 56);  // round(64 / 28) * 28
    EXPECT_EQ(v.plan.height, 56);
    for (size_t k = 0; k < 6; ++k) EXPECT_NEAR(mean_level(v.frames[k]), 10 + 7 * v.plan.indices[k], 3.0) << k;
    EXPECT_NEAR(v.plan.sample_fps, 6.0 / 30.0 * 10.0, 1e-9);
  }
}

TEST(VideoDecode, SeeksInLongClipsAndHandlesBFrames) {
  dhp::testing::TempDir dir("video_seek");
  ASSERT_EQ(sh("command -v ffmpeg"), 0) << "ffmpeg is needed (scripts/quickstart.sh installs it)";
  // 36 frames of levels at 12 fps, re-encoded by the ffmpeg CLI with B-frames and a keyframe every 12.
  const auto frames = level_frames(36, 64, 48);
  const auto raw = (dir.path() / "raw.avi").string();
  dhp::data::write_video(raw, frames, 12, "mpeg4");
  const auto clip = (dir.path() / "b.mp4").string();
  const std::string codec = dhp::data::video_encoder_available("libx264") ? "libx264 -bf 3 -g 12" : "mpeg4 -bf 2 -g 12";
  ASSERT_EQ(sh("ffmpeg -y -i " + raw + " -c:v " + codec + " -q:v 2 " + clip), 0);
  VideoOptions o;
  o.start = 1.0;  // frames 12 .. 30
  o.end = 2.5;
  o.nframes = 4;
  o.min_pixels = 28 * 28;
  const auto v = dhp::data::read_video(clip, o);
  ASSERT_EQ(v.plan.indices, (std::vector<int64_t>{12, 18, 24, 30}));
  for (size_t k = 0; k < 4; ++k) EXPECT_NEAR(mean_level(v.frames[k]), 10 + 7 * v.plan.indices[k], 4.0) << k;
}

TEST(VideoDecode, BadFilesAreNamedAndRefused) {
  dhp::testing::TempDir dir("video_bad");
  const auto d = dir.path();
  auto fails = [](const std::string& path, const VideoOptions& o, const std::string& reason) {
    SCOPED_TRACE(path + " -> " + reason);
    try {
      dhp::data::read_video(path, o);
      ADD_FAILURE() << "no error";
    } catch (const dhp::Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(path), std::string::npos) << m;
      EXPECT_NE(m.find(reason), std::string::npos) << m;
    }
  };
  VideoOptions o;
  o.min_pixels = 28 * 28;
  fails((d / "missing.mp4").string(), o, "no such video file");
  {
    std::ofstream f(d / "garbage.mp4", std::ios::binary);
    for (int i = 0; i < 5000; ++i) f.put(static_cast<char>((i * 7919) & 0xff));
  }
  fails((d / "garbage.mp4").string(), o, "");  // refused, whichever way FFmpeg's probe reads the bytes
  ASSERT_EQ(sh("ffmpeg -y -f lavfi -i sine=frequency=440:duration=1 " + (d / "audio.wav").string()), 0);
  fails((d / "audio.wav").string(), o, "has no video stream");
  dhp::data::write_video((d / "one.avi").string(), level_frames(1, 64, 48), 10, "mpeg4");
  fails((d / "one.avi").string(), o, "nframes should be in [2, 1]");
  dhp::data::write_video((d / "ok.avi").string(), level_frames(30, 64, 48), 10, "mpeg4");
  VideoOptions small = o;
  small.max_side = 32;
  fails((d / "ok.avi").string(), small, "exceed the limit of 32 pixels a side");
  VideoOptions shortest = o;
  shortest.max_duration_s = 1;
  fails((d / "ok.avi").string(), shortest, "3 s of video exceed the limit");
  // Truncated: the container lists 30 frames (index at the front), the data stops halfway.
  const auto full = (d / "full.mp4").string();
  ASSERT_EQ(sh("ffmpeg -y -i " + (d / "ok.avi").string() + " -c:v mpeg4 -movflags +faststart " + full), 0);
  const auto bytes = dhp::testing::slurp(full);
  {
    std::ofstream f(d / "cut.mp4", std::ios::binary);
    f << bytes.substr(0, bytes.size() / 2);
  }
  VideoOptions all = o;
  all.nframes = 30;
  try {
    dhp::data::read_video((d / "cut.mp4").string(), all);
    ADD_FAILURE() << "a truncated clip decoded";
  } catch (const dhp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cut.mp4"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------------------------------
// Against scripts/video_reference.py (PyAV, torch and torchvision, as qwen-vl-utils and the
// processor compute it).

struct Reference {
  torch::Tensor pixels, grid, seconds, indices, resized;
};

Reference run_reference(const std::string& clip, const std::string& out, const std::string& flags) {
  const std::string cmd = std::string("/usr/bin/python3 ") + DHP_SOURCE_DIR + "/scripts/video_reference.py " + clip +
                          " " + out + " " + flags;
  EXPECT_EQ(sh(cmd), 0) << cmd;
  dhp::io::SafetensorsReader r(out);
  return {r.read("pixel_values_videos"), r.read("video_grid_thw"), r.read("second_per_grid_ts"),
          r.read("frame_indices"), r.read("resized_frames")};
}

TEST(VideoReference, PreprocessingMatchesTheReferenceScript) {
  dhp::testing::TempDir dir("video_reference");
  ASSERT_EQ(sh("/usr/bin/python3 -c 'import av, torch, torchvision'"), 0)
      << "python3-av, python3-torch and python3-torchvision are needed (scripts/quickstart.sh installs them)";
  struct Case {
    std::string file, make, flags;
    VideoOptions o;
  };
  const std::string src = "-f lavfi -i testsrc2=size=160x120:rate=";
  std::vector<Case> cases;
  {
    Case c{"h264.mp4", src + "30:duration=3 -pix_fmt yuv420p -c:v " +
                           (dhp::data::video_encoder_available("libx264") ? "libx264" : "mpeg4"),
           "--min-pixels 3136 --max-pixels 12544", {}};
    c.o.min_pixels = 3136;
    c.o.requested_max_pixels = 12544;
    cases.push_back(c);
  }
  {
    Case c{"mpeg4.avi", src + "30000/1001:duration=4 -c:v mpeg4 -q:v 3",
           "--nframes 6 --video-start 0.5 --video-end 3.3 --min-pixels 3136 --max-pixels 20000", {}};
    c.o.nframes = 6;
    c.o.start = 0.5;
    c.o.end = 3.3;
    c.o.min_pixels = 3136;
    c.o.requested_max_pixels = 20000;
    cases.push_back(c);
  }
  {
    Case c{"mjpeg.mkv", src + "25:duration=2 -c:v mjpeg -q:v 3", "--fps 3.5 --min-pixels 3136 --total-pixels 100000",
           {}};
    c.o.fps = 3.5;
    c.o.min_pixels = 3136;
    c.o.total_pixels = 100000;
    cases.push_back(c);
  }
  for (const auto& c : cases) {
    SCOPED_TRACE(c.file);
    const auto clip = (dir.path() / c.file).string();
    ASSERT_EQ(sh("ffmpeg -y " + c.make + " " + clip), 0) << c.make;
    const auto ref = run_reference(clip, (dir.path() / (c.file + ".ref.safetensors")).string(), c.flags);
    const auto got = dhp::data::preprocess_video(clip, c.o, dhp::data::ImageOptions{});
    const auto& idx = got.frames.plan.indices;
    EXPECT_TRUE(torch::equal(torch::tensor(idx, torch::kInt64), ref.indices)) << ref.indices;
    EXPECT_TRUE(torch::equal(torch::tensor({got.grid[0], got.grid[1], got.grid[2]}, torch::kInt64).view({1, 3}),
                             ref.grid))
        << ref.grid;
    EXPECT_EQ(got.second_per_grid_t, ref.seconds[0].item<float>());
    ASSERT_EQ(got.frames.frames.size(), static_cast<size_t>(ref.resized.size(0)));
    // The 8-bit frames: the same decoder, colour conversion and resize kernel give the same
    // bytes; allow one level where the two float paths round a .5 differently.
    int64_t max_diff = 0;
    for (size_t k = 0; k < got.frames.frames.size(); ++k) {
      const auto& f = got.frames.frames[k];
      auto mine = torch::from_blob(const_cast<uint8_t*>(f.rgb.data()), {f.height, f.width, 3}, torch::kUInt8);
      ASSERT_EQ(mine.sizes(), ref.resized[static_cast<int64_t>(k)].sizes());
      max_diff = std::max(max_diff, (mine.to(torch::kInt64) - ref.resized[static_cast<int64_t>(k)].to(torch::kInt64))
                                        .abs()
                                        .max()
                                        .item<int64_t>());
    }
    EXPECT_LE(max_diff, 1) << "8-bit frames differ by up to " << max_diff << " levels";
    std::printf("[ %s ] frames %s, grid [%lld, %lld, %lld], %.6f s per temporal patch, 8-bit frames differ by %lld\n",
                c.file.c_str(), ::testing::PrintToString(idx).c_str(), static_cast<long long>(got.grid[0]),
                static_cast<long long>(got.grid[1]), static_cast<long long>(got.grid[2]), got.second_per_grid_t,
                static_cast<long long>(max_diff));
    // One level is 1/255/std <= 0.0151 after normalisation.
    ASSERT_EQ(got.pixel_values.sizes(), ref.pixels.sizes());
    EXPECT_LE((got.pixel_values - ref.pixels).abs().max().item<float>(), max_diff == 0 ? 0.0f : 0.0152f);
  }
}

// ---------------------------------------------------------------------------------------
// dhp forward's inputs: images and videos interleaved by their runs.

TEST(VideoForward, ProcessorInputsInterleaveImagesAndVideos) {
  auto c = dhp::qwen::preset("demo");
  const int64_t I = c.image_token_id, V = c.video_token_id, S = c.vision_start_token_id, E = c.vision_end_token_id;
  // video (2 x 4x4 -> 8 tokens) first, then an image (4x4 -> 4 tokens)
  std::vector<int64_t> ids = {S};
  for (int k = 0; k < 8; ++k) ids.push_back(V);
  ids.push_back(E);
  ids.push_back(S);
  for (int k = 0; k < 4; ++k) ids.push_back(I);
  ids.push_back(E);
  auto image = torch::randn({16, c.vision.patch_dim()});
  auto video = torch::randn({32, c.vision.patch_dim()});
  dhp::qwen::ProcessorInputs in{torch::tensor(ids, torch::kInt64).view({1, -1}), image,
                                torch::tensor({1, 4, 4}, torch::kInt64).view({1, 3}), video,
                                torch::tensor({2, 4, 4}, torch::kInt64).view({1, 3}), torch::tensor({0.5f})};
  auto b = dhp::qwen::forward_batch(c, in);
  ASSERT_EQ(b.grid_thw.size(), 2u);
  EXPECT_EQ(b.grid_thw[0], (dhp::qwen::GridTHW{2, 4, 4}));
  EXPECT_EQ(b.grid_thw[1], (dhp::qwen::GridTHW{1, 4, 4}));
  EXPECT_TRUE(torch::equal(b.pixel_values, torch::cat({video, image})));
  // t of the video's second temporal patch: 1 + int(1 * 0.5 * 2) = 2.
  EXPECT_EQ(b.position_ids[0][1 + 4].item<int64_t>(), 2);
  auto bad = in;
  bad.second_per_grid_ts = torch::tensor({0.5f, 0.5f});
  EXPECT_THROW(dhp::qwen::forward_batch(c, bad), dhp::Error);
  bad = in;
  bad.video_grid_thw = torch::tensor({1, 4, 4}, torch::kInt64).view({1, 3});
  EXPECT_THROW(dhp::qwen::forward_batch(c, bad), dhp::Error);  // rows do not match the grid
  // Logits agree with the same sample given as a packed training batch.
  dhp::qwen::Qwen2_5_VL m(c);
  dhp::qwen::init_parameters(*m, 3, c.initializer_range);
  auto logits = dhp::qwen::forward_logits(*m, in);
  EXPECT_EQ(logits.size(1), static_cast<int64_t>(ids.size()));
  EXPECT_TRUE(torch::isfinite(logits).all().item<bool>());
}

// ---------------------------------------------------------------------------------------
// LLaVA records with videos.

std::shared_ptr<const dhp::data::Tokenizer> qwen() {
  static const auto t = std::make_shared<const dhp::data::Tokenizer>(dhp::data::Tokenizer::from_file(DHP_QWEN_TOKENIZER));
  return t;
}

TEST(VideoRecords, TagsOrderSettingsAndBadRecords) {
  dhp::testing::TempDir dir("video_records");
  const auto file = (dir.path() / "train.jsonl").string();
  {
    std::ofstream f(file);
    f << R"({"video": "a.mp4", "conversations": [{"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": "A ball."}]})" "\n"
      << R"({"image": "x.png", "video": ["a.mp4", "b.mkv"], "fps": 1.5, "video_start": 1, "video_end": 3.5, "max_pixels": 50000, "conversations": [{"from": "human", "value": "<video> then <image> and <video>"}, {"from": "gpt", "value": "ok"}]})" "\n"
      << R"({"video": "a.mp4", "conversations": [{"from": "human", "value": "no tag"}, {"from": "gpt", "value": "x"}]})" "\n"
      << R"({"video": "a.mp4", "fps": 2, "nframes": 8, "conversations": [{"from": "human", "value": "<video>"}, {"from": "gpt", "value": "x"}]})" "\n"
      << R"({"video": "a.mp4", "video_start": 4, "video_end": 2, "conversations": [{"from": "human", "value": "<video>"}, {"from": "gpt", "value": "x"}]})" "\n"
      << R"({"video": "../a.mp4", "conversations": [{"from": "human", "value": "<video>"}, {"from": "gpt", "value": "x"}]})" "\n"
      << R"({"video": "a.mp4", "fps": -1, "conversations": [{"from": "human", "value": "<video>"}, {"from": "gpt", "value": "x"}]})" "\n"
      << R"({"video": "a.mp4", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "<video>"}]})" "\n";
  }
  std::vector<dhp::data::BadRecord> bad;
  const auto recs = dhp::data::read_llava(file, dir.path().string(), bad);
  ASSERT_EQ(recs.size(), 2u);
  EXPECT_EQ(recs[0].videos, std::vector<std::string>{"a.mp4"});
  EXPECT_EQ(recs[0].order, "v");
  EXPECT_EQ(recs[1].order, "viv");
  EXPECT_EQ(recs[1].video.fps, 1.5);
  EXPECT_EQ(recs[1].video.start, 1.0);
  EXPECT_EQ(recs[1].video.end, 3.5);
  EXPECT_EQ(recs[1].video.max_pixels, 50000);
  ASSERT_EQ(bad.size(), 6u);
  const std::vector<std::string> reasons = {"1 <video> tag(s) but the record has 0", "not both", "is not before",
                                            "leaves the data root", "must be > 0", "<video> in a assistant turn"};
  const std::vector<std::string> lines = {":3", ":4", ":5", ":6", ":7", ":8"};
  for (size_t k = 0; k < bad.size(); ++k) {
    EXPECT_NE(bad[k].where.find(lines[k]), std::string::npos) << bad[k].where;
    EXPECT_NE(bad[k].reason.find(k == 0 ? "0 <video> tag(s) but the record has 1" : reasons[k]), std::string::npos)
        << bad[k].reason;
  }
  // The template: <|vision_start|> <|video_pad|> x n <|vision_end|> per video, in tag order.
  dhp::data::ChatOptions co;
  const auto e = dhp::data::encode_chat(*qwen(), recs[1], {3}, co, {5, 2});
  const int64_t vs = qwen()->token_id("<|vision_start|>"), vp = qwen()->token_id("<|video_pad|>"),
                ip = qwen()->token_id("<|image_pad|>");
  EXPECT_EQ(vp, 151656);
  std::vector<int64_t> runs;  // pad runs after each <|vision_start|>, signed: + video, - image
  for (size_t i = 0; i < e.ids.size(); ++i) {
    if (e.ids[i] != vs) continue;
    int64_t n = 0;
    const int64_t pad = e.ids[i + 1];
    while (e.ids[i + 1 + static_cast<size_t>(n)] == pad) ++n;
    runs.push_back(pad == vp ? n : pad == ip ? -n : 0);
  }
  EXPECT_EQ(runs, (std::vector<int64_t>{5, -3, 2}));
}

TEST(VideoRecords, LoaderMixesImagesVideosAndTextAndSkipsABadClip) {
  dhp::testing::TempDir dir("video_loader");
  const auto d = dir.path();
  // A 16-frame clip at 4 fps (4 s -> 8 frames at 2 fps), an image, a corrupt clip.
  std::vector<dhp::data::Image> frames;
  for (int i = 0; i < 16; ++i) {
    frames.push_back({112, 84, std::vector<uint8_t>(112 * 84 * 3, static_cast<uint8_t>(20 + 10 * i))});
  }
  dhp::data::write_video((d / "clip.avi").string(), frames, 4, "mpeg4");
  dhp::data::save_png({56, 56, std::vector<uint8_t>(56 * 56 * 3, 128)}, (d / "still.png").string());
  {
    std::ofstream f(d / "broken.avi", std::ios::binary);
    f << "RIFF....AVI LIST garbage";
  }
  const auto file = (d / "train.jsonl").string();
  {
    std::ofstream f(file);
    f << R"({"video": "clip.avi", "conversations": [{"from": "human", "value": "<video>\nWhat?"}, {"from": "gpt", "value": "Brighter."}]})" "\n"
      << R"({"image": "still.png", "video": "clip.avi", "nframes": 4, "conversations": [{"from": "human", "value": "<image><video>"}, {"from": "gpt", "value": "Grey."}]})" "\n"
      << R"({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]})" "\n"
      << R"({"video": "broken.avi", "conversations": [{"from": "human", "value": "<video>"}, {"from": "gpt", "value": "x"}]})" "\n";
  }
  dhp::data::LoaderOptions o;
  o.datasets.push_back({file, "", 1.0});
  o.image.min_pixels = 3136;
  o.image.max_pixels = 12544;
  o.video.min_pixels = 3136;
  o.video.max_pixels = 12544;
  auto data = std::make_shared<dhp::data::LlavaDataset>(o, qwen());
  ASSERT_EQ(data->epoch_size(), 4);
  const auto c = dhp::qwen::preset("demo");
  int good = 0, bad = 0;
  for (int64_t p = 0; p < 4; ++p) {
    const auto& where = data->where(p);
    if (where == file + ":4") {
      try {
        data->load(p);
        ADD_FAILURE() << "the corrupt clip loaded";
      } catch (const dhp::Error& e) {
        EXPECT_NE(std::string(e.what()).find(file + ":4"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("broken.avi"), std::string::npos) << e.what();
      }
      ++bad;
      continue;
    }
    const auto s = data->load(p);
    const auto meta = data->load(p, false);  // grids and ids without decoding
    EXPECT_EQ(meta.grids, s.grids);
    EXPECT_EQ(meta.ids, s.ids);
    EXPECT_EQ(meta.second_per_grid_t, s.second_per_grid_t);
    int64_t videos = 0;
    for (auto id : s.ids) videos += id == 151656;
    if (where == file + ":1") {
      // 8 frames of 112x84 -> grid (4, 6, 8), 48 video tokens; 2 / (8 / 16 * 4) = 1 s per patch.
      ASSERT_EQ(s.grids.size(), 1u);
      EXPECT_EQ(s.grids[0], (dhp::qwen::GridTHW{4, 6, 8}));
      EXPECT_EQ(videos, 48);
      EXPECT_EQ(s.second_per_grid_t, std::vector<float>{1.0f});
      EXPECT_EQ(s.pixel_values.size(0), 4 * 6 * 8);
    } else if (where == file + ":2") {
      // The image first (4x4 patches), then 4 frames: grid (2, 6, 8); 2 / (4 / 16 * 4) = 2 s.
      ASSERT_EQ(s.grids.size(), 2u);
      EXPECT_EQ(s.grids[0], (dhp::qwen::GridTHW{1, 4, 4}));
      EXPECT_EQ(s.grids[1], (dhp::qwen::GridTHW{2, 6, 8}));
      EXPECT_EQ(s.second_per_grid_t, (std::vector<float>{0.0f, 2.0f}));
      EXPECT_EQ(videos, 24);
      EXPECT_EQ(s.pixel_values.size(0), 16 + 2 * 6 * 8);
    } else {
      EXPECT_TRUE(s.grids.empty());
      EXPECT_FALSE(s.pixel_values.defined());
    }
    // Packs into a batch whose positions follow the video's time.
    dhp::qwen::ModelConfig qc = c;
    qc.text.vocab_size = 151936;
    qc.image_token_id = 151655;
    qc.video_token_id = 151656;
    qc.vision_start_token_id = 151652;
    qc.vision_end_token_id = 151653;
    const auto b = dhp::data::collate({s}, qc);
    EXPECT_EQ(b.grid_thw, s.grids);
    ++good;
  }
  EXPECT_EQ(good, 3);
  EXPECT_EQ(bad, 1);
  dhp::data::Loader l(data, 0, 0, 1, 2, 2);
  for (int k = 0; k < 3; ++k) l.next();
  EXPECT_EQ(l.skipped(), 1);
  ASSERT_EQ(l.first_reasons().size(), 1u);
  EXPECT_NE(l.first_reasons()[0].find("broken.avi"), std::string::npos) << l.first_reasons()[0];
}

// ---------------------------------------------------------------------------------------
// The moving shapes task.

TEST(VideoShapes, ClipsMoveAndWriteAsFiles) {
  auto c = dhp::qwen::preset("demo");
  dhp::data::ShapesOptions so;
  so.frames = 8;
  so.seed = 5;
  dhp::data::ShapesDataset shapes(c, so);
  std::vector<dhp::data::Image> frames;
  const auto s = shapes.render_frames(3, frames);
  ASSERT_EQ(frames.size(), 8u);
  ASSERT_EQ(s.grids.size(), 1u);
  EXPECT_EQ(s.grids[0][0], 4);
  EXPECT_EQ(s.second_per_grid_t, std::vector<float>{1.0f});
  EXPECT_NE(s.answer.find(" moving "), std::string::npos) << s.answer;
  EXPECT_EQ(s.pixel_values.size(0), s.grids[0][0] * s.grids[0][1] * s.grids[0][2]);
  EXPECT_TRUE(torch::equal(shapes.get(3).pixel_values, s.pixel_values));
  EXPECT_EQ(shapes.get(3, false).ids, s.ids);
  // The shape crosses the frame the way the answer says: its centroid (pixels near its
  // colour) moves by over 0.3 of the side along the direction, under 0.05 across it.
  const std::map<std::string, std::array<float, 3>> colours = {
      {"red", {0.9f, 0.1f, 0.1f}}, {"green", {0.1f, 0.75f, 0.2f}}, {"blue", {0.15f, 0.25f, 0.95f}},
      {"yellow", {0.95f, 0.85f, 0.1f}}};
  for (int64_t i = 0; i < 12; ++i) {
    std::vector<dhp::data::Image> clip;
    const auto sample = shapes.render_frames(i, clip);
    const auto words = sample.answer;  // "a <colour> <shape> moving <direction>"
    const auto rgb = colours.at(words.substr(2, words.find(' ', 2) - 2));
    auto centroid = [&](const dhp::data::Image& im) {
      double sx = 0, sy = 0, n = 0;
      for (int64_t y = 0; y < im.height; ++y)
        for (int64_t x = 0; x < im.width; ++x) {
          bool near = true;
          for (int c = 0; c < 3; ++c) near = near && std::abs(im.rgb[(y * im.width + x) * 3 + c] / 255.f - rgb[c]) < 0.12f;
          if (near) sx += x, sy += y, n += 1;
        }
      EXPECT_GT(n, 20) << words;
      return std::make_pair(sx / n / im.width, sy / n / im.height);
    };
    const auto [x0, y0] = centroid(clip.front());
    const auto [x1, y1] = centroid(clip.back());
    const std::string dir = words.substr(words.rfind(' ') + 1);
    const double along = dir == "left" ? x0 - x1 : dir == "right" ? x1 - x0 : dir == "up" ? y0 - y1 : y1 - y0;
    const double across = dir == "left" || dir == "right" ? std::abs(y1 - y0) : std::abs(x1 - x0);
    EXPECT_GT(along, 0.3) << words;
    EXPECT_LT(across, 0.05) << words;
  }
  std::set<std::string> dirs;
  for (int64_t i = 0; i < 40; ++i) {
    const auto a = shapes.get(i, false).answer;
    dirs.insert(a.substr(a.rfind(' ') + 1));
  }
  EXPECT_EQ(dirs, (std::set<std::string>{"left", "right", "up", "down"}));
  dhp::testing::TempDir dir("video_synth");
  dhp::data::write_synthetic(dir.path().string(), 3, c, so);
  const auto clip = (dir.path() / "videos" / "000001.mp4").string();
  const auto info = dhp::data::probe_video(clip);
  EXPECT_EQ(info.total_frames, 8);
  EXPECT_NEAR(info.fps, 2.0, 1e-9);
  const auto jsonl = dhp::testing::slurp(dir.path() / "train.jsonl");
  EXPECT_NE(jsonl.find("\"video\":\"videos/000000.mp4\""), std::string::npos) << jsonl;
  EXPECT_NE(jsonl.find("<video>"), std::string::npos) << jsonl;
  so.frames = 7;
  EXPECT_THROW(dhp::data::ShapesDataset(c, so), dhp::Error);
}

}  // namespace
