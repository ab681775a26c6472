#include "support/attention_reference.h"

#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "dhp/nn/attention.h"

namespace dhp::testing {

using torch::Tensor;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

Tensor varlen_attention_naive(const Tensor& q, const Tensor& k, const Tensor& v,
                              const std::vector<int64_t>& cu, bool causal) {
  nn::check_cu_seqlens(cu, q.size(0), "varlen_attention_naive");
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(2)));
  std::vector<Tensor> outs;
  for (size_t i = 0; i + 1 < cu.size(); ++i) {
    const int64_t s0 = cu[i], len = cu[i + 1] - cu[i];
    auto qs = q.narrow(0, s0, len).transpose(0, 1).to(torch::kFloat32);  // (H, L, D)
    auto ks = k.narrow(0, s0, len).transpose(0, 1).to(torch::kFloat32);
    auto vs = v.narrow(0, s0, len).transpose(0, 1).to(torch::kFloat32);
    auto s = torch::matmul(qs, ks.transpose(-1, -2)) * scale;
    if (causal) {
      auto mask = torch::ones({len, len}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).triu(1);
      s = s.masked_fill(mask, kNegInf);
    }
    outs.push_back(torch::matmul(torch::softmax(s, -1), vs).transpose(0, 1));
  }
  return torch::cat(outs, 0).to(q.scalar_type());
}

}  // namespace dhp::testing
