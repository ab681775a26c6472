#include "dhp/bench/bench.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "dhp/bench/calibrate.h"
#include "dhp/bench/report.h"
#include "dhp/core/error.h"
#include "dhp/core/machine.h"
#include "dhp/plan/cost_model.h"
#include "dhp/train/auto_plan.h"
#include "dhp/train/config.h"
#include "dhp/train/metrics.h"
#include "dhp/train/parallel_model.h"

namespace dhp::bench {
namespace {

namespace fs = std::filesystem;

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s + sep) {
    if (c != sep) {
      cur += c;
    } else if (!cur.empty()) {
      out.push_back(cur);
      cur.clear();
    }
  }
  return out;
}

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / static_cast<double>(v.size());
}

// Runs `binary` with argv, stdout and stderr into `log`; returns the wait status.
int run_logged(const std::string& binary, const std::vector<std::string>& argv, const fs::path& log) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = ::fork();
  DHP_CHECK(pid >= 0, "fork failed: ", std::strerror(errno));
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      ::close(fd);
    }
    ::execv(binary.c_str(), args.data());
    std::fprintf(stderr, "dhp bench: cannot run %s: %s\n", binary.c_str(), std::strerror(errno));
    ::_exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return status;
}

// The job's error: the launcher's "rank R failed" line, else the last line naming an error.
std::string job_error(const fs::path& log) {
  std::ifstream f(log);
  std::string line, failed, error;
  while (std::getline(f, line)) {
    if (line.find("failed (") != std::string::npos) failed = line;
    if (line.find("error") != std::string::npos) error = line;
  }
  if (!failed.empty()) return failed;
  return error.empty() ? "failed; see " + log.string() : error;
}

std::string fmt_eta(double s) {
  char buf[32];
  const int t = static_cast<int>(s + 0.5);
  std::snprintf(buf, sizeof(buf), "%dm%02ds", t / 60, t % 60);
  return buf;
}

}  // namespace

double RunMetrics::comm_fraction() const { return step_time_s > 0 ? mean(comm_s_per_rank) / step_time_s : 0; }

double RunMetrics::idle_fraction(const std::vector<int64_t>& ranks) const {
  return step_time_s > 0 ? mean_over(idle_s_per_rank, ranks) / step_time_s : 0;
}

double RunMetrics::stall_fraction(const std::vector<int64_t>& ranks) const {
  if (step_time_s <= 0 || vision_s_per_rank.empty()) return 0;
  double s = 0;
  int64_t n = 0;
  for (auto r : ranks) {
    const auto k = static_cast<size_t>(r);
    if (r < 0 || k >= vision_s_per_rank.size() || k >= text_s_per_rank.size() || k >= update_s_per_rank.size() ||
        k >= comm_s_per_rank.size()) {
      continue;
    }
    const double work = vision_s_per_rank[k] + text_s_per_rank[k] + update_s_per_rank[k] - comm_s_per_rank[k];
    s += std::max(0.0, step_time_s - work);
    ++n;
  }
  return n ? s / static_cast<double>(n) / step_time_s : 0;
}

double RunMetrics::mean_over(const std::vector<double>& per_rank, const std::vector<int64_t>& ranks) {
  double s = 0;
  int64_t n = 0;
  for (auto r : ranks) {
    if (r < 0 || r >= static_cast<int64_t>(per_rank.size())) continue;
    s += per_rank[static_cast<size_t>(r)];
    ++n;
  }
  return n ? s / static_cast<double>(n) : 0;
}

double RunMetrics::breakdown_fraction(size_t k) const {
  if (k >= breakdown_per_rank.size() || breakdown_per_rank[k].empty()) return 0;
  double sum = 0;
  const size_t ranks = breakdown_per_rank[k].size();
  for (size_t r = 0; r < ranks; ++r) {
    double total = 0;
    for (const auto& part : breakdown_per_rank) total += r < part.size() ? part[r] : 0;
    if (total > 0) sum += breakdown_per_rank[k][r] / total;
  }
  return sum / static_cast<double>(ranks);
}

