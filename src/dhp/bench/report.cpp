#include "dhp/bench/report.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <sstream>
#include <thread>

#include "dhp/core/error.h"
#include "dhp/core/machine.h"
#include "dhp/models/qwen2_5_vl/config.h"
#include "dhp/train/metrics.h"

namespace dhp::bench {
namespace {

namespace fs = std::filesystem;

std::string quoted(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    if (c == '\n') {
      o += "\\n";
      continue;
    }
    o += c;
  }
  return o + "\"";
}

template <class T>
std::string json_list(const std::vector<T>& v) {
  std::ostringstream os;
  os << std::setprecision(10) << "[";
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  return os.str() + "]";
}

std::string cell(std::string s) {
  for (auto& c : s)
    if (c == '|' || c == '\n') c = '/';
  return s;
}

std::string fmt(const char* f, double x) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), f, x);
  return buf;
}

std::string joined(const std::vector<double>& v, const char* f, double scale) {
  std::string s;
  for (double x : v) s += (s.empty() ? "" : "/") + fmt(f, x * scale);
  return s;
}

const PointResult* find(const std::vector<PointResult>& rs, const std::string& name, int64_t tokens) {
  for (const auto& r : rs)
    if (r.name == name && r.vision_tokens == tokens) return &r;
  return nullptr;
}

std::vector<std::string> names_in_order(const std::vector<PointResult>& rs) {
  std::vector<std::string> n;
  for (const auto& r : rs)
    if (std::find(n.begin(), n.end(), r.name) == n.end()) n.push_back(r.name);
  return n;
}

std::string tried(const PointResult& r) {
  std::string s;
  for (const auto& a : r.attempts) s += (s.empty() ? "" : ", ") + std::to_string(a.batch_size);
  return s;
}

}  // namespace

