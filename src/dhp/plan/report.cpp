#include "dhp/plan/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>

#include "dhp/core/error.h"
#include "dhp/core/memory.h"
#include "dhp/dist/layout.h"
#include "dhp/io/json.h"

namespace dhp::plan {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), f, v);
  return buf;
}

io::Json module_json(const ModuleCost& m) {
  io::Json j = io::Json::object();
  j.set("time_s", io::Json(m.time_s()));
  j.set("gemm_s", io::Json(m.gemm_s));
  j.set("attention_s", io::Json(m.attention_s));
  j.set("elementwise_s", io::Json(m.elementwise_s));
  j.set("comm_s", io::Json(m.comm_s));
  j.set("comm_calls", io::Json(m.comm_calls));
  j.set("ahead_calls", io::Json(m.ahead_calls));
  j.set("comm_bytes", io::Json(m.comm_bytes));
  j.set("sync_s", io::Json(m.sync_s));
  j.set("overlap_s", io::Json(m.overlap_s));
  j.set("hidden_s", io::Json(m.hidden_s));
  j.set("host_s", io::Json(m.host_s));
  j.set("optimizer_s", io::Json(m.optimizer_s));
  j.set("flops", io::Json(m.flops));
  j.set("state_bytes", io::Json(m.state_bytes));
  j.set("activation_bytes", io::Json(m.activation_bytes));
  j.set("working_bytes", io::Json(m.working_bytes));
  j.set("logits_bytes", io::Json(m.logits_bytes));
  j.set("gathered_bytes", io::Json(m.gathered_bytes));
  j.set("reduce_bytes", io::Json(m.reduce_bytes));
  j.set("input_bytes", io::Json(m.input_bytes));
  return j;
}

io::Json estimate_json(const Estimate& e) {
  io::Json j = io::Json::object();
  j.set("plan", io::Json(e.plan.describe()));
  j.set("conventions", io::Json(e.plan.conventions));
  j.set("batch_size", io::Json(e.workload.batch_size));
  j.set("micro_batches", io::Json(e.workload.micro_batches));
  j.set("fits", io::Json(e.fits));
  if (!e.reason.empty()) j.set("reason", io::Json(e.reason));
  if (e.step_s > 0) {
    j.set("throughput", io::Json(e.throughput));
    j.set("step_time_s", io::Json(e.step_s));
    j.set("memory_bytes", io::Json(e.memory_bytes));
    j.set("capacity_bytes", io::Json(e.capacity_bytes));
    j.set("redistribute_s", io::Json(e.redistribute_s));
    j.set("input_s", io::Json(e.input_s));
    j.set("step_sync_s", io::Json(e.step_sync_s));
    j.set("vision", module_json(e.vision));
    j.set("text", module_json(e.text));
  }
  return j;
}

// The plan of an `auto` row of dhp bench's results: its chosen parallel.* keys (as the
// launcher pins them: each module's strategy, ranks, sp / tp / dp) and training.micro_batches.
Plan plan_from_sets(const std::vector<std::string>& sets, const std::string& what, int64_t& micro_batches) {
  std::map<std::string, std::string> kv;
  for (const auto& s : sets) {
    const auto eq = s.find('=');
    DHP_CHECK(eq != std::string::npos, what, ": '", s, "' is not KEY=VALUE");
    kv[s.substr(0, eq)] = s.substr(eq + 1);
  }
  auto get = [&](const std::string& k) {
    auto it = kv.find(k);
    DHP_CHECK(it != kv.end(), what, ": the chosen keys have no ", k);
    return it->second;
  };
  auto ranks_of = [&](const std::string& k) {
    std::vector<int64_t> out;
    std::string cur;
    for (char c : get(k) + ",") {
      if (c >= '0' && c <= '9') {
        cur += c;
      } else if (c == ',' && !cur.empty()) {
        out.push_back(std::stoll(cur));
        cur.clear();
      }
    }
    return out;
  };
  Plan p;
  p.name = "chosen";
  std::vector<std::vector<int64_t>> ranks;
  for (const auto& [module, ms] : {std::pair<std::string, ModuleStrategy*>{"vision", &p.vision}, {"text", &p.text}}) {
    const std::string k = "parallel." + module + ".";
    ms->kind = dist::parse_strategy(get(k + "strategy"), what + " " + k + "strategy", dist::all_strategies());
    ranks.push_back(ranks_of(k + "ranks"));
    const auto n = static_cast<int64_t>(ranks.back().size());
    DHP_CHECK(n > 0, what, ": ", k, "ranks is empty");
    ms->degree = ms->kind == dist::Strategy::kSequenceParallel ? std::stoll(get(k + "sp"))
                 : ms->kind == dist::Strategy::kTensorParallel ? std::stoll(get(k + "tp"))
                                                                : 1;
    DHP_CHECK(ms->degree >= 1 && n % ms->degree == 0, what, ": ", module, " degree ", ms->degree, " does not divide its ",
              n, " ranks");
    ms->dp = n / ms->degree;
  }
  p.disjoint = std::none_of(ranks[0].begin(), ranks[0].end(), [&](int64_t r) {
    return std::find(ranks[1].begin(), ranks[1].end(), r) != ranks[1].end();
  });
  micro_batches = std::stoll(get("training.micro_batches"));
  return p;
}

}  // namespace

