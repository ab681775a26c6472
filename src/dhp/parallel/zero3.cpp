#include "dhp/parallel/zero3.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/torch.h>

#include "dhp/core/error.h"

namespace dhp::parallel {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

struct StageHolder : torch::CustomClassHolder {
  Zero3* zero = nullptr;
  std::string unit;
  nn::StageFn fn;
  nn::RngState rng;  // the forward's random state, replayed by the recomputation (LoRA dropout)
};

}  // namespace

struct Zero3Stage : torch::autograd::Function<Zero3Stage> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, at::TensorList /*shards*/,
                               c10::intrusive_ptr<StageHolder> h) {
    ctx->save_for_backward({x});
    ctx->saved_data["holder"] = c10::IValue::make_capsule(h);
    const auto& u = h->zero->units_.at(h->unit);
    if (nn::random_ops_in_use()) h->rng = nn::RngState::save(x.device());
    torch::NoGradGuard no_grad;
    h->zero->gather(u);
    h->zero->prefetch_after(u, Zero3::Pass::kForward);
    torch::Tensor y;
    try {
      y = h->fn(x);
    } catch (...) {
      h->zero->release(u);
      throw;
    }
    h->zero->release(u);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto h = c10::static_intrusive_pointer_cast<StageHolder>(ctx->saved_data["holder"].toCapsule());
    Zero3& z = *h->zero;
    const auto& u = z.units_.at(h->unit);
    auto x = ctx->get_saved_variables()[0].detach();
    const bool x_grad = x.is_floating_point() && ctx->needs_input_grad(0);
    if (x_grad) x.requires_grad_(true);
    z.gather(u);
    z.prefetch_after(u, Zero3::Pass::kBackward);
    std::vector<torch::Tensor> inputs;
    if (x_grad) inputs.push_back(x);
    const auto trained = z.trained(u);  // frozen parameters: no gradient, no reduce-scatter
    for (auto i : trained) inputs.push_back(z.params_[i].param);
    variable_list g;
    if (!inputs.empty()) {
      torch::AutoGradMode enable(true);
      nn::RngState now;
      if (!h->rng.empty()) {
        now = nn::RngState::save(x.device());
        h->rng.restore();
      }
      auto y = h->fn(x);
      if (!now.empty()) now.restore();
      g = torch::autograd::grad({y}, inputs, {grads[0]}, /*retain_graph=*/false, /*create_graph=*/false,
                                /*allow_unused=*/true);
    }
    std::vector<torch::Tensor> param_grads(g.begin() + (x_grad ? 1 : 0), g.end());
    std::vector<torch::Tensor> slices;
    if (z.overlap_) {
      // Lands later: the previous unit's now, after this one's compute ran beside it; every
      // one of this backward when it ends, into the slices' .grad (as their gradient
      // accumulators would: summed over the backward first, then added).
      z.start_reduce_scatter(trained, param_grads);
      z.land_reductions(1);
      if (!z.flush_queued_) {
        z.flush_queued_ = true;
        torch::autograd::Engine::get_default_engine().queue_callback([&z] {
          z.flush_queued_ = false;
          z.land_reductions(0);
          z.flush_landed();
        });
      }
    } else {
      slices = z.reduce_scatter(trained, param_grads);
    }
    param_grads.clear();
    z.release(u);
    variable_list out;
    out.push_back(x_grad ? g[0] : torch::Tensor());
    size_t k = 0;
    for (auto i : u.params) {
      out.push_back(z.params_[i].trainable && !slices.empty() ? slices[k++] : torch::Tensor());
    }
    out.push_back(torch::Tensor());  // holder
    return out;
  }
};

Zero3::Zero3(const std::vector<optim::NamedParam>& params, const std::vector<std::string>& units, dist::Group group)
    : group_(std::move(group)) {
  torch::NoGradGuard no_grad;
  const int64_t ws = group_.size();
  for (const auto& u : units) units_[u];
  for (const auto& np : params) {
    const std::string& name = np.name;
    std::string best;
    for (const auto& u : units) {
      if (name.size() > u.size() && name.compare(0, u.size(), u) == 0 && name[u.size()] == '.' &&
          u.size() > best.size())
        best = u;
    }
    DHP_CHECK(!best.empty(), "ZeRO-3: parameter ", name, " belongs to no stage");
    Param p;
    p.name = name;
    p.param = np.param;
    p.shape = p.param.sizes().vec();
    p.numel = p.param.numel();
    p.decay = np.decay;
    p.chunk = (p.numel + ws - 1) / ws;
    auto flat = torch::zeros({p.chunk * ws}, p.param.options());
    flat.narrow(0, 0, p.numel).copy_(p.param.reshape({-1}));
    p.trainable = np.param.requires_grad();  // frozen (fine-tuning): a slice without gradient or state
    p.shard = flat.narrow(0, group_.rank() * p.chunk, p.chunk).clone().requires_grad_(p.trainable);
    auto& unit = units_[best];
    unit.params.push_back(params_.size());
    unit.width += p.chunk;
    params_.push_back(std::move(p));
  }
  for (auto& [name, u] : units_) release(u);
}

void Zero3::gather(const Unit& u) {
  torch::NoGradGuard no_grad;
  if (u.params.empty()) return;
  torch::Tensor all;
  auto it = prefetched_.find(&u);
  if (it != prefetched_.end()) {
    all = it->second.wait();
    prefetched_.erase(it);
    ++hits_;
  } else {
    std::vector<torch::Tensor> mine;
    for (auto i : u.params) mine.push_back(params_[i].shard.detach());
    all = group_.all_gather(torch::cat(mine), 0);
    ++gathers_;
  }
  all = all.view({group_.size(), u.width});  // row r: rank r's slices
  int64_t off = 0;
  for (auto i : u.params) {
    auto& p = params_[i];
    auto full = all.narrow(1, off, p.chunk).reshape({-1}).narrow(0, 0, p.numel).view(p.shape);
    p.param.set_data(full);
    off += p.chunk;
  }
}