double RunMetrics::max_peak_bytes() const {
  return peak_bytes_per_rank.empty() ? 0 : *std::max_element(peak_bytes_per_rank.begin(), peak_bytes_per_rank.end());
}

const char* outcome_name(Outcome o) {
  switch (o) {
    case Outcome::kOk: return "ok";
    case Outcome::kOom: return "oom";
    case Outcome::kInvalid: return "invalid";
    case Outcome::kFailed: return "failed";
  }
  return "?";
}

double PointResult::throughput() const {
  if (!ok() || metrics.step_time_s <= 0) return 0;
  if (mixed()) return metrics.patches_per_step / metrics.step_time_s;
  return static_cast<double>(vision_tokens * batch_size) / metrics.step_time_s;
}

std::vector<Point> parse_points(const std::string& strategies, const std::vector<std::string>& custom) {
  std::vector<Point> out;
  for (const auto& s : split(strategies, ',')) out.push_back({s, {"parallel.strategy=" + s}});
  for (const auto& c : custom) {
    const auto colon = c.find(':');
    DHP_CHECK(colon != std::string::npos && colon > 0, "--point '", c,
              "' must be NAME:KEY=VALUE[;KEY=VALUE...], e.g. 'seq:parallel.pipeline=false'");
    Point p{c.substr(0, colon), split(c.substr(colon + 1), ';')};
    for (const auto& kv : p.sets) {
      DHP_CHECK(kv.find('=') != std::string::npos, "--point '", c, "': '", kv, "' is not KEY=VALUE");
    }
    for (const auto& kv : p.sets) {
      const auto key = kv.substr(0, kv.find('='));
      for (const char* reserved :
           {"data.batch_size", "data.min_side", "data.max_side", "training.steps", "training.profile_every"}) {
        DHP_CHECK(key != reserved, "--point '", c, "' sets ", key, ", which the sweep controls (use --batch-sizes, ",
                  "--vision-tokens, --steps)");
      }
    }
    out.push_back(p);
  }
  DHP_CHECK(!out.empty(), "nothing to measure: give --strategies and/or --point");
  for (size_t i = 0; i < out.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      DHP_CHECK(out[i].name != out[j].name, "two points are named '", out[i].name, "'");
  return out;
}

int64_t image_side_for(int64_t vision_tokens, int64_t patch_size, int64_t merge_size) {
  const auto grid = static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(std::max<int64_t>(0, vision_tokens)))));
  DHP_CHECK(vision_tokens > 0 && grid * grid == vision_tokens && grid % merge_size == 0, "vision tokens ",
            vision_tokens, " is not the square of a multiple of ", merge_size, " patches (e.g. ",
            4 * merge_size * merge_size * 16, " = ", 4 * merge_size, "x", 4 * merge_size,
            "): images are squares of whole ", merge_size, "x", merge_size, " merge windows");
  return grid * patch_size;
}

void search_batch(std::vector<int64_t> batch_sizes, const std::function<Attempt(int64_t)>& run, PointResult& r) {
  std::sort(batch_sizes.begin(), batch_sizes.end(), std::greater<int64_t>());
  batch_sizes.erase(std::unique(batch_sizes.begin(), batch_sizes.end()), batch_sizes.end());
  DHP_CHECK(!batch_sizes.empty(), "no batch size to try");
  for (auto b : batch_sizes) {
    DHP_CHECK(b >= 1, "batch size ", b, " must be >= 1");
    Attempt a = run(b);
    a.batch_size = b;
    r.attempts.push_back(a);
    if (a.outcome == Outcome::kOk) {
      r.batch_size = b;
      r.metrics = a.metrics;
      r.chosen_sets = a.chosen_sets;
      r.oom = false;
      r.error.clear();
      return;
    }
  }
  r.batch_size = 0;
  r.oom = std::any_of(r.attempts.begin(), r.attempts.end(), [](const Attempt& a) { return a.outcome == Outcome::kOom; });
  // The reason to show: the first real failure, else the smallest batch's refusal.
  r.error.clear();
  for (const auto& a : r.attempts)
    if (a.outcome == Outcome::kFailed && r.error.empty()) r.error = a.message;
  if (r.error.empty() && !r.oom) r.error = r.attempts.back().message;
}