std::string strategy_conventions(const std::string& strategy, const std::string& conventions) {
  if (conventions != "reference") return conventions;
  return strategy == "zero3" ? "deepspeed" : "reference";
}

std::vector<StudyPoint> study(const qwen::ModelConfig& m, const Cluster& c, const StudyOptions& o) {
  DHP_CHECK(!o.vision_tokens.empty() && !o.batch_sizes.empty(), "dhp plan needs vision lengths and batch sizes");
  auto batches = o.batch_sizes;
  std::sort(batches.begin(), batches.end(), std::greater<int64_t>());
  std::vector<StudyPoint> out;
  for (int64_t vt : o.vision_tokens) {
    StudyPoint p;
    p.vision_tokens = vt;
    Workload w = o.workload;
    w.vision_tokens = vt;
    w.micro_batches = 1;
    for (const auto& name : o.strategies) {
      StrategyPoint sp;
      sp.name = name;
      Plan plan = named_plan(name, c.devices());
      plan.conventions = strategy_conventions(name, o.conventions);
      bool found = false, runnable = false;
      for (int64_t b : batches) {
        w.batch_size = b;
        auto e = estimate(m, c, w, plan);
        if (e.fits) {
          sp.estimate = e;
          found = true;
          break;
        }
        // When none fits, keep the smallest batch that runs (its memory tells by how much), else the
        // first reason.
        if (e.step_s > 0 || !runnable) sp.estimate = e;
        runnable = runnable || e.step_s > 0;
      }
      sp.oom = !found;
      p.strategies.push_back(sp);
    }
    // The search at every batch size; best = highest throughput.
    std::vector<Estimate> all;
    for (int64_t b : batches) {
      w.batch_size = b;
      auto ok = search(m, c, w, o.conventions,
                       b == batches.front() ? &p.rejected : nullptr);
      all.insert(all.end(), ok.begin(), ok.end());
    }
    std::stable_sort(all.begin(), all.end(), [](const Estimate& a, const Estimate& b) { return a.throughput > b.throughput; });
    for (const auto& e : all) {
      if (static_cast<int64_t>(p.best.size()) >= o.top) break;
      const bool dup = std::any_of(p.best.begin(), p.best.end(),
                                   [&](const Estimate& x) { return x.plan.describe() == e.plan.describe(); });
      if (!dup) p.best.push_back(e);
    }
    out.push_back(std::move(p));
  }
  return out;
}

