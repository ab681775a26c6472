// Save and load throughput of model weights through dhp's safetensors code, in one run:
// writes a Hugging Face directory of a model of a few hundred MB (the bench preset widened,
// bf16 and fp32), in one file and sharded, reads it back whole and by rows (what a
// tensor-parallel rank reads), and prints MB/s for each. Then whole training checkpoints
// of the same model (parameters + AdamW state, through Trainer::save_checkpoint and
// load_checkpoint) on 1 rank and on 2 ranks (threads) under dhp (vision sp=2 + ZeRO-1,
// text tp=2), fp32 and bf16. Files go to --dir (default: the system temp dir) and are
// removed at the end.
//   ./build/dhp-bench-io [--dir DIR] [--layers N]
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>

#include "dhp/core/error.h"
#include "dhp/core/log.h"
#include "dhp/core/memory.h"
#include "dhp/models/qwen2_5_vl/hf.h"
#include "dhp/models/qwen2_5_vl/model.h"
#include "dhp/train/trainer.h"

#include <mutex>
#include <thread>

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

// A training checkpoint of the model: save (every rank writes its pieces in parallel, rank 0
// commits) and load (every rank reads its boxes), timed on rank 0 between barriers.
void run_checkpoint(const fs::path& dir, int64_t layers, int64_t world, const std::string& precision) {
  fs::remove_all(dir);
  const std::vector<std::string> sets = {
      "model.preset=bench", "model.text.num_layers=" + std::to_string(layers), "model.text.vocab_size=32768",
      "training.precision=" + precision, "parallel.strategy=" + std::string(world > 1 ? "dhp" : "none"),
      "checkpoint.dir=" + dir.string(), "output.dir=" + (dir / "run").string(), "data.eval_samples=0",
      "training.threads=1"};
  const auto cfg = dhp::load_config("", sets);
  auto store = dhp::dist::make_hash_store();
  double save_s = 0, load_s = 0;
  std::mutex mu;
  auto body = [&](int64_t rank) {
    dhp::train::Runtime rt;
    rt.rank = rank;
    rt.world = world;
    if (world > 1) rt.store = std::make_shared<dhp::dist::Store>(store);
    dhp::train::Trainer t(cfg, rt);
    t.parallel_model().barrier();
    auto t0 = std::chrono::steady_clock::now();
    const auto path = t.save_checkpoint();
    t.parallel_model().barrier();
    const double s = seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    t.load_checkpoint(path);
    t.parallel_model().barrier();
    const double l = seconds_since(t0);
    if (rank == 0) {
      std::lock_guard<std::mutex> lock(mu);
      save_s = s;
      load_s = l;
    }
  };
  if (world == 1) {
    body(0);
  } else {
    std::vector<std::thread> threads;
    for (int64_t r = 0; r < world; ++r) threads.emplace_back(body, r);
    for (auto& th : threads) th.join();
  }
  int64_t bytes = 0, files = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.path().extension() == ".safetensors") {
      bytes += static_cast<int64_t>(e.file_size());
      ++files;
    }
  }
  const double mb = static_cast<double>(bytes) / 1e6;
  std::printf("checkpoint %-5s %lld rank(s) %8.1f MB  %3lld file(s)  save %7.0f MB/s  load %7.0f MB/s\n",
              precision.c_str(), static_cast<long long>(world), mb, static_cast<long long>(files), mb / save_s,
              mb / load_s);
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
    fp32.clear();
    bf16.clear();
    m = nullptr;
    dhp::set_log_level(dhp::LogLevel::kWarn);  // the trainer's own save lines
    for (const char* precision : {"fp32", "bf16"}) {
      for (int64_t world : {1, 2}) run_checkpoint(dir, layers, world, precision);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dhp-bench-io: error: %s\n", e.what());
    return 1;
  }
}