std::string markdown(const std::vector<PointResult>& results, const Options& o, double gemm_peak) {
  std::ostringstream os;
  const auto names = names_in_order(results);
  const bool clips = o.frames > 0;
  os << "Throughput = vision patches per " << (clips ? "clip" : "image") << " x batch / mean step time (steps "
     << o.warmup + 1 << "-" << o.steps
     << ")" << (o.repeats > 1 ? ", the median of " + std::to_string(o.repeats) + " rounds (step s: median [min-max])" : "")
     << ", " << o.nproc << " process(es)"
     << (o.memory_limit.empty() ? "" : ", memory limit " + o.memory_limit + " per rank") << "; (bs) = "
     << (o.batch_sizes.empty() ? std::string("the configured batch size")
                               : "the largest batch of " + json_list(o.batch_sizes) + " that fit")
     << (clips ? "; every sample a clip of " + std::to_string(o.frames) + " frames (the moving shapes task)" : "")
     << ".\n\n| vision patches/" << (clips ? "clip | frame px |" : "image | image px |");
  for (const auto& n : names) os << " " << n << " (bs) |";
  for (size_t j = 1; j < names.size(); ++j) os << " " << names[0] << "/" << names[j] << " |";
  os << "\n|---|---|";
  for (size_t j = 0; j < names.size() + (names.size() > 1 ? names.size() - 1 : 0); ++j) os << "---|";
  os << "\n";
  std::vector<int64_t> lengths;
  for (const auto& r : results)
    if (std::find(lengths.begin(), lengths.end(), r.vision_tokens) == lengths.end()) lengths.push_back(r.vision_tokens);
  for (auto t : lengths) {
    const auto* any = find(results, names[0], t);
    if (any && any->mixed()) {
      os << "| mixed (measured) | " << any->image_side << "-" << any->max_side << " |";
    } else {
      os << "| " << t << " | " << (any ? any->image_side : 0) << " |";
    }
    for (const auto& n : names) {
      const auto* r = find(results, n, t);
      if (!r) os << " - |";
      else if (r->ok()) os << " " << fmt("%.0f", r->throughput()) << " (" << r->batch_size << ") |";
      else if (r->oom) os << " OOM |";
      else os << " failed |";
    }
    const auto* first = find(results, names[0], t);
    for (size_t j = 1; j < names.size(); ++j) {
      const auto* r = find(results, names[j], t);
      if (first && r && first->ok() && r->ok()) os << " " << fmt("%.2f", first->throughput() / r->throughput()) << " |";
      else os << " - |";
    }
    os << "\n";
  }
  os << "\n| point | vision patches | batch | throughput | step s | text tok/s | peak MiB per rank | comm % | "
        "model GFLOP/s per rank | % of GEMM peak | idle % vision / text | stalled % vision / text | "
        "vision s / text s | layout |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& r : results) {
    os << "| " << r.name << " | "
       << (r.mixed() ? (r.ok() ? fmt("%.0f", r.metrics.patches_per_step / static_cast<double>(r.batch_size)) +
                                     " (mean)"
                               : std::string("mixed"))
                     : std::to_string(r.vision_tokens))
       << " | ";
    if (!r.ok()) {
      os << (r.oom ? "OOM (tried " + tried(r) + ")" : "failed: " + cell(r.error)) << " ||||||||||| "
         << cell(r.layout) << " |\n";
      continue;
    }
    const auto& m = r.metrics;
    const double job_gflops = m.model_flops / m.step_time_s / 1e9;
    std::string step = fmt("%.3f", m.step_time_s);
    if (r.round_step_s.size() > 1) {
      const auto [lo, hi] = std::minmax_element(r.round_step_s.begin(), r.round_step_s.end());
      step += " [" + fmt("%.3f", *lo) + "-" + fmt("%.3f", *hi) + "]";
    }
    if (r.failed_rounds > 0) step += " (" + std::to_string(r.failed_rounds) + " round(s) failed)";
    os << r.batch_size << " | " << fmt("%.0f", r.throughput()) << " | " << step << " | "
       << fmt("%.0f", m.tokens_per_s) << " | " << joined(m.peak_bytes_per_rank, "%.0f", 1.0 / (1 << 20)) << " | "
       << fmt("%.0f", 100 * m.comm_fraction()) << " | " << fmt("%.1f", job_gflops / static_cast<double>(o.nproc))
       << " | " << fmt("%.1f", gemm_peak > 0 ? 100 * job_gflops / gemm_peak : 0) << " | "
       << fmt("%.0f", 100 * m.idle_fraction(r.vision_ranks)) << " / " << fmt("%.0f", 100 * m.idle_fraction(r.text_ranks))
       << " | " << fmt("%.0f", 100 * m.stall_fraction(r.vision_ranks)) << " / "
       << fmt("%.0f", 100 * m.stall_fraction(r.text_ranks)) << " | "
       << (m.vision_s_per_rank.empty() ? std::string("-")
                                       : fmt("%.3f", RunMetrics::mean_over(m.vision_s_per_rank, r.vision_ranks)) +
                                             " / " + fmt("%.3f", RunMetrics::mean_over(m.text_s_per_rank, r.text_ranks)))
       << " | " << cell(r.layout) << " |\n";
  }
  os << "\nidle: blocked on the other module; stalled: not computing (the step minus vision, text and update "
        "time, plus the communication inside them): waiting for another module or replica, or communicating.\n";
  bool profiled = false;
  for (const auto& r : results) profiled = profiled || (r.ok() && !r.metrics.breakdown_per_rank.empty());
  if (profiled) {
    os << "\nWhere the time goes (the profiled step after the measured ones, mean over ranks, % of that step): "
          "operators' own time by kind in the forward and backward, time in collectives, the optimizer update "
          "without its collectives, making the samples, and the rest (dhp's code between operators).\n\n"
          "| point | vision patches | GEMM % | attention % | element-wise % | comm % | update % | data % | other % |\n"
          "|---|---|---|---|---|---|---|---|---|\n";
    for (const auto& r : results) {
      if (!r.ok() || r.metrics.breakdown_per_rank.empty()) continue;
      os << "| " << r.name << " | " << (r.mixed() ? std::string("mixed") : std::to_string(r.vision_tokens)) << " |";
      for (size_t k = 0; k < train::kBreakdownCount; ++k) os << " " << fmt("%.0f", 100 * r.metrics.breakdown_fraction(k)) << " |";
      os << "\n";
    }
  }
  os << "\nGEMM peak measured in this run: " << fmt("%.1f", gemm_peak) << " GFLOP/s (whole machine, "
     << std::thread::hardware_concurrency() << " threads; " << blas_description() << ").\n";
  return os.str();
}

