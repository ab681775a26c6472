#include "dhp/bench/calibrate.h"

#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "dhp/core/error.h"
#include "dhp/core/log.h"
#include "dhp/core/machine.h"
#include "dhp/data/shapes.h"
#include "dhp/dist/comm.h"
#include "dhp/dist/layout.h"
#include "dhp/io/json.h"
#include "dhp/io/safetensors.h"
#include "dhp/nn/attention.h"
#include "dhp/nn/layers.h"
#include "dhp/parallel/zero3.h"
#include "dhp/optim/adamw.h"

namespace dhp::bench {

using plan::Cluster;
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Runs `work` on `ranks` threads at once (the ranks of a job share the cores): each thread
// warms up and waits for the others; from the moment the last one arrives, every thread
// runs `reps` times. Returns the wall time from that moment until the last thread is done,
// per run: what each rank gets while all share the cores (a thread's own clock would miss
// the time it waited to be scheduled).
double concurrent(int64_t ranks, int reps, const std::function<std::function<void()>()>& make_work) {
  std::atomic<int64_t> ready{0};
  std::atomic<bool> go{false};
  Clock::time_point start;
  std::vector<Clock::time_point> end(static_cast<size_t>(ranks));
  std::vector<std::thread> th;
  for (int64_t r = 0; r < ranks; ++r) {
    th.emplace_back([&, r] {
      auto work = make_work();
      work();  // warm-up
      if (ready.fetch_add(1) + 1 == ranks) {
        start = Clock::now();
        go.store(true);
      }
      while (!go.load()) std::this_thread::yield();
      for (int i = 0; i < reps; ++i) work();
      end[static_cast<size_t>(r)] = Clock::now();
    });
  }
  for (auto& x : th) x.join();
  const auto last = *std::max_element(end.begin(), end.end());
  return std::chrono::duration<double>(last - start).count() / reps;
}

// concurrent() in 5 rounds, the median: one round on a shared machine can catch a neighbour's
// burst (or a quiet spell) that the training will not see.
double concurrent_median(int64_t ranks, int reps, const std::function<std::function<void()>()>& make_work) {
  std::vector<double> t;
  for (int round = 0; round < 5; ++round) t.push_back(concurrent(ranks, reps, make_work));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int64_t physical_memory() {
  const long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && size > 0 ? static_cast<int64_t>(pages) * size : 0;
}

}  // namespace

namespace {

using Say = std::function<void(const std::string&)>;

constexpr int kReps = 9;    // timed calls per kind and round
constexpr int kRounds = 3;  // rounds of every kind, interleaved: a neighbour's burst hits one
enum { kSmall, kReduce, kGather, kA2a, kKinds };
constexpr int64_t kBigFloats = 4 << 20;  // 16 MB
// (GEMMs per stretch, stretches): from ~0.1 ms to ~0.2 s of compute between collectives
// (per 2 ranks; 4 ranks sharing 2 cores take twice as long).
const std::vector<std::pair<int, int>> kSyncChunks = {{1, 256}, {8, 64}, {64, 16}, {512, 6}, {2048, 4}};
constexpr int kSyncRounds = 3;

// One rank's measurements.
struct RankTimings {
  std::vector<std::vector<double>> calls;  // [kind][round * kReps + i]: seconds of one call
  std::vector<std::array<std::vector<double>, 2>> sync;  // [stretch][compute, inside the collective][round]
  std::array<std::vector<double>, 3> overlap;  // [comm alone, compute alone, both][round]
};

// Each call starts after a barrier (no skew carried over from the previous one).
void time_calls(dist::Group& g, int64_t R, RankTimings& out) {
  auto s = torch::ones({256}), l = torch::ones({kBigFloats}), part = torch::ones({kBigFloats / R});
  std::vector<int64_t> rows(static_cast<size_t>(R), kBigFloats / R);
  const std::function<void()> ops[kKinds] = {[&] { g.all_reduce_sum_(s); }, [&] { g.all_reduce_sum_(l); },
                                             [&] { (void)g.all_gather(part, 0); },
                                             [&] { (void)g.all_to_all(l, rows, rows); }};
  out.calls.assign(kKinds, std::vector<double>(kRounds * kReps));
  for (int round = 0; round < kRounds; ++round) {
    for (int k = 0; k < kKinds; ++k) {
      ops[k]();  // warm-up
      for (int i = 0; i < kReps; ++i) {
        g.barrier();
        const auto t0 = Clock::now();
        ops[k]();
        out.calls[static_cast<size_t>(k)][static_cast<size_t>(round * kReps + i)] = seconds_since(t0);
      }
    }
  }
}

// Collectives between stretches of compute, as in training: every rank runs `chunk` bf16
// GEMMs then a small all-reduce, `iters` times, timing the compute and the time inside the
// all-reduce apart. The latter is what a collective costs once the ranks have computed
// apart: its latency plus waiting for the last to arrive.
void time_sync(dist::Group& g, RankTimings& out) {
  auto s = torch::ones({256});
  auto a = torch::randn({256, 256}).to(torch::kBFloat16), b = torch::randn({256, 256}).to(torch::kBFloat16);
  out.sync.assign(kSyncChunks.size(), {std::vector<double>(kSyncRounds), std::vector<double>(kSyncRounds)});
  for (int round = 0; round < kSyncRounds; ++round) {
    for (size_t j = 0; j < kSyncChunks.size(); ++j) {
      g.barrier();
      double compute = 0, inside = 0;
      for (int i = 0; i < kSyncChunks[j].second; ++i) {
        const auto t0 = Clock::now();
        for (int k = 0; k < kSyncChunks[j].first; ++k) (void)torch::matmul(a, b);
        const auto t1 = Clock::now();
        g.all_reduce_sum_(s);
        compute += std::chrono::duration<double>(t1 - t0).count();
        inside += seconds_since(t1);
      }
      out.sync[j][0][static_cast<size_t>(round)] = compute / kSyncChunks[j].second;
      out.sync[j][1][static_cast<size_t>(round)] = inside / kSyncChunks[j].second;
    }
  }
}

// A 16 MB all-reduce started beside bf16 GEMMs of about its length (parallel.overlap's
// case): the all-reduce alone, the GEMMs alone, then both (started, GEMMs, waited for).
void time_overlap(dist::Group& g, RankTimings& out) {
  auto l = torch::ones({kBigFloats});
  auto a = torch::randn({256, 256}).to(torch::kBFloat16), b = torch::randn({256, 256}).to(torch::kBFloat16);
  auto comm = [&] { g.start_all_reduce_sum(l).wait(); };
  g.barrier();
  comm();  // warm-up
  g.barrier();
  auto t0 = Clock::now();
  for (int k = 0; k < 8; ++k) (void)torch::matmul(a, b);
  const double per_gemm = seconds_since(t0) / 8;
  g.barrier();
  t0 = Clock::now();
  comm();
  // The same count of GEMMs on every rank (from rank 0's timing), about the all-reduce's length.
  auto n = torch::tensor({static_cast<double>(std::max(1.0, seconds_since(t0) / std::max(per_gemm, 1e-9)))});
  if (g.rank() != 0) n.zero_();
  g.all_reduce_sum_(n);
  const int gemms = static_cast<int>(std::min(1e5, n.item<double>()));
  auto compute = [&] {
    for (int k = 0; k < gemms; ++k) (void)torch::matmul(a, b);
  };
  for (auto& v : out.overlap) v.assign(kSyncRounds, 0);
  for (int round = 0; round < kSyncRounds; ++round) {
    g.barrier();
    t0 = Clock::now();
    comm();
    out.overlap[0][static_cast<size_t>(round)] = seconds_since(t0);
    g.barrier();
    t0 = Clock::now();
    compute();
    out.overlap[1][static_cast<size_t>(round)] = seconds_since(t0);
    g.barrier();
    t0 = Clock::now();
    auto w = g.start_all_reduce_sum(l);
    compute();
    w.wait();
    out.overlap[2][static_cast<size_t>(round)] = seconds_since(t0);
  }
}

// Every rank of a Gloo group of R threads measures; returns their timings.
std::vector<RankTimings> time_ranks(int64_t R) {
  auto store = dist::make_hash_store();
  std::vector<RankTimings> t(static_cast<size_t>(R));
  const auto ranks = dist::iota_ranks(R);
  std::vector<std::thread> th;
  std::mutex mu;
  std::string error;
  for (int64_t r = 0; r < R; ++r) {
    th.emplace_back([&, r] {
      try {
        dist::Group g(store, "calibrate", ranks, r, std::chrono::milliseconds(60000));
        time_calls(g, R, t[static_cast<size_t>(r)]);
        time_sync(g, t[static_cast<size_t>(r)]);
        time_overlap(g, t[static_cast<size_t>(r)]);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mu);
        error = e.what();
      }
    });
  }
  for (auto& x : th) x.join();
  DHP_CHECK(error.empty(), "calibrating the collectives: ", error);
  return t;
}

// A call takes the slowest rank's time; per round the fastest call counts (the link's
// capability: on a shared machine the others measure the neighbours); the median of the rounds.
double best_of_slowest(const std::vector<RankTimings>& t, int k) {
  std::vector<double> per_round;
  for (int round = 0; round < kRounds; ++round) {
    double best = 1e30;
    for (int i = 0; i < kReps; ++i) {
      double m = 0;
      for (const auto& rank : t) m = std::max(m, rank.calls[static_cast<size_t>(k)][static_cast<size_t>(round * kReps + i)]);
      best = std::min(best, m);
    }
    per_round.push_back(best);
  }
  std::sort(per_round.begin(), per_round.end());
  return per_round[per_round.size() / 2];
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Collectives over loopback (Gloo): latency from a small all-reduce; bus bandwidths from
// 16 MB all-reduce, all-gather and all-to-all buffers; the cost of a collective after each
// length of compute. First, before the compute kernels leave thread pools spinning on the
// cores the Gloo threads need.
void measure_collectives(Cluster& c, const CalibrateOptions& o, const Say& say) {
  const int64_t R = o.ranks;
  if (R <= 1) {
    c.intra = c.inter = {1e12, 0, 0, 0};
    return;
  }
  const auto t = time_ranks(R);
  const double lat = best_of_slowest(t, kSmall), bytes = 4.0 * static_cast<double>(kBigFloats);
  const double frac = static_cast<double>(R - 1) / static_cast<double>(R);
  auto bw = [&](double secs, double factor) { return factor * frac * bytes / std::max(secs - lat, 1e-9); };
  c.intra.latency_s = lat;
  c.intra.bus_bandwidth = bw(best_of_slowest(t, kReduce), 2);
  c.intra.gather_bandwidth = bw(best_of_slowest(t, kGather), 1);
  c.intra.a2a_bandwidth = bw(best_of_slowest(t, kA2a), 1);
  // Per stretch length: the ranks' mean compute per stretch and time inside the collective,
  // each the median of the rounds.
  std::string table;
  for (size_t j = 0; j < kSyncChunks.size(); ++j) {
    double compute = 0, inside = 0;
    for (const auto& rank : t) {
      compute += median(rank.sync[j][0]) / static_cast<double>(R);
      inside += median(rank.sync[j][1]) / static_cast<double>(R);
    }
    c.intra.sync_interval_s.push_back(compute);
    c.intra.sync_cost_s.push_back(std::max(lat, inside));
    table += (j ? ", " : "") + std::to_string(c.intra.sync_cost_s[j] * 1e3) + " ms after " +
             std::to_string(compute * 1e3) + " ms";
  }
  c.inter = c.intra;
  say("collectives between compute: " + table);
  // Overlap: what running both saved, of the shorter; per rank the medians of the rounds.
  double comm = 0, compute = 0, both = 0;
  for (const auto& rank : t) {
    comm += median(rank.overlap[0]) / static_cast<double>(R);
    compute += median(rank.overlap[1]) / static_cast<double>(R);
    both += median(rank.overlap[2]) / static_cast<double>(R);
  }
  c.overlap_hidden = std::clamp((comm + compute - both) / std::max(std::min(comm, compute), 1e-9), 0.0, 1.0);
  say("a 16 MB all-reduce beside GEMMs: " + std::to_string(comm * 1e3) + " ms alone, GEMMs " +
      std::to_string(compute * 1e3) + " ms, both " + std::to_string(both * 1e3) + " ms: " +
      std::to_string(static_cast<int>(100 * c.overlap_hidden)) + "% of the shorter hidden");
  say("collectives: latency " + std::to_string(lat * 1e3) + " ms; bus bandwidth all-reduce " +
      std::to_string(c.intra.bus_bandwidth / 1e9) + ", all-gather " + std::to_string(c.intra.gather_bandwidth / 1e9) +
      ", all-to-all " + std::to_string(c.intra.a2a_bandwidth / 1e9) + " GB/s");
}

// GEMM rate per rank with every rank busy, as training runs them: a linear layer's forward
// and backward (input and weight gradients) under autograd, 1024 rows of width 512.
void measure_gemm(Cluster& c, const CalibrateOptions& o, const Say& say) {
  const int64_t R = o.ranks;
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    const int64_t m = 1024, n = 512;
    const double secs = concurrent_median(R, 16, [&] {  // long enough (~0.1 s) for the ranks to time-slice
      auto x = torch::randn({m, n}).to(dtype).requires_grad_(true);
      auto w = torch::randn({n, n}).to(dtype).requires_grad_(true);
      auto g = torch::randn({m, n}).to(dtype);
      return std::function<void()>([x, w, g] {
        torch::AutoGradMode grad(true);
        x.mutable_grad() = torch::Tensor();
        w.mutable_grad() = torch::Tensor();
        torch::linear(x, w).backward(g);
      });
    });
    const double rate = 3 * 2.0 * m * n * n / secs;
    (dtype == torch::kFloat32 ? c.flops_fp32 : c.flops_bf16) = rate;
    say(std::string(dtype == torch::kFloat32 ? "fp32" : "bf16") + " GEMM " + std::to_string(rate / 1e9) +
        " GFLOP/s per rank");
  }
}

// Element-wise bandwidth as the model charges it: one block's element-wise passes (two
// RMSNorms, two residual adds, rotary on q and k, the SwiGLU product) forward and backward
// with dhp's own kernels and autograd, in the training's dtype, on 4096 rows of width 256
// (intermediate 1024); bandwidth = the bytes the cost model counts for them (3 passes x
// b x rows x (14 h + 3 I)) / the time they take. On a CPU these kernels (fp32 math on bf16
// data, fresh outputs) run far below the memory's bandwidth: measured, not assumed.
void measure_elementwise(Cluster& c, const CalibrateOptions& o, const Say& say) {
  const int64_t R = o.ranks;
  DHP_CHECK(o.precision == "bf16" || o.precision == "fp32", "calibration precision must be bf16 or fp32, got '",
            o.precision, "'");
  const auto dtype = o.precision == "bf16" ? torch::kBFloat16 : torch::kFloat32;
  const double elem = o.precision == "bf16" ? 2 : 4;
  const int64_t S = 4096, h = 256, I = 1024, heads = 4, hd = h / heads;
  const double secs = concurrent_median(R, 3, [&] {
    auto norm1 = std::make_shared<nn::RMSNormImpl>(h, 1e-6), norm2 = std::make_shared<nn::RMSNormImpl>(h, 1e-6);
    norm1->to(dtype);
    norm2->to(dtype);
    auto x = torch::randn({S, h}).to(dtype).requires_grad_(true);
    auto q = torch::randn({S, heads, hd}).to(dtype).requires_grad_(true);
    auto k = torch::randn({S, heads, hd}).to(dtype).requires_grad_(true);
    auto g = torch::randn({S, I}).to(dtype).requires_grad_(true);
    auto u = torch::randn({S, I}).to(dtype).requires_grad_(true);
    auto cos = torch::randn({S, hd}), sin = torch::randn({S, hd});
    return std::function<void()>([=] {
      torch::AutoGradMode grad(true);
      auto r1 = x + norm1->forward(x);
      auto r2 = r1 + norm2->forward(r1);
      auto act = torch::silu(g) * u;
      auto rq = nn::apply_rotary(q, cos, sin), rk = nn::apply_rotary(k, cos, sin);
      (r2.sum() + act.sum() + rq.sum() + rk.sum()).backward();
    });
  });
  c.hbm_bandwidth = 3.0 * elem * static_cast<double>(S) * static_cast<double>(14 * h + 3 * I) / secs;
  say("element-wise " + std::to_string(c.hbm_bandwidth / 1e9) + " GB/s per rank (a block's norms, residuals, "
      "rotary, SwiGLU product)");
}

// Fixed cost of one small op with autograd recording (as in training).
void measure_op_overhead(Cluster& c, const CalibrateOptions& o, const Say& say) {
  const int64_t R = o.ranks;
  const double secs = concurrent_median(R, 5, [&] {
    auto a = torch::ones({8}).requires_grad_(true), b = torch::ones({8});
    return std::function<void()>([a, b] {
      torch::AutoGradMode grad(true);
      for (int i = 0; i < 200; ++i) (void)(a + b);
    });
  }) / 200;
  c.launch_s = secs;
  say("op overhead " + std::to_string(secs * 1e6) + " us");
}

// dhp's ZeRO-3 around its collectives: a unit of four 1024x1024 linears (4M bf16
// parameters) run through parallel::Zero3 in a group of one, forward and backward on one
// row (its compute is negligible): two gathers, the reduce-scatter and the copies around
// them, per parameter byte.
void measure_zero3_unit(Cluster& c, const CalibrateOptions& o, const Say& say) {
  const int64_t R = o.ranks;
  const int64_t width = 1024, layers = 4;
  const double secs = concurrent_median(R, 4, [&] {
    auto root = std::make_shared<torch::nn::Module>();
    auto seq = root->register_module("u", torch::nn::Sequential());
    for (int64_t i = 0; i < layers; ++i) seq->push_back(torch::nn::Linear(torch::nn::LinearOptions(width, width).bias(false)));
    root->to(torch::kBFloat16);
    std::vector<optim::NamedParam> params;
    for (auto& kv : root->named_parameters(true)) params.push_back({kv.key(), kv.value(), true});
    auto z = std::make_shared<parallel::Zero3>(params, std::vector<std::string>{"u"}, dist::Group());
    auto x = torch::randn({1, width}).to(torch::kBFloat16);
    return std::function<void()>([root, seq, z, x] {
      torch::AutoGradMode grad(true);
      z->run("u", [seq](const torch::Tensor& in) { return seq->forward(in); }, x).sum().backward();
    });
  });
  c.zero3_unit_s_per_byte = secs / (2.0 * static_cast<double>(layers * width * width));
  say("ZeRO-3 unit " + std::to_string(c.zero3_unit_s_per_byte * 1e9) + " ns per parameter byte (gathers, " +
      "reduce-scatter and copies in a group of one)");
}

// The update as finish_step runs it, per parameter: the gradient's squared norm (fp32), the
// clipping scale (training.grad_clip, on by default) and dhp's AdamW (bf16 parameters and gradients, fp32 masters and moments), on 4M parameters
// per rank (far beyond the caches, like a real model).
void measure_update(Cluster& c, const CalibrateOptions& o, const Say& say) {
  const int64_t R = o.ranks;
  const double secs = concurrent_median(R, 3, [&] {
    std::vector<optim::NamedParam> ps;
    for (int i = 0; i < 4; ++i) {
      auto p = torch::randn({1024, 1024}).to(torch::kBFloat16).requires_grad_(true);
      p.mutable_grad() = torch::randn({1024, 1024}).to(torch::kBFloat16);
      ps.push_back({"p" + std::to_string(i), p, true});
    }
    auto adam = std::make_shared<optim::AdamW>(ps, optim::AdamWOptions{0.9, 0.95, 1e-8, 0.1});
    return std::function<void()>([ps, adam] {
      torch::NoGradGuard no_grad;
      double sq = 0;
      for (const auto& p : ps) sq += p.param.grad().to(torch::kFloat32).pow(2).sum().item<double>();
      for (const auto& p : ps) p.param.grad().mul_(1.0 / (1.0 + std::sqrt(sq)));
      adam->step(1e-4);
    });
  });
  c.optimizer_s_per_param = secs / (4.0 * 1024 * 1024);
  say("update (norm + AdamW) " + std::to_string(c.optimizer_s_per_param * 1e9) + " ns per parameter");
}

// dhp's synthetic shapes samples (drawn, patchified) as every rank makes them inside a
// step: 448-pixel images (1024 patches), per patch.
void measure_samples(Cluster& c, const CalibrateOptions& o, const Say& say) {
  const int64_t R = o.ranks;
  const int64_t side = 448, patches = (side / 14) * (side / 14);
  const double secs = concurrent_median(R, 4, [&] {
    data::ShapesOptions so;
    so.min_side = so.max_side = side;
    auto ds = std::make_shared<data::ShapesDataset>(qwen::preset("bench"), so);
    auto index = std::make_shared<int64_t>(0);
    return std::function<void()>([ds, index] { (void)ds->get((*index)++); });
  });
  c.synthetic_s_per_patch = secs / static_cast<double>(patches);
  say("synthetic samples " + std::to_string(c.synthetic_s_per_patch * 1e6) + " us per patch");
}

// Attention forward + backward (bf16 in, fp32 math, 4 heads of 64) of segments `cu`: FLOP/s
// as the model charges it (forward 1x + backward 2.5x the forward's 4 x D x H x len^2 each).
void measure_attention_rates(Cluster& c, const CalibrateOptions& o, const Say& say) {
  const int64_t R = o.ranks;
  auto measure_attention = [&](int64_t rounds, const std::vector<int64_t>& cu) {
    const int64_t S = cu.back(), H = 4, D = 64;
    const double secs = concurrent_median(R, rounds, [&] {
      auto q = torch::randn({S, H, D}).to(torch::kBFloat16).requires_grad_(true);
      auto k = torch::randn({S, H, D}).to(torch::kBFloat16).requires_grad_(true);
      auto v = torch::randn({S, H, D}).to(torch::kBFloat16).requires_grad_(true);
      return std::function<void()>([q, k, v, cu] {
        torch::AutoGradMode grad(true);
        nn::varlen_attention(q, k, v, cu).sum().backward();
      });
    });
    double pairs = 0;
    for (size_t i = 0; i + 1 < cu.size(); ++i) pairs += static_cast<double>(cu[i + 1] - cu[i]) * (cu[i + 1] - cu[i]);
    return 3.5 * 4.0 * D * H * pairs / secs;
  };
  // One 1024-token segment (the blockwise path).
  c.attention_flops = measure_attention(6, {0, 1024});
  say("attention " + std::to_string(c.attention_flops / 1e9) + " GFLOP/s per rank");
  // The dense path of short segments (vision windows, short text samples): 4,096 tokens in
  // segments of 32 to the block's length, batched as the kernel batches them. Its rate
  // falls with the length (the soft-max's element-wise work per pair is the same, the
  // GEMMs' per pair too, but the batched products get smaller): 64-token windows ran at
  // about half the long-segment rate.
  {
    const int64_t S = 4096;
    const int64_t block = nn::VarlenAttentionOptions{}.block_size;
    std::string rates;
    for (int64_t len = 32; len <= block; len *= 2) {
      std::vector<int64_t> cu;
      for (int64_t p = 0; p <= S; p += len) cu.push_back(p);
      const double rate = measure_attention(5, cu);
      c.attention_dense_len.push_back(static_cast<double>(len));
      c.attention_dense_flops.push_back(rate);
      rates += (rates.empty() ? "" : ", ") + std::to_string(len) + ": " + std::to_string(static_cast<int>(rate / 1e9));
    }
    say("attention on short segments (dense path), GFLOP/s per rank by length: " + rates);
  }
}

}  // namespace