RunMetrics read_metrics(const std::string& path, int64_t warmup) {
  std::ifstream f(path);
  DHP_CHECK(f.good(), "no metrics at ", path);
  RunMetrics r;
  std::string line;
  std::vector<double> step_s, patches_s, tokens_s, flops, patches;
  std::vector<std::vector<double>> comm, busy, idle, vision, text, update;
  std::vector<double> samples;
  auto add = [](std::vector<std::vector<double>>& to, const std::vector<double>& v) {
    if (to.size() < v.size()) to.resize(v.size());
    for (size_t k = 0; k < v.size(); ++k) to[k].push_back(v[k]);
  };
  int64_t lineno = 0;
  while (std::getline(f, line)) {
    ++lineno;
    if (line.empty()) continue;
    YAML::Node n;
    try {
      n = YAML::Load(line);
      if (n["step"].as<int64_t>() <= warmup) continue;
      if (n["breakdown_per_rank"]) {  // slowed down by the profiler: apart from the averages
        r.breakdown_per_rank.clear();
        for (const char* part : train::kBreakdownParts)
          r.breakdown_per_rank.push_back(n["breakdown_per_rank"][part].as<std::vector<double>>());
        continue;
      }
      step_s.push_back(n["step_time_s"].as<double>());
      patches_s.push_back(n["patches_per_s"].as<double>());
      tokens_s.push_back(n["tokens_per_s"].as<double>());
      flops.push_back(n["model_flops"].as<double>());
      if (n["patches"]) patches.push_back(n["patches"].as<double>());
      const auto peak = n["peak_bytes_per_rank"].as<std::vector<double>>();
      if (r.peak_bytes_per_rank.size() < peak.size()) r.peak_bytes_per_rank.resize(peak.size(), 0);
      for (size_t k = 0; k < peak.size(); ++k) r.peak_bytes_per_rank[k] = std::max(r.peak_bytes_per_rank[k], peak[k]);
      add(comm, n["comm_s_per_rank"].as<std::vector<double>>());
      add(busy, n["busy_s_per_rank"].as<std::vector<double>>());
      add(idle, n["idle_s_per_rank"].as<std::vector<double>>());
      // Written since the per-module timers exist; older metrics files lack them.
      if (n["vision_s_per_rank"]) add(vision, n["vision_s_per_rank"].as<std::vector<double>>());
      if (n["text_s_per_rank"]) add(text, n["text_s_per_rank"].as<std::vector<double>>());
      if (n["update_s_per_rank"]) add(update, n["update_s_per_rank"].as<std::vector<double>>());
      if (n["samples_s"]) samples.push_back(n["samples_s"].as<double>());
    } catch (const YAML::Exception& e) {
      DHP_FAIL(path, ":", lineno, ": not a metrics line (", e.what(), ")");
    }
  }
  DHP_CHECK(!step_s.empty(), path, " has no step after the ", warmup, " warm-up steps");
  r.steps_measured = static_cast<int64_t>(step_s.size());
  r.step_time_s = mean(step_s);
  r.patches_per_s = mean(patches_s);
  r.tokens_per_s = mean(tokens_s);
  r.model_flops = mean(flops);
  r.patches_per_step = mean(patches);
  for (auto& c : comm) r.comm_s_per_rank.push_back(mean(c));
  for (auto& b : busy) r.busy_s_per_rank.push_back(mean(b));
  for (auto& i : idle) r.idle_s_per_rank.push_back(mean(i));
  for (auto& v : vision) r.vision_s_per_rank.push_back(mean(v));
  for (auto& t : text) r.text_s_per_rank.push_back(mean(t));
  for (auto& u : update) r.update_s_per_rank.push_back(mean(u));
  if (!samples.empty()) r.samples_s = mean(samples);
  return r;
}

