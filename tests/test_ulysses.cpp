// Ulysses sequence-parallel attention over ragged shards equals the single-process
// attention on each shard's rows, values and gradients (fp32, 1e-5).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dhp/core/error.h"
#include "dhp/nn/attention.h"
#include "dhp/parallel/ulysses.h"
#include "ranks.h"

namespace {

using dhp::testing::kTestTimeout;
using dhp::testing::run_ranks;

void check_parity(const std::vector<int64_t>& rows, const std::vector<int64_t>& cu, bool causal) {
  const int64_t sp = static_cast<int64_t>(rows.size()), S = cu.back(), H = 6, D = 8;
  torch::manual_seed(11);
  auto q = torch::randn({S, H, D}).requires_grad_(true), k = torch::randn({S, H, D}).requires_grad_(true);
  auto v = torch::randn({S, H, D}).requires_grad_(true);
  auto dout = torch::randn({S, H, D});
  dhp::nn::VarlenAttentionOptions o;
  o.causal = causal;
  o.block_size = 8;
  auto ref = dhp::nn::varlen_attention(q, k, v, cu, o);
  ref.backward(dout);
  std::vector<int64_t> off = {0};
  for (auto r : rows) off.push_back(off.back() + r);
  ASSERT_EQ(off.back(), S);
  run_ranks(sp, [&](int64_t r, const dhp::dist::Store& store) {
    dhp::dist::Group g(store, "sp", dhp::testing::first_ranks(sp), r, kTestTimeout);
    auto part = [&](const torch::Tensor& t) { return t.detach().narrow(0, off[r], rows[r]).clone().requires_grad_(true); };
    auto qs = part(q), ks = part(k), vs = part(v);
    auto out = dhp::parallel::ulysses_attention(qs, ks, vs, cu, causal, g, rows, dhp::nn::VarlenAttentionOptions{false, 8});
    EXPECT_LT((out - ref.narrow(0, off[r], rows[r])).abs().max().item<double>(), 1e-5);
    out.backward(dout.narrow(0, off[r], rows[r]));
    EXPECT_LT((qs.grad() - q.grad().narrow(0, off[r], rows[r])).abs().max().item<double>(), 1e-5);
    EXPECT_LT((ks.grad() - k.grad().narrow(0, off[r], rows[r])).abs().max().item<double>(), 1e-5);
    EXPECT_LT((vs.grad() - v.grad().narrow(0, off[r], rows[r])).abs().max().item<double>(), 1e-5);
  });
}

TEST(Ulysses, TwoRanksEqualShardsFullAttentionOverImages) { check_parity({20, 20}, {0, 16, 40}, false); }
TEST(Ulysses, ThreeRanksRaggedShardsAcrossSegments) { check_parity({10, 7, 13}, {0, 4, 19, 30}, false); }
TEST(Ulysses, CausalSegments) { check_parity({9, 12}, {0, 5, 21}, true); }

TEST(Ulysses, RefusesHeadsNotDivisibleBySp) {
  run_ranks(2, [](int64_t r, const dhp::dist::Store& store) {
    dhp::dist::Group g(store, "sp", {0, 1}, r, kTestTimeout);
    auto x = torch::randn({3, 5, 4});
    EXPECT_THROW(dhp::parallel::seq_to_heads(x, g, {3, 3}), dhp::Error);
    EXPECT_THROW(dhp::parallel::seq_to_heads(torch::randn({3, 4, 4}), g, {2, 4}), dhp::Error);
  });
}

}  // namespace