std::string study_table(const std::string& model, const Cluster& c, const StudyOptions& o,
                        const std::vector<StudyPoint>& points) {
  std::ostringstream os;
  const auto& w = o.workload;
  os << "dhp plan: " << model << " on " << c.name << " (" << c.devices() << "x " << c.device << "), " << w.precision
     << (w.checkpointing ? ", activation checkpointing" : "") << ", " << w.images_per_sample
     << (w.temporal_patches > 1 ? " clip(s) of " + std::to_string(w.temporal_patches) + " temporal patches" : std::string(" image(s)"))
     << " + "
     << w.text_tokens << " text tokens per sample, conventions " << o.conventions << "\n";
  os << "predicted throughput = patches per image x batch / step time; (batch) = the largest of the batch sizes that "
        "fits; memory = the fullest device of "
     << fmt("%.1f", (c.memory_bytes - c.reserved_bytes) / kGiB) << " GiB usable\n";
  if (!c.eager_layer_host_s.empty()) {
    os << "eager PyTorch's host time per layer (forward + recomputation + backward; a module takes at least its "
          "layers' sum), measured on "
       << c.eager_host_source << ":";
    for (const auto& [k, v] : c.eager_layer_host_s) os << " " << k << " " << fmt("%.2f", v * 1e3) << " ms;";
    os << "\n";
  }
  os << "\n";
  os << "| patches |";
  for (const auto& s : o.strategies) os << " " << s << " patches/s (batch) | " << s << " step s | " << s << " GiB |";
  const bool ratio = std::find(o.strategies.begin(), o.strategies.end(), "dhp") != o.strategies.end() &&
                     std::find(o.strategies.begin(), o.strategies.end(), "tp") != o.strategies.end();
  if (ratio) os << " dhp/tp |";
  os << " best plan found | its patches/s (batch) |\n|---|";
  for (size_t i = 0; i < o.strategies.size(); ++i) os << "---|---|---|";
  if (ratio) os << "---|";
  os << "---|---|\n";
  for (const auto& p : points) {
    os << "| " << p.vision_tokens << " |";
    double dhp_t = 0, tp_t = 0;
    for (const auto& s : p.strategies) {
      const auto& e = s.estimate;
      if (s.oom) {
        os << " OOM | - | " << (e.memory_bytes > 0 ? fmt("%.1f", e.memory_bytes / kGiB) : std::string("-")) << " |";
        continue;
      }
      os << " " << fmt("%.0f", e.throughput) << " (" << e.workload.batch_size << ") | " << fmt("%.2f", e.step_s) << " | "
         << fmt("%.1f", e.memory_bytes / kGiB) << " |";
      if (s.name == "dhp") dhp_t = e.throughput;
      if (s.name == "tp") tp_t = e.throughput;
    }
    if (ratio) os << " " << (dhp_t > 0 && tp_t > 0 ? fmt("%.2f", dhp_t / tp_t) : std::string("-")) << " |";
    if (p.best.empty()) {
      os << " none fits | - |\n";
    } else {
      const auto& b = p.best.front();
      os << " " << b.plan.describe() << (b.workload.micro_batches > 1 ? ", " + std::to_string(b.workload.micro_batches) + " micro-batches" : "")
         << " | " << fmt("%.0f", b.throughput) << " (" << b.workload.batch_size << ") |\n";
    }
  }
  // Why the named strategies that do not fit do not.
  std::string notes;
  for (const auto& p : points) {
    for (const auto& s : p.strategies) {
      if (s.oom) notes += "- " + std::to_string(p.vision_tokens) + " patches, " + s.name + ": " + s.estimate.reason + "\n";
    }
  }
  if (!notes.empty()) os << "\n" << notes;
  return os.str();
}

