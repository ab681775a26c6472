// The planner's cost model: step time and memory per device of a training step of a
// Qwen2.5-VL model under a parallel plan (a strategy per module, their placement), on a
// described cluster, for a described workload. Every formula and every constant's source
// is in docs/cost_model.md; nothing here is fitted to a measured step time.
//
// Time: each module's forward, recomputation (activation checkpointing) and backward are
// summed per layer from its GEMMs (a roofline per GEMM shape: compute- or memory-bound,
// plus a launch cost), its flash attention (tile-padded segments), its element-wise
// passes (memory-bound; replicated on every tensor-parallel rank) and its collectives
// (ring formulas on the bus bandwidth of the link they cross, plus a latency per call).
// Memory: model states by precision and ZeRO stage, stored activations (layer inputs under
// checkpointing, or everything without), one layer's working set, the logits, the
// ZeRO-3 gathered parameters, and a fixed reserve per device.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "dhp/dist/layout.h"
#include "dhp/models/qwen2_5_vl/config.h"
#include "dhp/models/qwen2_5_vl/freezing.h"
#include "dhp/models/qwen2_5_vl/lora.h"

namespace dhp::plan {

// A link's collective performance: NCCL-style bus bandwidth (bytes/s) of all-reduce, of
// all-gather / reduce-scatter and of all-to-all (0: the all-reduce's), and a latency per call.
struct Link {
  double bus_bandwidth = 0;
  double latency_s = 0;
  double gather_bandwidth = 0;
  double a2a_bandwidth = 0;
  // Measured cost of one small collective issued after `sync_interval_s[i]` seconds of
  // compute on every rank: its latency plus the wait for the last rank to arrive (ranks
  // drift apart while they compute). Empty: latency_s alone (the presets).
  std::vector<double> sync_interval_s, sync_cost_s;
  double gather() const { return gather_bandwidth > 0 ? gather_bandwidth : bus_bandwidth; }
  double a2a() const { return a2a_bandwidth > 0 ? a2a_bandwidth : bus_bandwidth; }
  // Latency plus arrival wait of a collective after `interval` seconds of compute: the table
  // interpolated linearly (held flat beyond its ends), or latency_s without a table.
  double sync_seconds(double interval) const;
};

struct Cluster {
  std::string name;                 // as asked for, e.g. h100x8
  std::string device;               // e.g. "H100 SXM 80GB"
  int64_t devices_per_node = 8;
  int64_t nodes = 1;
  double memory_bytes = 0;          // per device, as the driver reports it
  double reserved_bytes = 0;        // per device, not available to tensors (context, comm buffers)
  double flops_bf16 = 0;            // dense peak per device, FLOP/s
  double flops_fp32 = 0;
  double gemm_efficiency = 0;       // fraction of peak a large GEMM reaches
  double attention_efficiency = 0;  // fraction of peak the flash-attention forward reaches
  double attention_flops = 0;       // measured attention FLOP/s (local); 0: flops x attention_efficiency
  int64_t attention_tile = 128;     // query/key tile of the attention kernel (segments pad to it)
  int64_t attention_block = 0;      // dhp's CPU attention: its block (see attention_pairs); 0: flash tiles
  // dhp's CPU attention on short segments (at most attention_block tokens, batched densely):
  // measured FLOP/s by padded segment length (local; empty: attention_flops for every length).
  std::vector<double> attention_dense_len, attention_dense_flops;
  double hbm_bandwidth = 0;         // bytes/s per device
  double hbm_efficiency = 0;        // fraction reached by element-wise kernels
  double launch_s = 0;              // fixed cost per kernel
  double optimizer_s_per_param = 0; // measured update (norm + AdamW) per parameter (local); 0: bytes / bandwidth
  double synthetic_s_per_patch = 0; // measured generation of dhp's synthetic samples per image patch (local)
  // Measured local work of dhp's ZeRO-3 per unit and parameter byte: its gathers' and
  // reduce-scatter's copies (local); 0: Conventions::zero3_copy_passes at HBM bandwidth.
  double zero3_unit_s_per_byte = 0;
  bool half_all_reduce_in_fp32 = false;  // bf16 all-reduces carried as fp32 (dhp on Gloo, which cannot sum bf16)
  // Of a collective started beside compute (parallel.overlap), the fraction of the shorter of
  // the two that the overlap hides: measured (local: a 16 MB all-reduce beside bf16 GEMMs of
  // the same length on every rank); 0: none (presets, older calibrations).
  double overlap_hidden = 0;
  // Eager PyTorch's host time per layer (forward + recomputation + backward), measured by
  // bench/device/reference_layers.py with tiny inputs (the GPU idle, so the time is the
  // host's dispatch alone): keys vision/tp and text/tp (DTensor tensor parallelism),
  // vision/plain and text/plain (plain modules). Used under the eager conventions
  // (reference, deepspeed); empty: not modeled (load_eager_host_times, calibration.h).
  std::map<std::string, double> eager_layer_host_s;
  std::string eager_host_source;    // where they were measured
  Link intra, inter;                // inside a node, across nodes
  std::string source;               // where the numbers come from
  int64_t devices() const { return devices_per_node * nodes; }
  double flops(const std::string& precision) const { return precision == "fp32" ? flops_fp32 : flops_bf16; }
};

// Presets: h100, h200, a100 (optionally xN devices, e.g. h100x8, h100x16: 8 per node), or
// local (loaded from a calibration file, see calibration.h). Throws naming the known ones.
Cluster cluster_preset(const std::string& spec);
std::vector<std::string> cluster_preset_names();

// What a training step processes.
struct Workload {
  int64_t vision_tokens = 1024;     // patches per image (before the 2x2 merge); a square grid when possible
  int64_t images_per_sample = 1;
  // > 1: each image is a clip of this many temporal patches (frames / temporal_patch_size),
  // vision_tokens its patches over all of them; Qwen's tower attends within each temporal
  // patch (its windows and its full-attention layers), so a clip costs as that many images
  // of vision_tokens / temporal_patches patches in attention and as one sample elsewhere.
  int64_t temporal_patches = 1;
  int64_t text_tokens = 64;         // text tokens per sample besides the image tokens (prompt, template, answer)
  int64_t target_tokens = 32;       // tokens per sample with a loss (the answer)
  int64_t batch_size = 8;           // global samples per step
  int64_t micro_batches = 1;
  std::string precision = "bf16";   // bf16 (fp32 masters, see Conventions) or fp32
  bool checkpointing = true;        // activation checkpointing (recompute each layer in backward)
  // The samples are dhp's synthetic shapes task, generated inside the step by every rank
  // (whole global batch); otherwise the data loader's threads prepare them ahead (no cost).
  bool synthetic_data = false;
  // Fine-tuning (model.vision.freeze, ...): frozen parameters hold no gradient or optimizer
  // state and take no part in the gradient reductions; a frozen layer's backward computes
  // its input's gradient only (no weight gradient), and none at all before the first layer
  // that trains; a frozen vision encoder runs forward only.
  qwen::Freezing freezing;
  // dhp's gradient reductions (parallel.bucket_mb, parallel.buckets_in_flight): bytes of
  // gradients per bucket and buckets started and not landed at once.
  double reduce_bucket_bytes = 25.0 * (1 << 20);
  int64_t reduce_buckets_in_flight = 2;
  // LoRA (lora.*): the adapters' parameters train (gradients, state, reductions); their
  // FLOPs (rank << width) are not counted. Their base weights are frozen (freezing.adapted).
  qwen::LoraSpec lora;
  // Patch grid (h, w) of one image or one temporal patch of a clip: the squarest even-sided
  // grid of vision_tokens / temporal_patches patches.
  std::pair<int64_t, int64_t> grid() const;
  int64_t tokens_per_sample(int64_t merge) const;  // text sequence length of one sample
};

// How the runtime holds state and computes the loss: dhp's own, or the reference
// systems' (both documented with their sources in docs/cost_model.md).
struct Conventions {
  std::string name = "dhp";
  double param_bytes = 2, grad_bytes = 2;  // per parameter, bf16 training
  double optim_bytes = 12;                 // fp32 master + Adam moments (ZeRO's K = 12)
  bool logits_all_positions = false;       // logits at every position (HF) or at the targets only (dhp)
  double logit_bytes = 12;                 // per logit element at the loss' peak
  double zero3_live_params = 0;            // parameters a ZeRO-3 module keeps gathered (0 = two layers)
  double zero3_bucket_bytes = 0;           // ZeRO-3 gradient reduce bucket
  bool vision_fused_qkv = true;            // one qkv GEMM (HF's vision) or separate q, k, v linears
  // dhp's ZeRO-3 (parallel/zero3.cpp): each unit (layer, embedding, head) gathered for its
  // forward and again for its backward, which recomputes it (checkpointing or not); gradients
  // reduce-scattered by an all-to-all; `zero3_copy_passes` x the unit's bytes of local copies
  // around them. Otherwise DeepSpeed's: gathered for forward, recomputation and backward.
  bool zero3_units = true;
  double zero3_copy_passes = 10;
  // An eager PyTorch runtime (one host thread dispatching every operator): a module's step
  // takes at least its layers' host time (Cluster::eager_layer_host_s); tensor parallelism
  // through DTensor (its own host cost per layer) when dtensor_tp.
  bool eager = false;
  bool dtensor_tp = false;
  // Gradient reductions started during the last backward, ZeRO-3's gathers prefetched and its
  // reduce-scatters landing later (dhp's parallel.overlap): Cluster::overlap_hidden of the
  // overlappable communication is hidden, up to the compute it can hide behind.
  bool overlap = true;
};
Conventions conventions(const std::string& name);  // dhp, reference (SP+TP, TP: the Ray system), deepspeed (ZeRO-3)

// One module's strategy: kind none, sp (Ulysses + ZeRO-1 over the module's ranks), tp
// (Megatron tensor parallel; vocabulary split for the text), zero3, dp; `degree` is the sp
// or tp degree, `dp` the replicas. Ranks = degree * dp.
struct ModuleStrategy {
  dist::Strategy kind = dist::Strategy::kNone;
  int64_t degree = 1;
  int64_t dp = 1;
  int64_t ranks() const { return degree * dp; }
  std::string describe() const;
};

struct Plan {
  std::string name;            // dhp, tp, zero3 or a description
  ModuleStrategy vision, text;
  bool disjoint = false;       // modules on separate ranks (pipelined) or on the same ones (one after the other)
  std::string conventions = "dhp";
  bool overlap = true;         // parallel.overlap (false: every collective waited for where it is issued)
  std::string describe() const;
};

// Named plans on `devices` ranks, colocated: dhp (vision sp + text tp), tp (both tp),
// zero3 (both zero3), dp (both data-parallel).
Plan named_plan(const std::string& name, int64_t devices);

struct ModuleCost {
  // Seconds per step on one rank of the module.
  double gemm_s = 0, attention_s = 0, elementwise_s = 0, comm_s = 0, optimizer_s = 0;
  double sync_s = 0;       // waiting at collectives for the other ranks (calibrated links only)
  double overlap_s = 0;    // of comm_s, what may run beside compute (Conventions::overlap)
  double hidden_s = 0;     // of that, what compute hides (Cluster::overlap_hidden)
  double host_s = 0;       // eager runtimes: the host's dispatch of the layers (0: not modeled)
  int64_t comm_calls = 0;
  // Of comm_calls, those started a unit ahead of their use (ZeRO-3's prefetched gathers and
  // late reduce-scatters under Conventions::overlap): the compute beside them absorbs the
  // ranks' arrival skew, so they add no sync_s.
  int64_t ahead_calls = 0;
  double comm_bytes = 0;   // bytes this rank sends per step (ring formulas)
  double flops = 0;        // model FLOPs per step of the whole module (fwd + bwd, no recompute)
  // Bytes per device.
  double state_bytes = 0, activation_bytes = 0, working_bytes = 0, logits_bytes = 0, gathered_bytes = 0;
  // The gradient reduction's buckets in flight (dp and tp x dp all-reduce, ZeRO-1 reduce-scatter):
  // their flat copies, and on Gloo the fp32 copies of bf16 ones.
  double reduce_bytes = 0;
  // The step's input this rank holds at the text's backward: its vision replica's samples'
  // pixel values (fp32 patch rows) of the micro-batches not encoded yet, and this one's
  // sequence share of its own (kept for the backward).
  double input_bytes = 0;
  // The device's work and the host's dispatch overlap (kernels are queued ahead): the longer
  // of the two, then the update.
  double device_s() const { return gemm_s + attention_s + elementwise_s + comm_s - hidden_s + sync_s; }
  double time_s() const { return std::max(device_s(), host_s) + optimizer_s; }
  double memory_bytes() const {
    return state_bytes + activation_bytes + working_bytes + logits_bytes + gathered_bytes + reduce_bytes + input_bytes;
  }
};

struct Estimate {
  Plan plan;
  Workload workload;
  ModuleCost vision, text;
  double redistribute_s = 0;   // embeddings and their gradients between the groups
  double input_s = 0;          // generating synthetic samples (Workload::synthetic_data)
  double step_sync_s = 0;      // the step's closing reductions (gradient norm, loss) waiting for the last rank
  double step_s = 0;
  double throughput = 0;       // the reference's metric: patches per image x batch / step time
  double memory_bytes = 0;     // the fullest device
  double capacity_bytes = 0;   // memory - reserve
  bool fits = false;
  std::string reason;          // why it does not fit or cannot run (empty when it does)
};

// Step time and memory of `plan` for `w` on `c`. A plan that cannot run (degrees that do
// not divide the heads, too few samples for the replicas, more ranks than devices) comes
// back with fits = false and the reason.
Estimate estimate(const qwen::ModelConfig& m, const Cluster& c, const Workload& w, const Plan& plan);

// Every plan the search considers on c.devices() ranks: each module none/sp/tp/zero3/dp
// with every degree and replica count that divides the devices, colocated or disjoint.
std::vector<Plan> candidate_plans(const Cluster& c, const std::string& conventions);

// The feasible estimates of every candidate, fastest first, and the infeasible ones with
// their reasons (in `rejected`).
std::vector<Estimate> search(const qwen::ModelConfig& m, const Cluster& c, const Workload& w,
                             const std::string& conventions, std::vector<Estimate>* rejected = nullptr);

// Formulas exposed for tests.
// Host seconds per step of `layers` layers of `module` (vision, text) under strategy s on
// an eager runtime: layers x micro-batches x the measured time per layer (x 3/4 without
// recomputation); 0 when cv is not eager or c has no measurement for it.
double eager_host_seconds(const Cluster& c, const Conventions& cv, const std::string& module, const ModuleStrategy& s,
                          int64_t layers, const Workload& w);
// Temporal patches of a clip of `frames` frames (0: an image, 1): frames padded up to whole
// temporal patches of v.temporal_patch_size, as Qwen's processor pads them.
int64_t clip_temporal_patches(const qwen::VisionConfig& v, int64_t frames);
// Parameters of one vision block / text layer.
int64_t vision_block_params(const qwen::VisionConfig& v);
int64_t text_layer_params(const qwen::TextConfig& t);
// Per parameter bytes of the model states on one of n ranks under a ZeRO stage (0..3).
double state_bytes_per_param(const Conventions& cv, int64_t zero_stage, int64_t n);
// Seconds of one GEMM (m x k) @ (k x n) forward on c in `precision`.
double gemm_seconds(const Cluster& c, const std::string& precision, double m, double n, double k);
// Seconds of a collective over n ranks on `link` moving `bytes` (the full buffer for
// all-reduce / all-gather / reduce-scatter; the local buffer for all-to-all).
double all_reduce_seconds(const Link& link, int64_t n, double bytes);
double all_gather_seconds(const Link& link, int64_t n, double bytes);
double all_to_all_seconds(const Link& link, int64_t n, double bytes);
// Query-key pairs the attention kernel of c computes for one segment of L tokens.
double attention_pairs(const Cluster& c, double L, bool causal);
// FLOP/s of c's attention kernel on a segment of L tokens: the dense-path table for short
// segments of dhp's CPU attention (interpolated in log length, flat beyond its ends), else
// attention_flops, else the peak x attention_efficiency.
double attention_rate(const Cluster& c, const std::string& precision, double L);
// Forward FLOPs of one image's vision tower (exact: windows from Qwen's window index).
double vision_image_flops(const qwen::VisionConfig& v, int64_t grid_h, int64_t grid_w);

}  // namespace dhp::plan
