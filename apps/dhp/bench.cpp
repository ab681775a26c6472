// dhp bench: runs each benchmark point as its own `dhp train` job (own worker processes,
// so a point that fails or runs out of memory is recorded, never the end of the sweep),
// reads the job's metrics.jsonl and prints, in one run, step time, peak memory per rank,
// communication time per rank and each module group's idle fraction; writes
// DIR/results.json with every figure and the exact settings.
#include "bench.h"

#include <sys/wait.h>
#include <unistd.h>
#include <fcntl.h>
#include <yaml-cpp/yaml.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <sstream>
#include <thread>

#include "dhp/core/error.h"
#include "dhp/core/machine.h"
#include "dhp/core/memory.h"
#include "dhp/train/config.h"
#include "dhp/train/parallel_model.h"

namespace dhp::bench {
namespace {

namespace fs = std::filesystem;

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == sep) {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

// Runs argv with stdout and stderr into `log`; returns the exit status.
int run_logged(const std::vector<std::string>& argv, const fs::path& log) {
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
    ::execv("/proc/self/exe", args.data());
    ::_exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return status;
}

std::string last_error_line(const fs::path& log) {
  std::ifstream f(log);
  std::string line, last;
  while (std::getline(f, line)) {
    if (line.find("error") != std::string::npos || line.find("failed") != std::string::npos) last = line;
  }
  return last.empty() ? "see " + log.string() : last;
}

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / static_cast<double>(v.size());
}

// Reads metrics.jsonl and averages the steps after the warm-up.
void summarize(const fs::path& metrics, int64_t warmup, PointResult& r) {
  std::ifstream f(metrics);
  DHP_CHECK(f.good(), "no metrics at ", metrics.string());
  std::string line;
  std::vector<double> step_s, patches_s;
  std::vector<std::vector<double>> comm, busy, idle;
  while (std::getline(f, line)) {
    if (line.empty()) continue;
    const YAML::Node n = YAML::Load(line);
    if (n["step"].as<int64_t>() <= warmup) continue;
    step_s.push_back(n["step_time_s"].as<double>());
    patches_s.push_back(n["patches_per_s"].as<double>());
    const auto peak = n["peak_bytes_per_rank"].as<std::vector<double>>();
    const auto c = n["comm_s_per_rank"].as<std::vector<double>>();
    const auto b = n["busy_s_per_rank"].as<std::vector<double>>();
    const auto i = n["idle_s_per_rank"].as<std::vector<double>>();
    r.peak_bytes_per_rank.resize(peak.size(), 0);
    comm.resize(c.size());
    busy.resize(b.size());
    idle.resize(i.size());
    for (size_t k = 0; k < peak.size(); ++k) r.peak_bytes_per_rank[k] = std::max(r.peak_bytes_per_rank[k], peak[k]);
    for (size_t k = 0; k < c.size(); ++k) comm[k].push_back(c[k]);
    for (size_t k = 0; k < b.size(); ++k) busy[k].push_back(b[k]);
    for (size_t k = 0; k < i.size(); ++k) idle[k].push_back(i[k]);
  }
  DHP_CHECK(!step_s.empty(), metrics.string(), " has no step after the ", warmup, " warm-up steps");
  r.steps_measured = static_cast<int64_t>(step_s.size());
  r.step_time_s = mean(step_s);
  r.patches_per_s = mean(patches_s);
  for (auto& c : comm) r.comm_s_per_rank.push_back(mean(c));
  for (auto& b : busy) r.busy_s_per_rank.push_back(mean(b));
  for (auto& i : idle) r.idle_s_per_rank.push_back(mean(i));
}

// Mean idle fraction over the given ranks.
double idle_fraction(const PointResult& r, const std::vector<int64_t>& ranks) {
  double s = 0;
  for (auto k : ranks) s += r.idle_s_per_rank.at(static_cast<size_t>(k)) / r.step_time_s;
  return ranks.empty() ? 0 : s / static_cast<double>(ranks.size());
}

std::string json_list(const std::vector<double>& v, int precision = 6) {
  std::ostringstream os;
  os << std::setprecision(precision) << "[";
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  return os.str() + "]";
}

std::string json_list(const std::vector<int64_t>& v) {
  std::vector<double> d(v.begin(), v.end());
  return json_list(d, 12);
}

std::string quoted(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    o += c;
  }
  return o + "\"";
}