std::string study_json(const std::string& model, const Cluster& c, const StudyOptions& o,
                       const std::vector<StudyPoint>& points) {
  io::Json root = io::Json::object();
  root.set("model", io::Json(model));
  io::Json cl = io::Json::object();
  cl.set("name", io::Json(c.name));
  cl.set("device", io::Json(c.device));
  cl.set("devices", io::Json(c.devices()));
  cl.set("memory_bytes", io::Json(c.memory_bytes));
  cl.set("reserved_bytes", io::Json(c.reserved_bytes));
  cl.set("source", io::Json(c.source));
  if (!c.eager_layer_host_s.empty()) {
    io::Json h = io::Json::object();
    for (const auto& [k, v] : c.eager_layer_host_s) h.set(k, io::Json(v));
    cl.set("eager_layer_host_s", h);
    cl.set("eager_host_source", io::Json(c.eager_host_source));
  }
  root.set("cluster", cl);
  io::Json wl = io::Json::object();
  wl.set("images_per_sample", io::Json(o.workload.images_per_sample));
  wl.set("temporal_patches", io::Json(o.workload.temporal_patches));
  wl.set("text_tokens", io::Json(o.workload.text_tokens));
  wl.set("target_tokens", io::Json(o.workload.target_tokens));
  wl.set("precision", io::Json(o.workload.precision));
  wl.set("checkpointing", io::Json(o.workload.checkpointing));
  wl.set("synthetic_data", io::Json(o.workload.synthetic_data));
  wl.set("conventions", io::Json(o.conventions));
  root.set("workload", wl);
  io::Json arr = io::Json::array();
  for (const auto& p : points) {
    io::Json jp = io::Json::object();
    jp.set("vision_tokens", io::Json(p.vision_tokens));
    io::Json st = io::Json::object();
    for (const auto& s : p.strategies) {
      auto j = estimate_json(s.estimate);
      j.set("oom", io::Json(s.oom));
      st.set(s.name, j);
    }
    jp.set("strategies", st);
    io::Json best = io::Json::array();
    for (const auto& e : p.best) best.push(estimate_json(e));
    jp.set("best", best);
    io::Json rej = io::Json::array();
    for (const auto& e : p.rejected) {
      io::Json r = io::Json::object();
      r.set("plan", io::Json(e.plan.describe()));
      r.set("reason", io::Json(e.reason));
      rej.push(r);
    }
    jp.set("rejected", rej);
    arr.push(jp);
  }
  root.set("points", arr);
  return root.dump(2) + "\n";
}

