// Single-process training: the model, its optimizer, the data, one step at a time.
// Owns everything it creates; not thread-safe.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dhp/data/shapes.h"
#include "dhp/models/qwen2_5_vl/model.h"
#include "dhp/train/config.h"
#include "dhp/train/optim.h"

namespace dhp::train {

struct StepMetrics {
  int64_t step = 0;            // 1-based after the step
  double loss = 0;             // mean CE over the global batch's target tokens
  double lr = 0;
  double grad_norm = 0;        // before clipping
  double step_time_s = 0;
  double tokens_per_s = 0;     // text tokens (input ids) per second
  double patches_per_s = 0;    // vision patches per second
  int64_t tokens = 0, target_tokens = 0, patches = 0;
  int64_t peak_bytes = 0;      // peak CPU tensor bytes during the step
  double model_flops = 0;      // forward+backward FLOPs of the step (6*N*T style, see flops.h)
};

struct EvalResult {
  int64_t samples = 0;
  int64_t exact = 0;           // samples whose whole answer is predicted (greedy == teacher-forced argmax)
  double accuracy = 0;
  double loss = 0;             // mean CE on the held-out answers
  std::vector<double> slot_accuracy;  // token accuracy at each answer position (a, colour, shape, ...)
};

class Trainer {
 public:
  explicit Trainer(const Config& cfg);
  // One optimizer step over the next global batch.
  StepMetrics train_step();
  EvalResult evaluate(int64_t num_samples);
  // Trains cfg.training.steps steps with a progress display, writes metrics.jsonl and
  // config.yaml in cfg.output.dir, evaluates, writes summary.json. Returns the eval.
  EvalResult run();

  qwen::Qwen2_5_VL& model() { return model_; }
  AdamW& optimizer() { return *optim_; }
  const data::ShapesDataset& dataset() const { return train_data_; }
  // The samples of global step `step` (0-based), split into micro-batches.
  std::vector<qwen::Batch> step_batches(int64_t step) const;

 private:
  Config cfg_;
  qwen::Qwen2_5_VL model_{nullptr};
  std::unique_ptr<AdamW> optim_;
  data::ShapesDataset train_data_, eval_data_;
  int64_t step_ = 0;
};

// Builds the model for a config: presets, init from the seed, precision, checkpointing.
qwen::Qwen2_5_VL build_model(const Config& cfg);
std::vector<NamedParam> named_params(qwen::Qwen2_5_VLImpl& model);

}  // namespace dhp::train
