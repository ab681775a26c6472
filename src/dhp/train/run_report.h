// What rank 0 shows and writes of a training run: config.yaml (the resolved config),
// metrics.jsonl (one JSON line per step; resumed, the lines up to the checkpoint's step are
// kept and later ones written again), the progress line (a bar on a terminal), the start and
// closing log lines, and summary.json. On other ranks every method does nothing.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>

#include "dhp/train/config.h"
#include "dhp/train/metrics.h"

namespace dhp::train {

class RunReport {
 public:
  // Creates output.dir with config.yaml and metrics.jsonl (main rank only). Throws naming
  // the file when it cannot be written.
  RunReport(const Config& cfg, bool main, int64_t resumed_step);
  // The start lines: model, steps, threads, run dir, then `lines` (the layout, device, ...).
  void start(const std::vector<std::string>& lines);
  // One step's metrics line, and the progress line with the time left.
  void step(const StepMetrics& m, double eta_s);
  // The data loader's wait and skips, when the data came from a loader.
  void data_wait(double wait_s, double train_s, int64_t skipped);
  // summary.json and the closing lines. `chance`: 1 / number of answers (0: unknown);
  // `no_eval_reason` says why there was no held-out evaluation when ev.samples == 0.
  void finish(const EvalResult& ev, double train_s, double data_wait_s, int64_t skipped, double chance,
              const std::string& no_eval_reason);

 private:
  const Config& cfg_;
  bool main_;
  bool tty_;
  std::string dir_;
  std::ofstream metrics_;
  double first_loss_ = 0, last_loss_ = 0;
  bool have_first_ = false;
};

// "1h02m" / "3m05s".
std::string format_duration(double seconds);

}  // namespace dhp::train
