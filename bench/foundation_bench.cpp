// Foundation benchmark (not a test): prints, from one run on this machine,
//   1. the measured GEMM peak, fp32 and bf16;
//   2. varlen attention forward+backward time and peak memory against the naive
//      masked-softmax reference at 1k, 4k and 16k tokens (one full-attention segment);
//   3. the single-process training step's model FLOP/s as a fraction of the GEMM peak.
// usage: dhp-bench-foundation [--quick] [--naive-limit BYTES]
#include <torch/torch.h>

#include <cstdio>
#include <cstring>
#include <thread>

#include "dhp/core/log.h"
#include "dhp/core/machine.h"
#include "dhp/core/memory.h"
#include "dhp/nn/attention.h"
#include "support/attention_reference.h"
#include "dhp/train/trainer.h"

namespace {

struct AttnResult {
  bool oom = false;
  double seconds = 0;
  int64_t peak = 0;
};

AttnResult time_attention(int64_t S, bool naive, int64_t block, int64_t limit) {
  const int64_t H = 4, D = 64;
  auto q = torch::randn({S, H, D}).requires_grad_(true), k = torch::randn({S, H, D}).requires_grad_(true);
  auto v = torch::randn({S, H, D}).requires_grad_(true);
  auto dout = torch::randn({S, H, D});
  std::vector<int64_t> cu = {0, S};
  AttnResult r;
  const int64_t base = dhp::memory_live_bytes();
  dhp::reset_memory_peak();
  dhp::set_memory_limit(limit > 0 ? base + limit : 0);
  dhp::Timer t;
  try {
    dhp::nn::VarlenAttentionOptions o;
    o.block_size = block;
    auto out = naive ? dhp::testing::varlen_attention_naive(q, k, v, cu, false) : dhp::nn::varlen_attention(q, k, v, cu, o);
    auto g = torch::autograd::grad({out}, {q, k, v}, {dout});
    r.seconds = t.seconds();
  } catch (const dhp::OutOfMemory&) {
    r.oom = true;
  }
  dhp::set_memory_limit(0);
  r.peak = dhp::memory_peak_bytes() - base;
  return r;
}

void train_mfu(const char* preset, const std::vector<std::string>& sets, double peak_gflops, int steps) {
  std::vector<std::string> all = {"model.preset=" + std::string(preset), "data.eval_samples=0"};
  all.insert(all.end(), sets.begin(), sets.end());
  auto cfg = dhp::load_config("", all);
  dhp::train::Trainer tr(cfg);
  tr.train_step();  // warm-up
  double flops = 0, secs = 0;
  for (int i = 0; i < steps; ++i) {
    auto m = tr.train_step();
    flops += m.model_flops;
    secs += m.step_time_s;
  }
  const double gf = flops / secs / 1e9;
  std::printf("  %-8s %-34s step %7.3f s  model %7.1f GFLOP/s  = %5.1f%% of the GEMM peak\n", preset,
              [&] { std::string s; for (auto& x : sets) s += x + " "; return s; }().c_str(), secs / steps, gf,
              100 * gf / peak_gflops);
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  int64_t naive_limit = 8LL << 30;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--naive-limit") && i + 1 < argc) naive_limit = dhp::parse_bytes(argv[++i], "--naive-limit");
    else {
      std::fprintf(stderr, "usage: dhp-bench-foundation [--quick] [--naive-limit BYTES (default 8GiB)]\n");
      return 2;
    }
  }
  try {
    dhp::install_memory_accounting();
    const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    torch::set_num_threads(threads);
    std::printf("dhp foundation benchmark (libtorch %s, %d threads, %s)\n", TORCH_VERSION, threads,
                dhp::blas_description().c_str());
    if (!dhp::blas_hint().empty()) std::printf("note: %s\n", dhp::blas_hint().c_str());
    std::printf("\n");

    std::printf("1. GEMM peak (best of square matmuls)\n");
    double peak32 = 0, peak16 = 0;
    for (int64_t n : {512L, 1024L, 2048L}) {
      const double f = dhp::gemm_gflops(torch::kFloat32, n, quick ? 2 : 5);
      const double b = dhp::gemm_gflops(torch::kBFloat16, n, quick ? 2 : 5);
      peak32 = std::max(peak32, f);
      peak16 = std::max(peak16, b);
      std::printf("  n=%-5lld fp32 %8.1f GFLOP/s   bf16 %8.1f GFLOP/s\n", static_cast<long long>(n), f, b);
    }
    std::printf("  peak   fp32 %8.1f GFLOP/s   bf16 %8.1f GFLOP/s (%.1f GFLOP/s per core fp32)\n\n", peak32, peak16,
                peak32 / threads);

    std::printf("2. Attention forward+backward, one segment, 4 heads x 64, fp32 (naive capped at %s)\n",
                dhp::format_bytes(naive_limit).c_str());
    std::printf("  %-7s %-22s %-22s %s\n", "tokens", "blockwise (time, mem)", "naive (time, mem)", "speed, memory ratio");
    for (int64_t S : quick ? std::vector<int64_t>{1024, 4096} : std::vector<int64_t>{1024, 4096, 16384}) {
      auto f = time_attention(S, false, 256, 0);
      auto n = time_attention(S, true, 0, naive_limit);
      char ns[64];
      if (n.oom) std::snprintf(ns, sizeof(ns), "OOM (> %s)", dhp::format_bytes(naive_limit).c_str());
      else std::snprintf(ns, sizeof(ns), "%7.3f s %10s", n.seconds, dhp::format_bytes(n.peak).c_str());
      std::printf("  %-7lld %7.3f s %12s  %-22s", static_cast<long long>(S), f.seconds, dhp::format_bytes(f.peak).c_str(), ns);
      if (!n.oom) std::printf(" naive/blockwise time %.2fx, memory %.1fx", n.seconds / f.seconds, static_cast<double>(n.peak) / f.peak);
      std::printf("\n");
    }

    std::printf("\n3. Training step model FLOP/s (3x forward FLOPs, recompute not counted)\n");
    const int steps = quick ? 2 : 4;
    train_mfu("demo", {}, peak32, steps);
    train_mfu("bench", {"data.batch_size=4", "data.min_side=224", "data.max_side=448"}, peak32, steps);
    train_mfu("bench", {"data.batch_size=4", "data.min_side=224", "data.max_side=448", "training.precision=bf16"}, peak16, steps);
    std::printf("  (bf16 rows are relative to the bf16 GEMM peak)\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dhp-bench-foundation: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
