// Throughput of the LLaVA data pipeline (decode PNG, Qwen processor, chat template with the
// real tokenizer, patches) on the synthetic dataset written as files, with 1 and 2 worker
// threads, at 448x448 and 896x896 px, as the images are (sides already multiples of 28) and
// resized to half their area (Pillow's bicubic path). Prints samples/s, input MB/s (PNG
// bytes) and output MB/s (pixel_values bytes) measured in the same run.
//
// On a shared machine one pass moves by 2x, so every setting runs --repeats times, the
// 1- and 2-worker runs interleaved (alternating which goes first) so that a slow spell
// hits both: the table gives the median and the range, the CPU time per sample (process
// CPU clock: what the work costs, steadier than wall time), and the median of the rounds'
// 2-worker / 1-worker ratios.
//
// --video measures the video path instead: the moving task's clips written as H.264 files
// (32 frames at 8 fps, square sides 224 and 448), each read with FFmpeg, 8 frames sampled at
// 2 fps, resized (none, or to half the area), cut into patches: clips/s and CPU ms per clip.
//   ./build/dhp-bench-data [--video] [--num N] [--repeats R] [--dir DIR] [--tokenizer FILE]
#include <torch/torch.h>
#include <unistd.h>

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "dhp/core/error.h"
#include "dhp/core/log.h"
#include "dhp/data/loader.h"
#include "dhp/models/qwen2_5_vl/config.h"

namespace fs = std::filesystem;

namespace {

double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Pass {
  double wall = 0, cpu = 0;
  int64_t out_bytes = 0;
};

}  // namespace

int main(int argc, char** argv) {
  try {
    int64_t num = 64, repeats = 5;
    fs::path base = fs::temp_directory_path();
    std::string tokenizer = "third_party/qwen-tokenizer/tokenizer.json";
    bool video = false;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--num" && i + 1 < argc) num = std::stoll(argv[++i]);
      else if (a == "--repeats" && i + 1 < argc) repeats = std::stoll(argv[++i]);
      else if (a == "--dir" && i + 1 < argc) base = argv[++i];
      else if (a == "--tokenizer" && i + 1 < argc) tokenizer = argv[++i];
      else if (a == "--video") video = true;
      else DHP_FAIL("usage: dhp-bench-data [--video] [--num N] [--repeats R] [--dir DIR] [--tokenizer FILE]; unknown "
                    "argument '", a, "'");
    }
    torch::set_num_threads(1);
    auto tok = std::make_shared<const dhp::data::Tokenizer>(dhp::data::Tokenizer::from_file(tokenizer));
    DHP_CHECK(num > 0 && repeats > 0, "--num and --repeats must be > 0");
    std::printf("dhp-bench-data: %lld %s per run, %lld rounds, %u cores; median (min-max) over the rounds\n",
                static_cast<long long>(num), video ? "clips" : "samples", static_cast<long long>(repeats),
                std::thread::hardware_concurrency());
    std::printf("%-5s %-10s %-7s %-22s %9s %10s %12s %10s\n", "side", "resize", "workers", "samples/s", "in MB/s",
                "out MB/s", "CPU ms/sample", "2w/1w");
    for (int64_t side : video ? std::vector<int64_t>{224, 448} : std::vector<int64_t>{448, 896}) {
      const fs::path dir = base / ("dhp-bench-data-" + std::to_string(::getpid()) + "-" + std::to_string(side));
      dhp::data::ShapesOptions so;
      so.min_side = so.max_side = side;
      if (video) {
        so.frames = 32;
        so.fps = 8;
      }
      dhp::data::write_synthetic(dir.string(), num, dhp::qwen::preset("demo"), so);
      int64_t in_bytes = 0;
      for (const auto& e : fs::directory_iterator(dir / (video ? "videos" : "images"))) {
        in_bytes += static_cast<int64_t>(e.file_size());
      }
      {  // warm-up: the page cache holds the files and the tokenizer's piece cache is filled
        dhp::data::LoaderOptions o;
        o.datasets.push_back({(dir / "train.jsonl").string(), "", 1.0});
        o.video.min_pixels = 3136;
        dhp::data::Loader warm(std::make_shared<dhp::data::LlavaDataset>(o, tok), 0, 0, 1, 2, 16);
        for (int64_t i = 0; i < num; ++i) warm.next();
      }
      for (bool half : {false, true}) {
        dhp::data::LoaderOptions o;
        o.datasets.push_back({(dir / "train.jsonl").string(), "", 1.0});
        o.image.max_pixels = half ? side * side / 2 : o.image.max_pixels;
        o.video.min_pixels = 3136;
        o.video.max_pixels = half ? static_cast<double>(side * side / 2) : static_cast<double>(side * side);
        auto data = std::make_shared<dhp::data::LlavaDataset>(o, tok);
        auto pass = [&](int64_t workers) {
          dhp::data::Loader loader(data, 0, 0, 1, workers, 16);
          Pass p;
          const double c0 = cpu_seconds();
          const auto t0 = std::chrono::steady_clock::now();
          for (int64_t i = 0; i < num; ++i) p.out_bytes += loader.next().pixel_values.numel() * 4;
          p.wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          p.cpu = cpu_seconds() - c0;
          return p;
        };
        std::vector<Pass> runs[2];
        std::vector<double> ratios;
        for (int64_t r = 0; r < repeats; ++r) {
          for (int64_t k = 0; k < 2; ++k) {
            const int64_t w = (r % 2 == 0) == (k == 0) ? 1 : 2;  // alternate which goes first
            runs[w - 1].push_back(pass(w));
          }
          ratios.push_back(runs[0].back().wall / runs[1].back().wall);
        }
        for (int64_t w = 1; w <= 2; ++w) {
          std::vector<double> rate, cpu_ms;
          for (const auto& p : runs[w - 1]) {
            rate.push_back(static_cast<double>(num) / p.wall);
            cpu_ms.push_back(1e3 * p.cpu / static_cast<double>(num));
          }
          const double med = median(rate);
          const double out_per_sample = static_cast<double>(runs[w - 1].front().out_bytes) / static_cast<double>(num);
          char range[64];
          std::snprintf(range, sizeof(range), "%.1f (%.1f-%.1f)", med, *std::min_element(rate.begin(), rate.end()),
                        *std::max_element(rate.begin(), rate.end()));
          char ratio[16] = "";
          if (w == 2) std::snprintf(ratio, sizeof(ratio), "%.2f", median(ratios));
          std::printf("%-5lld %-10s %-7lld %-22s %9.1f %10.1f %12.2f %10s\n", static_cast<long long>(side),
                      half ? "half area" : "none", static_cast<long long>(w), range,
                      med * static_cast<double>(in_bytes) / static_cast<double>(num) / 1e6,
                      med * out_per_sample / 1e6, median(cpu_ms), ratio);
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