void keep_median_round(PointResult& r, const std::vector<RunMetrics>& rounds) {
  DHP_CHECK(!rounds.empty(), "point ", r.name, " at ", r.vision_tokens, " patches has no round to keep");
  std::vector<size_t> order(rounds.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = k;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return rounds[a].step_time_s < rounds[b].step_time_s; });
  r.metrics = rounds[order[(order.size() - 1) / 2]];
  r.round_step_s.clear();
  for (const auto& m : rounds) r.round_step_s.push_back(m.step_time_s);
}

namespace {

// The point at one vision length, before any try: its keys and sizes.
PointResult make_point(const Options& o, const Point& p, int64_t tokens, int64_t side, const qwen::VisionConfig& vc) {
  PointResult r;
  r.name = p.name;
  r.frames = o.frames;
  r.vision_tokens = tokens * plan::clip_temporal_patches(vc, o.frames);
  r.image_side = side;
  if (o.mixed_max_side > 0) {
    r.vision_tokens = 0;
    r.image_side = o.mixed_min_side;
    r.max_side = o.mixed_max_side;
  }
  r.sets = o.sets;
  r.sets.insert(r.sets.end(), p.sets.begin(), p.sets.end());
  if (o.frames > 0) r.sets.push_back("data.frames=" + std::to_string(o.frames));
  for (const auto& s : {"data.min_side=" + std::to_string(r.image_side),
                        "data.max_side=" + std::to_string(r.mixed() ? r.max_side : r.image_side),
                        // One more step, profiled (the breakdown), after the measured ones.
                        "training.steps=" + std::to_string(o.steps + 1),
                        "training.profile_every=" + std::to_string(o.steps + 1), std::string("data.eval_samples=0"),
                        std::string("checkpoint.at_end=false")}) {
    r.sets.push_back(s);
  }
  if (!o.memory_limit.empty()) r.sets.push_back("training.memory_limit=" + o.memory_limit);
  return r;
}

// One try of `r` at `batch`: refused before it starts when the layout cannot take the
// batch, else a `dhp train` job in OUT/runs/<point>_<tokens>_b<batch><suffix>. Fills r's layout.
Attempt try_batch(const Options& o, PointResult& r, int64_t batch, const std::string& progress,
                  const std::string& suffix = "") {
  Attempt a;
  auto sets = r.sets;
  sets.push_back("data.batch_size=" + std::to_string(batch));
  std::string auto_why;
  try {
    auto cfg = load_config(o.config, sets);
    const bool chosen = parse_combination(cfg.parallel.strategy) == Combination::kAuto;
    if (chosen) {
      // The planner's layout and micro-batch count for this point and batch (refused when
      // none fits), pinned for the job as the launcher pins it.
      cfg = train::resolve_auto(cfg, o.nproc, &auto_why);
      a.chosen_sets = train::pinned_parallel_sets(cfg);
      sets.insert(sets.end(), a.chosen_sets.begin(), a.chosen_sets.end());
    }
    const auto layouts = train::resolve_layouts(cfg, o.nproc);
    r.layout = train::describe(layouts);
    if (chosen) r.layout = "auto: " + r.layout + ", " + train::micro_batches_phrase(cfg.training.micro_batches);
    r.vision_ranks = layouts.at("vision").ranks;
    r.text_ranks = layouts.at("text").ranks;
  } catch (const Error& e) {
    a.outcome = Outcome::kInvalid;
    a.message = e.what();
    return a;
  }
  if (!o.quiet) std::fprintf(stderr, "%s, batch %lld\n", progress.c_str(), static_cast<long long>(batch));
  const fs::path dir =
      fs::path(o.out) / "runs" /
      (r.name + "_" + (r.mixed() ? std::string("mixed") : std::to_string(r.vision_tokens)) + "_b" +
       std::to_string(batch) + suffix);
  fs::create_directories(dir);
  if (!auto_why.empty()) std::ofstream(dir / "auto.txt") << auto_why << "\n";
  std::vector<std::string> argv = {"dhp", "train", "--nproc", std::to_string(o.nproc), "--out", dir.string()};
  if (!o.config.empty()) argv.insert(argv.end(), {"--config", o.config});
  for (const auto& s : sets) argv.insert(argv.end(), {"--set", s});
  const int status = run_logged(o.binary, argv, dir / "log.txt");
  if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
    a.message = job_error(dir / "log.txt");
    a.outcome = a.message.find("out of memory") != std::string::npos ? Outcome::kOom : Outcome::kFailed;
  } else {
    try {
      a.metrics = read_metrics((dir / "metrics.jsonl").string(), o.warmup);
      a.outcome = Outcome::kOk;
    } catch (const std::exception& e) {
      a.message = e.what();
    }
  }
  if (!o.quiet && a.outcome != Outcome::kOk) std::fprintf(stderr, "  %s: %s\n", outcome_name(a.outcome), a.message.c_str());
  return a;
}

}  // namespace