void write_json(const std::vector<PointResult>& results, const Options& o, double gemm_peak, const Config& base,
                const std::string& path) {
  std::ofstream f(path);
  DHP_CHECK(f.good(), "cannot write ", path);
  const auto pc = qwen::count_parameters(base.model.config);
  f << std::setprecision(10) << "{\"machine\": {\"cores\": " << std::thread::hardware_concurrency()
    << ", \"blas\": " << quoted(blas_description()) << ", \"gemm_peak_gflops\": " << gemm_peak
    << ", \"precision\": " << quoted(base.training.precision) << "},\n \"model\": {\"preset\": "
    << quoted(base.model.preset) << ", \"vision_params\": " << pc.vision << ", \"text_params\": " << pc.text
    << "},\n \"settings\": {\"nproc\": " << o.nproc << ", \"steps\": " << o.steps << ", \"warmup\": " << o.warmup << ", \"repeats\": " << o.repeats
    << ", \"memory_limit\": " << quoted(o.memory_limit) << ", \"batch_sizes\": " << json_list(o.batch_sizes)
    << ", \"config\": " << quoted(o.config) << "},\n \"points\": [";
  for (size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    const auto& m = r.metrics;
    f << (i ? ",\n  " : "\n  ") << "{\"strategy\": " << quoted(r.name) << ", \"vision_tokens\": " << r.vision_tokens
      << ", \"image_side\": " << r.image_side << ", \"max_side\": " << r.max_side << ", \"frames\": " << r.frames << ", \"batch_size\": " << r.batch_size
      << ", \"oom\": " << (r.oom ? "true" : "false") << ", \"throughput\": " << r.throughput()
      << ", \"layout\": " << quoted(r.layout) << ", \"vision_ranks\": " << json_list(r.vision_ranks)
      << ", \"text_ranks\": " << json_list(r.text_ranks);
    if (!r.error.empty()) f << ", \"error\": " << quoted(r.error);
    if (r.ok()) {
      const double job_gflops = m.model_flops / m.step_time_s / 1e9;
      f << ", \"step_time_s\": " << m.step_time_s << ", \"steps_measured\": " << m.steps_measured
        << ", \"patches_per_step\": " << m.patches_per_step
        << ", \"patches_per_s\": " << m.patches_per_s << ", \"tokens_per_s\": " << m.tokens_per_s
        << ", \"model_flops_per_step\": " << m.model_flops
        << ", \"model_gflops_per_rank\": " << job_gflops / static_cast<double>(o.nproc)
        << ", \"fraction_of_gemm_peak\": " << (gemm_peak > 0 ? job_gflops / gemm_peak : 0)
        << ", \"peak_bytes_per_rank\": " << json_list(m.peak_bytes_per_rank)
        << ", \"comm_s_per_rank\": " << json_list(m.comm_s_per_rank) << ", \"comm_fraction\": " << m.comm_fraction()
        << ", \"busy_s_per_rank\": " << json_list(m.busy_s_per_rank)
        << ", \"idle_s_per_rank\": " << json_list(m.idle_s_per_rank)
        << ", \"idle_fraction_vision\": " << m.idle_fraction(r.vision_ranks)
        << ", \"idle_fraction_text\": " << m.idle_fraction(r.text_ranks)
        << ", \"stall_fraction_vision\": " << m.stall_fraction(r.vision_ranks)
        << ", \"stall_fraction_text\": " << m.stall_fraction(r.text_ranks)
        << ", \"vision_s_per_rank\": " << json_list(m.vision_s_per_rank)
        << ", \"text_s_per_rank\": " << json_list(m.text_s_per_rank)
        << ", \"update_s_per_rank\": " << json_list(m.update_s_per_rank) << ", \"samples_s\": " << m.samples_s
        << ", \"round_step_time_s\": " << json_list(r.round_step_s) << ", \"failed_rounds\": " << r.failed_rounds;
      if (!m.breakdown_per_rank.empty()) {
        f << ", \"breakdown_per_rank\": {";
        for (size_t k = 0; k < train::kBreakdownCount; ++k)
          f << (k ? ", " : "") << quoted(train::kBreakdownParts[k]) << ": " << json_list(m.breakdown_per_rank[k]);
        f << "}, \"breakdown_fraction\": {";
        for (size_t k = 0; k < train::kBreakdownCount; ++k)
          f << (k ? ", " : "") << quoted(train::kBreakdownParts[k]) << ": " << m.breakdown_fraction(k);
        f << "}";
      }
    }
    f << ", \"sets\": [";
    for (size_t k = 0; k < r.sets.size(); ++k) f << (k ? ", " : "") << quoted(r.sets[k]);
    f << "]";
    if (!r.chosen_sets.empty()) {
      f << ", \"chosen_sets\": [";
      for (size_t k = 0; k < r.chosen_sets.size(); ++k) f << (k ? ", " : "") << quoted(r.chosen_sets[k]);
      f << "]";
    }
    f << ", \"attempts\": [";
    for (size_t k = 0; k < r.attempts.size(); ++k) {
      const auto& a = r.attempts[k];
      f << (k ? ", " : "") << "{\"batch_size\": " << a.batch_size << ", \"outcome\": " << quoted(outcome_name(a.outcome));
      if (!a.message.empty()) f << ", \"message\": " << quoted(a.message);
      if (a.outcome == Outcome::kOk) f << ", \"step_time_s\": " << a.metrics.step_time_s;
      f << "}";
    }
    f << "]}";
  }
  f << "\n]}\n";
}

