// Training on one rank of a job (or alone): the step loop over the parallel model
// (parallel_model.h) and the data stream (data_stream.h), with checkpoints
// (checkpointing.h), held-out evaluation (evaluation.h) and the report of the run
// (run_report.h). Every rank draws the same global batch; ParallelModel decides what each
// computes. Rank 0 alone prints and writes the run directory. Not thread-safe.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dhp/data/shapes.h"
#include "dhp/models/qwen2_5_vl/model.h"
#include "dhp/train/config.h"
#include "dhp/train/data_stream.h"
#include "dhp/train/metrics.h"
#include "dhp/train/parallel_model.h"

namespace dhp::train {

class Trainer {
 public:
  explicit Trainer(const Config& cfg, const Runtime& rt = {});
  // One optimizer step over the next global batch.
  StepMetrics train_step();
  // Held-out evaluation (rank 0's result; collective under parallel strategies).
  EvalResult evaluate(int64_t num_samples);
  // Trains cfg.training.steps steps with a progress display, writes metrics.jsonl and
  // config.yaml in cfg.output.dir, evaluates, writes summary.json. Returns the eval.
  EvalResult run();

  // This rank's model (sharded under parallel strategies).
  qwen::Qwen2_5_VLImpl& model() { return parallel_->model(); }
  ParallelModel& parallel_model() { return *parallel_; }
  // Every parameter in full (collective over the job).
  std::map<std::string, torch::Tensor> full_parameters() { return parallel_->full_parameters(); }
  const data::ShapesDataset& dataset() const;  // data.dataset=shapes only
  // The next step's samples from the stream, split into training.micro_batches micro-batches
  // (data.batch_size samples, or packed to data.pack_tokens each). Pixel values only of the
  // samples this rank's vision replica encodes (all of them on one process).
  std::vector<std::vector<data::Sample>> next_step_samples();
  bool is_main() const { return rt_.rank == 0; }
  int64_t step() const { return step_; }  // optimizer steps taken (including those resumed from)

  // Writes the whole training state as checkpoint_root(cfg)/step-<step> (collective; see
  // checkpoint.h and docs/checkpoint_format.md), keeps the newest checkpoint.keep. Throws
  // on every rank when any rank fails to write; the previous checkpoints stay.
  std::string save_checkpoint();
  // Restores the training state from a checkpoint directory saved under any layout
  // (collective). Throws naming the file on a missing, truncated or corrupted one.
  void load_checkpoint(const std::string& dir);

 private:
  Config cfg_;
  Runtime rt_;
  std::unique_ptr<ParallelModel> parallel_;
  DataStream data_;
  int64_t step_ = 0;
};

}  // namespace dhp::train
