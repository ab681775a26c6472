// The planner's presets and plan space: the data-centre clusters (sources in
// docs/cost_model.md) and this machine's calibrated one, the runtimes' conventions, the named
// plans and the candidates the search tries.
#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "dhp/core/error.h"
#include "dhp/plan/calibration.h"
#include "dhp/plan/cost_model.h"

namespace dhp::plan {

using S = dist::Strategy;
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr double kMiB = 1024.0 * 1024.0;

// The three data-centre presets; sources in docs/cost_model.md.
Cluster h100() {
  Cluster c;
  c.device = "H100 SXM 80GB";
  c.memory_bytes = 81559 * kMiB;   // nvidia-smi's total for the 80 GB part
  c.reserved_bytes = 2 * kGiB;     // CUDA context, cuBLAS workspaces, NCCL buffers
  c.flops_bf16 = 989e12;           // dense, datasheet
  c.flops_fp32 = 67e12;            // non-tensor-core fp32, datasheet (PyTorch's default: no TF32 for matmuls)
  c.gemm_efficiency = 0.75;
  c.attention_efficiency = 0.35;   // FlashAttention-2 forward on H100 (FlashAttention-3 paper, fig. 5)
  c.hbm_bandwidth = 3.35e12;
  c.hbm_efficiency = 0.8;
  c.launch_s = 4e-6;
  c.intra = {370e9, 15e-6};        // NVLink 4: NCCL bus bandwidth for all-reduce / all-gather / all-to-all
  c.inter = {45e9, 30e-6};         // 8x 400 Gb/s InfiniBand per node: ~50 GB/s per GPU, NCCL ~90%
  c.source = "NVIDIA H100 SXM datasheet; NCCL bus bandwidth as the issue states; FA3 paper for FA2 on H100";
  return c;
}

Cluster h200() {
  Cluster c = h100();
  c.device = "H200 SXM 141GB";
  c.memory_bytes = 143771 * kMiB;  // nvidia-smi's total for the 141 GB part
  c.hbm_bandwidth = 4.8e12;
  c.source = "NVIDIA H200 datasheet (H100 compute and NVLink, 141 GB at 4.8 TB/s)";
  return c;
}

Cluster a100() {
  Cluster c;
  c.device = "A100 SXM 80GB";
  c.memory_bytes = 81920 * kMiB;
  c.reserved_bytes = 2 * kGiB;
  c.flops_bf16 = 312e12;
  c.flops_fp32 = 19.5e12;
  c.gemm_efficiency = 0.8;
  c.attention_efficiency = 0.6;    // FlashAttention-2 paper: 50-73% of peak forward on A100
  c.hbm_bandwidth = 2.039e12;
  c.hbm_efficiency = 0.8;
  c.launch_s = 4e-6;
  c.intra = {230e9, 15e-6};        // NVLink 3, 600 GB/s total: NCCL all-reduce bus bandwidth ~230 GB/s
  c.inter = {22e9, 30e-6};         // 8x 200 Gb/s HDR per node
  c.source = "NVIDIA A100 datasheet; FA2 paper; NCCL bus bandwidth on DGX A100";
  return c;
}

}  // namespace

std::vector<std::string> cluster_preset_names() { return {"h100", "h200", "a100", "local"}; }  // xN: N devices

Cluster cluster_preset(const std::string& spec) {
  std::string base = spec;
  int64_t n = 8;
  const auto x = spec.find('x');
  if (spec == "local") n = 1;
  if (x != std::string::npos) {
    base = spec.substr(0, x);
    const std::string count = spec.substr(x + 1);
    DHP_CHECK(!count.empty() && count.find_first_not_of("0123456789") == std::string::npos,
              "cluster '", spec, "': the device count after 'x' must be a number (e.g. h100x8)");
    n = std::stoll(count);
    DHP_CHECK(n >= 1, "cluster '", spec, "': needs at least one device");
  }
  Cluster c;
  if (base == "h100") c = h100();
  else if (base == "h200") c = h200();
  else if (base == "a100") c = a100();
  else if (base == "local") {
    c = load_local_cluster(default_calibration_path(n));
    c.name = spec;
    DHP_CHECK(c.devices() == n, default_calibration_path(n), " was measured with ", c.devices(), " ranks, not ", n);
    return c;
  }
  else {
    std::string names;
    for (const auto& p : cluster_preset_names()) names += (names.empty() ? "" : ", ") + p;
    DHP_FAIL("unknown cluster '", spec, "'; known: ", names, ", each optionally xN for N devices (e.g. h100x8, ",
             "localx4: this machine as 4 ranks, from `dhp plan --calibrate --ranks 4`)");
  }
  c.name = spec;
  c.devices_per_node = std::min<int64_t>(8, n);
  c.nodes = (n + 7) / 8;
  DHP_CHECK(n <= 8 || n % 8 == 0, "cluster '", spec, "': more than 8 devices come in whole nodes of 8");
  return c;
}