namespace {

void check_options(const Options& o) {
  DHP_CHECK(o.steps > o.warmup, "--steps ", o.steps, " must exceed --warmup ", o.warmup);
  DHP_CHECK(o.warmup >= 0, "--warmup must be >= 0, got ", o.warmup);
  DHP_CHECK(o.nproc >= 1, "--nproc must be >= 1, got ", o.nproc);
  DHP_CHECK(o.repeats >= 1, "--repeats must be >= 1, got ", o.repeats);
  DHP_CHECK(!o.vision_tokens.empty() || o.mixed_max_side > 0, "no vision length to measure");
  DHP_CHECK((o.mixed_min_side == 0 && o.mixed_max_side == 0) ||
                (o.mixed_min_side > 0 && o.mixed_max_side >= o.mixed_min_side),
            "mixed sides ", o.mixed_min_side, "-", o.mixed_max_side, " must be 0 < MIN <= MAX");
  DHP_CHECK(o.frames >= 0 && o.frames % 2 == 0, "--frames ", o.frames, " must be an even number >= 0 (0: images)");
}

// "[3/12] WHAT, ETA 1m20s": the sweep's progress over its jobs (every point once, then again
// in each later round; the ETA as if every point fits at its first batch).
class Progress {
 public:
  explicit Progress(size_t total) : total_(total) {}
  std::string line(const std::string& what) const {
    std::string s = "[" + std::to_string(done_ + 1) + "/" + std::to_string(total_) + "] " + what;
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    if (done_) s += ", ETA " + fmt_eta(elapsed / static_cast<double>(done_) * static_cast<double>(total_ - done_));
    return s;
  }
  void job_done() { ++done_; }

