// dhp plan's study: for each vision length, the named strategies' predicted throughput,
// step time, memory per device and largest batch, and the best plan of the whole search,
// as a table and as JSON.
#pragma once

#include <string>
#include <vector>

#include "dhp/plan/cost_model.h"

namespace dhp::plan {

struct StudyOptions {
  std::vector<int64_t> vision_tokens{1024, 4096};
  std::vector<int64_t> batch_sizes{1, 2, 4, 8};
  std::vector<std::string> strategies{"dhp", "tp", "zero3"};
  std::string conventions = "dhp";  // dhp, or reference: the published systems (SP+TP / TP: Ray's, zero3: DeepSpeed)
  Workload workload;                // vision_tokens and batch_size are set per point
  int64_t top = 3;                  // best plans listed per length
};

struct StrategyPoint {
  std::string name;
  Estimate estimate;   // at the largest batch that fits (or the smallest tried when none does)
  bool oom = false;
};

struct StudyPoint {
  int64_t vision_tokens = 0;
  std::vector<StrategyPoint> strategies;
  std::vector<Estimate> best;      // the search's fastest feasible plans (throughput), up to top
  std::vector<Estimate> rejected;  // infeasible plans at the largest batch, with their reasons
};

// The conventions a named strategy runs under: its own system's for the reference study.
std::string strategy_conventions(const std::string& strategy, const std::string& conventions);

std::vector<StudyPoint> study(const qwen::ModelConfig& m, const Cluster& c, const StudyOptions& o);
std::string study_table(const std::string& model, const Cluster& c, const StudyOptions& o,
                        const std::vector<StudyPoint>& points);
std::string study_json(const std::string& model, const Cluster& c, const StudyOptions& o,
                       const std::vector<StudyPoint>& points);

// Predicted against measured: every point of a `dhp bench` results.json (strategy, vision
// length, the batch it ran) predicted with the same workload on `c`, error per point, and
// per vision length whether the predicted order of the strategies is the measured one. The
// bench's per-rank memory limit (settings.memory_limit) is the devices' memory unless
// `memory_given` (the caller set it).
struct ValidationRow {
  std::string strategy;
  int64_t vision_tokens = 0, batch_size = 0;
  bool measured_oom = false, predicted_oom = false;
  double measured_s = 0, predicted_s = 0;
  // The fastest and slowest of the measured rounds (dhp bench --repeats; else measured_s).
  double measured_min_s = 0, measured_max_s = 0;
  double measured_peak_bytes = 0, predicted_bytes = 0;
  // What was estimated: the plan, its micro-batches and overlap. Two rows of one layout (a
  // named strategy and `auto` choosing it) are one configuration: the model cannot order them.
  std::string layout;
  double error() const { return predicted_s / measured_s - 1; }
};
struct Validation {
  std::vector<ValidationRow> rows;
  int64_t lengths = 0, rankings_matched = 0;
  int64_t within_20 = 0;  // points whose predicted step time is within 20% of the measured one
  // Pairs of strategies at one length whose measured throughputs differ by more than
  // kTiePercent (repeated sweeps differ by about that much) and, where the sweep ran rounds,
  // whose rounds' ranges do not overlap, and whose layouts differ; and those the model orders
  // alike.
  int64_t decisive_pairs = 0, decisive_matched = 0;
  static constexpr double kTiePercent = 5;
  std::vector<std::string> not_validated;  // rows with no plan to estimate ("auto at 256 patches")
  std::string table;
};
Validation validate(const qwen::ModelConfig& m, Cluster c, const Workload& w, const std::string& results_json,
                    bool memory_given = false);

}  // namespace dhp::plan
