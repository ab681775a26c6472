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
#include "dhp/io/safetensors.h"
#include "dhp/models/qwen2_5_vl/hf.h"
#include "dhp/models/qwen2_5_vl/model.h"
#include "dhp/train/auto_plan.h"
#include "cli.h"

namespace dhp::cli {

int cmd_data(int argc, char** argv, int first) {
  const char* usage =
      "usage: dhp data preprocess --image PATH [--min-pixels A] [--max-pixels B] --out F.safetensors\n"
      "       dhp data synth --out DIR --num N [--seed S] [--min-side A] [--max-side B]\n\n"
      "Preprocesses one image (JPEG or PNG) exactly as Qwen2-VL's Hugging Face processor does\n"
      "(EXIF orientation, transparency over white, smart_resize to multiples of 28 within\n"
      "[A, B] pixels, Pillow's bicubic resize, rescale, normalise, 2 frames, merge-window patch\n"
      "order) and writes pixel_values [N, 1176] fp32 and image_grid_thw [1, 3] int64, to compare\n"
      "with the processor tensor by tensor. Defaults: Qwen2.5-VL's min 3136, max 12845056.\n\n"
      "synth writes the built-in shapes task as a LLaVA dataset: DIR/train.jsonl (one conversation\n"
      "per image: \"<image>\\nWhat is in the image?\" -> \"a red circle top left\") and DIR/images/*.png\n"
      "(sides in [A, B] px, multiples of 28; default 112..224).\n";
  if (first >= argc || std::string(argv[first]) == "-h" || std::string(argv[first]) == "--help") {
    std::printf("%s", usage);
    return first >= argc ? 2 : 0;
  }
  if (std::string(argv[first]) == "synth") {
    std::string out;
    int64_t num = -1;
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
      else DHP_FAIL("unknown option '", flags.raw(), "' (see dhp data --help)");
    }
    DHP_CHECK(!out.empty() && num > 0, "dhp data synth needs --out DIR and --num N > 0\n\n", usage);
    dhp::data::write_synthetic(out, num, dhp::qwen::preset("demo"), so);
    dhp::log_info("wrote " + std::to_string(num) + " samples of the shapes task to " + out +
                  " (train.jsonl + images/*.png)");
    return 0;
  }
  DHP_CHECK(std::string(argv[first]) == "preprocess", "unknown 'dhp data' command '", argv[first], "'\n\n", usage);
  std::string image, out;
  dhp::data::ImageOptions o;
  Flags flags(argc, argv, first + 1);
  while (flags.next()) {
    const auto& f = flags.flag();
    if (f == "-h" || f == "--help") {
      std::printf("%s", usage);
      return 0;
    }
    if (f == "--image") image = flags.value();
    else if (f == "--out") out = flags.value();
    else if (f == "--min-pixels") o.min_pixels = parse_int(f, flags.value());
    else if (f == "--max-pixels") o.max_pixels = parse_int(f, flags.value());
    else DHP_FAIL("unknown option '", flags.raw(), "' (see dhp data --help)");
  }
  DHP_CHECK(!image.empty() && !out.empty(), "dhp data preprocess needs --image and --out\n\n", usage);
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
