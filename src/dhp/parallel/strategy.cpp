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

// The elements of `params` (and of those that train), and of their optimizer state when
// there is one: the two moments, and fp32 masters unless the parameters are fp32, each over
// `state_slice` elements (ZeRO-1's slice; -1: as many as the trainable parameters).
HeldElements held_by(const std::vector<optim::NamedParam>& params, bool optimizer, int64_t state_slice = -1) {
  HeldElements h;
  bool fp32 = true;
  for (const auto& p : params) {
    h.parameters += p.param.numel();
    if (p.param.requires_grad()) h.trainable += p.param.numel();
    fp32 = fp32 && p.param.scalar_type() == torch::kFloat32;
  }
  if (optimizer) h.optimizer_state = (fp32 ? 2 : 3) * (state_slice >= 0 ? state_slice : h.trainable);
  return h;
}

// The parameters of `params` that train (requires_grad), and their indexes.
std::vector<size_t> trainable_indexes(const std::vector<optim::NamedParam>& params) {
  std::vector<size_t> out;
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].param.requires_grad()) out.push_back(i);
  return out;
}
template <class T>
std::vector<T> pick(const std::vector<T>& all, const std::vector<size_t>& at) {
  std::vector<T> out;
  for (auto i : at) out.push_back(all[i]);
  return out;
}

