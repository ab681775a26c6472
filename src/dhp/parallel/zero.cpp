#include "dhp/parallel/zero.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "dhp/core/error.h"

namespace dhp::parallel {

Zero1AdamW::Zero1AdamW(std::vector<optim::NamedParam> params, optim::AdamWOptions options, dist::Group group,
                       std::vector<bool> in_norm)
    : params_(std::move(params)), options_(options), group_(std::move(group)) {
  torch::NoGradGuard no_grad;
  // The state lives where the parameters do (every tensor below is created on that device).
  const auto on = torch::TensorOptions().dtype(torch::kFloat32).device(
      params_.empty() ? torch::Device(torch::kCPU) : params_.front().param.device());
  DHP_CHECK(in_norm.empty() || in_norm.size() == params_.size(), "Zero1AdamW: ", in_norm.size(),
            " in_norm flags for ", params_.size(), " parameters");
  std::vector<torch::Tensor> flat, decay, lr_scale, weight_decay;
  bool uniform = true;  // every parameter on the default rate and decay: the scalar update
  for (const auto& p : params_) {
    const auto st = optim::settings_for(p, options_);
    uniform = uniform && st.lr_scale == 1.0 && st.weight_decay == (p.decay ? options_.weight_decay : 0.0);
    flat.push_back(p.param.detach().reshape({-1}).to(torch::kFloat32));
    decay.push_back(torch::full({p.param.numel()}, p.decay ? 1.f : 0.f, on));
    lr_scale.push_back(torch::full({p.param.numel()}, st.lr_scale, on));
    weight_decay.push_back(torch::full({p.param.numel()}, st.weight_decay, on));
  }
  if (!params_.empty()) dtype_ = params_.front().param.scalar_type();
  for (const auto& p : params_) {
    if (p.param.scalar_type() != dtype_) dtype_ = torch::kFloat32;
  }
  total_ = 0;
  for (const auto& f : flat) total_ += f.numel();
  const int64_t ws = group_.size();
  padded_ = (total_ + ws - 1) / ws * ws;
  n_ = padded_ / ws;
  lo_ = group_.rank() * n_;
  auto pad = [&](const std::vector<torch::Tensor>& parts) {
    return torch::cat({torch::cat(parts), torch::zeros({padded_ - total_}, on)}).narrow(0, lo_, n_).clone();
  };
  master_ = pad(flat);
  if (uniform) {
    decay_ = pad(decay);  // the 0/1 mask of the shared decay
  } else {
    lr_scale_ = pad(lr_scale);
    weight_decay_ = pad(weight_decay);
  }
  // The parameters counted in the norm, clipped to this rank's slice [lo_, lo_ + n_).
  int64_t off = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t b = std::max(off, lo_), e = std::min(off + params_[i].param.numel(), lo_ + n_);
    if ((in_norm.empty() || in_norm[i]) && b < e) {
      if (!norm_ranges_.empty() && norm_ranges_.back().second == b - lo_) norm_ranges_.back().second = e - lo_;
      else norm_ranges_.emplace_back(b - lo_, e - lo_);
    }
    off += params_[i].param.numel();
  }
  exp_avg_ = torch::zeros({n_}, on);
  exp_avg_sq_ = torch::zeros({n_}, on);
}

torch::Tensor Zero1AdamW::flat_grads() const {
  std::vector<torch::Tensor> parts;
  const auto opts = master_.options().dtype(dtype_);
  for (const auto& p : params_) {
    auto g = p.param.grad();
    parts.push_back(g.defined() ? g.reshape({-1}).to(dtype_) : torch::zeros({p.param.numel()}, opts));
  }
  parts.push_back(torch::zeros({padded_ - total_}, opts));
  return torch::cat(parts);
}

void Zero1AdamW::reduce_gradients() {
  torch::NoGradGuard no_grad;
  grad_ = group_.reduce_scatter_sum(flat_grads());
}

torch::Tensor Zero1AdamW::grad_sq_norm() const {
  DHP_CHECK(grad_.defined(), "Zero1AdamW::grad_sq_norm before reduce_gradients");
  auto sq = torch::zeros({}, grad_.options().dtype(torch::kFloat64));
  for (const auto& r : norm_ranges_) sq += grad_.narrow(0, r.first, r.second - r.first).pow(2).sum().to(torch::kFloat64);
  return sq;
}

void Zero1AdamW::scale_gradients(double factor) {
  DHP_CHECK(grad_.defined(), "Zero1AdamW::scale_gradients before reduce_gradients");
  grad_.mul_(factor);
}

void Zero1AdamW::step(double lr) {
  torch::NoGradGuard no_grad;
  if (!grad_.defined()) reduce_gradients();
  ++step_;
  const double bc1 = 1.0 - std::pow(options_.beta1, static_cast<double>(step_));
  const double bc2 = 1.0 - std::pow(options_.beta2, static_cast<double>(step_));
  const auto& g = grad_;
  if (lr_scale_.defined()) master_.mul_(1.0 - weight_decay_ * lr_scale_ * lr);
  else if (options_.weight_decay > 0) master_.mul_(1.0 - decay_ * (lr * options_.weight_decay));
  exp_avg_.mul_(options_.beta1).add_(g, 1.0 - options_.beta1);
  exp_avg_sq_.mul_(options_.beta2).addcmul_(g, g, 1.0 - options_.beta2);
  auto denom = (exp_avg_sq_ / bc2).sqrt_().add_(options_.eps);
  if (lr_scale_.defined()) master_.addcmul_(exp_avg_ / denom, lr_scale_, -lr / bc1);
  else master_.addcdiv_(exp_avg_, denom, -lr / bc1);
  grad_ = torch::Tensor();
  // Gathered in the parameters' dtype: the copy into them would round to it anyway.
  auto full = group_.all_gather(master_.to(dtype_), 0);  // (padded) every rank's updated slice
  int64_t off = 0;
  for (auto& p : params_) {
    const int64_t n = p.param.numel();
    p.param.copy_(full.narrow(0, off, n).view_as(p.param));
    off += n;
  }
}

void Zero1AdamW::zero_grad() {
  grad_ = torch::Tensor();
  for (auto& p : params_) {
    if (p.param.grad().defined()) p.param.mutable_grad() = torch::Tensor();
  }
}

}  // namespace dhp::parallel
