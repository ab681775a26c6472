#include "dhp/parallel/strategy.h"

#include <torch/torch.h>

#include <algorithm>

#include "dhp/core/error.h"
#include "dhp/core/memory.h"
#include "dhp/parallel/data_parallel.h"
#include "dhp/parallel/zero.h"

namespace dhp::parallel {
namespace {

using ShapeMap = std::map<std::string, std::vector<int64_t>>;

// Adds the squared L2 norm of `g` (summed in fp32) to `acc` (fp64, on g's device; no host sync).
void add_sq_norm(torch::Tensor& acc, const torch::Tensor& g) {
  auto sq = g.to(torch::kFloat32).pow(2).sum().to(torch::kFloat64);
  acc = acc.defined() ? acc + sq : sq;
}
// The sum (a 0-dim fp64 tensor; 0 on the CPU when nothing was added).
torch::Tensor or_zero(const torch::Tensor& acc) { return acc.defined() ? acc : torch::zeros({}, torch::kFloat64); }

// The elements of `params`, and of their optimizer state when there is one: the two
// moments, and fp32 masters unless the parameters are fp32, each over `state_slice`
// elements (ZeRO-1's slice; -1: as many as the parameters).
HeldElements held_by(const std::vector<optim::NamedParam>& params, bool optimizer, int64_t state_slice = -1) {
  HeldElements h;
  bool fp32 = true;
  for (const auto& p : params) {
    h.parameters += p.param.numel();
    fp32 = fp32 && p.param.scalar_type() == torch::kFloat32;
  }
  if (optimizer) h.optimizer_state = (fp32 ? 2 : 3) * (state_slice >= 0 ? state_slice : h.parameters);
  return h;
}

// Adds one piece per call; the piece's name is "<kind>/<parameter>".
struct PieceSink {
  std::vector<CheckpointPiece>& out;
  const std::string& param;
  const std::vector<int64_t>& shape;
  TpShard tp;
  int64_t tp_rank = 0, tp_size = 1;
  void add(const char* kind, const torch::Tensor& data, int64_t begin, bool write) const {
    CheckpointPiece c;
    c.name = std::string(kind) + "/" + param;
    c.shape = shape;
    c.tp = tp;
    c.tp_rank = tp_rank;
    c.tp_size = tp_size;
    c.begin = begin;
    c.data = data;
    c.write = write;
    out.push_back(std::move(c));
  }
};

// Parameters replicated over the module's data group (sp x dp), whole or tensor-parallel
// shards (tp_map_): none, dp, sp and tp. Gradients are summed over the data group before
// the step: by a bucketed all-reduce for AdamW, or reduce-scattered into ZeRO-1's slices.
class ReplicatedStrategy : public ModuleStrategy {
 public:
  using ModuleStrategy::ModuleStrategy;

  void apply(ModuleTarget& target) override {
    parallelize(target);
    const int64_t tp_coord = groups_.tp.rank();
    for (auto& p : target.parameters()) {
      const bool once_over_tp = tp_map_.count(p.name) || tp_coord == 0;  // TP shards count on every TP rank
      params_.push_back(std::move(p));
      once_over_tp_.push_back(once_over_tp);
      in_norm_.push_back(groups_.data.rank() == 0 && once_over_tp);
    }
  }

  void make_optimizer(const optim::AdamWOptions& o) override {
    // Elements of a ZeRO-1 slice are unique over the data group, so its slicing replaces
    // in_norm's data-rank condition.
    if (layout_.zero == 1) zero1_ = std::make_unique<Zero1AdamW>(params_, o, groups_.data, once_over_tp_);
    else adam_ = std::make_unique<optim::AdamW>(params_, o);
  }

  void zero_grad() override {
    if (zero1_) zero1_->zero_grad();
    else if (adam_) adam_->zero_grad();
  }

  torch::Tensor reduce_gradients() override {
    if (zero1_) {  // reduce-scattered into the optimizer's slices: no full gradient is summed
      zero1_->reduce_gradients();
      memory_mark("gradients reduced");
      return zero1_->grad_sq_norm();
    }
    if (groups_.data.size() > 1) {
      // Every member must reduce the same tensors: a parameter unused here is a zero gradient.
      std::vector<torch::Tensor> ps;
      for (auto& p : params_) {
        if (!p.param.grad().defined()) p.param.mutable_grad() = torch::zeros_like(p.param);
        ps.push_back(p.param);
      }
      all_reduce_grads(ps, groups_.data);
      memory_mark("gradients reduced");
    }
    torch::Tensor sq;
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto& g = params_[i].param.grad();
      if (in_norm_[i] && g.defined()) add_sq_norm(sq, g);
    }
    return or_zero(sq);
  }

