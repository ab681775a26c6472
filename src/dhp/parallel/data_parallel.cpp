#include "dhp/parallel/data_parallel.h"

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

}  // namespace dhp::parallel