std::string mib_list(const std::vector<double>& bytes) {
  std::string s;
  for (double b : bytes) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%s%.0f", s.empty() ? "" : "/", b / (1 << 20));
    s += buf;
  }
  return s;
}

// The layout as one table cell (no '|').
std::string cell(std::string s) {
  for (auto& c : s)
    if (c == '|') c = '/';
  return s;
}

std::string seconds_list(const std::vector<double>& v) {
  std::string s;
  for (double x : v) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%s%.3f", s.empty() ? "" : "/", x);
    s += buf;
  }
  return s;
}

}  // namespace

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
    out.push_back(p);
  }
  DHP_CHECK(!out.empty(), "nothing to measure: give --strategies and/or --point");
  return out;
}

int run(const Options& o) {
  DHP_CHECK(o.steps > o.warmup, "--steps ", o.steps, " must exceed --warmup ", o.warmup);
  DHP_CHECK(o.nproc >= 1, "--nproc must be >= 1, got ", o.nproc);
  DHP_CHECK(!o.image_sides.empty(), "--image-sides needs at least one side");
  fs::create_directories(o.out);
  // Every point's layout is checked before anything runs.
  struct Job {
    Point point;
    int64_t side;
    std::vector<std::string> sets;
    train::Layouts layouts;
  };
  std::vector<Job> jobs;
  for (const auto& p : o.points) {
    for (auto side : o.image_sides) {
      DHP_CHECK(side >= 28 && side % 28 == 0, "--image-sides: ", side, " is not a positive multiple of 28");
      auto sets = o.sets;
      sets.insert(sets.end(), p.sets.begin(), p.sets.end());
      for (const auto& s : {"data.min_side=" + std::to_string(side), "data.max_side=" + std::to_string(side),
                            "training.steps=" + std::to_string(o.steps), std::string("data.eval_samples=0")}) {
        sets.push_back(s);
      }
      const auto cfg = load_config(o.config, sets);
      jobs.push_back({p, side, sets, train::resolve_layouts(cfg, o.nproc)});
    }
  }
  std::vector<PointResult> results;
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t k = 0; k < jobs.size(); ++k) {
    const auto& j = jobs[k];
    PointResult r;
    r.name = j.point.name;
    r.image_side = j.side;
    r.sets = j.sets;
    r.layout = train::describe(j.layouts);
    r.vision_ranks = j.layouts.vision.ranks;
    r.text_ranks = j.layouts.text.ranks;
    const fs::path dir = fs::path(o.out) / (j.point.name + "_" + std::to_string(j.side));
    fs::create_directories(dir);
    std::vector<std::string> argv = {"dhp", "train", "--nproc", std::to_string(o.nproc), "--out", dir.string()};
    if (!o.config.empty()) argv.insert(argv.end(), {"--config", o.config});
    for (const auto& s : j.sets) argv.insert(argv.end(), {"--set", s});
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::string eta = "";
    if (k > 0) eta = ", ETA " + std::to_string(static_cast<int>(elapsed / k * (jobs.size() - k))) + " s";
    std::fprintf(stderr, "[%zu/%zu] %s, images %lldx%lld px, %s%s\n", k + 1, jobs.size(), j.point.name.c_str(),
                 static_cast<long long>(j.side), static_cast<long long>(j.side), r.layout.c_str(), eta.c_str());
    const int status = run_logged(argv, dir / "log.txt");
    if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
      r.ok = false;
      r.error = last_error_line(dir / "log.txt");
      std::fprintf(stderr, "  failed: %s\n", r.error.c_str());
    } else {
      try {
        summarize(dir / "metrics.jsonl", o.warmup, r);
      } catch (const std::exception& e) {
        r.ok = false;
        r.error = e.what();
      }
    }
    results.push_back(r);
  }
  print_table(results, o);
  write_results(results, o);
  return 0;
}