  void scale_gradients(double factor) override {
    if (zero1_) {
      zero1_->scale_gradients(factor);
      return;
    }
    for (auto& p : params_)
      if (p.param.grad().defined()) p.param.grad().mul_(factor);
  }

  void step(double lr) override {
    if (zero1_) zero1_->step(lr);
    else adam_->step(lr);
  }

  void set_step_count(int64_t n) override {
    if (zero1_) zero1_->set_step_count(n);
    else if (adam_) adam_->set_step_count(n);
  }

  std::map<std::string, torch::Tensor> full_parameters() override {
    std::map<std::string, torch::Tensor> full;
    for (const auto& p : params_) {
      auto it = tp_map_.find(p.name);
      full[p.name] = it == tp_map_.end() ? p.param.detach().clone() : unshard(p.param.detach(), it->second, groups_.tp);
    }
    return full;
  }

  std::vector<CheckpointPiece> checkpoint_pieces(const ShapeMap& full_shapes) override {
    std::vector<CheckpointPiece> out;
    const bool data_first = groups_.data.rank() == 0;
    int64_t flat_at = 0;  // ZeRO-1: where parameter i starts in the flat vector
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto& p = params_[i];
      const auto it = tp_map_.find(p.name);
      const PieceSink sink{out, p.name, full_shapes.at(p.name), it == tp_map_.end() ? TpShard{} : it->second,
                           groups_.tp.rank(), groups_.tp.size()};
      const bool tp_unique = once_over_tp_[i];  // one TP rank writes a replicated parameter
      const bool fp32 = p.param.scalar_type() == torch::kFloat32;
      sink.add("param", p.param.detach().view({-1}), 0, data_first && tp_unique);
      if (zero1_) {
        const auto& z = *zero1_;
        const int64_t numel = p.param.numel(), lo = z.slice_begin(), hi = lo + z.state_numel();
        const int64_t b = std::max(flat_at, lo), e = std::min(flat_at + numel, hi);
        const int64_t begin = b - flat_at;
        flat_at += numel;
        if (b >= e) continue;
        // An fp32 model's masters equal its parameters: loaded, not saved.
        sink.add("master", z.master().narrow(0, b - lo, e - b), begin, tp_unique && !fp32);
        sink.add("exp_avg", z.exp_avg().narrow(0, b - lo, e - b), begin, tp_unique);
        sink.add("exp_avg_sq", z.exp_avg_sq().narrow(0, b - lo, e - b), begin, tp_unique);
      } else if (adam_) {
        const auto& st = adam_->state()[i];
        if (!fp32) sink.add("master", st.master.view({-1}), 0, data_first && tp_unique);
        sink.add("exp_avg", st.exp_avg.view({-1}), 0, data_first && tp_unique);
        sink.add("exp_avg_sq", st.exp_avg_sq.view({-1}), 0, data_first && tp_unique);
      }
    }
    return out;
  }

  HeldElements held() const override {
    return held_by(params_, adam_ || zero1_, zero1_ ? zero1_->state_numel() : -1);
  }

  bool whole_parameters() const override { return tp_map_.empty(); }

 protected:
  // What the strategy does to the module before its parameters are taken.
  virtual void parallelize(ModuleTarget& target) { (void)target; }
  TpShardMap tp_map_;

 private:
  std::vector<optim::NamedParam> params_;  // what the optimizer updates on this rank
  std::vector<bool> once_over_tp_;         // counted on one rank of its TP group (TP shards: on each)
  std::vector<bool> in_norm_;              // counted once in the global gradient norm
  std::unique_ptr<optim::AdamW> adam_;
  std::unique_ptr<Zero1AdamW> zero1_;
};

// Ulysses over the sp group; each rank holds the whole parameters.
class SequenceParallelStrategy : public ReplicatedStrategy {
 public:
  using ReplicatedStrategy::ReplicatedStrategy;

 protected:
  void parallelize(ModuleTarget& target) override { target.sequence_parallel(groups_.sp); }
};