// Adds one piece per call; the piece's name is "<kind>/<parameter>".
struct PieceSink {
  std::vector<CheckpointPiece>& out;
  const std::string& param;
  const std::vector<int64_t>& shape;
  TpShard tp;
  int64_t tp_rank = 0, tp_size = 1;
  bool frozen = false;
  void add(const char* kind, const torch::Tensor& data, int64_t begin, bool write) const {
    CheckpointPiece c;
    c.frozen = frozen;
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
      const auto it = tp_map_.find(p.name);
      const bool sharded = it != tp_map_.end() && it->second.dim >= 0;
      const bool once_over_tp = sharded || tp_coord == 0;  // TP shards count on every TP rank
      if (it != tp_map_.end() && it->second.partial_grad && p.param.requires_grad()) tp_partial_.push_back(p.param);
      params_.push_back(std::move(p));
      once_over_tp_.push_back(once_over_tp);
      in_norm_.push_back(groups_.data.rank() == 0 && once_over_tp);
    }
    trained_ = trainable_indexes(params_);
  }

  void make_optimizer(const optim::AdamWOptions& o) override {
    if (trained_.empty()) return;  // all frozen: nothing to update
    const auto params = pick(params_, trained_);
    // Elements of a ZeRO-1 slice are unique over the data group, so its slicing replaces
    // in_norm's data-rank condition.
    if (layout_.zero == 1) {
      zero1_ = std::make_unique<Zero1AdamW>(params, o, groups_.data, pick(once_over_tp_, trained_), comm_.bucket_bytes);
    } else {
      adam_ = std::make_unique<optim::AdamW>(params, o);
    }
  }

  void arm_reduction() override {
    if (auto* r = reducer()) r->arm();
  }
  ReductionCounts reduction_counts() const override {
    return reducer_ ? ReductionCounts{reducer_->started(), reducer_->started_early(), 0} : ReductionCounts{};
  }

  void zero_grad() override {
    if (zero1_) zero1_->zero_grad();
    else if (adam_) adam_->zero_grad();
  }

  torch::Tensor reduce_gradients() override {
    const bool partial = !tp_partial_.empty() && groups_.tp.size() > 1;
    if (partial) {
      // Replicated halves of adapters beside sharded weights: each TP rank holds a partial sum.
      for (auto& p : tp_partial_)
        if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    }
    if (zero1_) {  // reduce-scattered into the optimizer's chunks: no full gradient is summed
      // Before the data sum (its buckets wait for it: reducer() does not overlap then).
      if (partial) all_reduce_grads(tp_partial_, groups_.tp);
      reducer()->finish();
      memory_mark("gradients reduced");
      return zero1_->grad_sq_norm();
    }
    if (auto* r = reducer()) {
      r->finish();
      memory_mark("gradients reduced");
    }
    if (partial) all_reduce_grads(tp_partial_, groups_.tp);  // after the data sum: sums commute
    torch::Tensor sq;
    for (auto i : trained_) {
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
    for (auto i : trained_)
      if (params_[i].param.grad().defined()) params_[i].param.grad().mul_(factor);
  }

  void step(double lr) override {
    if (zero1_) zero1_->step(lr);
    else if (adam_) adam_->step(lr);
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
    size_t k = 0;         // parameter i's index among the trained ones (the optimizer's)
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto& p = params_[i];
      const auto it = tp_map_.find(p.name);
      const bool frozen = !p.param.requires_grad();
      const PieceSink sink{out,
                           p.name,
                           full_shapes.at(p.name),
                           it == tp_map_.end() || it->second.dim < 0 ? TpShard{} : it->second,
                           groups_.tp.rank(),
                           groups_.tp.size(),
                           frozen};
      const bool tp_unique = once_over_tp_[i];  // one TP rank writes a replicated parameter
      const bool fp32 = p.param.scalar_type() == torch::kFloat32;
      sink.add("param", p.param.detach().view({-1}), 0, data_first && tp_unique);
      if (frozen) continue;  // no optimizer state
      const size_t st_k = k++;
      if (zero1_) {
        const auto& z = *zero1_;
        const auto h = z.held(st_k);
        if (h.n == 0) continue;
        // An fp32 model's masters equal its parameters: loaded, not saved.
        sink.add("master", z.master().narrow(0, h.state_begin, h.n), h.param_begin, tp_unique && !fp32);
        sink.add("exp_avg", z.exp_avg().narrow(0, h.state_begin, h.n), h.param_begin, tp_unique);
        sink.add("exp_avg_sq", z.exp_avg_sq().narrow(0, h.state_begin, h.n), h.param_begin, tp_unique);
      } else if (adam_) {
        const auto& st = adam_->state()[st_k];
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

  bool whole_parameters() const override {
    for (const auto& [name, how] : tp_map_)
      if (how.dim >= 0) return false;
    return true;
  }

 protected:
  // What the strategy does to the module before its parameters are taken.
  virtual void parallelize(ModuleTarget& target) { (void)target; }
  TpShardMap tp_map_;

 private:
  std::vector<optim::NamedParam> params_;  // the module's parameters on this rank
  std::vector<size_t> trained_;            // those that train (the optimizer's, in order)
  std::vector<bool> once_over_tp_;         // counted on one rank of its TP group (TP shards: on each)
  std::vector<torch::Tensor> tp_partial_;  // replicated over TP with partial gradients (TpShard::partial_grad)
  std::vector<bool> in_norm_;              // counted once in the global gradient norm
  std::unique_ptr<optim::AdamW> adam_;
  std::unique_ptr<Zero1AdamW> zero1_;
  std::unique_ptr<GradReducer> reducer_;

  // The group the reductions run on: a connection of the data group's members of their own
  // when they overlap the backward (nothing else communicates on it), else the data group.
  const dist::Group& reduce_group(bool overlap) const {
    return overlap && groups_.grads.connected() && groups_.grads.size() > 1 ? groups_.grads : groups_.data;
  }

  // The module's gradient reduction over the data group (made on first use), or null when
  // there is none (one data replica and no ZeRO-1, or nothing trains).
  GradReducer* reducer() {
    if (reducer_) return reducer_.get();
    if (trained_.empty() || (!zero1_ && groups_.data.size() == 1)) return nullptr;
    std::vector<torch::Tensor> ps;
    std::vector<std::string> names;
    std::vector<int64_t> bytes;
    for (auto i : trained_) {
      ps.push_back(params_[i].param);
      names.push_back(params_[i].name);
      bytes.push_back(ps.back().numel() * static_cast<int64_t>(ps.back().element_size()));
    }
    // ZeRO-1 with tensor-parallel partial gradients sums those over TP first: no overlap.
    const bool overlap = comm_.overlap && groups_.data.size() > 1 &&
                         !(zero1_ && !tp_partial_.empty() && groups_.tp.size() > 1);
    const dist::Group* g = &reduce_group(overlap);
    if (zero1_) {
      auto* z = zero1_.get();
      reducer_ = std::make_unique<GradReducer>(
          ps, names, z->buckets(), [z, g](size_t b) { return z->start_bucket(b, *g); },
          [z](size_t b, dist::Work& w) { z->land_bucket(b, w); }, overlap, comm_.buckets_in_flight);
      return reducer_.get();
    }
    auto runs = bucket_runs(bytes, comm_.bucket_bytes);
    auto start = [ps, runs, g](size_t b) {
      std::vector<torch::Tensor> parts;
      bool same = true;
      for (size_t i = runs[b].first; i < runs[b].second; ++i)
        same = same && ps[i].scalar_type() == ps[runs[b].first].scalar_type();
      const auto dtype = same ? ps[runs[b].first].scalar_type() : torch::kFloat32;
      for (size_t i = runs[b].first; i < runs[b].second; ++i) {
        const auto& grad = ps[i].grad();
        parts.push_back(grad.defined() ? grad.reshape({-1}).to(dtype) : torch::zeros({ps[i].numel()}, ps[i].options().dtype(dtype)));
      }
      return g->start_all_reduce_sum(torch::cat(parts));
    };
    auto land = [ps, runs](size_t b, dist::Work& w) {
      auto flat = w.wait();
      int64_t off = 0;
      for (size_t i = runs[b].first; i < runs[b].second; ++i) {
        auto p = ps[i];
        auto part = flat.narrow(0, off, p.numel()).view(p.sizes());
        if (p.grad().defined()) p.mutable_grad().copy_(part);
        else p.mutable_grad() = part.to(p.scalar_type()).clone();
        off += p.numel();
      }
    };
    reducer_ = std::make_unique<GradReducer>(ps, names, runs, start, land, overlap, comm_.buckets_in_flight);
    return reducer_.get();
  }
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
    zero3_->set_overlap(comm_.overlap && groups_.dp.size() > 1);
    params_ = zero3_->shards();
  }

  void make_optimizer(const optim::AdamWOptions& o) override {
    const auto trained = trainable_indexes(params_);
    if (!trained.empty()) adam_ = std::make_unique<optim::AdamW>(pick(params_, trained), o);
  }
  void zero_grad() override {
    if (adam_) adam_->zero_grad();
  }

  // Frozen slices never get a gradient (Zero3 reduce-scatters the trainable ones only).
  torch::Tensor reduce_gradients() override {
    zero3_->finish();  // the reduce-scatters still in flight land; prefetched gathers go
    torch::Tensor sq;  // every slice element is unique over the job
    for (const auto& p : params_)
      if (p.param.grad().defined()) add_sq_norm(sq, p.param.grad());
    return or_zero(sq);
  }

  void scale_gradients(double factor) override {
    for (auto& p : params_)
      if (p.param.grad().defined()) p.param.grad().mul_(factor);
  }

  void step(double lr) override {
    zero3_->finish();  // no gather prefetched before the update may serve after it
    if (adam_) adam_->step(lr);
  }
  void set_step_count(int64_t n) override {
    if (adam_) adam_->set_step_count(n);
  }
  std::map<std::string, torch::Tensor> full_parameters() override { return zero3_->full_parameters(); }

  std::vector<CheckpointPiece> checkpoint_pieces(const ShapeMap& full_shapes) override {
    std::vector<CheckpointPiece> out;
    size_t k = 0;  // index among the trained slices (the optimizer's)
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto& p = params_[i];
      const auto& shape = full_shapes.at(p.name);
      const bool frozen = !p.param.requires_grad();
      const PieceSink sink{out, p.name, shape, TpShard{}, 0, 1, frozen};
      // The slice holds elements [rank * chunk, +chunk) of the flattened parameter, padded.
      const int64_t chunk = p.param.numel(), total = c10::multiply_integers(shape);
      const int64_t lo = std::min(total, groups_.dp.rank() * chunk), n = std::min(total, lo + chunk) - lo;
      sink.add("param", p.param.detach().narrow(0, 0, n), lo, true);
      if (!adam_ || frozen) continue;
      const auto& st = adam_->state()[k++];
      if (p.param.scalar_type() != torch::kFloat32) sink.add("master", st.master.narrow(0, 0, n), lo, true);
      sink.add("exp_avg", st.exp_avg.narrow(0, 0, n), lo, true);
      sink.add("exp_avg_sq", st.exp_avg_sq.narrow(0, 0, n), lo, true);
    }
    return out;
  }

  HeldElements held() const override { return held_by(params_, adam_ != nullptr); }

  bool whole_parameters() const override { return false; }
  bool replicas_run_together() const override { return true; }
  ReductionCounts reduction_counts() const override { return {0, 0, zero3_->prefetch_hits()}; }
  torch::Tensor run_unit(const std::string& unit, const nn::StageFn& fn, const torch::Tensor& x) override {
    return zero3_->run(unit, fn, x);
  }

 private:
  std::unique_ptr<Zero3> zero3_;
  std::vector<optim::NamedParam> params_;  // this rank's slices
  std::unique_ptr<optim::AdamW> adam_;
};

}  // namespace

std::unique_ptr<ModuleStrategy> make_strategy(const dist::ModuleLayout& layout, const dist::ProcessGroups& groups,
                                              const CommOptions& comm) {
  DHP_CHECK(groups.member, "make_strategy: this rank does not run the ", layout.name, " module");
  switch (layout.strategy) {
    case dist::Strategy::kNone:
    case dist::Strategy::kDataParallel:
      return std::make_unique<ReplicatedStrategy>(layout, groups, comm);
    case dist::Strategy::kSequenceParallel:
      return std::make_unique<SequenceParallelStrategy>(layout, groups, comm);
    case dist::Strategy::kTensorParallel:
      return std::make_unique<TensorParallelStrategy>(layout, groups, comm);
    case dist::Strategy::kZero3:
      return std::make_unique<FullyShardedStrategy>(layout, groups, comm);
  }
  TORCH_INTERNAL_ASSERT(false, "unknown strategy ", static_cast<int>(layout.strategy));
}

}  // namespace dhp::parallel
