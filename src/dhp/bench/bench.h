// dhp bench: the throughput-vs-vision-length study of the reference system, and any
// side-by-side comparison of strategies and placements, measured in one run.
//
// Every (point, vision length) runs as `dhp train --nproc N` jobs of its own (own worker
// processes, so a point that fails or runs out of memory is recorded and the sweep goes
// on). For each one the batch sizes are tried from the largest down and the largest that
// fits the per-rank memory limit is kept; a point where none fits is recorded as OOM.
// Throughput is the reference's metric: vision patches per image x batch size / mean step
// time over the steps after the warm-up.
//
// Outputs under Options::out: results.json (every point and attempt, every figure, the
// settings and the machine), table.md (the reference-style table with dhp/tp and dhp/zero3
// ratios, then the detail per point), throughput.png (gnuplot, when installed), and one run
// directory per attempt (metrics.jsonl, log.txt).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace dhp::bench {

// One thing to measure: a name and the config keys that make it.
struct Point {
  std::string name;
  std::vector<std::string> sets;  // KEY=VALUE
};

struct Options {
  std::string binary = "/proc/self/exe";   // the dhp binary the jobs run
  std::string config;                      // base config file (may be empty)
  std::vector<std::string> sets;           // base --set overrides
  std::vector<Point> points;
  std::vector<int64_t> vision_tokens{64, 256};  // patches per image (square images), per frame with `frames`
  int64_t frames = 0;                      // > 0: every sample a clip of the moving task with this many frames
  // > 0: one length instead of vision_tokens: images of random heights and widths in
  // [mixed_min_side, mixed_max_side] px (data.min_side / data.max_side), a mixed-resolution
  // batch; throughput is then the measured vision patches / s.
  int64_t mixed_min_side = 0, mixed_max_side = 0;
  std::vector<int64_t> batch_sizes;        // tried largest first; empty: data.batch_size of the config
  std::string memory_limit;                // per-rank budget, e.g. 2GiB (empty: the config's)
  int64_t nproc = 2;
  int64_t steps = 6;                       // steps per job
  int64_t warmup = 2;                      // first steps left out of the averages
  int64_t repeats = 1;                     // rounds: each point's kept batch is run again in
                                           // rounds 2..N, interleaved, and the median kept
  std::string out = "runs/bench";
  bool plot = true;                        // draw throughput.png with gnuplot when available
  bool quiet = false;                      // no progress lines
};

// Figures of one finished job, averaged over the steps after the warm-up.
struct RunMetrics {
  int64_t steps_measured = 0;
  double step_time_s = 0, patches_per_s = 0, tokens_per_s = 0;
  double patches_per_step = 0;  // vision patches of the whole batch, mean over the steps
  double model_flops = 0;  // per step, whole job
  std::vector<double> peak_bytes_per_rank, comm_s_per_rank, busy_s_per_rank, idle_s_per_rank;
  std::vector<double> vision_s_per_rank, text_s_per_rank;  // inside each module's forward/backward
  std::vector<double> update_s_per_rank;                    // finish_step: reductions, norm, optimizer
  double samples_s = 0;                                     // making the step's samples (rank 0)
  // The profiled step after the measured ones (train::kBreakdownParts x ranks, seconds);
  // empty when the job profiled none.
  std::vector<std::vector<double>> breakdown_per_rank;
  // Mean over ranks of part k of the profiled step / that step's time on the rank; 0 when none.
  double breakdown_fraction(size_t k) const;
  double comm_fraction() const;          // mean over ranks of comm time / step time
  double idle_fraction(const std::vector<int64_t>& ranks) const;
  // Mean over `ranks` of the step's time spent not computing, / step time: the step minus
  // (vision + text + update - communication), i.e. waiting for another module or replica, or
  // in a collective. 0 when the per-module timers are absent.
  double stall_fraction(const std::vector<int64_t>& ranks) const;
  // Mean over `ranks` of a per-rank figure (seconds per step).
  static double mean_over(const std::vector<double>& per_rank, const std::vector<int64_t>& ranks);
  double max_peak_bytes() const;
};

enum class Outcome { kOk, kOom, kInvalid, kFailed };
const char* outcome_name(Outcome o);

struct Attempt {
  int64_t batch_size = 0;
  Outcome outcome = Outcome::kFailed;
  std::string message;  // error or reason (empty when ok)
  std::vector<std::string> chosen_sets;  // an auto point: what the planner chose for this batch
  RunMetrics metrics;
};

struct PointResult {
  std::string name, layout;
  int64_t vision_tokens = 0, image_side = 0;  // patches per sample (a clip's: per frame x temporal patches); side in px
  int64_t frames = 0;                         // frames per clip; 0: still images
  int64_t max_side = 0;                       // > 0: mixed sides image_side..max_side (vision_tokens 0)
  std::vector<std::string> sets;
  // An auto point: the keys the planner chose for the kept batch (its parallel.* keys and
  // training.micro_batches, as pinned for the job); empty for other points.
  std::vector<std::string> chosen_sets;
  std::vector<int64_t> vision_ranks, text_ranks;
  int64_t batch_size = 0;  // the largest that ran; 0 when none did
  bool oom = false;        // nothing ran and at least one batch ran out of memory
  std::string error;       // why nothing ran (when not only OOM)
  RunMetrics metrics;      // of the kept batch (with --repeats: its round of median step time)
  std::vector<Attempt> attempts;
  std::vector<double> round_step_s;  // the kept batch's step time in each round that ran, in order
  int64_t failed_rounds = 0;         // later rounds of the kept batch that failed (logged, left out)
  bool ok() const { return batch_size > 0; }
  bool mixed() const { return max_side > 0; }
  // Vision patches per sample x batch / step time (the reference's metric; mixed sizes: the
  // measured patches per step / step time); 0 when none ran.
  double throughput() const;
};

// Points from "--strategies a,b" (each parallel.strategy=NAME) and "--point NAME:K=V;K=V".
std::vector<Point> parse_points(const std::string& strategies, const std::vector<std::string>& custom);

// Square image side in pixels whose patch grid gives `vision_tokens` patches: the side is a
// multiple of patch * merge. Throws naming the value when no such square exists.
int64_t image_side_for(int64_t vision_tokens, int64_t patch_size, int64_t merge_size);

// Tries `batch_sizes` from the largest down, calling `run` for each until one runs (kOk);
// out-of-memory and invalid (layout refused for that batch) attempts move on to the next
// smaller; other failures too, recorded. Fills batch_size, oom, error, metrics, attempts.
void search_batch(std::vector<int64_t> batch_sizes, const std::function<Attempt(int64_t)>& run, PointResult& r);

// Records the kept batch's rounds (each round's metrics, in run order; at least one) in r:
// every round's step time, and as r.metrics the round of median step time (for an even count
// the lower of the middle two), so that every figure of the row comes from one run.
void keep_median_round(PointResult& r, const std::vector<RunMetrics>& rounds);

// Reads a job's metrics.jsonl, averaging the steps after `warmup`; a profiled step (one with
// breakdown_per_rank) is kept apart, out of the averages.
RunMetrics read_metrics(const std::string& path, int64_t warmup);

// Runs the sweep; prints progress (stderr) and the table (stdout); writes the outputs.
// Returns the results.
std::vector<PointResult> run(const Options& o);

// The reference-style table and the detail table, as markdown.
std::string markdown(const std::vector<PointResult>& results, const Options& o, double gemm_peak_gflops);

}  // namespace dhp::bench