Conventions conventions(const std::string& name) {
  Conventions cv;
  cv.name = name;
  if (name == "dhp") return cv;  // bf16 params and grads, fp32 masters and moments; logits at targets
  if (name == "reference") {
    // The Ray system's DeepSpeed config: bf16 master weights, gradients and optimizer states.
    cv.param_bytes = 2;
    cv.grad_bytes = 2;
    cv.optim_bytes = 4;  // Adam moments in bf16, no separate master
    cv.logits_all_positions = true;
    cv.logit_bytes = 12;  // bf16 logits, fp32 log-softmax saved, fp32 gradient
    cv.vision_fused_qkv = false;  // its vision attention has q_proj, k_proj, v_proj (each column-parallel)
    cv.zero3_units = false;
    cv.zero3_copy_passes = 0;
    cv.eager = true;       // eager PyTorch under Ray
    cv.dtensor_tp = true;  // its TP: parallelize_module with ColwiseParallel / RowwiseParallel
    cv.overlap = false;    // its numbers were measured as they ran: nothing modeled beyond them
    return cv;
  }
  if (name == "deepspeed") {
    // Qwen-VL's ZeRO-3 fine-tuning (HF Trainer + DeepSpeed, bf16): ZeRO's mixed-precision
    // Adam, 2 + 2 + K=12 bytes per parameter, all partitioned.
    cv.param_bytes = 2;
    cv.grad_bytes = 2;
    cv.optim_bytes = 12;
    cv.logits_all_positions = true;
    cv.logit_bytes = 12;
    cv.zero3_live_params = 1e9;        // stage3_max_live_parameters default
    cv.zero3_bucket_bytes = 5e8 * 2;   // reduce_bucket_size default (elements), bf16
    cv.zero3_units = false;
    cv.zero3_copy_passes = 0;
    cv.eager = true;  // eager PyTorch under HF Trainer
    cv.overlap = false;
    return cv;
  }
  DHP_FAIL("unknown conventions '", name, "'; known: dhp, reference, deepspeed");
}

Plan named_plan(const std::string& name, int64_t devices) {
  Plan p;
  p.name = name;
  if (name == "dhp") {
    p.vision = {S::kSequenceParallel, devices, 1};
    p.text = {S::kTensorParallel, devices, 1};
  } else if (name == "tp") {
    p.vision = {S::kTensorParallel, devices, 1};
    p.text = {S::kTensorParallel, devices, 1};
  } else if (name == "zero3") {
    p.vision = {S::kZero3, 1, devices};
    p.text = {S::kZero3, 1, devices};
  } else if (name == "dp") {
    p.vision = {S::kDataParallel, 1, devices};
    p.text = {S::kDataParallel, 1, devices};
  } else {
    DHP_FAIL("unknown named plan '", name, "'; known: dhp, tp, zero3, dp");
  }
  return p;
}

std::vector<Plan> candidate_plans(const Cluster& c, const std::string& conv) {
  const int64_t G = c.devices();
  auto module_options = [&](int64_t n, bool vision) {
    std::vector<ModuleStrategy> out;
    if (n == 1) {
      out.push_back({S::kNone, 1, 1});
      return out;
    }
    for (int64_t d = 2; d <= n; ++d) {
      if (n % d) continue;
      if (vision) out.push_back({S::kSequenceParallel, d, n / d});
      out.push_back({S::kTensorParallel, d, n / d});
    }
    out.push_back({S::kZero3, 1, n});
    out.push_back({S::kDataParallel, 1, n});
    return out;
  };
  std::vector<Plan> plans;
  for (const auto& vs : module_options(G, true)) {
    for (const auto& ts : module_options(G, false)) {
      Plan p;
      p.vision = vs;
      p.text = ts;
      p.conventions = conv;
      p.name = p.describe();
      plans.push_back(p);
    }
  }
  for (int64_t gv = 1; gv < G; ++gv) {
    for (const auto& vs : module_options(gv, true)) {
      for (const auto& ts : module_options(G - gv, false)) {
        Plan p;
        p.vision = vs;
        p.text = ts;
        p.disjoint = true;
        p.conventions = conv;
        p.name = p.describe();
        plans.push_back(p);
      }
    }
  }
  return plans;
}

std::vector<Estimate> search(const qwen::ModelConfig& m, const Cluster& c, const Workload& w, const std::string& conv,
                             std::vector<Estimate>* rejected) {
  std::vector<Estimate> ok;
  for (const auto& p : candidate_plans(c, conv)) {
    Estimate best;
    bool have = false;
    Estimate last_bad;
    for (int64_t mbs = 1; mbs <= w.batch_size; mbs *= 2) {
      if (w.batch_size % mbs) continue;
      if (!p.disjoint && mbs > 1) break;  // colocated: micro-batches only cost time (no overlap to gain)
      Workload wm = w;
      wm.micro_batches = mbs;
      auto e = estimate(m, c, wm, p);
      if (e.fits && (!have || e.step_s < best.step_s)) {
        best = e;
        have = true;
      } else if (!e.fits) {
        last_bad = e;
      }
    }
    if (have) ok.push_back(best);
    else if (rejected) rejected->push_back(last_bad);
  }
  std::sort(ok.begin(), ok.end(), [](const Estimate& a, const Estimate& b) { return a.step_s < b.step_s; });
  return ok;
}

}  // namespace dhp::plan
