#include "dhp/plan/cost_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <set>
#include <sstream>

#include "dhp/core/error.h"
#include "dhp/models/qwen2_5_vl/windows.h"
#include "dhp/plan/calibration.h"

namespace dhp::plan {

using S = dist::Strategy;
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

double ceil_div(double a, double b) { return std::ceil(a / b); }

// Non-causal attention pairs a flash kernel computes for a segment of length L: whole tiles.
double padded_pairs(double L, double tile) {
  const double t = ceil_div(L, tile);
  return t * t * tile * tile;
}

// Causal: the tiles on or below the diagonal.
double padded_causal_pairs(double L, double tile) {
  const double t = ceil_div(L, tile);
  return t * (t + 1) / 2 * tile * tile;
}

}  // namespace

// Query-key pairs the attention kernel computes for one segment of length L. Flash kernels
// (attention_block 0): whole tiles. dhp's CPU attention (nn/attention.cpp, attention_block
// B): a segment of at most B tokens is padded to the next power of two and computed as a
// whole square, causal or not (short segments are batched densely); a longer one runs in
// query blocks of B, each against all keys, or (causal) the keys up to the block's end.
double attention_pairs(const Cluster& c, double L, bool causal) {
  if (c.attention_block <= 0) {
    const double tile = static_cast<double>(c.attention_tile);
    return causal ? padded_causal_pairs(L, tile) : padded_pairs(L, tile);
  }
  const double B = static_cast<double>(c.attention_block);
  if (L <= B) {
    double p = 1;
    while (p < L) p *= 2;
    return p * p;
  }
  if (!causal) return L * L;
  double pairs = 0;
  for (double i0 = 0; i0 < L; i0 += B) pairs += std::min(B, L - i0) * std::min(i0 + B, L);
  return pairs;
}

double attention_rate(const Cluster& c, const std::string& precision, double L) {
  const auto& x = c.attention_dense_len;
  const auto& y = c.attention_dense_flops;
  if (c.attention_block > 0 && L <= static_cast<double>(c.attention_block) && !x.empty() && x.size() == y.size()) {
    double p = 1;  // the padded length the kernel computes
    while (p < L) p *= 2;
    if (p <= x.front()) return y.front();
    for (size_t i = 1; i < x.size(); ++i) {
      if (p <= x[i]) {
        const double f = std::log(p / x[i - 1]) / std::log(x[i] / x[i - 1]);
        return y[i - 1] + f * (y[i] - y[i - 1]);
      }
    }
    return y.back();
  }
  return c.attention_flops > 0 ? c.attention_flops : c.flops(precision) * c.attention_efficiency;
}

