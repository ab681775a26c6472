// `dhp bench`: measures strategies and placements side by side in one run. Each point
// (a named strategy, or a custom set of config keys) at each image size runs as its own
// `dhp train --nproc N` job, so a failing point is recorded and the sweep goes on.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dhp::bench {

// One thing to measure: a name and the config keys that make it.
struct Point {
  std::string name;
  std::vector<std::string> sets;  // KEY=VALUE
};

struct Options {
  std::string config;                       // base config file (may be empty)
  std::vector<std::string> sets;            // base --set overrides
  std::vector<Point> points;
  std::vector<int64_t> image_sides{112, 224};  // square images of this many pixels per side
  int64_t nproc = 2;
  int64_t steps = 6;   // steps per point
  int64_t warmup = 2;  // first steps left out of the averages
  std::string out = "runs/bench";
};

struct PointResult {
  std::string name, layout, error;
  int64_t image_side = 0;
  std::vector<std::string> sets;
  std::vector<int64_t> vision_ranks, text_ranks;
  bool ok = true;
  int64_t steps_measured = 0;
  double step_time_s = 0, patches_per_s = 0;
  std::vector<double> peak_bytes_per_rank, comm_s_per_rank, busy_s_per_rank, idle_s_per_rank;
};

// Points from "--strategies a,b" (each parallel.strategy=NAME) and "--point NAME:K=V;K=V".
std::vector<Point> parse_points(const std::string& strategies, const std::vector<std::string>& custom);

// Runs the sweep, prints the table and writes OUT/results.json. Returns the exit code.
int run(const Options& o);
void print_table(const std::vector<PointResult>& results, const Options& o);
void write_results(const std::vector<PointResult>& results, const Options& o);

}  // namespace dhp::bench
