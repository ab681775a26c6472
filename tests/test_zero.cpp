// ZeRO-1 AdamW over 2 and 3 ranks equals the single-process AdamW over several steps
// (fp32, 1e-6), while each rank holds only its slice of the optimizer state.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include "dhp/parallel/zero.h"
#include "ranks.h"

namespace {

using dhp::testing::kTestTimeout;
using dhp::testing::run_ranks;

// Own generator: ranks are threads, and the global RNG would be shared between them.
std::vector<dhp::train::NamedParam> make_params() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  auto randn = [&](std::vector<int64_t> shape) { return torch::empty(shape).normal_(0, 1, gen).requires_grad_(true); };
  return {{"w", randn({5, 7}), true}, {"b", randn({7}), false}, {"e", randn({3, 5}), true}};
}

void set_grads(std::vector<dhp::train::NamedParam>& ps, int step) {
  for (size_t i = 0; i < ps.size(); ++i) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 * step + i);
    auto g = torch::empty(ps[i].param.sizes());
    g.normal_(0, 1, gen);
    ps[i].param.mutable_grad() = g;
  }
}

void check(int64_t ws) {
  dhp::train::AdamWOptions o;
  o.weight_decay = 0.1;
  auto ref = make_params();
  dhp::train::AdamW adam(ref, o);
  for (int s = 0; s < 3; ++s) {
    set_grads(ref, s);
    adam.step(0.01 * (s + 1));
  }
  run_ranks(ws, [&](int64_t r, const dhp::dist::Store& store) {
    dhp::dist::Group g(store, "zero", dhp::testing::first_ranks(ws), r, kTestTimeout);
    auto ps = make_params();
    dhp::parallel::Zero1AdamW z(ps, o, g);
    EXPECT_EQ(z.total_numel(), 35 + 7 + 15);  // 57: padded to 58 on 2 ranks
    EXPECT_LE(z.state_numel(), (z.total_numel() + ws - 1) / ws);
    for (int s = 0; s < 3; ++s) {
      set_grads(ps, s);
      z.step(0.01 * (s + 1));
    }
    for (size_t i = 0; i < ps.size(); ++i) {
      EXPECT_LT((ps[i].param - ref[i].param).abs().max().item<double>(), 1e-6) << ps[i].name;
    }
  });
}

TEST(Zero1, TwoRanksWithPaddingEqualAdamW) { check(2); }
TEST(Zero1, ThreeRanksEqualAdamW) { check(3); }

}  // namespace
