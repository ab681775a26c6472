#include "dhp/parallel/zero.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "dhp/core/error.h"
#include "dhp/parallel/data_parallel.h"

namespace dhp::parallel {

Zero1AdamW::Zero1AdamW(std::vector<optim::NamedParam> params, optim::AdamWOptions options, dist::Group group,
                       std::vector<bool> in_norm, int64_t bucket_bytes)
    : params_(std::move(params)), options_(options), group_(std::move(group)) {
  torch::NoGradGuard no_grad;
  // The state lives where the parameters do (every tensor below is created on that device).
  const auto on = torch::TensorOptions().dtype(torch::kFloat32).device(
      params_.empty() ? torch::Device(torch::kCPU) : params_.front().param.device());
  DHP_CHECK(in_norm.empty() || in_norm.size() == params_.size(), "Zero1AdamW: ", in_norm.size(),
            " in_norm flags for ", params_.size(), " parameters");
  if (!params_.empty()) dtype_ = params_.front().param.scalar_type();
  for (const auto& p : params_) {
    if (p.param.scalar_type() != dtype_) dtype_ = torch::kFloat32;
  }
  std::vector<torch::Tensor> flat, decay, lr_scale, weight_decay;
  std::vector<int64_t> bytes;
  bool uniform = true;  // every parameter on the default rate and decay: the scalar update
  for (const auto& p : params_) {
    const auto st = optim::settings_for(p, options_);
    uniform = uniform && st.lr_scale == 1.0 && st.weight_decay == (p.decay ? options_.weight_decay : 0.0);
    flat.push_back(p.param.detach().reshape({-1}).to(torch::kFloat32));
    decay.push_back(torch::full({p.param.numel()}, p.decay ? 1.f : 0.f, on));
    lr_scale.push_back(torch::full({p.param.numel()}, st.lr_scale, on));
    weight_decay.push_back(torch::full({p.param.numel()}, st.weight_decay, on));
    offsets_.push_back(total_);
    total_ += p.param.numel();
    bytes.push_back(p.param.numel() * static_cast<int64_t>(c10::elementSize(dtype_)));
  }
  const int64_t ws = group_.size();
  runs_ = bucket_runs(bytes, bucket_bytes);
  for (const auto& [first, last] : runs_) {
    Bucket b;
    b.begin = offsets_[first];
    const int64_t end = last < params_.size() ? offsets_[last] : total_;
    b.padded = (end - b.begin + ws - 1) / ws * ws;
    b.state = n_;
    n_ += b.padded / ws;
    buckets_.push_back(b);
  }
  master_ = chunks_of(flat);
  if (uniform) {
    decay_ = chunks_of(decay);  // the 0/1 mask of the shared decay
  } else {
    lr_scale_ = chunks_of(lr_scale);
    weight_decay_ = chunks_of(weight_decay);
  }
  // The parameters counted in the norm: where they lie in this rank's chunks.
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto h = held(i);
    if ((in_norm.empty() || in_norm[i]) && h.n > 0) {
      const int64_t b = h.state_begin, e = b + h.n;
      if (!norm_ranges_.empty() && norm_ranges_.back().second == b) norm_ranges_.back().second = e;
      else norm_ranges_.emplace_back(b, e);
    }
  }
  exp_avg_ = torch::zeros({n_}, on);
  exp_avg_sq_ = torch::zeros({n_}, on);
  landed_.assign(buckets_.size(), false);
}

torch::Tensor Zero1AdamW::chunks_of(const std::vector<torch::Tensor>& per_param) const {
  std::vector<torch::Tensor> mine;
  const int64_t ws = group_.size();
  for (size_t k = 0; k < runs_.size(); ++k) {
    const auto& b = buckets_[k];
    std::vector<torch::Tensor> parts(per_param.begin() + static_cast<int64_t>(runs_[k].first),
                                     per_param.begin() + static_cast<int64_t>(runs_[k].second));
    int64_t n = 0;
    for (const auto& t : parts) n += t.numel();
    parts.push_back(torch::zeros({b.padded - n}, per_param[runs_[k].first].options()));
    const int64_t chunk = b.padded / ws;
    mine.push_back(torch::cat(parts).narrow(0, group_.rank() * chunk, chunk));
  }
  if (mine.empty()) return torch::zeros({0}, torch::kFloat32);
  return torch::cat(mine).clone();
}

