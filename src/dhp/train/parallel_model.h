// ParallelModel: the Qwen2.5-VL model on this rank with each module's strategy applied,
// and the step logic that makes every strategy and placement train like one process.
//
// The model is a list of module stages (qwen::module_names(): the vision encoder, then the
// text decoder), each with its layout, its process groups and its strategy object
// (parallel/strategy.h); the lifecycle calls (zero_grad, gradient reduction and norm,
// clipping, optimizer steps, full parameters, checkpoint pieces) loop over the stages and
// never ask which strategy a stage has.
// Placement: each module runs on its own global ranks (parallel.vision.ranks /
// parallel.text.ranks; every rank by default): colocated, disjoint or overlapping. A rank
// builds, parallelizes and optimizes only the modules it hosts; the other modules'
// parameters are released.
// A step runs the rank's schedule (schedule.h) over the global micro-batches (the same
// list of samples on every rank). Each module's data-parallel replicas take contiguous
// chunks of every micro-batch: vision replica v encodes the images of its chunk (sp:
// ragged window shards inside the replica; tp: heads/MLP split; zero3/dp: one rank per
// replica); parallel::Redistribute moves each text replica's embedding rows to all of its
// ranks (point-to-point, nothing moved where they already are) and the gradients back;
// text replica t runs the decoder on its chunk, its loss divided by the number of target
// tokens of the whole global batch, so summed gradients are the global mean's.
// finish_step(): each stage's strategy reduces its gradients (summed over the module's data
// group, sp x dp, or reduce-scattered) and gives its share of the squared norm; the global
// gradient norm is their sum over every rank, gradients are clipped, and each strategy
// steps its optimizer (AdamW, ZeRO-1 sharded AdamW, or AdamW over ZeRO-3 slices).
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dhp/data/sample.h"
#include "dhp/dist/process_groups.h"
#include "dhp/models/qwen2_5_vl/model.h"
#include "dhp/train/checkpoint.h"
#include "dhp/train/config.h"
#include "dhp/train/layouts.h"
#include "dhp/optim/adamw.h"
#include "dhp/parallel/redistribute.h"
#include "dhp/parallel/strategy.h"
#include "dhp/train/schedule.h"

namespace dhp::train {

// Failures a test asks a job to suffer, passed in explicitly (dhp train --inject-fault);
// -1 = none. Kills happen only in a job's first attempt (Runtime::restart == 0), so that
// the restarted job can finish.
struct FaultInjection {
  int64_t fail_rank = -1, fail_step = -1;  // that rank throws before that step (1-based)
  int64_t kill_rank = -1, kill_step = -1;  // that rank SIGKILLs itself before that step
  int64_t kill_in_save_step = -1;          // rank 0 SIGKILLs itself while saving that step's
                                           // checkpoint, after the rank files, before the commit
};

// Where this process sits in the job.
struct Runtime {
  int64_t rank = 0, world = 1;
  int64_t local_world = 0;             // ranks on this machine (0: all of them)
  int64_t local_rank = 0;              // this rank's index on its machine (LOCAL_RANK)
  std::shared_ptr<dist::Store> store;  // required when world > 1
  std::chrono::milliseconds timeout{300000};
  bool optimizer = true;               // false: forward only (no optimizer state is allocated)
  int64_t restart = 0;                 // restarts of the job so far (the launcher's count)
  std::string host;                    // this host, for messages ("name (address)" across hosts)
  FaultInjection faults;               // tests only; none by default
};

// Where a rank's tensors live and what its module groups and transfers communicate on.
struct Placement {
  torch::Device device{torch::kCPU};
  dist::Backend backend = dist::Backend::kGloo;
};
// The placement of `local_rank` in a job of `world` ranks, from training.device (`device`)
// and parallel.backend (`backend`), on a machine with `device_count` CUDA devices and a build
// with (`nccl`) or without NCCL. Pure. cpu: Gloo (nccl refused). cuda: one rank takes cuda:0;
// several take cuda:LOCAL_RANK under NCCL (more ranks than GPUs refused: NCCL will not put
// two ranks on one GPU) and cuda:(LOCAL_RANK mod count) under Gloo; cuda:N puts every rank
// on N (refused for several ranks under NCCL). auto is NCCL on CUDA when the build has it.
// Throws dhp::Error naming the setting and the way out.
Placement place_rank(const std::string& device, const std::string& backend, int64_t world, int64_t local_rank,
                     int64_t device_count, bool nccl);
// place_rank for this process (torch::cuda::device_count(), dist::nccl_available()).
Placement resolve_placement(const Config& cfg, const Runtime& rt);
torch::Device resolve_device(const Config& cfg, const Runtime& rt);

// training.beta1/beta2/eps/weight_decay and the per-module rates and decay (training.lr_vision,
// ..., as optim::ParamGroups over qwen::part_prefixes()) as the optimizer's options.
optim::AdamWOptions optimizer_options(const Config& cfg);
// parallel.overlap and parallel.bucket_mb as the strategies' communication options.
parallel::CommOptions comm_options(const Config& cfg);
// training.attention_block and training.attention as the attention kernel's options.
nn::VarlenAttentionOptions attention_options(const Config& cfg);

// Per encoder (module order, the decoder left out): true when it trains nothing (fine-tuning
// froze it whole), so the schedule sends it no gradients and it encodes without autograd.
std::vector<bool> forward_only_encoders(const Config& cfg);

// lora.from's adapters into `model` (checked against lora.*: dhp::Error naming the file).
void load_peft_adapters(const Config& cfg, qwen::Qwen2_5_VLImpl& model);

// Builds the model for a config: presets, init from the seed, model.from's weights (unless
// `load_from` is false), LoRA adapters (lora.*; lora.from's unless `load_from` is false),
// precision, checkpointing, the frozen parameters marked (model.*.freeze, LoRA's base).
qwen::Qwen2_5_VL build_model(const Config& cfg, bool load_from = true);

// finish_step's refusal of a gradient norm that is not finite (nothing was updated).
class NonFiniteGradient : public Error {
 public:
  using Error::Error;
};

class ParallelModel {
 public:
  ParallelModel(const Config& cfg, const Layouts& layouts, const Runtime& rt);
  ~ParallelModel();