bool plot_throughput(const std::vector<PointResult>& results, const Options& o, const std::string& png) {
  if (std::system("command -v gnuplot > /dev/null 2>&1") != 0) {
    std::fprintf(stderr, "dhp bench: gnuplot is not installed, so no %s (apt-get install gnuplot-nox)\n", png.c_str());
    return false;
  }
  const fs::path dir = fs::path(png).parent_path();
  const auto names = names_in_order(results);
  std::vector<int64_t> lengths;
  for (const auto& r : results)
    if (std::find(lengths.begin(), lengths.end(), r.vision_tokens) == lengths.end()) lengths.push_back(r.vision_tokens);
  double top = 1;
  for (const auto& r : results) top = std::max(top, r.throughput());
  const fs::path dat = dir / "throughput.dat", gp = dir / "throughput.gp";
  {
    std::ofstream d(dat);
    d << "# vision_tokens";
    for (const auto& n : names) d << " " << n;
    d << "\n";
    for (auto t : lengths) {
      const auto* any = find(results, names[0], t);
      if (any && any->mixed()) {
        d << "\"mixed " << any->image_side << "-" << any->max_side << " px\"";
      } else {
        d << t;
      }
      for (const auto& n : names) {
        const auto* r = find(results, n, t);
        d << " " << (r ? r->throughput() : 0.0);
      }
      d << "\n";
    }
  }
  std::ofstream g(gp);
  const double n = static_cast<double>(names.size());
  g << "set terminal pngcairo size 960,540 font ',11'\nset output '" << png << "'\n"
    << "set title 'dhp bench: throughput by vision length (" << o.nproc << " processes"
    << (o.memory_limit.empty() ? "" : ", " + o.memory_limit + " per rank") << ")'\n"
    << "set style data histograms\nset style histogram clustered gap 1\nset style fill solid 0.85 border -1\n"
    << "set boxwidth 0.9\nset ylabel 'vision patches / s'\nset xlabel 'vision patches per image'\n"
    << "set yrange [0:" << top * 1.15 << "]\nset key top left\nset grid ytics\n";
  // OOM marks: bar j of cluster i sits at i + (j - (n-1)/2) / (n + gap).
  for (size_t i = 0; i < lengths.size(); ++i) {
    for (size_t j = 0; j < names.size(); ++j) {
      const auto* r = find(results, names[j], lengths[i]);
      if (r && r->ok()) continue;
      const double x = static_cast<double>(i) + (static_cast<double>(j) - (n - 1) / 2) / (n + 1);
      g << "set label '" << (r && r->oom ? "OOM" : "failed") << "' at " << x << "," << top * 0.03
        << " center rotate by 90 front\n";
    }
  }
  g << "plot";
  for (size_t j = 0; j < names.size(); ++j) {
    g << (j ? ", ''" : " '" + dat.string() + "'") << " using " << j + 2 << (j ? "" : ":xtic(1)") << " title '"
      << names[j] << "'";
  }
  g << "\n";
  g.close();
  const std::string cmd = "gnuplot '" + gp.string() + "' 2> '" + (dir / "gnuplot.log").string() + "'";
  if (std::system(cmd.c_str()) != 0) {
    std::fprintf(stderr, "dhp bench: gnuplot failed (see %s)\n", (dir / "gnuplot.log").c_str());
    return false;
  }
  std::fprintf(stderr, "dhp bench: wrote %s\n", png.c_str());
  return true;
}

}  // namespace dhp::bench
