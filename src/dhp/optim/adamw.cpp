#include "dhp/optim/adamw.h"

#include <torch/torch.h>

#include <cmath>

namespace dhp::optim {

ParamSettings settings_for(const NamedParam& p, const AdamWOptions& o) {
  const ParamGroup* best = nullptr;
  for (const auto& g : o.groups) {
    if (p.name.rfind(g.prefix, 0) == 0 && (!best || g.prefix.size() > best->prefix.size())) best = &g;
  }
  ParamSettings s;
  s.lr_scale = best ? best->lr_scale : 1.0;
  const double wd = best && best->weight_decay >= 0 ? best->weight_decay : o.weight_decay;
  s.weight_decay = p.decay ? wd : 0.0;
  return s;
}

AdamW::AdamW(std::vector<NamedParam> params, AdamWOptions options)
    : params_(std::move(params)), options_(std::move(options)) {
  torch::NoGradGuard no_grad;
  for (const auto& p : params_) {
    settings_.push_back(settings_for(p, options_));
    State s;
    s.master = p.param.scalar_type() == torch::kFloat32 ? p.param : p.param.to(torch::kFloat32);
    s.exp_avg = torch::zeros_like(s.master);
    s.exp_avg_sq = torch::zeros_like(s.master);
    state_.push_back(std::move(s));
  }
}

void AdamW::step(double lr) {
  torch::NoGradGuard no_grad;
  ++step_;
  const double bc1 = 1.0 - std::pow(options_.beta1, static_cast<double>(step_));
  const double bc2 = 1.0 - std::pow(options_.beta2, static_cast<double>(step_));
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i].param;
    if (!p.grad().defined()) continue;
    auto& s = state_[i];
    auto g = p.grad().to(torch::kFloat32);
    const double plr = lr * settings_[i].lr_scale, wd = settings_[i].weight_decay;
    if (wd > 0) s.master.mul_(1.0 - plr * wd);
    s.exp_avg.mul_(options_.beta1).add_(g, 1.0 - options_.beta1);
    s.exp_avg_sq.mul_(options_.beta2).addcmul_(g, g, 1.0 - options_.beta2);
    auto denom = (s.exp_avg_sq / bc2).sqrt_().add_(options_.eps);
    s.master.addcdiv_(s.exp_avg, denom, -plr / bc1);
    if (!s.master.is_same(p)) p.copy_(s.master);
  }
}

void AdamW::zero_grad() {
  for (auto& p : params_) {
    if (p.param.grad().defined()) p.param.mutable_grad() = torch::Tensor();
  }
}

double lr_at(int64_t step, int64_t total, int64_t warmup, double lr, double min_lr) {
  if (warmup > 0 && step < warmup) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  const int64_t decay = std::max<int64_t>(1, total - warmup);
  const double t = std::min(1.0, static_cast<double>(step - warmup) / static_cast<double>(decay));
  return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(M_PI * t));
}

}  // namespace dhp::optim
