// Save and load throughput of model weights through dhp's safetensors code, in one run:
// writes a Hugging Face directory of a model of a few hundred MB (the bench preset widened,
// bf16 and fp32), in one file and sharded, reads it back whole and by rows (what a
// tensor-parallel rank reads), and prints MB/s for each. Files go to --dir (default: the
// system temp dir) and are removed at the end.
//   ./build/dhp-bench-io [--dir DIR] [--layers N]
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>

#include "dhp/core/error.h"
#include "dhp/core/memory.h"
#include "dhp/models/qwen2_5_vl/hf.h"
#include "dhp/models/qwen2_5_vl/model.h"

namespace {

namespace fs = std::filesystem;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int64_t bytes_of(const std::map<std::string, torch::Tensor>& ps) {
  int64_t b = 0;
  for (const auto& kv : ps) b += kv.second.numel() * static_cast<int64_t>(kv.second.element_size());
  return b;
}

void run(const fs::path& dir, const std::map<std::string, torch::Tensor>& params, const dhp::qwen::ModelConfig& c,
         const char* label, int64_t shard_bytes) {
  fs::remove_all(dir);
  const double mb = static_cast<double>(bytes_of(params)) / 1e6;
  auto t0 = std::chrono::steady_clock::now();
  dhp::qwen::save_hf(dir.string(), params, c, shard_bytes);
  const double save_s = seconds_since(t0);
  int64_t files = 0;
  for (const auto& e : fs::directory_iterator(dir)) files += e.path().extension() == ".safetensors";
  // Drop the page cache's advantage as far as an unprivileged process can: a fresh open.
  t0 = std::chrono::steady_clock::now();
  dhp::qwen::HfWeights w(dir.string());
  double sum = 0;
  for (const auto& n : w.names()) sum += static_cast<double>(w.read(n).numel());
  const double load_s = seconds_since(t0);
  // One of four tensor-parallel ranks: a quarter of the rows of every matrix.
  t0 = std::chrono::steady_clock::now();
  dhp::qwen::HfWeights w2(dir.string());
  int64_t part = 0;
  for (const auto& n : w2.names()) {
    const auto shape = w2.shape(n);
    if (shape.empty()) continue;
    const int64_t rows = shape[0] / 4;
    auto t = w2.read_rows(n, rows, rows);
    part += t.numel() * static_cast<int64_t>(t.element_size());
  }
  const double rows_s = seconds_since(t0);
  std::printf("%-22s %8.1f MB  %3lld file(s)  save %7.0f MB/s  load %7.0f MB/s  quarter-rows load %7.0f MB/s (%.1f MB)\n",
              label, mb, static_cast<long long>(files), mb / save_s, mb / load_s,
              static_cast<double>(part) / 1e6 / rows_s, static_cast<double>(part) / 1e6);
  (void)sum;
  fs::remove_all(dir);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    fs::path base = fs::temp_directory_path();
    int64_t layers = 8;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--dir" && i + 1 < argc) base = argv[++i];
      else if (a == "--layers" && i + 1 < argc) layers = std::stoll(argv[++i]);
      else DHP_FAIL("usage: dhp-bench-io [--dir DIR] [--layers N]; unknown argument '", a, "'");
    }
    dhp::install_memory_accounting();  // as dhp itself runs: the same malloc settings
    torch::set_num_threads(1);
    auto c = dhp::qwen::preset("bench");
    c.text.num_layers = layers;
    c.text.vocab_size = 32768;
    dhp::qwen::Qwen2_5_VL m(c);
    dhp::qwen::init_parameters(*m, 1, c.initializer_range);
    std::map<std::string, torch::Tensor> fp32, bf16;
    for (auto& kv : m->named_parameters(true)) {
      fp32[kv.key()] = kv.value().detach();
      bf16[kv.key()] = kv.value().detach().to(torch::kBFloat16);
    }
    const auto dir = base / ("dhp-bench-io-" + std::to_string(::getpid()));
    std::printf("dhp-bench-io: bench preset, %lld decoder layers, vocab 32768, in %s\n",
                static_cast<long long>(layers), base.string().c_str());
    run(dir, fp32, c, "fp32, one file", int64_t{1} << 40);
    run(dir, fp32, c, "fp32, 64 MB shards", 64LL << 20);
    run(dir, bf16, c, "bf16, one file", int64_t{1} << 40);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dhp-bench-io: error: %s\n", e.what());
    return 1;
  }
}