 private:
  size_t total_, done_ = 0;
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
};

std::string describe_point(const PointResult& r) {
  if (r.mixed()) {
    return r.name + ", mixed " + std::string(r.frames > 0 ? "clips of " + std::to_string(r.frames) + " frames" : "images") +
           " of " + std::to_string(r.image_side) + "-" + std::to_string(r.max_side) + " px";
  }
  if (r.frames > 0) {
    return r.name + ", " + std::to_string(r.vision_tokens) + " patches/clip (" + std::to_string(r.frames) + " frames of " +
           std::to_string(r.image_side) + " px)";
  }
  return r.name + ", " + std::to_string(r.vision_tokens) + " patches/image (" + std::to_string(r.image_side) + " px)";
}

// Later rounds run every point's kept batch again, point after point, so that a slow stretch
// of a shared machine falls on every point's rounds alike rather than on one point; each
// point keeps its median round.
void repeat_rounds(const Options& o, std::vector<PointResult>& results, Progress& progress) {
  std::vector<std::vector<RunMetrics>> rounds(results.size());
  for (size_t i = 0; i < results.size(); ++i)
    if (results[i].ok()) rounds[i].push_back(results[i].metrics);
  for (int64_t k = 2; k <= o.repeats; ++k) {
    for (size_t i = 0; i < results.size(); ++i) {
      auto& r = results[i];
      if (!r.ok()) {
        progress.job_done();
        continue;
      }
      const std::string what = describe_point(r) + ", round " + std::to_string(k);
      const auto a = try_batch(o, r, r.batch_size, progress.line(what), "_r" + std::to_string(k));
      progress.job_done();
      if (a.outcome == Outcome::kOk) {
        rounds[i].push_back(a.metrics);
      } else {
        ++r.failed_rounds;  // try_batch logged why
      }
    }
  }
  for (size_t i = 0; i < results.size(); ++i)
    if (results[i].ok()) keep_median_round(results[i], rounds[i]);
}

// An `auto` point needs the planner's calibration of this machine as nproc ranks: measured
// once here when missing, as `dhp train` does.
void calibrate_for_auto(const Options& o) {
  for (const auto& p : o.points) {
    auto sets = o.sets;
    sets.insert(sets.end(), p.sets.begin(), p.sets.end());
    const auto cfg = load_config(o.config, sets);
    if (parse_combination(cfg.parallel.strategy) != Combination::kAuto) continue;
    calibrate_if_missing(o.nproc, cfg.training.precision);
    return;
  }
}

}  // namespace

std::vector<PointResult> run(const Options& o) {
  check_options(o);
  const auto base = load_config(o.config, o.sets);
  const auto& vc = base.model.config.vision;
  std::vector<int64_t> sides;
  const auto lengths = o.mixed_max_side > 0 ? std::vector<int64_t>{0} : o.vision_tokens;
  if (o.mixed_max_side > 0) {
    const int64_t unit = vc.patch_size * vc.spatial_merge_size;
    DHP_CHECK(o.mixed_min_side % unit == 0 && o.mixed_max_side % unit == 0, "mixed sides ", o.mixed_min_side, "-",
              o.mixed_max_side, " must be multiples of ", unit, " px (whole merge windows)");
    sides.push_back(o.mixed_min_side);
  }
  for (auto t : o.mixed_max_side > 0 ? std::vector<int64_t>{} : o.vision_tokens) {
    sides.push_back(image_side_for(t, vc.patch_size, vc.spatial_merge_size));
  }
  const auto batches = o.batch_sizes.empty() ? std::vector<int64_t>{base.data.batch_size} : o.batch_sizes;
  fs::create_directories(o.out);
  calibrate_for_auto(o);
  const bool bf16 = base.training.precision == "bf16";
  if (!o.quiet) std::fprintf(stderr, "dhp bench: measuring the %s GEMM peak...\n", bf16 ? "bf16" : "fp32");
  const double peak = gemm_peak_gflops(bf16 ? c10::ScalarType::BFloat16 : c10::ScalarType::Float);

  std::vector<PointResult> results;
  Progress progress(o.points.size() * lengths.size() * static_cast<size_t>(o.repeats));
  for (const auto& p : o.points) {
    for (size_t v = 0; v < lengths.size(); ++v) {
      auto r = make_point(o, p, lengths[v], sides[v], vc);
      const std::string what = describe_point(r) + (o.repeats > 1 ? ", round 1" : "");
      search_batch(batches, [&](int64_t b) { return try_batch(o, r, b, progress.line(what)); }, r);
      progress.job_done();
      results.push_back(r);
    }
  }
  repeat_rounds(o, results, progress);
  const std::string table = markdown(results, o, peak);
  std::printf("%s", table.c_str());
  std::ofstream(fs::path(o.out) / "table.md") << table;
  write_json(results, o, peak, base, (fs::path(o.out) / "results.json").string());
  if (o.plot) plot_throughput(results, o, (fs::path(o.out) / "throughput.png").string());
  return results;
}

}  // namespace dhp::bench
