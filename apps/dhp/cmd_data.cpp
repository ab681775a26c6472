// `dhp data`: the image processor on one file, or the shapes task written as a LLaVA set.
#include <torch/torch.h>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dhp/core/log.h"
#include "dhp/data/image.h"
#include "dhp/data/loader.h"
#include "dhp/data/video.h"
#include "dhp/io/safetensors.h"
#include "dhp/models/qwen2_5_vl/hf.h"
#include "dhp/models/qwen2_5_vl/model.h"
#include "dhp/train/auto_plan.h"
#include "cli.h"

namespace dhp::cli {

int cmd_data(int argc, char** argv, int first) {
  const char* usage =
      "usage: dhp data preprocess --image PATH [--min-pixels A] [--max-pixels B] --out F.safetensors\n"
      "       dhp data preprocess --video PATH [--fps F | --nframes N] [--video-start S] [--video-end E]\n"
      "                           [--min-pixels A] [--max-pixels B] [--total-pixels T] --out F.safetensors\n"
      "       dhp data synth --out DIR --num N [--seed S] [--min-side A] [--max-side B]\n"
      "                      [--video [--frames F] [--fps R]]\n\n"
      "Preprocesses one image (JPEG or PNG) exactly as Qwen2-VL's Hugging Face processor does\n"
      "(EXIF orientation, transparency over white, smart_resize to multiples of 28 within\n"
      "[A, B] pixels, Pillow's bicubic resize, rescale, normalise, 2 frames, merge-window patch\n"
      "order) and writes pixel_values [N, 1176] fp32 and image_grid_thw [1, 3] int64, to compare\n"
      "with the processor tensor by tensor. Defaults: Qwen2.5-VL's min 3136, max 12845056.\n\n"
      "--video decodes one video with FFmpeg and prepares it as qwen-vl-utils' fetch_video and the\n"
      "processor do: F frames a second (default 2.0; at least 4, at most 768, an even count) or N\n"
      "frames, evenly over [S, E] seconds (default: the whole video); frames resized to multiples of\n"
      "28 within [A, min(B, max(min(602112, T / frames * 2), 1.05 A))] pixels (defaults A 100352,\n"
      "no B, T 90316800) with torchvision's antialiased bicubic; rescale, normalise, 2 frames per\n"
      "temporal patch. Writes pixel_values_videos [M, 1176] fp32, video_grid_thw [1, 3] int64,\n"
      "second_per_grid_ts [1] fp32 (2 / sampled fps) and frame_indices [frames] int64.\n\n"
      "synth writes the built-in shapes task as a LLaVA dataset: DIR/train.jsonl (one conversation\n"
      "per image: \"<image>\\nWhat is in the image?\" -> \"a red triangle top left\") and DIR/images/*.png\n"
      "(sides in [A, B] px, multiples of 28; default 112..224). With --video it writes the moving\n"
      "task instead: DIR/videos/*.mp4 (H.264, F frames at R fps; default 8 at 2.0) in which a shape\n"
      "crosses the frame (\"<video>\\nWhat is in the video?\" -> \"a red square moving left\").\n";
  if (first >= argc || std::string(argv[first]) == "-h" || std::string(argv[first]) == "--help") {
    std::printf("%s", usage);
    return first >= argc ? 2 : 0;
  }
  if (std::string(argv[first]) == "synth") {
    std::string out;
    int64_t num = -1;
    bool video = false;
    std::optional<int64_t> frames;
    dhp::data::ShapesOptions so;
    so.seed = 1234 * 2;  // data.seed's default training stream
    Flags flags(argc, argv, first + 1);
    while (flags.next()) {
      const auto& f = flags.flag();
      if (f == "-h" || f == "--help") {
        std::printf("%s", usage);
        return 0;
      }
      if (f == "--out") out = flags.value();
      else if (f == "--num") num = parse_int(f, flags.value());
      else if (f == "--seed") so.seed = static_cast<uint64_t>(parse_int(f, flags.value()));
      else if (f == "--min-side") so.min_side = parse_int(f, flags.value());
      else if (f == "--max-side") so.max_side = parse_int(f, flags.value());
      else if (f == "--video") video = true;
      else if (f == "--frames") frames = parse_int(f, flags.value());
      else if (f == "--fps") so.fps = parse_double(f, flags.value());
      else DHP_FAIL("unknown option '", flags.raw(), "' (see dhp data --help)");
    }
    DHP_CHECK(video || (!frames && so.fps == 2.0), "--frames and --fps need --video");
    if (video) so.frames = frames.value_or(8);
    DHP_CHECK(!out.empty() && num > 0, "dhp data synth needs --out DIR and --num N > 0\n\n", usage);
    dhp::data::write_synthetic(out, num, dhp::qwen::preset("demo"), so);
    dhp::log_info("wrote " + std::to_string(num) + " samples of the " + (video ? "moving " : "") + "shapes task to " +
                  out + (video ? " (train.jsonl + videos/*.mp4)" : " (train.jsonl + images/*.png)"));
    return 0;
  }
  DHP_CHECK(std::string(argv[first]) == "preprocess", "unknown 'dhp data' command '", argv[first], "'\n\n", usage);
  std::string image, video, out;
  dhp::data::ImageOptions o;
  dhp::data::VideoOptions v;
  std::optional<int64_t> min_pixels, max_pixels;
  bool fps_given = false;
  Flags flags(argc, argv, first + 1);
  while (flags.next()) {
    const auto& f = flags.flag();
    if (f == "-h" || f == "--help") {
      std::printf("%s", usage);
      return 0;
    }
    if (f == "--image") image = flags.value();
    else if (f == "--video") video = flags.value();
    else if (f == "--out") out = flags.value();
    else if (f == "--min-pixels") min_pixels = parse_int(f, flags.value());
    else if (f == "--max-pixels") max_pixels = parse_int(f, flags.value());
    else if (f == "--fps") v.fps = parse_double(f, flags.value()), fps_given = true;
    else if (f == "--nframes") v.nframes = parse_int(f, flags.value());
    else if (f == "--video-start") v.start = parse_double(f, flags.value());
    else if (f == "--video-end") v.end = parse_double(f, flags.value());
    else if (f == "--total-pixels") v.total_pixels = static_cast<double>(parse_int(f, flags.value()));
    else DHP_FAIL("unknown option '", flags.raw(), "' (see dhp data --help)");
  }
  DHP_CHECK(image.empty() != video.empty() && !out.empty(),
            "dhp data preprocess needs --out and one of --image or --video\n\n", usage);
  if (!video.empty()) {
    DHP_CHECK(!(fps_given && v.nframes > 0), "give --fps or --nframes, not both");
    DHP_CHECK(v.nframes >= 0, "--nframes ", v.nframes, " must be > 0");
    if (min_pixels) v.min_pixels = static_cast<double>(*min_pixels);
    if (max_pixels) v.requested_max_pixels = static_cast<double>(*max_pixels);
    v.validate("--");
    DHP_CHECK(!max_pixels || *max_pixels > 0, "--max-pixels ", *max_pixels, " must be > 0");
    const auto p = dhp::data::preprocess_video(video, v, o);
    const auto& idx = p.frames.plan.indices;
    auto grid = torch::tensor({p.grid[0], p.grid[1], p.grid[2]}, torch::kInt64).view({1, 3});
    dhp::io::write_safetensors(out, {{"pixel_values_videos", p.pixel_values},
                                     {"video_grid_thw", grid},
                                     {"second_per_grid_ts", torch::tensor({p.second_per_grid_t}, torch::kFloat32)},
                                     {"frame_indices", torch::tensor(idx, torch::kInt64)}});
    const auto& info = p.frames.info;
    dhp::log_info(video + " (" + info.container + ", " + info.codec + ", " + std::to_string(info.width) + "x" +
                  std::to_string(info.height) + ", " + std::to_string(info.total_frames) + " frames at " +
                  std::to_string(info.fps) + " fps): " + std::to_string(idx.size()) + " frames at " +
                  std::to_string(p.frames.plan.sample_fps) + " fps resized to " + std::to_string(p.frames.plan.width) +
                  "x" + std::to_string(p.frames.plan.height) + ", video_grid_thw [" + std::to_string(p.grid[0]) + ", " +
                  std::to_string(p.grid[1]) + ", " + std::to_string(p.grid[2]) + "] -> " + out);
    return 0;
  }
  if (min_pixels) o.min_pixels = *min_pixels;
  if (max_pixels) o.max_pixels = *max_pixels;
  DHP_CHECK(o.min_pixels > 0 && o.max_pixels >= o.min_pixels, "--min-pixels ", o.min_pixels, " and --max-pixels ",
            o.max_pixels, " must satisfy 0 < min <= max");
  const auto p = dhp::data::preprocess(dhp::data::load_image(image), o);
  auto grid = torch::tensor({p.grid[0], p.grid[1], p.grid[2]}, torch::kInt64).view({1, 3});
  dhp::io::write_safetensors(out, {{"pixel_values", p.pixel_values}, {"image_grid_thw", grid}});
  dhp::log_info(image + ": resized to " + std::to_string(p.resized.width) + "x" + std::to_string(p.resized.height) +
                " px (width x height), image_grid_thw [" + std::to_string(p.grid[0]) + ", " + std::to_string(p.grid[1]) +
                ", " + std::to_string(p.grid[2]) + "] -> " + out);
  return 0;
}

}  // namespace dhp::cli