Validation validate(const qwen::ModelConfig& m, Cluster c, const Workload& base, const std::string& path,
                    bool memory_given) {
  std::ifstream f(path);
  DHP_CHECK(f.good(), "cannot read bench results ", path, " (dhp bench writes DIR/results.json)");
  std::stringstream ss;
  ss << f.rdbuf();
  const auto root = io::Json::parse(ss.str(), path);
  const auto& settings = root.at("settings", path);
  const int64_t nproc = settings.at("nproc", path + " settings").integer(path + " settings.nproc");
  if (const auto* lim = settings.find("memory_limit"); !memory_given && lim && lim->is_string() && !lim->str().empty()) {
    c.memory_bytes = static_cast<double>(parse_bytes(lim->str(), path + " settings.memory_limit"));
    c.reserved_bytes = 0;
  }
  DHP_CHECK(nproc == c.devices(), path, " was measured on ", nproc, " ranks but the cluster ", c.name, " has ",
            c.devices(), "; use --cluster localx", nproc);
  Validation v;
  std::map<int64_t, std::vector<const ValidationRow*>> by_length;
  for (const auto& p : root.at("points", path).elements(path + " points")) {
    const std::string what = path + " point";
    ValidationRow r;
    r.strategy = p.at("strategy", what).str(what + " strategy");
    r.vision_tokens = p.at("vision_tokens", what).integer(what + " vision_tokens");
    r.batch_size = p.at("batch_size", what).integer(what + " batch_size");
    r.measured_oom = p.at("oom", what).boolean(what + " oom");
    Workload w = base;
    w.vision_tokens = r.vision_tokens;
    // A clip's patches are over its temporal patches; a row without frames is of images
    // (whatever the workload it is estimated with says).
    const auto* frames = p.find("frames");
    w.temporal_patches = clip_temporal_patches(m.vision, frames ? frames->integer(what + " frames") : 0);
    w.micro_batches = 1;
    // A named strategy, or an `auto` row's recorded choice; a row with neither (the planner
    // found nothing to run) is listed, not validated.
    // A `--point NAME:...` row is estimated as the named combination its keys set
    // (parallel.strategy=dhp|tp|zero3|dp), with parallel.overlap as they set it.
    std::string named = r.strategy;
    bool overlap = true;
    if (const auto* row_sets = p.find("sets")) {
      for (const auto& e : row_sets->elements(what + " sets")) {
        const auto kv = e.str(what + " sets");
        if (kv.rfind("parallel.strategy=", 0) == 0) named = kv.substr(18);
        if (kv == "parallel.overlap=false") overlap = false;
      }
    }
    Plan plan;
    if (const auto* chosen = p.find("chosen_sets")) {
      std::vector<std::string> sets;
      for (const auto& e : chosen->elements(what + " chosen_sets")) sets.push_back(e.str(what + " chosen_sets"));
      plan = plan_from_sets(sets, what + " " + r.strategy, w.micro_batches);
    } else if (named == "dhp" || named == "tp" || named == "zero3" || named == "dp") {
      plan = named_plan(named, nproc);
    } else {
      v.not_validated.push_back(r.strategy + " at " + std::to_string(r.vision_tokens) + " patches");
      continue;
    }
    plan.overlap = overlap;
    r.layout = plan.describe() + ", " + std::to_string(w.micro_batches) + " micro-batch" +
               (w.micro_batches == 1 ? "" : "es") + (overlap ? "" : ", overlap off");
    if (r.measured_oom) {
      // Nothing ran: does the model agree that no batch tried runs? Shown: the smallest batch
      // the plan can run at all (a replica needs a sample) and its predicted memory.
      std::vector<int64_t> tried;
      for (const auto& b : settings.at("batch_sizes", what).elements(what)) tried.push_back(b.integer(what));
      std::sort(tried.begin(), tried.end());
      r.predicted_oom = true;
      r.batch_size = tried.empty() ? 1 : tried.front();
      bool shown = false;
      for (int64_t b : tried) {
        w.batch_size = b;
        const auto e = estimate(m, c, w, plan);
        r.predicted_oom = r.predicted_oom && !e.fits;
        if (!shown && e.memory_bytes > 0) {
          r.batch_size = b;
          r.predicted_bytes = e.memory_bytes;
          shown = true;
        }
      }
    } else {
      w.batch_size = r.batch_size;
      r.measured_s = p.at("step_time_s", what).number(what + " step_time_s");
      r.measured_min_s = r.measured_max_s = r.measured_s;
      if (const auto* rounds = p.find("round_step_time_s")) {
        for (const auto& t : rounds->elements(what + " round_step_time_s")) {
          const double x = t.number(what + " round_step_time_s");
          r.measured_min_s = std::min(r.measured_min_s, x);
          r.measured_max_s = std::max(r.measured_max_s, x);
        }
      }
      double peak = 0;
      for (const auto& b : p.at("peak_bytes_per_rank", what).elements(what)) peak = std::max(peak, b.number(what));
      r.measured_peak_bytes = peak;
      const auto e = estimate(m, c, w, plan);
      r.predicted_s = e.step_s;
      r.predicted_oom = !e.fits;
      r.predicted_bytes = e.memory_bytes;
    }
    v.rows.push_back(r);
  }
  for (const auto& r : v.rows) by_length[r.vision_tokens].push_back(&r);
  std::ostringstream os;
  os << "| strategy | patches | batch | measured s | predicted s | error | measured peak MiB | predicted MiB |\n"
        "|---|---|---|---|---|---|---|---|\n";
  double sum_abs = 0;
  int64_t n = 0;
  for (const auto& r : v.rows) {
    os << "| " << r.strategy << " | " << r.vision_tokens << " | " << r.batch_size << " | ";
    if (r.measured_oom) {
      os << "OOM | " << (r.predicted_oom ? "OOM" : "fits") << " | " << (r.predicted_oom ? "agrees" : "MISS") << " | - | "
         << fmt("%.0f", r.predicted_bytes / 1048576.0) << " |\n";
      continue;
    }
    os << fmt("%.3f", r.measured_s)
       << (r.measured_max_s > r.measured_min_s
               ? " [" + fmt("%.3f", r.measured_min_s) + "-" + fmt("%.3f", r.measured_max_s) + "]"
               : "")
       << " | " << fmt("%.3f", r.predicted_s) << (r.predicted_oom ? " (predicted OOM)" : "")
       << " | " << fmt("%+.0f%%", 100 * r.error()) << " | " << fmt("%.0f", r.measured_peak_bytes / 1048576.0) << " | "
       << fmt("%.0f", r.predicted_bytes / 1048576.0) << " |\n";
    sum_abs += std::fabs(r.error());
    if (std::fabs(r.error()) <= 0.2) ++v.within_20;
    ++n;
  }
  os << "\nranking of the strategies by throughput at each length (measured / predicted):\n";
  for (auto& [len, rows] : by_length) {
    // Order: runnable ones by step time (same batch per strategy as measured), OOM last.
    auto order = [&](bool predicted) {
      std::vector<const ValidationRow*> r = rows;
      auto key = [&](const ValidationRow* x) {
        const bool oom = predicted ? x->predicted_oom : x->measured_oom;
        const double t = predicted ? x->predicted_s : x->measured_s;
        return oom ? 1e30 : static_cast<double>(x->vision_tokens * x->batch_size) / -std::max(t, 1e-12);
      };
      std::stable_sort(r.begin(), r.end(), [&](auto* a, auto* b) { return key(a) < key(b); });
      std::string s;
      for (auto* x : r) s += (s.empty() ? "" : " > ") + x->strategy;
      return s;
    };
    const auto meas = order(false), pred = order(true);
    ++v.lengths;
    if (meas == pred) ++v.rankings_matched;
    os << "- " << len << " patches: " << meas << " / " << pred << (meas == pred ? " (same)" : " (DIFFERENT)");
    // Pairs that ran: measured apart by more than the tie margin, does the model agree?
    std::string ties, overlaps, same;
    for (size_t i = 0; i < rows.size(); ++i) {
      for (size_t j = i + 1; j < rows.size(); ++j) {
        const auto *a = rows[i], *b = rows[j];
        if (a->measured_oom || b->measured_oom) continue;
        const double ma = static_cast<double>(a->batch_size) / a->measured_s, mb = static_cast<double>(b->batch_size) / b->measured_s;
        if (a->layout == b->layout && a->batch_size == b->batch_size) {  // one configuration measured twice
          same += (same.empty() ? "" : ", ") + a->strategy + " = " + b->strategy + fmt(" (%.1f%% apart)", 100 * std::fabs(ma / mb - 1));
          continue;
        }
        if (std::fabs(ma / mb - 1) * 100 <= Validation::kTiePercent) {
          ties += (ties.empty() ? "" : ", ") + a->strategy + " ~ " + b->strategy + fmt(" (%.1f%%)", 100 * std::fabs(ma / mb - 1));
          continue;
        }
        // Rounds: throughput ranges batch / slowest .. batch / fastest; overlapping ones are not
        // told apart by the measurement either.
        const double lo_a = static_cast<double>(a->batch_size) / a->measured_max_s;
        const double hi_a = static_cast<double>(a->batch_size) / a->measured_min_s;
        const double lo_b = static_cast<double>(b->batch_size) / b->measured_max_s;
        const double hi_b = static_cast<double>(b->batch_size) / b->measured_min_s;
        if (lo_a <= hi_b && lo_b <= hi_a) {
          overlaps += (overlaps.empty() ? "" : ", ") + a->strategy + " ~ " + b->strategy;
          continue;
        }
        ++v.decisive_pairs;
        const double pa = a->predicted_oom ? 0 : static_cast<double>(a->batch_size) / a->predicted_s;
        const double pb = b->predicted_oom ? 0 : static_cast<double>(b->batch_size) / b->predicted_s;
        if ((ma > mb) == (pa > pb)) ++v.decisive_matched;
      }
    }
    os << (ties.empty() ? "" : "; measured within " + fmt("%.0f%%", Validation::kTiePercent) + ": " + ties)
       << (overlaps.empty() ? "" : "; rounds' ranges overlap: " + overlaps)
       << (same.empty() ? "" : "; the same layout: " + same) << "\n";
  }
  os << "\nmean |error| " << fmt("%.0f%%", n ? 100 * sum_abs / static_cast<double>(n) : 0.0) << " over " << n
     << " points, " << v.within_20 << " within 20%; rankings matched at " << v.rankings_matched << " of " << v.lengths
     << " lengths; pairs of strategies measured more than " << fmt("%.0f%%", Validation::kTiePercent)
     << " apart (and, with rounds, their ranges apart) ordered as measured: " << v.decisive_matched << " of " << v.decisive_pairs << "\n";
  if (!v.not_validated.empty()) {
    os << "not validated (neither a named strategy nor a recorded choice):";
    for (const auto& x : v.not_validated) os << " " << x << ";";
    os << "\n";
  }
  v.table = os.str();
  return v;
}

}  // namespace dhp::plan
