// Throughput of the LLaVA data pipeline (decode PNG, Qwen processor, chat template with the
// real tokenizer, patches) on the synthetic dataset written as files, with 1 and 2 worker
// threads, at 448x448 and 896x896 px, as the images are (sides already multiples of 28) and
// resized to half their area (Pillow's bicubic path). Prints samples/s, input MB/s (PNG
// bytes) and output MB/s (pixel_values bytes) measured in the same run.
//   ./build/dhp-bench-data [--num N] [--dir DIR] [--tokenizer FILE]
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "dhp/core/error.h"
#include "dhp/core/log.h"
#include "dhp/data/loader.h"
#include "dhp/models/qwen2_5_vl/config.h"

namespace fs = std::filesystem;

int main(int argc, char** argv) {
  try {
    int64_t num = 64;
    fs::path base = fs::temp_directory_path();
    std::string tokenizer = "third_party/qwen-tokenizer/tokenizer.json";
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--num" && i + 1 < argc) num = std::stoll(argv[++i]);
      else if (a == "--dir" && i + 1 < argc) base = argv[++i];
      else if (a == "--tokenizer" && i + 1 < argc) tokenizer = argv[++i];
      else DHP_FAIL("usage: dhp-bench-data [--num N] [--dir DIR] [--tokenizer FILE]; unknown argument '", a, "'");
    }
    torch::set_num_threads(1);
    auto tok = std::make_shared<const dhp::data::Tokenizer>(dhp::data::Tokenizer::from_file(tokenizer));
    std::printf("dhp-bench-data: %lld samples per run, %u cores\n", static_cast<long long>(num),
                std::thread::hardware_concurrency());
    std::printf("%-6s %-10s %-8s %10s %12s %12s\n", "side", "resize", "workers", "samples/s", "in MB/s", "out MB/s");
    for (int64_t side : {448, 896}) {
      const fs::path dir = base / ("dhp-bench-data-" + std::to_string(::getpid()) + "-" + std::to_string(side));
      dhp::data::ShapesOptions so;
      so.min_side = so.max_side = side;
      dhp::data::write_synthetic(dir.string(), num, dhp::qwen::preset("demo"), so);
      int64_t in_bytes = 0;
      for (const auto& e : fs::directory_iterator(dir / "images")) in_bytes += static_cast<int64_t>(e.file_size());
      {  // warm-up: the page cache holds the files and the tokenizer's piece cache is filled
        dhp::data::LoaderOptions o;
        o.datasets.push_back({(dir / "train.jsonl").string(), "", 1.0});
        dhp::data::Loader warm(std::make_shared<dhp::data::LlavaDataset>(o, tok), 0, 0, 1, 2, 16);
        for (int64_t i = 0; i < num; ++i) warm.next();
      }
      for (bool half : {false, true}) {
        for (int64_t workers : {1, 2}) {
          dhp::data::LoaderOptions o;
          o.datasets.push_back({(dir / "train.jsonl").string(), "", 1.0});
          o.image.max_pixels = half ? side * side / 2 : o.image.max_pixels;
          auto data = std::make_shared<dhp::data::LlavaDataset>(o, tok);
          dhp::data::Loader loader(data, 0, 0, 1, workers, 16);
          int64_t out_bytes = 0;
          const auto t0 = std::chrono::steady_clock::now();
          for (int64_t i = 0; i < num; ++i) {
            const auto s = loader.next();
            out_bytes += s.pixel_values.numel() * 4;
          }
          const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          std::printf("%-6lld %-10s %-8lld %10.1f %12.1f %12.1f\n", static_cast<long long>(side),
                      half ? "half area" : "none", static_cast<long long>(workers), static_cast<double>(num) / secs,
                      static_cast<double>(in_bytes) / 1e6 / secs, static_cast<double>(out_bytes) / 1e6 / secs);
        }
      }
      fs::remove_all(dir);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dhp-bench-data: error: %s\n", e.what());
    return 1;
  }
}
