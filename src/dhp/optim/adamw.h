// AdamW with decoupled weight decay and fp32 master weights, and the learning-rate
// schedule. Local (no communication); not thread-safe. The distributed optimizers build on
// it (parallel/zero.h slices its state, parallel/strategy.h picks one per module).
#pragma once

#include <torch/types.h>

#include <string>
#include <vector>

namespace dhp::optim {

// Settings of the parameters whose names start with `prefix` (per-module learning rates and
// weight decay: training.lr_vision, ...). The longest matching prefix wins.
struct ParamGroup {
  std::string prefix;
  double lr_scale = 1.0;       // the group's learning rate over the default: the same schedule, scaled
  double weight_decay = -1.0;  // the group's decoupled weight decay (< 0: AdamWOptions::weight_decay)
};

struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.0;
  std::vector<ParamGroup> groups;  // empty: every parameter takes the defaults
};

struct NamedParam {
  std::string name;
  torch::Tensor param;  // the model's parameter (fp32 or bf16)
  bool decay = true;    // decoupled weight decay applies
};

// What one parameter's update uses: its group's lr scale and weight decay (0 where the
// parameter takes no decay: norms, biases).
struct ParamSettings {
  double lr_scale = 1.0;
  double weight_decay = 0.0;
};
ParamSettings settings_for(const NamedParam& p, const AdamWOptions& o);

// Keeps an fp32 master copy of every non-fp32 parameter and fp32 moments; step() updates
// the masters from the (any dtype) gradients and writes them back into the parameters.
class AdamW {
 public:
  AdamW(std::vector<NamedParam> params, AdamWOptions options);
  // One update with learning rate `lr` (times each parameter's group scale). Parameters
  // without a gradient are skipped.
  void step(double lr);
  void zero_grad();
  int64_t step_count() const { return step_; }
  void set_step_count(int64_t n) { step_ = n; }  // resuming: the bias corrections continue from n
  const std::vector<NamedParam>& params() const { return params_; }

  // Per parameter: fp32 master (the parameter itself when it is fp32) and moments. Writable
  // in place (checkpoint loading).
  struct State {
    torch::Tensor master, exp_avg, exp_avg_sq;
  };
  const std::vector<State>& state() const { return state_; }

 private:
  std::vector<NamedParam> params_;
  std::vector<ParamSettings> settings_;  // per parameter
  std::vector<State> state_;
  AdamWOptions options_;
  int64_t step_ = 0;
};

// Linear warm-up from 0 to `lr` over `warmup` steps, then cosine decay to `min_lr` at
// `total` steps. `step` counts from 0.
double lr_at(int64_t step, int64_t total, int64_t warmup, double lr, double min_lr);

}  // namespace dhp::optim