  struct StepResult {
    double loss_sum = 0;  // this rank's share: a sum over the job is the step's loss sum
    double wait_s = 0;    // time blocked on the other module (receives, pending sends)
    double vision_s = 0;  // time in the vision tower's forward and backward (VF, VB)
    double text_s = 0;    // time in the decoder's forward and backward (TFB)
  };
  // Forward and backward of a step's global micro-batches through this rank's schedule;
  // losses scaled by 1/`global_targets`. Collective over the job. Takes the samples so that
  // their pixel values are freed as soon as they are packed for the vision tower.
  StepResult forward_backward(std::vector<std::vector<data::Sample>> micro_batches, double global_targets);
  // Logits (1, L, vocab) fp32 of every position of a one-sample batch, on rank 0 (undefined
  // elsewhere), computed under the layout: the vision module encodes, the embeddings move
  // to the text ranks, the decoder runs and (TP) the vocabulary shards are gathered.
  // Collective. Each module must be one replica (dp = 1).
  torch::Tensor forward_logits(const qwen::Batch& batch);
  // Which samples of micro-batch `mb` each module's data-parallel replicas take (one
  // assignment per module, encoders first; parallel.balance), the same on every rank: needs
  // the samples' ids and grids, not their pixels.
  std::vector<parallel::ReplicaSamples> assign(const std::vector<data::Sample>& mb) const;
  // Which samples of `mb` this rank's encoder replicas encode (they need their pixels).
  std::vector<bool> encodes(const std::vector<data::Sample>& mb) const;
  // What module `name`'s strategy holds on this rank ({0, 0} where it does not run).
  parallel::HeldElements held(const std::string& name) const;
  // Gradient reduction buckets this rank started so far over its modules, and how many of
  // them during a backward (parallel.overlap).
  parallel::ReductionCounts reduction_counts() const;
  // Gradient sums, global-norm clipping (max_norm 0 = off), optimizer steps. Returns the
  // global gradient norm before clipping (equal on every rank). Throws NonFiniteGradient on
  // every rank, before any update, when that norm is not finite.
  double finish_step(double lr, double max_norm);
  void zero_grad();

  // Every parameter in full with its single-process name and shape, on the CPU (collective). Complete
  // on rank 0 and on the ranks that host both modules; a rank that hosts one module gets
  // that module's parameters.
  std::map<std::string, torch::Tensor> full_parameters();
  // This rank's schedule for a step of `micro_batches`.
  std::vector<Action> schedule(int64_t micro_batches) const;
  // Sum / max of one number over every rank of the job.
  double sum_over_job(double x) const;
  double max_over_job(double x) const;
  // Every rank's `x` (same length everywhere), rank-major: result[r * x.size() + i].
  std::vector<double> gather_over_job(const std::vector<double>& x) const;
  void barrier() const;
  // Every rank's `s`, rank-major, on every rank (collective).
  std::vector<std::string> all_gather_strings(const std::string& s) const;