namespace {

// The link a group of n ranks crosses: inside a node when it fits in one.
const Link& link_for(const Cluster& c, int64_t n) { return n <= c.devices_per_node ? c.intra : c.inter; }

double elementwise_seconds(const Cluster& c, double bytes, double kernels) {
  return bytes / (c.hbm_bandwidth * c.hbm_efficiency) + kernels * c.launch_s;
}

// Work of one module on one of its ranks, accumulated per micro-batch.
// How much backward a layer runs (fine-tuning): none (frozen, and nothing before it trains),
// its input's gradient only (frozen), or input and weight gradients (trains).
enum Backward { kNoBackward = 0, kInputGrad = 1, kFullBackward = 2 };

struct Tally {
  const Cluster& c;
  const std::string& precision;
  ModuleCost& cost;
  bool recompute;                 // activation checkpointing: the forward again before the backward
  Backward backward = kFullBackward;  // of the layers tallied next
  double passes_gemm() const { return 1 + (backward != kNoBackward && recompute ? 1 : 0) + backward; }
  double passes_fwd() const { return 1 + (backward != kNoBackward && recompute ? 1 : 0); }
  void gemm(double m, double n, double k) {
    if (m <= 0 || n <= 0 || k <= 0) return;
    cost.gemm_s += passes_gemm() * gemm_seconds(c, precision, m, n, k);
  }
  // Element-wise bytes of one forward pass; backward moves twice as much.
  void elementwise(double bytes, double kernels) {
    cost.elementwise_s += (passes_fwd() + (backward != kNoBackward ? 2 : 0)) * elementwise_seconds(c, bytes, kernels);
  }
  // Forward FLOPs of segments of `segment` tokens (the kernel's rate depends on it).
  void attention(double flops_fwd, double segment) {
    const double s = flops_fwd / attention_rate(c, precision, segment);
    // FA2 backward: 2.5x the forward's matmul work
    cost.attention_s += passes_fwd() * s + (backward != kNoBackward ? 2.5 * s : 0.0);
  }
  void collective(double seconds, double bytes, int64_t calls, bool overlappable = false, bool ahead = false) {
    cost.comm_s += seconds;
    cost.comm_bytes += bytes;
    cost.comm_calls += calls;
    if (overlappable) cost.overlap_s += seconds;
    if (ahead) cost.ahead_calls += calls;
  }
};

struct Shape {  // one module's per-rank view
  int64_t t = 1;      // tensor-parallel split of the GEMMs / heads
  int64_t share = 1;  // sequence split (sp) of the tokens
  int64_t ranks = 1;  // ranks of the module
  int64_t replicas = 1;
};

Shape shape_of(const ModuleStrategy& s) {
  Shape sh;
  sh.ranks = s.ranks();
  if (s.kind == S::kTensorParallel) sh.t = s.degree;
  if (s.kind == S::kSequenceParallel) sh.share = s.degree;
  sh.replicas = (s.kind == S::kZero3 || s.kind == S::kDataParallel) ? s.ranks() : s.dp;
  return sh;
}

double dtype_bytes(const std::string& precision) { return precision == "fp32" ? 4 : 2; }

// Bytes per element an all-reduce moves: bf16 goes as fp32 where the backend cannot sum it.
double all_reduce_elem_bytes(const Cluster& c, double b) { return c.half_all_reduce_in_fp32 && b == 2 ? 4 : b; }

// Model states per rank of a module with `params` parameters (of which `sharded` follow the
// tensor-parallel split), by strategy.
// `trainable` of them train; the frozen rest is parameters alone (no gradient, no optimizer
// state), split like the parameters (tensor-parallel shards, ZeRO-3 slices).
double module_state_bytes(const Conventions& cv, const ModuleStrategy& s, double params, double trainable,
                          const std::string& precision) {
  Conventions v = cv;
  if (precision == "fp32") {  // fp32 training: the parameter is its own master
    v.param_bytes = 4;
    v.grad_bytes = 4;
    v.optim_bytes = 8;
  }
  const double frozen = params - trainable;
  // tp x dp: every data replica holds its TP shard's whole state (the runtime's parallel.<module>.zero
  // default for tp is 0), and all-reduces its gradients.
  if (s.kind == S::kTensorParallel)
    return (trainable * state_bytes_per_param(v, 0, 1) + frozen * v.param_bytes) / static_cast<double>(s.degree);
  if (s.kind == S::kSequenceParallel) return trainable * state_bytes_per_param(v, 1, s.ranks()) + frozen * v.param_bytes;
  if (s.kind == S::kZero3)
    return trainable * state_bytes_per_param(v, 3, s.ranks()) + frozen * v.param_bytes / static_cast<double>(s.ranks());
  return trainable * state_bytes_per_param(v, 0, 1) + frozen * v.param_bytes;
}

// Per layer of a tower of `layers`, how much backward it runs: `trains(l)` says whether its
// weights train; `below` whether anything before the first layer needs a gradient.
std::vector<Backward> backward_of_layers(int64_t layers, bool below, const std::function<bool(int64_t)>& trains) {
  std::vector<Backward> out;
  bool needed = below;
  for (int64_t l = 0; l < layers; ++l) {
    const bool t = trains(l);
    out.push_back(t ? kFullBackward : needed ? kInputGrad : kNoBackward);
    needed = needed || t;
  }
  return out;
}

// Optimizer step: memory-bound over the parameters this rank updates (read gradient, master,
// moments; write master, moments, parameter).
double optimizer_seconds(const Cluster& c, const Conventions& cv, double params_updated) {
  if (params_updated <= 0) return 0;  // all frozen: no step at all
  if (c.optimizer_s_per_param > 0) return params_updated * c.optimizer_s_per_param;  // measured (local)
  const double bytes = params_updated * (cv.grad_bytes + 2 * cv.optim_bytes + cv.param_bytes);
  return elementwise_seconds(c, bytes, 8);
}

double params_updated(const ModuleStrategy& s, double params) {
  if (s.kind == S::kTensorParallel) return params / static_cast<double>(s.degree) / (s.dp > 1 ? static_cast<double>(s.dp) : 1.0);
  if (s.kind == S::kSequenceParallel || s.kind == S::kZero3) return params / static_cast<double>(s.ranks());
  return params;
}

// Gradient synchronisation once per step (bf16/fp32 gradients).
void step_collectives(Tally& tl, const Cluster& c, const ModuleStrategy& s, double params, double gbytes) {
  const int64_t n = s.ranks();
  if (n <= 1) return;
  const Link& l = link_for(c, n);
  // The gradients' reduction may overlap the last backward; ZeRO-1's gather of the updated
  // parameters follows the update and does not.
  if (s.kind == S::kSequenceParallel) {  // ZeRO-1: reduce-scatter the gradients, all-gather the updated parameters
    const double b = params * gbytes;
    tl.collective(all_gather_seconds(l, n, b), b * (n - 1) / n, 1, true);
    tl.collective(all_gather_seconds(l, n, b), b * (n - 1) / n, 1);
  } else if (s.kind == S::kTensorParallel && s.dp > 1) {
    const double b = params / static_cast<double>(s.degree) * all_reduce_elem_bytes(c, gbytes);
    tl.collective(all_reduce_seconds(link_for(c, n), s.dp, b), 2 * b * (s.dp - 1) / s.dp, 1, true);
  } else if (s.kind == S::kDataParallel) {
    const double b = params * all_reduce_elem_bytes(c, gbytes);
    tl.collective(all_reduce_seconds(l, n, b), 2 * b * (n - 1) / n, 1, true);
  }
}

// Bytes the gradient reduction of a module holds on a rank at once: its buckets in flight
// (Workload::reduce_buckets_in_flight of reduce_bucket_bytes, at most the rank's `params`
// trained parameters' gradients of `gbytes` each), each a flat copy of the gradients plus, for
// an all-reduce on Gloo of bf16 ones, an fp32 copy (2 more bytes per byte); ZeRO-1's
// reduce-scatter (an all-to-all) adds the received parts instead (1 more).
double reduce_buffer_bytes(const Cluster& c, const Workload& w, const ModuleStrategy& s, double params, double gbytes) {
  const bool zero1 = s.kind == S::kSequenceParallel && s.ranks() > 1;
  const bool all_reduce = (s.kind == S::kTensorParallel && s.dp > 1) || (s.kind == S::kDataParallel && s.ranks() > 1);
  if (!zero1 && !all_reduce) return 0;
  const double flat = std::min(params * gbytes, static_cast<double>(w.reduce_buckets_in_flight) * w.reduce_bucket_bytes);
  const double copies = zero1 ? 2 : 1 + (all_reduce_elem_bytes(c, gbytes) > gbytes ? 2 : 0);
  return copies * flat;
}

// ZeRO-3, per micro-batch: `units` units of `unit_params` parameters each. DeepSpeed: gathered
// for forward, recomputation (checkpointing) and backward, gradients reduce-scattered. dhp
// (Conventions::zero3_units): gathered for forward and backward, gradients reduce-scattered
// by an all-to-all, plus the local copies around them.
// With tl.backward: a unit without backward is gathered once; a frozen one's gradients are
// not reduced.
void zero3_unit_collectives(Tally& tl, const Cluster& c, const Conventions& cv, const ModuleStrategy& s,
                            double unit_params, double units, double gbytes, bool checkpointing) {
  const int64_t n = s.ranks();
  if (s.kind != S::kZero3 || n <= 1 || units <= 0) return;
  const Link& l = link_for(c, n);
  const double b = unit_params * gbytes;
  const double frac = static_cast<double>(n - 1) / static_cast<double>(n);
  const double reduces = tl.backward == kFullBackward ? 1 : 0;
  if (cv.zero3_units) {
    const double gathers = tl.backward == kNoBackward ? 1 : 2;
    tl.collective(units * (gathers * all_gather_seconds(l, n, b) + reduces * all_to_all_seconds(l, n, b)),
                  units * (gathers + reduces) * b * frac, static_cast<int64_t>(units * (gathers + reduces)), true,
                  cv.overlap);
    if (reduces > 0)
      tl.cost.elementwise_s += units * (c.zero3_unit_s_per_byte > 0 ? b * c.zero3_unit_s_per_byte
                                                                    : elementwise_seconds(c, cv.zero3_copy_passes * b, 8));
    return;
  }
  const double gathers = tl.backward == kNoBackward ? 1 : checkpointing ? 3 : 2;
  tl.collective(units * (gathers + reduces) * all_gather_seconds(l, n, b), units * (gathers + reduces) * b * frac,
                static_cast<int64_t>(units * (gathers + reduces)));
}

// Of the module's overlappable communication, what its compute hides (Conventions::overlap):
// the measured fraction of the shorter of the two. Gradient reductions run beside the last
// micro-batch's backward (about half of its compute); ZeRO-3's gathers and reduce-scatters
// beside every unit's compute.
void add_hidden(ModuleCost& cost, const Cluster& c, const Conventions& cv, const ModuleStrategy& s, int64_t micro_batches) {
  if (!cv.overlap || c.overlap_hidden <= 0 || cost.overlap_s <= 0) return;
  const double compute = cost.gemm_s + cost.attention_s + cost.elementwise_s;
  const double beside = s.kind == S::kZero3 ? compute : 0.5 * compute / static_cast<double>(std::max<int64_t>(1, micro_batches));
  cost.hidden_s = c.overlap_hidden * std::min(cost.overlap_s, beside);
}

// Waiting at the module's collectives for the slowest rank: each call that blocks (not one
// started ahead) after the module's compute divided evenly between those calls, at the
// link's measured cost for that interval (beyond the latency already counted in comm_s).
void add_sync_wait(ModuleCost& cost, const Link& l) {
  const int64_t blocking = cost.comm_calls - cost.ahead_calls;
  if (l.sync_interval_s.empty() || blocking <= 0) return;
  const double calls = static_cast<double>(blocking);
  const double interval = (cost.gemm_s + cost.attention_s + cost.elementwise_s) / calls;
  cost.sync_s = calls * std::max(0.0, l.sync_seconds(interval) - l.latency_s);
}

std::string fmt_gib(double b) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f GiB", b / kGiB);
  return buf;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Formulas

std::pair<int64_t, int64_t> Workload::grid() const {
  DHP_CHECK(temporal_patches >= 1, "temporal patches per clip must be at least 1, got ", temporal_patches);
  DHP_CHECK(vision_tokens % temporal_patches == 0, "vision tokens per clip (", vision_tokens,
            ") must divide into its ", temporal_patches, " temporal patches");
  const int64_t frame = vision_tokens / temporal_patches;
  DHP_CHECK(frame >= 4 && frame % 4 == 0, "vision tokens per image", temporal_patches > 1 ? " (temporal patch)" : "",
            " must be a positive multiple of 4 (2x2 merge), got ", frame);
  // The squarest grid with even sides: h = largest even divisor <= sqrt.
  const int64_t units = frame / 4;
  int64_t best = 1;
  for (int64_t a = 1; a * a <= units; ++a) {
    if (units % a == 0) best = a;
  }
  return {2 * best, 2 * (units / best)};
}

int64_t Workload::tokens_per_sample(int64_t merge) const {
  return images_per_sample * vision_tokens / (merge * merge) + text_tokens;
}

std::string ModuleStrategy::describe() const {
  std::ostringstream os;
  os << dist::strategy_name(kind);
  if (kind == S::kSequenceParallel || kind == S::kTensorParallel) os << degree;
  if (kind == S::kZero3 || kind == S::kDataParallel) os << "(" << ranks() << ")";
  else if (dp > 1) os << "xdp" << dp;
  return os.str();
}

std::string Plan::describe() const {
  return "vision " + vision.describe() + " | text " + text.describe() + (disjoint ? " (disjoint)" : "");
}

int64_t vision_block_params(const qwen::VisionConfig& v) {
  const int64_t h = v.hidden_size, I = v.intermediate_size;
  return 2 * h                       // two RMSNorm weights
         + h * 3 * h + 3 * h         // qkv with bias
         + h * h + h                 // proj with bias
         + 2 * (h * I + I) + I * h + h;  // gate, up, down with biases
}

int64_t text_layer_params(const qwen::TextConfig& t) {
  const int64_t h = t.hidden_size, kv = t.num_kv_heads * t.head_dim(), I = t.intermediate_size;
  return 2 * h                           // input and post-attention RMSNorm
         + h * h + h + 2 * (h * kv + kv)  // q, k, v with biases
         + h * h                          // o without bias
         + 3 * h * I;                     // gate, up, down
}

double state_bytes_per_param(const Conventions& cv, int64_t zero_stage, int64_t n) {
  DHP_CHECK(zero_stage >= 0 && zero_stage <= 3 && n >= 1, "ZeRO stage ", zero_stage, " over ", n, " ranks");
  const double N = static_cast<double>(n);
  switch (zero_stage) {
    case 0: return cv.param_bytes + cv.grad_bytes + cv.optim_bytes;
    case 1: return cv.param_bytes + cv.grad_bytes + cv.optim_bytes / N;
    case 2: return cv.param_bytes + (cv.grad_bytes + cv.optim_bytes) / N;
    default: return (cv.param_bytes + cv.grad_bytes + cv.optim_bytes) / N;
  }
}

double Link::sync_seconds(double interval) const {
  const auto& x = sync_interval_s;
  const auto& y = sync_cost_s;
  if (x.empty() || x.size() != y.size()) return latency_s;
  if (interval <= x.front()) return y.front();
  for (size_t i = 1; i < x.size(); ++i) {
    if (interval <= x[i]) return y[i - 1] + (y[i] - y[i - 1]) * (interval - x[i - 1]) / (x[i] - x[i - 1]);
  }
  return y.back();
}

double gemm_seconds(const Cluster& c, const std::string& precision, double m, double n, double k) {
  const double b = dtype_bytes(precision);
  const double compute = 2 * m * n * k / (c.flops(precision) * c.gemm_efficiency);
  const double memory = b * (m * k + k * n + m * n) / (c.hbm_bandwidth * c.hbm_efficiency);
  return std::max(compute, memory) + c.launch_s;
}

double all_reduce_seconds(const Link& l, int64_t n, double bytes) {
  if (n <= 1) return 0;
  return l.latency_s + 2.0 * static_cast<double>(n - 1) / static_cast<double>(n) * bytes / l.bus_bandwidth;
}

double all_gather_seconds(const Link& l, int64_t n, double bytes) {
  if (n <= 1) return 0;
  return l.latency_s + static_cast<double>(n - 1) / static_cast<double>(n) * bytes / l.gather();
}

double all_to_all_seconds(const Link& l, int64_t n, double bytes) {
  if (n <= 1) return 0;
  return l.latency_s + static_cast<double>(n - 1) / static_cast<double>(n) * bytes / l.a2a();
}

int64_t clip_temporal_patches(const qwen::VisionConfig& v, int64_t frames) {
  DHP_CHECK(frames >= 0, "frames per clip must be >= 0 (0: images), got ", frames);
  return frames == 0 ? 1 : (frames + v.temporal_patch_size - 1) / v.temporal_patch_size;
}

double vision_image_flops(const qwen::VisionConfig& v, int64_t gh, int64_t gw) {
  std::vector<int64_t> index, cu;
  qwen::window_index({{1, gh, gw}}, v, index, cu);
  const double N = static_cast<double>(gh * gw), h = static_cast<double>(v.hidden_size);
  const double I = static_cast<double>(v.intermediate_size);
  double window_pairs = 0;
  for (size_t i = 0; i + 1 < cu.size(); ++i) window_pairs += std::pow(static_cast<double>(cu[i + 1] - cu[i]), 2);
  const std::set<int64_t> full(v.fullatt_block_indexes.begin(), v.fullatt_block_indexes.end());
  double f = 2 * N * static_cast<double>(v.patch_dim()) * h;
  for (int64_t l = 0; l < v.depth; ++l) {
    f += 2 * N * h * (4 * h + 3 * I) + 4 * h * (full.count(l) ? N * N : window_pairs);
  }
  const double unit = static_cast<double>(v.spatial_merge_size * v.spatial_merge_size);
  f += 2 * (N / unit) * (unit * h) * (unit * h + static_cast<double>(v.out_hidden_size));
  return f;
}

double eager_host_seconds(const Cluster& c, const Conventions& cv, const std::string& module, const ModuleStrategy& s,
                          int64_t layers, const Workload& w) {
  if (!cv.eager || c.eager_layer_host_s.empty()) return 0;
  const auto it = c.eager_layer_host_s.find(module + (s.kind == S::kTensorParallel && cv.dtensor_tp ? "/tp" : "/plain"));
  if (it == c.eager_layer_host_s.end()) return 0;
  // Measured with recomputation: forward, forward again, backward (about twice the forward's
  // operators: each linear's input and weight gradients). Without it, 3 of those 4 parts.
  const double passes = w.checkpointing ? 1.0 : 0.75;
  return static_cast<double>(layers * w.micro_batches) * it->second * passes;
}

// ---------------------------------------------------------------------------------------
// The estimate

namespace {

// Vision tower on one rank, whole step.
ModuleCost vision_cost(const qwen::ModelConfig& model, const Cluster& c, const Workload& w, const ModuleStrategy& s,
                       const Conventions& cv, std::string& why) {
  ModuleCost cost;
  const auto& v = model.vision;
  const Shape sh = shape_of(s);
  const auto [gh, gw] = w.grid();
  // N: patches of one attention segment (an image, or one temporal patch of a clip of T).
  const double N = static_cast<double>(gh * gw), T = static_cast<double>(w.temporal_patches);
  const double h = static_cast<double>(v.hidden_size);
  const double I = static_cast<double>(v.intermediate_size), out = static_cast<double>(v.out_hidden_size);
  const double unit = static_cast<double>(v.spatial_merge_size * v.spatial_merge_size);
  const double hd = static_cast<double>(v.head_dim()), heads = static_cast<double>(v.num_heads);
  const double b = dtype_bytes(w.precision);
  const int64_t images_step = w.batch_size * w.images_per_sample;
  const double images_mb = static_cast<double>(images_step) / static_cast<double>(w.micro_batches) /
                           static_cast<double>(sh.replicas);  // per replica and micro-batch
  if (static_cast<double>(w.batch_size) / static_cast<double>(w.micro_batches) < static_cast<double>(sh.replicas)) {
    why = "vision " + s.describe() + ": " + std::to_string(sh.replicas) + " replicas need as many samples per micro-batch";
    return cost;
  }
  std::vector<int64_t> index, cu;
  qwen::window_index({{1, gh, gw}}, v, index, cu);
  const double windows = T * static_cast<double>(cu.size() - 1);
  if (s.kind == S::kSequenceParallel && windows * images_mb < static_cast<double>(s.degree)) {
    why = "vision sp" + std::to_string(s.degree) + ": only " + std::to_string(static_cast<int64_t>(windows * images_mb)) +
          " attention windows per replica and micro-batch to split";
    return cost;
  }
  const double M = images_mb * T * N / static_cast<double>(sh.share);  // patch rows on this rank
  const double t = static_cast<double>(sh.t);
  // dhp's ZeRO-3 recomputes every unit in backward, checkpointing or not.
  const bool recompute = w.checkpointing || (s.kind == S::kZero3 && cv.zero3_units);
  Tally tl{c, w.precision, cost, recompute};
  // Fine-tuning: what of the tower runs backward.
  const auto& fz = w.freezing;
  const Backward patch_bwd = fz.trainable("visual.patch_embed.proj.weight", model) ? kFullBackward : kNoBackward;
  // LoRA's adapters in a part: every layer there runs a backward (the adapters' gradients).
  const auto block_bwd = backward_of_layers(v.depth, patch_bwd != kNoBackward || w.lora.adapts("vision"), [&](int64_t l) {
    return fz.trainable("visual.blocks." + std::to_string(l) + ".attn.qkv.weight", model);
  });
  int64_t blocks_bwd = 0;  // blocks that keep activations for a backward
  for (auto m : block_bwd) blocks_bwd += m != kNoBackward ? 1 : 0;
  const Backward merger_bwd = fz.trainable("visual.merger.mlp.0.weight", model) ? kFullBackward
                              : blocks_bwd > 0 || w.lora.adapts("merger")            ? kInputGrad
                                                                               : kNoBackward;
  // Window layers: pairs of each window, weighted by the kernel's rate at its length relative
  // to the rate at a whole image's (so that one attention() call at that rate charges them).
  double window_padded = 0;
  const double full_rate = attention_rate(c, w.precision, N);
  for (size_t i = 0; i + 1 < cu.size(); ++i) {
    const double len = static_cast<double>(cu[i + 1] - cu[i]);
    window_padded += T * attention_pairs(c, len, false) * full_rate / attention_rate(c, w.precision, len);
  }
  const std::set<int64_t> full(v.fullatt_block_indexes.begin(), v.fullatt_block_indexes.end());
  const double attn_share = static_cast<double>(sh.t * sh.share);  // heads (tp, sp) or windows (sp) split
  for (int64_t mb = 0; mb < w.micro_batches; ++mb) {
    tl.backward = patch_bwd;
    tl.gemm(M, h, static_cast<double>(v.patch_dim()));  // patch embedding
    for (int64_t l = 0; l < v.depth; ++l) {
      tl.backward = block_bwd[static_cast<size_t>(l)];
      const int64_t passes = static_cast<int64_t>(tl.passes_fwd()) + (tl.backward != kNoBackward ? 1 : 0);
      if (cv.vision_fused_qkv) {
        tl.gemm(M, 3 * h / t, h);
      } else {
        for (int i = 0; i < 3; ++i) tl.gemm(M, h / t, h);
      }
      tl.gemm(M, h, h / t);
      tl.gemm(M, I / t, h);
      tl.gemm(M, I / t, h);
      tl.gemm(M, h, I / t);
      const double pairs = full.count(l) ? T * attention_pairs(c, N, false) : window_padded;
      tl.attention(4 * hd * heads * pairs * images_mb / attn_share, N);
      // Norms and residuals (10h per token) run on every tensor-parallel rank; rotary (4h) and
      // the SwiGLU product (3I) are split.
      tl.elementwise(b * M * (10 * h + (4 * h + 3 * I) / t), 12);
      if (s.kind == S::kTensorParallel) {  // row-parallel outputs each forward pass, each column-parallel input grad backward
        const double ab = all_reduce_elem_bytes(c, b);
        const double ar = all_reduce_seconds(link_for(c, sh.t), sh.t, ab * M * h);
        const int64_t calls = 2 * static_cast<int64_t>(tl.passes_fwd()) +
                              (tl.backward != kNoBackward ? (cv.vision_fused_qkv ? 3 : 5) : 0);
        tl.collective(calls * ar, calls * 2 * ab * M * h * (t - 1) / t, calls);
      }
      if (s.kind == S::kSequenceParallel && full.count(l)) {  // q, k, v to heads and the output back, each pass
        const double a2a = all_to_all_seconds(link_for(c, s.degree), s.degree, b * M * h);
        const int64_t calls = 4 * passes;
        tl.collective(calls * a2a, calls * b * M * h * (s.degree - 1) / s.degree, calls);
      }
      zero3_unit_collectives(tl, c, cv, s, static_cast<double>(vision_block_params(v)), 1, b, w.checkpointing);
    }
    // Merger: norm, fc1 (4h -> 4h), GELU, fc2 (4h -> out).
    tl.backward = merger_bwd;
    tl.elementwise(b * M * h * 2 + b * M / unit * unit * h * 3 / t, 4);
    tl.gemm(M / unit, unit * h / t, unit * h);
    tl.gemm(M / unit, out, unit * h / t);
    if (s.kind == S::kTensorParallel) {
      const int64_t calls = static_cast<int64_t>(tl.passes_fwd()) + (tl.backward != kNoBackward ? 1 : 0);
      const double ar = all_reduce_seconds(link_for(c, sh.t), sh.t, all_reduce_elem_bytes(c, b) * M / unit * out);
      tl.collective(calls * ar, 0, calls);
    }
    if (cv.zero3_units) {  // dhp's patch embedding and merger are units of their own
      zero3_unit_collectives(tl, c, cv, s, unit * h * (unit * h + out), 1, b, w.checkpointing);
      tl.backward = patch_bwd;
      zero3_unit_collectives(tl, c, cv, s, static_cast<double>(v.patch_dim()) * h, 1, b, w.checkpointing);
    }
  }
  const auto pc = static_cast<double>(qwen::count_parameters(model).vision +
                                      qwen::count_adapter_parameters(model, w.lora).vision);
  const auto pt = static_cast<double>(qwen::count_trainable(model, fz).vision +
                                      qwen::count_adapter_parameters(model, w.lora).vision);
  step_collectives(tl, c, s, pt, b);
  add_hidden(cost, c, cv, s, w.micro_batches);
  add_sync_wait(cost, link_for(c, s.ranks()));
  cost.optimizer_s = optimizer_seconds(c, cv, params_updated(s, pt));
  cost.host_s = eager_host_seconds(c, cv, "vision", s, v.depth, w);
  cost.reduce_bytes = reduce_buffer_bytes(c, w, s, pt / t, b);
  // The step's pixel values (fp32 patch rows) come whole at its start; a micro-batch's are
  // freed after its vision forward but for this rank's sequence share, kept for the backward.
  const double mbs = static_cast<double>(w.micro_batches);
  cost.input_bytes = static_cast<double>(images_step) / static_cast<double>(sh.replicas) * T * N *
                     static_cast<double>(v.patch_dim()) * 4 * (mbs - 1 + 1 / static_cast<double>(sh.share)) / mbs;
  cost.flops = (fz.encoder_frozen() ? 1 : 3) * vision_image_flops(v, gh, gw) * T * static_cast<double>(images_step);
  // Memory.
  cost.state_bytes = module_state_bytes(cv, s, pc, pt, w.precision);
  const double per_token_layer = b * (4 * h + (2 * h + 2 * h + 3 * I) / t);  // one block's saved tensors
  const double rows = M;  // one micro-batch's rows are alive at a time
  const double kept = static_cast<double>(blocks_bwd);  // blocks whose activations wait for a backward
  cost.activation_bytes = kept == 0 ? 0.0 : recompute ? b * rows * h * (kept + 1) : per_token_layer * rows * kept;
  // A block's tensors and their gradients in backward (its forward's alone when none runs).
  cost.working_bytes = (blocks_bwd > 0 || merger_bwd != kNoBackward ? 2 : 1) * per_token_layer * rows;
  if (s.kind == S::kZero3) {
    // dhp: the largest unit in its backward: gathered, its full gradient, and the
    // reduce-scatter's padded copy, send buffer and received sums (5x its bytes).
    const double largest = std::max({static_cast<double>(vision_block_params(v)), static_cast<double>(v.patch_dim()) * h,
                                     unit * h * (unit * h + out)});
    cost.gathered_bytes = cv.zero3_live_params > 0 ? std::min(cv.zero3_live_params, pc) * b + cv.zero3_bucket_bytes
                                                   : 5 * largest * b;
  }
  return cost;
}

// Text decoder on one rank, whole step.
ModuleCost text_cost(const qwen::ModelConfig& m, const Cluster& c, const Workload& w, const ModuleStrategy& s,
                     const Conventions& cv, std::string& why) {
  ModuleCost cost;
  const auto& tc = m.text;
  const Shape sh = shape_of(s);
  const double h = static_cast<double>(tc.hidden_size), I = static_cast<double>(tc.intermediate_size);
  const double kv = static_cast<double>(tc.num_kv_heads * tc.head_dim()), V = static_cast<double>(tc.vocab_size);
  const double hd = static_cast<double>(tc.head_dim()), heads = static_cast<double>(tc.num_heads);
  const double b = dtype_bytes(w.precision);
  const double samples_mb = static_cast<double>(w.batch_size) / static_cast<double>(w.micro_batches) /
                            static_cast<double>(sh.replicas);
  if (samples_mb < 1) {
    why = "text " + s.describe() + ": " + std::to_string(sh.replicas) + " replicas need as many samples per micro-batch";
    return cost;
  }
  const double L = static_cast<double>(w.tokens_per_sample(m.vision.spatial_merge_size));
  const double M = samples_mb * L;
  const double targets = samples_mb * static_cast<double>(w.target_tokens);
  const double logit_rows = cv.logits_all_positions ? M : targets;
  const double t = static_cast<double>(sh.t);
  const bool recompute = w.checkpointing || (s.kind == S::kZero3 && cv.zero3_units);
  Tally tl{c, w.precision, cost, recompute};
  const double layers = static_cast<double>(tc.num_layers);
  const Link& tl_link = link_for(c, sh.t);
  // Fine-tuning: what of the decoder runs backward (all of it while the encoder trains).
  const auto& fz = w.freezing;
  const bool embed_trains = fz.trainable("model.embed_tokens.weight", m);
  const auto layer_bwd = backward_of_layers(tc.num_layers, embed_trains || !fz.encoder_frozen() || w.lora.adapts("text"), [&](int64_t l) {
    return fz.trainable("model.layers." + std::to_string(l) + ".mlp.up_proj.weight", m);
  });
  int64_t layers_bwd = 0;
  for (auto b_ : layer_bwd) layers_bwd += b_ != kNoBackward ? 1 : 0;
  const bool head_trains = fz.trainable(tc.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight", m);
  for (int64_t mb = 0; mb < w.micro_batches; ++mb) {
    tl.backward = embed_trains ? kFullBackward : kNoBackward;
    tl.elementwise(b * M * h * 2, 1);  // embedding lookup
    if (s.kind == S::kTensorParallel) {
      const double ab = all_reduce_elem_bytes(c, b);
      tl.collective(all_reduce_seconds(tl_link, sh.t, ab * M * h), 2 * ab * M * h * (t - 1) / t, 1);
    }
    for (int64_t l = 0; l < tc.num_layers; ++l) {
      tl.backward = layer_bwd[static_cast<size_t>(l)];
      tl.gemm(M, h / t, h);  // q, k, v: separate linears (HF's text attention)
      tl.gemm(M, kv / t, h);
      tl.gemm(M, kv / t, h);
      tl.gemm(M, h, h / t);
      tl.gemm(M, I / t, h);
      tl.gemm(M, I / t, h);
      tl.gemm(M, h, I / t);
      tl.attention(4 * hd * heads / t * samples_mb * attention_pairs(c, L, true), L);
      tl.elementwise(b * M * (10 * h + (2 * h + 2 * kv + 3 * I) / t), 12);
      if (s.kind == S::kTensorParallel) {  // o and down each forward pass; q, k, v, gate, up input grads backward
        const double ab = all_reduce_elem_bytes(c, b);
        const double ar = all_reduce_seconds(tl_link, sh.t, ab * M * h);
        const int64_t calls = 2 * static_cast<int64_t>(tl.passes_fwd()) + (tl.backward != kNoBackward ? 5 : 0);
        tl.collective(calls * ar, calls * 2 * ab * M * h * (t - 1) / t, calls);
      }
      zero3_unit_collectives(tl, c, cv, s, static_cast<double>(text_layer_params(tc)), 1, b, w.checkpointing);
    }
    // Final norm, lm_head (vocabulary split under tp), softmax cross-entropy in fp32; the
    // backward always runs here (the loss' gradient reaches whatever trains below).
    tl.backward = fz.trainable("model.norm.weight", m) ? kFullBackward : kInputGrad;
    tl.elementwise(b * M * h * 2, 2);
    cost.gemm_s += (head_trains ? 3 : 2) * gemm_seconds(c, w.precision, logit_rows, V / t, h);  // not recomputed
    cost.elementwise_s += 3 * elementwise_seconds(c, 4 * logit_rows * V / t * 3, 6);
    if (s.kind == S::kTensorParallel) {
      tl.collective(3 * all_reduce_seconds(tl_link, sh.t, 8 * logit_rows) +
                        all_reduce_seconds(tl_link, sh.t, all_reduce_elem_bytes(c, b) * logit_rows * h),
                    2 * b * logit_rows * h * (t - 1) / t, 4);
    }
    tl.backward = head_trains ? kFullBackward : kInputGrad;
    if (cv.zero3_units) {  // dhp: the embedding and the head (the embedding again when tied) are units
      zero3_unit_collectives(tl, c, cv, s, V * h, 2, b, w.checkpointing);
    } else if (s.kind == S::kZero3) {  // embeddings and lm_head gathered too
      const Link& l = link_for(c, s.ranks());
      const double eb = V * h * b * (tc.tie_word_embeddings ? 1 : 2);
      tl.collective(3 * all_gather_seconds(l, s.ranks(), eb), 3 * eb, 3);
    }
  }
  const auto pc = static_cast<double>(qwen::count_parameters(m).text + qwen::count_adapter_parameters(m, w.lora).text);
  const auto pt = static_cast<double>(qwen::count_trainable(m, fz).text + qwen::count_adapter_parameters(m, w.lora).text);
  step_collectives(tl, c, s, pt, b);
  add_hidden(cost, c, cv, s, w.micro_batches);
  add_sync_wait(cost, link_for(c, s.ranks()));
  cost.optimizer_s = optimizer_seconds(c, cv, params_updated(s, pt));
  cost.host_s = eager_host_seconds(c, cv, "text", s, tc.num_layers, w);
  cost.reduce_bytes = reduce_buffer_bytes(c, w, s, pt / t, b);
  const double per_layer_flops = 2 * L * (h * h + 2 * h * kv + h * h + 3 * h * I) + 4 * h * L * (L + 1) / 2;
  cost.flops = 3 * static_cast<double>(w.batch_size) *
               (layers * per_layer_flops + 2 * (cv.logits_all_positions ? L : static_cast<double>(w.target_tokens)) * h * V);
  // Memory.
  cost.state_bytes = module_state_bytes(cv, s, pc, pt, w.precision);
  const double per_token_layer = b * (4 * h + (2 * h + 2 * kv + 3 * I) / t);
  const double kept = static_cast<double>(layers_bwd);  // layers whose activations wait for a backward
  cost.activation_bytes = recompute ? b * M * h * (kept + 1) : per_token_layer * M * kept;
  cost.working_bytes = 2 * per_token_layer * M;
  cost.logits_bytes = cv.logit_bytes * logit_rows * V / t;
  if (s.kind == S::kZero3) {
    const double largest = std::max(static_cast<double>(text_layer_params(tc)), V * h);  // as for the vision
    cost.gathered_bytes = cv.zero3_live_params > 0 ? std::min(cv.zero3_live_params, pc) * b + cv.zero3_bucket_bytes
                                                   : 5 * largest * b;
  }
  return cost;
}

bool divides(int64_t d, int64_t n) { return d >= 1 && n % d == 0; }

}  // namespace

namespace {

// Why `plan` cannot run `w` on `c` at all (devices, divisibility), or "".
std::string infeasible(const qwen::ModelConfig& m, const Cluster& c, const Workload& w, const Plan& plan) {
  const int64_t G = c.devices();
  const auto& vs = plan.vision;
  const auto& ts = plan.text;
  if (plan.disjoint) {
    if (vs.ranks() + ts.ranks() > G) return "needs " + std::to_string(vs.ranks() + ts.ranks()) + " devices, the cluster has " + std::to_string(G);
  } else if (vs.ranks() > G || ts.ranks() > G) {
    return "needs " + std::to_string(std::max(vs.ranks(), ts.ranks())) + " devices, the cluster has " +
           std::to_string(G);
  }
  if (w.batch_size % w.micro_batches != 0) return "batch not divisible into micro-batches";
  const auto& v = m.vision;
  if ((vs.kind == S::kTensorParallel || vs.kind == S::kSequenceParallel) && !divides(vs.degree, v.num_heads)) {
    return "vision " + vs.describe() + ": " + std::to_string(v.num_heads) + " heads do not split " +
           std::to_string(vs.degree) + " ways";
  }
  if (ts.kind == S::kTensorParallel && (!divides(ts.degree, m.text.num_heads) || !divides(ts.degree, m.text.num_kv_heads))) {
    return "text " + ts.describe() + ": " + std::to_string(m.text.num_heads) + " heads / " +
           std::to_string(m.text.num_kv_heads) + " kv heads do not split " + std::to_string(ts.degree) + " ways";
  }
  return "";
}

// What the step costs besides the modules' own work: the embeddings (and their gradients)
// between the groups, drawing the synthetic images, and the step's closing reductions.
void add_overheads(const qwen::ModelConfig& m, const Cluster& c, const Workload& w, const Plan& plan, Estimate& e) {
  const int64_t G = c.devices();
  const auto& vs = plan.vision;
  const auto& ts = plan.text;
  const auto& v = m.vision;
  const double b = dtype_bytes(w.precision);
  const double emb = b * static_cast<double>(w.batch_size * w.images_per_sample) * static_cast<double>(w.vision_tokens) /
                     static_cast<double>(v.spatial_merge_size * v.spatial_merge_size) * static_cast<double>(v.out_hidden_size);
  if (plan.disjoint) {
    const Link& l = link_for(c, G);
    const double ways = w.freezing.encoder_frozen() ? 1 : 2;  // embeddings, and their gradients back
    e.redistribute_s = ways * (l.latency_s + emb / static_cast<double>(std::max<int64_t>(1, std::min(vs.ranks(), ts.ranks()))) /
                                                 l.bus_bandwidth);
  } else if (vs.kind == S::kSequenceParallel && ts.kind != S::kZero3 && ts.kind != S::kDataParallel) {
    // Sequence-split embeddings gathered to every text rank; gradients sliced locally.
    e.redistribute_s = all_gather_seconds(link_for(c, vs.ranks()), vs.ranks(), emb / static_cast<double>(vs.dp));
  }
  if (w.synthetic_data) {  // a rank draws the images its vision replica encodes (every one's text is cheap)
    e.input_s = static_cast<double>(w.batch_size * w.images_per_sample * w.vision_tokens) /
                static_cast<double>(std::min(shape_of(vs).replicas, w.batch_size)) * c.synthetic_s_per_patch;
  }
  // After the backward every rank joins the gradient norm's and the loss' reductions: one
  // collective after the whole step's compute (the ranks drift apart over it).
  const int64_t job = plan.disjoint ? vs.ranks() + ts.ranks() : std::max(vs.ranks(), ts.ranks());
  const Link& job_link = link_for(c, job);
  if (job > 1 && !job_link.sync_interval_s.empty()) {
    const double compute = e.vision.gemm_s + e.vision.attention_s + e.vision.elementwise_s + e.text.gemm_s +
                           e.text.attention_s + e.text.elementwise_s;
    e.step_sync_s = job_link.sync_seconds(compute);
  }
}

}  // namespace

Estimate estimate(const qwen::ModelConfig& m, const Cluster& c, const Workload& w, const Plan& plan) {
  Estimate e;
  e.plan = plan;
  e.workload = w;
  e.capacity_bytes = c.memory_bytes - c.reserved_bytes;
  const auto fail = [&](const std::string& why) {
    e.fits = false;
    e.reason = why;
    return e;
  };
  if (auto why = infeasible(m, c, w, plan); !why.empty()) return fail(why);
  Conventions cv = conventions(plan.conventions);
  cv.overlap = cv.overlap && plan.overlap;
  std::string why;
  e.vision = vision_cost(m, c, w, plan.vision, cv, why);
  if (!why.empty()) return fail(why);
  e.text = text_cost(m, c, w, plan.text, cv, why);
  if (!why.empty()) return fail(why);
  add_overheads(m, c, w, plan, e);
  const double tv = e.vision.time_s(), tt = e.text.time_s();
  const double overhead = e.redistribute_s + e.input_s + e.step_sync_s;
  if (plan.disjoint) {
    const double mbs = static_cast<double>(w.micro_batches);
    e.step_s = std::max(tv, tt) + std::min(tv, tt) / mbs + overhead;
    e.memory_bytes = std::max(e.vision.memory_bytes(), e.text.memory_bytes());
  } else {
    e.step_s = tv + tt + overhead;
    // Stored activations of both are alive together; the text's backward (its working set and
    // logits) comes before the vision's. Reductions started during backward (overlap) hold the
    // text's buckets from its backward through the vision's; without overlap they run after
    // both backwards, one module after the other.
    const double text_reduce = plan.overlap ? e.text.reduce_bytes : 0;
    e.memory_bytes = e.vision.state_bytes + e.text.state_bytes + e.vision.activation_bytes + e.text.activation_bytes +
                     e.vision.input_bytes +
                     std::max({e.text.working_bytes + e.text.gathered_bytes + e.text.logits_bytes + text_reduce,
                               e.vision.working_bytes + e.vision.gathered_bytes + text_reduce +
                                   (plan.overlap ? e.vision.reduce_bytes : 0),
                               plan.overlap ? 0.0 : std::max(e.vision.reduce_bytes, e.text.reduce_bytes)});
  }
  e.throughput = static_cast<double>(w.vision_tokens * w.batch_size * w.images_per_sample) / e.step_s;
  e.fits = e.memory_bytes <= e.capacity_bytes;
  if (!e.fits) e.reason = "out of memory: " + fmt_gib(e.memory_bytes) + " > " + fmt_gib(e.capacity_bytes) + " usable";
  return e;
}

}  // namespace dhp::plan