void print_table(const std::vector<PointResult>& results, const Options& o) {
  std::printf("\n%lld process(es), %lld steps per point (first %lld warm-up, not averaged); fp32 GEMMs: %s\n",
              static_cast<long long>(o.nproc), static_cast<long long>(o.steps), static_cast<long long>(o.warmup),
              blas_description().c_str());
  std::printf("| point | image px | layout | step s | patches/s | peak MiB per rank | comm s/step per rank | "
              "comm %% | idle %% vision / text |\n|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& r : results) {
    if (!r.ok) {
      std::printf("| %s | %lld | %s | failed: %s |||||\n", r.name.c_str(), static_cast<long long>(r.image_side),
                  cell(r.layout).c_str(), cell(r.error).c_str());
      continue;
    }
    const double comm_frac = mean(r.comm_s_per_rank) / r.step_time_s;
    std::printf("| %s | %lld | %s | %.3f | %.0f | %s | %s | %.0f | %.0f / %.0f |\n", r.name.c_str(),
                static_cast<long long>(r.image_side), cell(r.layout).c_str(), r.step_time_s, r.patches_per_s,
                mib_list(r.peak_bytes_per_rank).c_str(), seconds_list(r.comm_s_per_rank).c_str(), 100 * comm_frac,
                100 * idle_fraction(r, r.vision_ranks), 100 * idle_fraction(r, r.text_ranks));
  }
  // Ratios against the first point at the same image size, measured in this run.
  for (const auto& r : results) {
    for (const auto& base : results) {
      if (&base == &r || base.image_side != r.image_side || !base.ok || !r.ok) continue;
      if (&base != &results[0] && base.name != results[0].name) continue;
      std::printf("%s / %s at %lld px: step time %.2fx, peak memory (max rank) %.2fx\n", r.name.c_str(),
                  base.name.c_str(), static_cast<long long>(r.image_side), r.step_time_s / base.step_time_s,
                  *std::max_element(r.peak_bytes_per_rank.begin(), r.peak_bytes_per_rank.end()) /
                      *std::max_element(base.peak_bytes_per_rank.begin(), base.peak_bytes_per_rank.end()));
    }
  }
}

void write_results(const std::vector<PointResult>& results, const Options& o) {
  const fs::path path = fs::path(o.out) / "results.json";
  std::ofstream f(path);
  DHP_CHECK(f.good(), "cannot write ", path.string());
  f << std::setprecision(8) << "{\"machine\": {\"cores\": " << std::thread::hardware_concurrency()
    << ", \"blas\": " << quoted(blas_description()) << "}, \"nproc\": " << o.nproc << ", \"steps\": " << o.steps
    << ", \"warmup\": " << o.warmup << ", \"config\": " << quoted(o.config) << ",\n \"points\": [";
  for (size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    f << (i ? ",\n  " : "\n  ") << "{\"name\": " << quoted(r.name) << ", \"image_side\": " << r.image_side
      << ", \"layout\": " << quoted(r.layout) << ", \"ok\": " << (r.ok ? "true" : "false");
    if (!r.ok) f << ", \"error\": " << quoted(r.error);
    f << ", \"sets\": [";
    for (size_t k = 0; k < r.sets.size(); ++k) f << (k ? ", " : "") << quoted(r.sets[k]);
    f << "], \"vision_ranks\": " << json_list(r.vision_ranks) << ", \"text_ranks\": " << json_list(r.text_ranks);
    if (r.ok) {
      f << ", \"steps_measured\": " << r.steps_measured << ", \"step_time_s\": " << r.step_time_s
        << ", \"patches_per_s\": " << r.patches_per_s
        << ", \"peak_bytes_per_rank\": " << json_list(r.peak_bytes_per_rank, 12)
        << ", \"comm_s_per_rank\": " << json_list(r.comm_s_per_rank)
        << ", \"busy_s_per_rank\": " << json_list(r.busy_s_per_rank)
        << ", \"idle_s_per_rank\": " << json_list(r.idle_s_per_rank)
        << ", \"comm_fraction\": " << mean(r.comm_s_per_rank) / r.step_time_s
        << ", \"idle_fraction_vision\": " << idle_fraction(r, r.vision_ranks)
        << ", \"idle_fraction_text\": " << idle_fraction(r, r.text_ranks);
    }
    f << "}";
  }
  f << "\n]}\n";
  std::printf("wrote %s\n", path.string().c_str());
}

}  // namespace dhp::bench
