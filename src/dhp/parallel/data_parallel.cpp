#include "dhp/parallel/data_parallel.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include "dhp/core/error.h"

namespace dhp::parallel {
namespace {

int64_t flush(std::vector<torch::Tensor>& grads, const dist::Group& g) {
  if (grads.empty()) return 0;
  std::vector<torch::Tensor> flat_parts;
  for (auto& t : grads) flat_parts.push_back(t.reshape({-1}));
  auto flat = torch::cat(flat_parts);
  g.all_reduce_sum_(flat);
  int64_t off = 0;
  for (auto& t : grads) {
    t.copy_(flat.narrow(0, off, t.numel()).view_as(t));
    off += t.numel();
  }
  grads.clear();
  return 1;
}

}  // namespace

int64_t all_reduce_grads(const std::vector<torch::Tensor>& params, const dist::Group& g, int64_t bucket_bytes) {
  DHP_CHECK(bucket_bytes > 0, "all_reduce_grads: bucket_bytes must be > 0, got ", bucket_bytes);
  if (g.size() == 1) return 0;
  torch::NoGradGuard no_grad;
  int64_t calls = 0, bytes = 0;
  std::vector<torch::Tensor> bucket;
  torch::ScalarType dtype = torch::kFloat32;
  for (const auto& p : params) {
    auto grad = p.grad();
    if (!grad.defined()) continue;
    // One dtype per bucket.
    if (!bucket.empty() && (grad.scalar_type() != dtype || bytes >= bucket_bytes)) {
      calls += flush(bucket, g);
      bytes = 0;
    }
    dtype = grad.scalar_type();
    bucket.push_back(grad);
    bytes += grad.numel() * static_cast<int64_t>(grad.element_size());
  }
  calls += flush(bucket, g);
  return calls;
}

std::vector<std::pair<size_t, size_t>> bucket_runs(const std::vector<int64_t>& bytes, int64_t bucket_bytes) {
  std::vector<std::pair<size_t, size_t>> runs;
  int64_t in_run = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    if (runs.empty() || (bucket_bytes > 0 && in_run >= bucket_bytes)) {
      runs.emplace_back(i, i);
      in_run = 0;
    }
    runs.back().second = i + 1;
    in_run += bytes[i];
  }
  return runs;
}

// Runs after the parameter's gradient accumulator added this backward's gradient to .grad.
// `link` is cleared when the reducer goes, so a graph that outlives it calls nothing.
struct GradReducer::Hook : torch::autograd::FunctionPostHook {
  std::shared_ptr<GradReducer*> link;
  size_t param;
  Hook(std::shared_ptr<GradReducer*> l, size_t p) : link(std::move(l)), param(p) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (*link) (*link)->ready(param);
    return outputs;
  }
};

GradReducer::GradReducer(std::vector<torch::Tensor> params, std::vector<std::string> names,
                         std::vector<std::pair<size_t, size_t>> buckets, Start start, Land land, bool overlap,
                         int64_t in_flight)
    : params_(std::move(params)),
      names_(std::move(names)),
      buckets_(std::move(buckets)),
      bucket_of_(params_.size(), 0),
      start_(std::move(start)),
      land_(std::move(land)),
      overlap_(overlap),
      in_flight_(in_flight),
      fires_(params_.size(), 0),
      missing_(buckets_.size(), 0) {
  TORCH_INTERNAL_ASSERT(names_.size() == params_.size());
  DHP_CHECK(in_flight_ >= 1, "GradReducer: buckets in flight must be >= 1, got ", in_flight_);
  size_t covered = 0;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    TORCH_INTERNAL_ASSERT(buckets_[b].first == covered && buckets_[b].second > covered, "buckets must tile the parameters");
    for (size_t i = buckets_[b].first; i < buckets_[b].second; ++i) bucket_of_[i] = b;
    covered = buckets_[b].second;
  }
  TORCH_INTERNAL_ASSERT(covered == params_.size(), "buckets must tile the parameters");
  if (!overlap_) return;
  link_ = std::make_shared<GradReducer*>(this);
  for (size_t i = 0; i < params_.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
    DHP_CHECK(acc, "GradReducer: parameter ", names_[i], " is not a leaf that requires grad");
    acc->add_post_hook(std::make_unique<Hook>(link_, i));
    accumulators_.push_back(std::move(acc));
  }
}

GradReducer::~GradReducer() {
  if (link_) *link_ = nullptr;
}

size_t GradReducer::bucket_at(size_t k) const { return buckets_.size() - 1 - k; }

void GradReducer::arm() {
  armed_ = true;
  std::fill(fires_.begin(), fires_.end(), 0);
  for (size_t b = 0; b < buckets_.size(); ++b) missing_[b] = static_cast<int64_t>(buckets_[b].second - buckets_[b].first);
}

void GradReducer::ready(size_t i) {
  if (!armed_) return;
  if (++fires_[i] > 1 || !verified_) {
    // Its bucket may be on its way already: the reduction would miss this part.
    if (verified_ && late_.empty() && buckets_.size() - 1 - bucket_of_[i] < next_) late_ = names_[i];
    return;
  }
  --missing_[bucket_of_[i]];
  while (next_ < buckets_.size() && missing_[bucket_at(next_)] == 0) {
    start_next();
    ++early_;
  }
}

void GradReducer::start_next() {
  torch::NoGradGuard no_grad;
  if (static_cast<int64_t>(next_ - landed_) >= in_flight_) land_next();
  works_.push_back(start_(bucket_at(next_)));
  ++next_;
  ++total_;
  most_in_flight_ = std::max(most_in_flight_, static_cast<int64_t>(next_ - landed_));
}

void GradReducer::land_next() {
  torch::NoGradGuard no_grad;
  land_(bucket_at(landed_), works_[landed_]);  // its wait() frees the work's buffers
  ++landed_;
}

void GradReducer::finish() {
  while (next_ < buckets_.size()) start_next();
  while (landed_ < next_) land_next();
  works_.clear();
  next_ = 0;
  landed_ = 0;
  if (armed_ && overlap_ && !verified_ && !twice_) {
    bool any = false;
    for (auto f : fires_) {
      any = any || f > 0;
      twice_ = twice_ || f > 1;
    }
    verified_ = any && !twice_;
  }
  armed_ = false;
  if (!late_.empty()) {
    const auto name = late_;
    late_.clear();
    DHP_FAIL("the gradient of ", name, " arrived in two parts in one backward, after its bucket's reduction had ",
             "started: the summed gradients miss a part (set parallel.overlap: false to reduce at the end of the step)");
  }
}

}  // namespace dhp::parallel