Cluster calibrate_local(const CalibrateOptions& o) {
  DHP_CHECK(o.ranks >= 1 && o.threads >= 1, "calibration needs ranks >= 1 and threads >= 1");
  const int old_threads = torch::get_num_threads();
  torch::set_num_threads(static_cast<int>(o.threads));
  auto say = [&](const std::string& s) {
    if (!o.quiet) log_info("calibrate: " + s);
  };
  Cluster c;
  c.name = "local";
  c.device = "CPU (" + std::to_string(std::thread::hardware_concurrency()) + " threads), " + blas_description();
  c.devices_per_node = o.ranks;
  c.nodes = 1;
  c.memory_bytes = static_cast<double>(physical_memory()) / static_cast<double>(o.ranks);
  c.reserved_bytes = 0;
  c.gemm_efficiency = 1;  // the measured rates are what is reached
  c.hbm_efficiency = 1;
  c.attention_efficiency = 1;
  c.attention_tile = 1;
  c.attention_block = nn::VarlenAttentionOptions{}.block_size;  // dhp's CPU attention (training.attention_block's default)
  c.half_all_reduce_in_fp32 = true;  // Gloo has no bf16 sum: dhp widens to fp32 (dist/comm.cpp)
  const int64_t R = o.ranks;
  // Collectives first, before the compute kernels leave thread pools spinning on the cores
  // the Gloo threads need.
  measure_collectives(c, o, say);
  measure_gemm(c, o, say);
  measure_elementwise(c, o, say);
  measure_op_overhead(c, o, say);
  measure_zero3_unit(c, o, say);
  measure_update(c, o, say);
  measure_samples(c, o, say);
  measure_attention_rates(c, o, say);
  c.source = "measured by dhp plan --calibrate with " + std::to_string(R) + " rank(s) x " + std::to_string(o.threads) +
             " thread(s), element-wise in " + o.precision;
  torch::set_num_threads(old_threads);
  const std::string path = o.out.empty() ? plan::default_calibration_path(o.ranks) : o.out;
  plan::save_cluster(c, path);
  say("saved " + path);
  return c;
}

void calibrate_if_missing(int64_t ranks, const std::string& precision) {
  if (ranks < 2 || std::filesystem::exists(plan::default_calibration_path(ranks))) return;
  log_info("parallel.strategy=auto: no calibration of this machine as " + std::to_string(ranks) +
           " ranks yet; measuring it once (dhp plan --calibrate --ranks " + std::to_string(ranks) + ")");
  CalibrateOptions co;
  co.ranks = ranks;
  co.precision = precision;
  calibrate_local(co);
}

}  // namespace dhp::bench
