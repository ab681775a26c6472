#include "support/grad_norm.h"

#include <torch/torch.h>

#include <cmath>

namespace dhp::testing {

double grad_norm(const std::vector<optim::NamedParam>& params) {
  torch::NoGradGuard no_grad;
  double sq = 0;
  for (const auto& p : params) {
    if (p.param.grad().defined()) sq += p.param.grad().to(torch::kFloat32).pow(2).sum().item<double>();
  }
  return std::sqrt(sq);
}

double clip_grad_norm(const std::vector<optim::NamedParam>& params, double max_norm) {
  const double norm = grad_norm(params);
  if (max_norm > 0 && norm > max_norm) {
    torch::NoGradGuard no_grad;
    const double scale = max_norm / (norm + 1e-6);
    for (const auto& p : params) {
      if (p.param.grad().defined()) p.param.grad().mul_(scale);
    }
  }
  return norm;
}

}  // namespace dhp::testing