  // What this rank holds of every trainable parameter and optimizer-state tensor, for
  // checkpoints (checkpoint.h): views into the live tensors; across the job each element has
  // exactly one writer. Loading all pieces (then set_optimizer_steps) restores the training
  // state; frozen parameters are left out (they come from model.from or the seed, as at the
  // start).
  std::vector<CheckpointPiece> checkpoint_pieces();
  void set_optimizer_steps(int64_t n);

  // True when this rank's model is the whole single-process model (one rank, no ZeRO-3).
  bool plain() const;
  qwen::Qwen2_5_VLImpl& model() { return *model_; }
  const Layouts& layouts() const { return layouts_; }
  const Runtime& runtime() const { return rt_; }
  const Config& config() const { return cfg_; }
  const torch::Device& device() const { return device_; }  // where the model and the batches live

 private:
  struct Stage;
  struct Transfer;
  struct MicroBatchState;
  Stage& decoder();          // the last module: takes the encoders' rows, computes the loss
  int64_t encoders() const;  // the modules before it
  // This rank's replica's output rows of encoder `encoder` for micro-batch `mb` (0 rows
  // when its samples have nothing for it).
  torch::Tensor encode_chunk(int64_t encoder, std::vector<data::Sample>& mb, const MicroBatchState& st,
                             int64_t micro_batch);
  // Decoder forward and backward of this rank's replica's samples of `mb`; returns the loss
  // sum this rank reports, a 0-dim fp64 tensor on the device (undefined on TP ranks other
  // than the first).
  torch::Tensor decode_chunk(std::vector<data::Sample>& mb, MicroBatchState& st, double global_targets);
  // Encoder `encoder`'s output rows for `batch` ((0, hidden) when it has no input for it).
  torch::Tensor encode(int64_t encoder, const qwen::Batch& batch);
  // Transfer action `a` (SA / RA / SG / RG) of `plan`, posted as train/transfers.h says:
  // sends from `local` (this rank's source rows, may be undefined when it has none) and,
  // at RA / RG, the received (rows, hidden) tensor (undefined at SA / SG).
  torch::Tensor transfer(const Action& a, const parallel::RedistributePlan& plan, const torch::Tensor& local);
  // The group a transfer action's messages travel on (train/transfers.h: Channel).
  const dist::Group& channel(const Action& a) const;
  void run_action(const Action& a, std::vector<std::vector<data::Sample>>& micro, double global_targets,
                  std::vector<MicroBatchState>& state, StepResult& result, torch::Tensor& loss_sum);
  void release_parameters(const parallel::ModuleTarget& target);  // frees a module this rank does not host
  // Every parameter of one stage in full on rank 0 and on the stage's ranks (collective).
  void gather_full(Stage& s, std::map<std::string, torch::Tensor>& out);
  // model.from: this rank's slices of every parameter (and master) from an HF directory;
  // lora.from: the adapters' from a PEFT directory.
  void load_weights();
  // Every stage's checkpoint pieces, the frozen parameters' too or not.
  std::vector<CheckpointPiece> pieces(bool frozen_too);

  Config cfg_;
  Layouts layouts_;
  Runtime rt_;
  qwen::Qwen2_5_VL model_{nullptr};
  dist::Group job_;    // every rank, Gloo on host tensors: bookkeeping (sums, strings, barriers)
  dist::Group acts_;   // the activations' channel (train/transfers.h); job_ itself under Gloo
  dist::Group grads_;  // the gradients' channel; job_ itself under Gloo
  std::vector<bool> forward_only_;  // per encoder: frozen whole, no gradients (forward_only_encoders)
  std::vector<Stage> stages_;  // the model's modules in order (Layouts::modules)
  // Name -> shape of every parameter, kept for those released on this rank.
  std::map<std::string, std::vector<int64_t>> full_shapes_;
  torch::Dtype dtype_ = torch::kFloat32;  // the model's parameter (and activation) dtype
  torch::Device device_{torch::kCPU};     // training.device
};

}  // namespace dhp::train
