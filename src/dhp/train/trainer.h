// Training on one rank of a job (or alone): the parallel model, the data, one step at a
// time. Every rank builds the same global batch; ParallelModel decides what each computes.
// Rank 0 alone prints and writes the run directory. Not thread-safe.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dhp/data/loader.h"
#include "dhp/data/shapes.h"
#include "dhp/models/qwen2_5_vl/model.h"
#include "dhp/train/config.h"
#include "dhp/train/optim.h"
#include "dhp/train/parallel_model.h"

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
  double comm_s = 0;           // this rank's time inside collectives during the step
  int64_t comm_calls = 0;
  int64_t comm_bytes = 0;
  double samples_s = 0;        // making (or taking from the loader) this step's samples
  double update_s = 0;         // this rank's finish_step: gradient reductions, norm, clipping, optimizer
  double wait_s = 0;           // this rank's time blocked on the other module (schedule receives)
  double data_wait_s = 0;      // rank 0's time waiting for the data loader's samples
  int64_t skipped_samples = 0; // bad samples skipped so far (llava; see the log for the reasons)
  int64_t samples = 0;         // samples in the step (varies when packing to a token budget)
  // Per rank of the job, rank-major (rank 0 has them all; other ranks their own only).
  std::vector<double> peak_bytes_per_rank, comm_s_per_rank, busy_s_per_rank, idle_s_per_rank;
  std::vector<double> vision_s_per_rank, text_s_per_rank;  // time in each module's forward/backward
  std::vector<double> update_s_per_rank;                    // time in finish_step (update_s)
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
  // checkpoint.resume (constructor): nothing, a directory, or the newest usable one.
  void resume();
  // Held-out samples [start, start + count) (shapes: generated; llava: the eval files' good
  // samples in their seeded order, at most one epoch).
  std::vector<data::Sample> eval_samples(int64_t start, int64_t count);
  int64_t eval_size(int64_t wanted) const;  // how many held-out samples exist, up to wanted
  EvalResult evaluate_model(qwen::Qwen2_5_VLImpl& model, int64_t num_samples);
  Config cfg_;
  Runtime rt_;
  std::unique_ptr<ParallelModel> parallel_;
  std::unique_ptr<data::ShapesDataset> train_data_, eval_data_;  // data.dataset=shapes
  std::shared_ptr<const data::LlavaDataset> llava_;               // data.dataset=llava
  std::shared_ptr<const data::LlavaDataset> llava_eval_;          // data.eval_files
  std::unique_ptr<data::Loader> eval_loader_;                     // reads llava_eval_ from its start
  std::vector<data::Sample> eval_cache_;                          // the held-out samples read so far
  std::unique_ptr<data::Loader> loader_;                          // created at the first step
  // The stream position of the next sample a step will use (a packed micro-batch's
  // look-ahead that did not fit counts as unused).
  int64_t data_position() const;
  // The next sample of the stream with its pixels (the look-ahead first, if any).
  data::Sample take_sample();
  int64_t step_ = 0;
  int64_t sample_base_ = 0;  // the stream position training (re)started at
  int64_t next_sample_ = 0;  // shapes: the next stream position to generate
  std::optional<data::Sample> pending_;  // packing look-ahead, at stream position pending_position_
  int64_t pending_position_ = 0;
  int64_t fail_at_step_ = -1;  // DHP_TEST_FAIL_AT test hook
  int64_t kill_at_step_ = -1;  // DHP_TEST_KILL_AT test hook
  int64_t kill_in_save_ = -1;  // DHP_TEST_KILL_IN_SAVE test hook
};

}  // namespace dhp::train