Zero1AdamW::Held Zero1AdamW::held(size_t i) const {
  DHP_CHECK(i < params_.size(), "Zero1AdamW::held: parameter ", i, " of ", params_.size());
  // The bucket whose run [first, second) holds i (the runs are in order).
  const auto run = std::upper_bound(runs_.begin(), runs_.end(), i,
                                    [](size_t v, const std::pair<size_t, size_t>& r) { return v < r.second; });
  const auto& b = buckets_[static_cast<size_t>(run - runs_.begin())];
  const int64_t chunk = b.padded / group_.size();
  const int64_t lo = b.begin + group_.rank() * chunk, hi = lo + chunk;  // among all parameters end to end
  const int64_t p0 = offsets_[i], p1 = p0 + params_[i].param.numel();
  Held h;
  const int64_t s = std::max(lo, p0), e = std::min(hi, p1);
  if (s >= e) return h;
  h.param_begin = s - p0;
  h.state_begin = b.state + (s - lo);
  h.n = e - s;
  return h;
}

torch::Tensor Zero1AdamW::flat_grads(size_t k) const {
  std::vector<torch::Tensor> parts;
  const auto opts = master_.options().dtype(dtype_);
  int64_t n = 0;
  for (size_t i = runs_[k].first; i < runs_[k].second; ++i) {
    const auto& p = params_[i].param;
    auto g = p.grad();
    parts.push_back(g.defined() ? g.reshape({-1}).to(dtype_) : torch::zeros({p.numel()}, opts));
    n += p.numel();
  }
  parts.push_back(torch::zeros({buckets_[k].padded - n}, opts));
  return torch::cat(parts);
}

dist::Work Zero1AdamW::start_bucket(size_t k, const dist::Group& group) const {
  torch::NoGradGuard no_grad;
  TORCH_INTERNAL_ASSERT(group.size() == group_.size() && group.rank() == group_.rank());
  return group.start_reduce_scatter_sum(flat_grads(k));
}

void Zero1AdamW::land_bucket(size_t k, dist::Work& work) {
  auto got = work.wait();
  if (!grad_.defined()) {
    grad_ = torch::zeros({n_}, master_.options());
    landed_.assign(buckets_.size(), false);
  }
  grad_.narrow(0, buckets_[k].state, got.numel()).copy_(got);
  landed_[k] = true;
}

void Zero1AdamW::reduce_gradients(int64_t in_flight) {
  DHP_CHECK(in_flight >= 1, "Zero1AdamW::reduce_gradients: in_flight=", in_flight, " must be >= 1");
  torch::NoGradGuard no_grad;
  // Bucket k starts once bucket k - in_flight has landed: at most in_flight flat copies (and
  // the backend's own) are alive at once, as GradReducer bounds them.
  std::vector<dist::Work> works(runs_.size());
  const auto n = static_cast<size_t>(in_flight);
  for (size_t k = 0; k < runs_.size(); ++k) {
    if (k >= n) land_bucket(k - n, works[k - n]);
    works[k] = start_bucket(k, group_);
  }
  for (size_t k = runs_.size() > n ? runs_.size() - n : 0; k < runs_.size(); ++k) land_bucket(k, works[k]);
}

bool Zero1AdamW::all_landed() const {
  return grad_.defined() && std::all_of(landed_.begin(), landed_.end(), [](bool b) { return b; });
}

torch::Tensor Zero1AdamW::grad_sq_norm() const {
  DHP_CHECK(all_landed(), "Zero1AdamW::grad_sq_norm before every bucket was reduced");
  auto sq = torch::zeros({}, grad_.options().dtype(torch::kFloat64));
  for (const auto& r : norm_ranges_) sq += grad_.narrow(0, r.first, r.second - r.first).pow(2).sum().to(torch::kFloat64);
  return sq;
}

void Zero1AdamW::scale_gradients(double factor) {
  DHP_CHECK(all_landed(), "Zero1AdamW::scale_gradients before every bucket was reduced");
  grad_.mul_(factor);
}

void Zero1AdamW::step(double lr) {
  torch::NoGradGuard no_grad;
  if (!grad_.defined()) reduce_gradients();
  DHP_CHECK(all_landed(), "Zero1AdamW::step before every bucket was reduced");
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
  const int64_t ws = group_.size();
  auto all = group_.all_gather(master_.to(dtype_), 0).view({ws, n_});  // every rank's updated chunks
  for (size_t k = 0; k < runs_.size(); ++k) {
    const auto& b = buckets_[k];
    auto bucket = all.narrow(1, b.state, b.padded / ws).reshape({-1});  // the bucket, rank by rank
    for (size_t i = runs_[k].first; i < runs_[k].second; ++i) {
      auto& p = params_[i].param;
      p.copy_(bucket.narrow(0, offsets_[i] - b.begin, p.numel()).view_as(p));
    }
  }
}

void Zero1AdamW::zero_grad() {
  grad_ = torch::Tensor();
  for (auto& p : params_) {
    if (p.param.grad().defined()) p.param.mutable_grad() = torch::Tensor();
  }
}

}  // namespace dhp::parallel
