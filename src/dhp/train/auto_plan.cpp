#include "dhp/train/auto_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>

#include "dhp/core/error.h"
#include "dhp/core/memory.h"
#include "dhp/data/shapes.h"
#include "dhp/plan/calibration.h"
#include "dhp/plan/cost_model.h"
#include "dhp/train/layouts.h"

namespace dhp::train {

std::string auto_calibration_path(int64_t world) { return plan::default_calibration_path(world); }

std::pair<int64_t, int64_t> shapes_text_tokens(const Config& cfg) {
  const auto& m = cfg.model.config;
  data::ShapesOptions so;
  so.min_side = so.max_side = 112;
  data::ShapesDataset ds(m, so);
  int64_t text = 0, targets = 0;
  const int n = 64;
  for (int i = 0; i < n; ++i) {
    const auto s = ds.get(i, false);
    int64_t image = 0;
    for (const auto& g : s.grids) image += g[0] * g[1] * g[2] / (m.vision.spatial_merge_size * m.vision.spatial_merge_size);
    text += static_cast<int64_t>(s.ids.size()) - image;
    targets += data::num_targets(s);
  }
  return {(text + n / 2) / n, std::max<int64_t>(1, (targets + n / 2) / n)};
}

int64_t clip_frames(const Config& cfg) { return cfg.data.dataset == "shapes" ? cfg.data.frames : 0; }

void apply_runtime(const Config& cfg, plan::Cluster& c, plan::Workload& w) {
  if (c.attention_block > 0) c.attention_block = cfg.training.attention_block;
  w.synthetic_data = cfg.data.dataset == "shapes";
  w.reduce_bucket_bytes = cfg.parallel.bucket_mb * (1 << 20);
  w.reduce_buckets_in_flight = cfg.parallel.buckets_in_flight;
}

std::string micro_batches_phrase(int64_t m) {
  return std::to_string(m) + " micro-batch" + (m == 1 ? "" : "es");
}

std::vector<int64_t> auto_micro_batches(const Config& cfg) {
  if (cfg.data.pack_tokens > 0) return {cfg.training.micro_batches};
  std::vector<int64_t> out;
  for (int64_t m = 1; m <= cfg.data.batch_size; m *= 2)
    if (cfg.data.batch_size % m == 0) out.push_back(m);
  if (std::find(out.begin(), out.end(), cfg.training.micro_batches) == out.end()) {
    out.push_back(cfg.training.micro_batches);
  }
  return out;
}

namespace {

// This machine as `world` ranks (its calibration), with training.memory_limit as the device memory.
plan::Cluster auto_cluster(const Config& cfg, int64_t world) {
  auto c = plan::cluster_preset("localx" + std::to_string(world));
  if (const int64_t limit = parse_bytes(cfg.training.memory_limit, "training.memory_limit"); limit > 0) {
    c.memory_bytes = static_cast<double>(limit);
    c.reserved_bytes = 0;
  }
  return c;
}

// The workload: the typical image of the data (its side in px in `side`), its text, the
// configured batch.
plan::Workload auto_workload(const Config& cfg, int64_t& side) {
  const auto& m = cfg.model.config;
  const int64_t unit = m.vision.patch_size * m.vision.spatial_merge_size;
  plan::Workload w;
  if (cfg.data.dataset == "shapes") {
    side = unit * std::max<int64_t>(1, std::llround(0.5 * static_cast<double>(cfg.data.min_side + cfg.data.max_side) /
                                                    static_cast<double>(unit)));
    std::tie(w.text_tokens, w.target_tokens) = shapes_text_tokens(cfg);
  } else {  // llava: the largest image the processor makes (the memory bound), 64 text tokens
    side = unit * std::max<int64_t>(1, static_cast<int64_t>(std::sqrt(static_cast<double>(cfg.data.max_pixels))) / unit);
  }
  const int64_t patches_side = side / m.vision.patch_size;
  // The moving task: a clip of data.frames frames of that side.
  w.temporal_patches = plan::clip_temporal_patches(m.vision, clip_frames(cfg));
  w.vision_tokens = patches_side * patches_side * w.temporal_patches;
  w.batch_size = cfg.data.pack_tokens > 0 ? std::max<int64_t>(1, cfg.data.pack_tokens / std::max<int64_t>(1, w.tokens_per_sample(m.vision.spatial_merge_size))) * cfg.training.micro_batches
                                          : cfg.data.batch_size;
  w.micro_batches = cfg.training.micro_batches;
  w.precision = cfg.training.precision;
  w.checkpointing = cfg.training.activation_checkpointing;
  w.freezing = cfg.model.freezing;
  w.lora = cfg.lora.spec();
  return w;
}

// A planned module strategy as the config's parallel.<module> options on ranks first, first+1, ...
ModuleParallelOptions to_options(const plan::ModuleStrategy& s, int64_t first) {
  using S = dist::Strategy;
  ModuleParallelOptions o;
  o.strategy = dist::strategy_name(s.kind);
  if (s.kind == S::kSequenceParallel) o.sp = s.degree;
  if (s.kind == S::kTensorParallel) o.tp = s.degree;
  if (s.kind == S::kSequenceParallel || s.kind == S::kTensorParallel) o.dp = s.dp;
  for (int64_t r = 0; r < s.ranks(); ++r) o.ranks.push_back(first + r);
  return o;
}

// A plan and its micro-batch count, as the log says them.
std::string auto_choice(const plan::Estimate& e) {
  return e.plan.describe() + ", " + micro_batches_phrase(e.workload.micro_batches);
}

// The lines of resolve_auto's `why`: the choice, the runners-up, the rejections, the workload.
std::string explain(const plan::Estimate& e, const std::vector<plan::Estimate>& ok, int64_t world, int64_t rejected,
                    const std::string& reasons, const std::string& refused, const plan::Workload& w, int64_t side) {
  char line[384];
  std::snprintf(line, sizeof(line),
                "parallel.strategy=auto on %lld ranks (%s): %s, predicted %.3f s/step, %.0f MiB per rank (of %.0f)",
                static_cast<long long>(world), auto_calibration_path(world).c_str(), auto_choice(e).c_str(),
                e.step_s, e.memory_bytes / 1048576.0, e.capacity_bytes / 1048576.0);
  std::string why = line;
  int shown = 0;
  for (const auto& r : ok) {
    if (&r == &e || shown == 3) continue;
    std::snprintf(line, sizeof(line), "\n  then %s: %.3f s/step (%+.0f%%)", auto_choice(r).c_str(), r.step_s,
                  100 * (r.step_s / e.step_s - 1));
    why += line;
    ++shown;
  }
  if (rejected) why += "\n  " + std::to_string(rejected) + " plan(s) rejected: " + reasons;
  if (!refused.empty()) why += "\n  skipped (the runtime refused): " + refused;
  const std::string per = w.temporal_patches > 1 ? "clip (" + std::to_string(w.temporal_patches) + " temporal patches of"
                                                 : "image (";
  std::snprintf(line, sizeof(line), "\n  workload: %lld patches per %s %lld px), %lld text tokens, batch %lld, %s%s",
                static_cast<long long>(w.vision_tokens), per.c_str(), static_cast<long long>(side),
                static_cast<long long>(w.text_tokens), static_cast<long long>(w.batch_size), w.precision.c_str(),
                w.checkpointing ? ", activation checkpointing" : "");
  return why + line;
}

}  // namespace

Config resolve_auto(const Config& cfg, int64_t world, std::string* why) {
  if (parse_combination(cfg.parallel.strategy) != Combination::kAuto) return cfg;
  Config out = cfg;
  auto& p = out.parallel;
  p.vision = ModuleParallelOptions();
  p.text = ModuleParallelOptions();
  if (world == 1) {
    p.strategy = "none";
    if (why) *why = "parallel.strategy=auto on one rank: none";
    return out;
  }
  auto c = auto_cluster(cfg, world);
  int64_t side = 0;
  auto w = auto_workload(cfg, side);
  apply_runtime(cfg, c, w);
  std::vector<plan::Estimate> ok;
  std::map<std::string, int64_t> reasons;
  for (const auto& cand : plan::candidate_plans(c, "dhp")) {
    // Each plan at its fastest micro-batch count that fits (packing: the configured count,
    // which sets the global batch).
    plan::Estimate best, last_bad;
    bool have = false;
    for (const auto mbs : auto_micro_batches(cfg)) {
      auto wm = w;
      wm.micro_batches = mbs;
      auto e = plan::estimate(cfg.model.config, c, wm, cand);
      if (e.fits && (!have || e.step_s < best.step_s)) {
        best = e;
        have = true;
      } else if (!e.fits) {
        last_bad = e;
      }
    }
    if (!have) {
      const auto key = last_bad.reason.substr(0, last_bad.reason.find(':'));
      ++reasons[key.size() < 60 ? key : last_bad.reason.substr(0, 60)];
      continue;
    }
    ok.push_back(best);
  }
  std::stable_sort(ok.begin(), ok.end(), [](const plan::Estimate& a, const plan::Estimate& b) { return a.step_s < b.step_s; });
  int64_t rejected = 0;  // by the cost model, summarised by reason
  std::string reasons_list;
  for (const auto& [k, n] : reasons) {
    rejected += n;
    reasons_list += (reasons_list.empty() ? "" : "; ") + std::to_string(n) + "x " + k;
  }
  std::string rejected_by_dhp;
  for (const auto& e : ok) {
    Config trial = out;
    trial.parallel.strategy = "custom";
    trial.parallel.vision = to_options(e.plan.vision, 0);
    trial.parallel.text = to_options(e.plan.text, e.plan.disjoint ? e.plan.vision.ranks() : 0);
    trial.training.micro_batches = e.workload.micro_batches;
    try {
      resolve_layouts(trial, world);  // what the planner allows, the runtime must too
    } catch (const Error& err) {
      if (rejected_by_dhp.empty()) rejected_by_dhp = e.plan.describe() + ": " + err.what();
      continue;
    }
    if (why) *why = explain(e, ok, world, rejected, reasons_list, rejected_by_dhp, w, side);
    return trial;
  }
  DHP_FAIL("parallel.strategy=auto: no plan fits ", world, " ranks of this machine (", reasons_list,
           rejected_by_dhp.empty() ? std::string() : "; " + rejected_by_dhp,
           "); lower data.batch_size, raise training.memory_limit or enable activation checkpointing");
}

std::vector<std::string> pinned_parallel_sets(const Config& cfg) {
  std::vector<std::string> out = {"parallel.strategy=" + cfg.parallel.strategy};
  for (const auto& [name, m] : {std::pair<const char*, const ModuleParallelOptions*>{"vision", &cfg.parallel.vision},
                                {"text", &cfg.parallel.text}}) {
    const std::string k = std::string("parallel.") + name + ".";
    out.push_back(k + "strategy=" + (m->strategy.empty() ? "\"\"" : m->strategy));
    out.push_back(k + "ranks=" + detail::to_yaml_text(m->ranks));
    out.push_back(k + "sp=" + std::to_string(m->sp));
    out.push_back(k + "tp=" + std::to_string(m->tp));
    out.push_back(k + "dp=" + std::to_string(m->dp));
    out.push_back(k + "zero=" + std::to_string(m->zero));
  }
  out.push_back("training.micro_batches=" + std::to_string(cfg.training.micro_batches));
  return out;
}

}  // namespace dhp::train
