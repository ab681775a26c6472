// ParallelModel: the Qwen2.5-VL model on this rank with each module's strategy applied,
// and the step logic that makes every strategy train like one process.
//
// Colocated placement (this issue): both modules run on every rank of the job.
// A global micro-batch (the same list of samples on every rank) is split into contiguous
// chunks per data-parallel replica of each module:
//   vision replica v encodes the images of its chunk (sp: ragged window shards inside the
//   replica; tp: heads/MLP split; zero3/dp: one rank per replica);
//   when the two modules' replicas are the same rank sets (dhp, tp, zero3, dp, none), each
//   text replica uses its vision replica's output as is; otherwise the embeddings are
//   all-gathered across vision replicas and each text replica takes its samples' rows
//   (backward: the gradient rows of each text replica, summed over the job, reach every
//   vision rank that produced them);
//   text replica t runs the decoder on its chunk; its loss is divided by the number of
//   target tokens of the whole global batch, so summed gradients are the global mean's.
// finish_step(): gradients of replicated parameters are summed over each module's data
// group (sp x dp), the global gradient norm is computed once over unique elements across
// both modules and every rank, gradients are clipped, and each module's optimizer steps
// (AdamW, ZeRO-1 sharded AdamW, or AdamW over ZeRO-3 slices).
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dhp/data/shapes.h"
#include "dhp/dist/layout.h"
#include "dhp/dist/process_groups.h"
#include "dhp/models/qwen2_5_vl/model.h"
#include "dhp/train/config.h"
#include "dhp/train/optim.h"

namespace dhp::train {

struct Layouts {
  dist::ModuleLayout vision, text;
};

// The vision and text layouts of `cfg` on `world` colocated ranks, validated (strategy
// names, degrees that multiply to the ranks, heads / kv heads / vocabulary / MLP widths
// divisible, enough attention windows per micro-batch for sp). Throws dhp::Error naming
// the parallel.* keys and the numbers.
Layouts resolve_layouts(const Config& cfg, int64_t world);
// One line, e.g. "vision sp=4 zero=1 | text tp=2 dp=2".
std::string describe(const Layouts& l);

// Where this process sits in the job.
struct Runtime {
  int64_t rank = 0, world = 1;
  int64_t local_world = 0;             // ranks on this machine (0: all of them)
  std::shared_ptr<dist::Store> store;  // required when world > 1
  std::chrono::milliseconds timeout{300000};
};

// Builds the model for a config: presets, init from the seed, precision, checkpointing.
qwen::Qwen2_5_VL build_model(const Config& cfg);
std::vector<NamedParam> named_params(qwen::Qwen2_5_VLImpl& model);

class ParallelModel {
 public:
  ParallelModel(const Config& cfg, const Layouts& layouts, const Runtime& rt);
  ~ParallelModel();

  // Forward and backward of one global micro-batch; loss scaled by 1/`global_targets`.
  // Returns this rank's text replica's summed loss (0 on all but one rank per replica, so
  // a sum over the job is the micro-batch's loss sum).
  double forward_backward(const std::vector<data::Sample>& micro_batch, double global_targets);
  // Gradient sums, global-norm clipping (max_norm 0 = off), optimizer steps. Returns the
  // global gradient norm before clipping (equal on every rank).
  double finish_step(double lr, double max_norm);
  void zero_grad();

  // Every parameter in full with its single-process name and shape (collective).
  std::map<std::string, torch::Tensor> full_parameters();
  // Sum / max of one number over every rank of the job.
  double sum_over_job(double x) const;
  double max_over_job(double x) const;
  void barrier() const;

  // True when this rank's model is the whole single-process model (one rank, no ZeRO-3).
  bool plain() const;
  qwen::Qwen2_5_VLImpl& model() { return *model_; }
  const Layouts& layouts() const { return layouts_; }
  const Runtime& runtime() const { return rt_; }

 private:
  struct Module;
  torch::Tensor bridge(const torch::Tensor& vision_rows, const std::vector<data::Sample>& mb);
  std::vector<int64_t> chunk(int64_t n, int64_t replicas, int64_t replica) const;

  Config cfg_;
  Layouts layouts_;
  Runtime rt_;
  qwen::Qwen2_5_VL model_{nullptr};
  dist::Group job_;
  std::unique_ptr<Module> vision_, text_;
  bool same_replicas_ = true;  // each text replica is exactly one vision replica's ranks
};

}  // namespace dhp::train