void Zero3::prefetch_after(const Unit& u, Pass pass) {
  auto& after = after_[pass == Pass::kBackward ? 1 : 0];
  if (last_ && last_pass_ == pass) after[last_] = &u;
  last_ = &u;
  last_pass_ = pass;
  if (!overlap_) return;
  const auto it = after.find(&u);
  if (it == after.end()) return;
  const Unit* next = it->second;
  if (next == &u || next->params.empty() || prefetched_.count(next) > 0 || prefetched_.size() >= 2) return;
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> mine;
  for (auto i : next->params) mine.push_back(params_[i].shard.detach());
  prefetched_.emplace(next, group_.start_all_gather(torch::cat(mine), 0));
  ++gathers_;
}

void Zero3::start_reduce_scatter(const std::vector<size_t>& params, const std::vector<torch::Tensor>& grads) {
  torch::NoGradGuard no_grad;
  if (params.empty()) return;
  const std::vector<int64_t> ones(static_cast<size_t>(group_.size()), 1);
  reductions_.push_back({params, group_.start_all_to_all(scatter_rows(params, grads), ones, ones)});
}

void Zero3::land_reductions(size_t keep) {
  torch::NoGradGuard no_grad;
  while (reductions_.size() > keep) {
    auto r = std::move(reductions_.front());
    reductions_.erase(reductions_.begin());
    const auto slices = slices_of(r.params, r.work.wait().sum(0));
    for (size_t k = 0; k < r.params.size(); ++k) {
      auto it = landed_.find(r.params[k]);
      if (it == landed_.end()) landed_.emplace(r.params[k], slices[k]);
      else it->second.add_(slices[k]);
    }
  }
}

void Zero3::flush_landed() {
  torch::NoGradGuard no_grad;
  for (auto& [i, g] : landed_) {
    auto& shard = params_[i].shard;
    if (shard.grad().defined()) shard.mutable_grad().add_(g);
    else shard.mutable_grad() = g;
  }
  landed_.clear();
}

void Zero3::finish() {
  land_reductions(0);
  flush_landed();
  for (auto& [unit, work] : prefetched_) work.wait();
  prefetched_.clear();
}

void Zero3::release(const Unit& u) {
  for (auto i : u.params) params_[i].param.set_data(torch::empty({0}, params_[i].param.options()));
}

std::vector<size_t> Zero3::trained(const Unit& u) const {
  std::vector<size_t> out;
  for (auto i : u.params)
    if (params_[i].trainable) out.push_back(i);
  return out;
}

torch::Tensor Zero3::scatter_rows(const std::vector<size_t>& params, const std::vector<torch::Tensor>& grads) const {
  const int64_t ws = group_.size();
  std::vector<torch::Tensor> rows;  // each (ws, chunk): row j goes to rank j
  for (size_t k = 0; k < params.size(); ++k) {
    const auto& p = params_[params[k]];
    auto flat = torch::zeros({p.chunk * ws}, p.shard.options().requires_grad(false));
    if (grads[k].defined()) flat.narrow(0, 0, p.numel).copy_(grads[k].reshape({-1}));
    rows.push_back(flat.view({ws, p.chunk}));
  }
  return torch::cat(rows, 1);  // (ws, width)
}

std::vector<torch::Tensor> Zero3::slices_of(const std::vector<size_t>& params, const torch::Tensor& recv) const {
  std::vector<torch::Tensor> out;
  int64_t off = 0;
  for (auto i : params) {
    out.push_back(recv.narrow(0, off, params_[i].chunk).clone());
    off += params_[i].chunk;
  }
  return out;
}

std::vector<torch::Tensor> Zero3::reduce_scatter(const std::vector<size_t>& params,
                                                 const std::vector<torch::Tensor>& grads) const {
  torch::NoGradGuard no_grad;
  if (params.empty()) return {};  // a frozen unit: nothing to reduce (the same on every rank)
  const std::vector<int64_t> ones(static_cast<size_t>(group_.size()), 1);
  auto recv = group_.all_to_all(scatter_rows(params, grads), ones, ones).sum(0);  // (width): my slice, summed
  return slices_of(params, recv);
}

torch::Tensor Zero3::run(const std::string& unit, const nn::StageFn& fn, const torch::Tensor& x) {
  auto it = units_.find(unit);
  DHP_CHECK(it != units_.end(), "ZeRO-3: no stage named ", unit);
  auto h = c10::make_intrusive<StageHolder>();
  h->zero = this;
  h->unit = unit;
  h->fn = fn;
  std::vector<torch::Tensor> shards;
  for (auto i : it->second.params) shards.push_back(params_[i].shard);
  return Zero3Stage::apply(x, at::TensorList(shards), h);
}

nn::StageRunner Zero3::runner() {
  return [this](const std::string& name, const nn::StageFn& fn, const torch::Tensor& x) { return run(name, fn, x); };
}

std::vector<optim::NamedParam> Zero3::shards() const {
  std::vector<optim::NamedParam> out;
  for (const auto& p : params_) {
    out.push_back({p.name, p.shard, p.decay});
  }
  return out;
}

std::map<std::string, torch::Tensor> Zero3::full_parameters() {
  std::map<std::string, torch::Tensor> out;
  for (auto& [name, u] : units_) {
    gather(u);
    for (auto i : u.params) out[params_[i].name] = params_[i].param.detach().clone();
    release(u);
  }
  return out;
}

}  // namespace dhp::parallel
