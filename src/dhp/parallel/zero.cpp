#include "dhp/parallel/zero.h"

#include <torch/torch.h>

#include <cmath>

namespace dhp::parallel {

Zero1AdamW::Zero1AdamW(std::vector<train::NamedParam> params, train::AdamWOptions options, dist::Group group)
    : params_(std::move(params)), options_(options), group_(std::move(group)) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> flat, decay;
  for (const auto& p : params_) {
    flat.push_back(p.param.detach().reshape({-1}).to(torch::kFloat32));
    decay.push_back(torch::full({p.param.numel()}, p.decay ? 1.f : 0.f));
  }
  total_ = 0;
  for (const auto& f : flat) total_ += f.numel();
  const int64_t ws = group_.size();
  padded_ = (total_ + ws - 1) / ws * ws;
  n_ = padded_ / ws;
  lo_ = group_.rank() * n_;
  auto all = torch::cat(flat), all_decay = torch::cat(decay);
  auto pad = [&](const torch::Tensor& t) { return torch::cat({t, torch::zeros({padded_ - total_})}); };
  master_ = pad(all).narrow(0, lo_, n_).clone();
  decay_ = pad(all_decay).narrow(0, lo_, n_).clone();
  exp_avg_ = torch::zeros({n_});
  exp_avg_sq_ = torch::zeros({n_});
}

torch::Tensor Zero1AdamW::flat_grads() const {
  std::vector<torch::Tensor> parts;
  for (const auto& p : params_) {
    auto g = p.param.grad();
    parts.push_back(g.defined() ? g.reshape({-1}).to(torch::kFloat32) : torch::zeros({p.param.numel()}));
  }
  parts.push_back(torch::zeros({padded_ - total_}));
  return torch::cat(parts);
}

void Zero1AdamW::step(double lr) {
  torch::NoGradGuard no_grad;
  ++step_;
  const double bc1 = 1.0 - std::pow(options_.beta1, static_cast<double>(step_));
  const double bc2 = 1.0 - std::pow(options_.beta2, static_cast<double>(step_));
  auto g = flat_grads().narrow(0, lo_, n_);
  if (options_.weight_decay > 0) master_.mul_(1.0 - decay_ * (lr * options_.weight_decay));
  exp_avg_.mul_(options_.beta1).add_(g, 1.0 - options_.beta1);
  exp_avg_sq_.mul_(options_.beta2).addcmul_(g, g, 1.0 - options_.beta2);
  auto denom = (exp_avg_sq_ / bc2).sqrt_().add_(options_.eps);
  master_.addcdiv_(exp_avg_, denom, -lr / bc1);
  auto full = group_.all_gather(master_, 0);  // (padded) every rank's updated slice
  int64_t off = 0;
  for (auto& p : params_) {
    const int64_t n = p.param.numel();
    p.param.copy_(full.narrow(0, off, n).view_as(p.param));
    off += n;
  }
}

void Zero1AdamW::zero_grad() {
  for (auto& p : params_) {
    if (p.param.grad().defined()) p.param.mutable_grad() = torch::Tensor();
  }
}

}  // namespace dhp::parallel