// Megatron TP over the tp group; replicas over dp.
class TensorParallelStrategy : public ReplicatedStrategy {
 public:
  using ReplicatedStrategy::ReplicatedStrategy;

 protected:
  void parallelize(ModuleTarget& target) override { tp_map_ = target.tensor_parallel(groups_.tp); }
};

// ZeRO-3 over the dp group: each rank keeps one flat slice of every parameter; the stage
// gathers reduce-scatter the gradients in backward, so the slices' gradients are already
// the group's sums.
class FullyShardedStrategy : public ModuleStrategy {
 public:
  using ModuleStrategy::ModuleStrategy;

  void apply(ModuleTarget& target) override {
    zero3_ = target.fully_shard(groups_.dp);
    params_ = zero3_->shards();
  }

  void make_optimizer(const optim::AdamWOptions& o) override { adam_ = std::make_unique<optim::AdamW>(params_, o); }
  void zero_grad() override {
    if (adam_) adam_->zero_grad();
  }

  torch::Tensor reduce_gradients() override {
    torch::Tensor sq;  // every slice element is unique over the job
    for (const auto& p : params_)
      if (p.param.grad().defined()) add_sq_norm(sq, p.param.grad());
    return or_zero(sq);
  }

  void scale_gradients(double factor) override {
    for (auto& p : params_)
      if (p.param.grad().defined()) p.param.grad().mul_(factor);
  }

  void step(double lr) override { adam_->step(lr); }
  void set_step_count(int64_t n) override {
    if (adam_) adam_->set_step_count(n);
  }
  std::map<std::string, torch::Tensor> full_parameters() override { return zero3_->full_parameters(); }

  std::vector<CheckpointPiece> checkpoint_pieces(const ShapeMap& full_shapes) override {
    std::vector<CheckpointPiece> out;
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto& p = params_[i];
      const auto& shape = full_shapes.at(p.name);
      const PieceSink sink{out, p.name, shape, TpShard{}, 0, 1};
      // The slice holds elements [rank * chunk, +chunk) of the flattened parameter, padded.
      const int64_t chunk = p.param.numel(), total = c10::multiply_integers(shape);
      const int64_t lo = std::min(total, groups_.dp.rank() * chunk), n = std::min(total, lo + chunk) - lo;
      sink.add("param", p.param.detach().narrow(0, 0, n), lo, true);
      if (!adam_) continue;
      const auto& st = adam_->state()[i];
      if (p.param.scalar_type() != torch::kFloat32) sink.add("master", st.master.narrow(0, 0, n), lo, true);
      sink.add("exp_avg", st.exp_avg.narrow(0, 0, n), lo, true);
      sink.add("exp_avg_sq", st.exp_avg_sq.narrow(0, 0, n), lo, true);
    }
    return out;
  }

  HeldElements held() const override { return held_by(params_, adam_ != nullptr); }

  bool whole_parameters() const override { return false; }
  bool replicas_run_together() const override { return true; }
  torch::Tensor run_unit(const std::string& unit, const nn::StageFn& fn, const torch::Tensor& x) override {
    return zero3_->run(unit, fn, x);
  }

 private:
  std::unique_ptr<Zero3> zero3_;
  std::vector<optim::NamedParam> params_;  // this rank's slices
  std::unique_ptr<optim::AdamW> adam_;
};

}  // namespace

std::unique_ptr<ModuleStrategy> make_strategy(const dist::ModuleLayout& layout, const dist::ProcessGroups& groups) {
  DHP_CHECK(groups.member, "make_strategy: this rank does not run the ", layout.name, " module");
  switch (layout.strategy) {
    case dist::Strategy::kNone:
    case dist::Strategy::kDataParallel:
      return std::make_unique<ReplicatedStrategy>(layout, groups);
    case dist::Strategy::kSequenceParallel:
      return std::make_unique<SequenceParallelStrategy>(layout, groups);
    case dist::Strategy::kTensorParallel:
      return std::make_unique<TensorParallelStrategy>(layout, groups);
    case dist::Strategy::kZero3:
      return std::make_unique<FullyShardedStrategy>(layout, groups);
  }
  TORCH_INTERNAL_ASSERT(false, "unknown strategy ", static_cast<int>(layout.strategy));
}

}  // namespace dhp::parallel
