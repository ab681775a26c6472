// ZeRO-1 AdamW over 2 and 3 ranks equals the single-process AdamW on the summed gradients
// over several steps (fp32, 1e-6), while each rank holds only its slice of the optimizer
// state; the reduce-scatter underneath.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <mutex>

#include "dhp/core/error.h"
#include "dhp/parallel/zero.h"
#include "ranks.h"

namespace {

using dhp::testing::kTestTimeout;
using dhp::testing::run_ranks;

// Own generator: ranks are threads, and the global RNG would be shared between them.
std::vector<dhp::optim::NamedParam> make_params() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  auto randn = [&](std::vector<int64_t> shape) { return torch::empty(shape).normal_(0, 1, gen).requires_grad_(true); };
  return {{"w", randn({5, 7}), true}, {"b", randn({7}), false}, {"e", randn({3, 5}), true}};
}

// Rank r's local gradient at a step (rank -1: the sum over `ranks` ranks, added in rank
// order as the reduce-scatter adds them).
torch::Tensor local_grad(const std::vector<int64_t>& shape, int step, size_t i, int64_t rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * rank + 100 * step + static_cast<int64_t>(i));
  return torch::empty(shape).normal_(0, 1, gen);
}

void set_grads(std::vector<dhp::optim::NamedParam>& ps, int step, int64_t rank, int64_t ranks) {
  for (size_t i = 0; i < ps.size(); ++i) {
    const auto shape = ps[i].param.sizes().vec();
    if (rank >= 0) {
      ps[i].param.mutable_grad() = local_grad(shape, step, i, rank);
      continue;
    }
    auto sum = local_grad(shape, step, i, 0);
    for (int64_t r = 1; r < ranks; ++r) sum.add_(local_grad(shape, step, i, r));
    ps[i].param.mutable_grad() = sum;
  }
}

// Each rank holds its own gradients; the sharded optimizer must step like AdamW on their
// sum, with the clipping-norm pieces adding up to the norm of the sum.
// bucket_bytes > 0: the bucketed layout (rank r owns chunk r of every bucket), its buckets
// reduced one by one as a GradReducer would, from the last.
void check(int64_t ws, std::vector<dhp::optim::ParamGroup> groups = {}, int64_t bucket_bytes = 0) {
  dhp::optim::AdamWOptions o;
  o.weight_decay = 0.1;
  o.groups = std::move(groups);
  auto ref = make_params();
  dhp::optim::AdamW adam(ref, o);
  std::vector<double> ref_sq;
  for (int s = 0; s < 3; ++s) {
    set_grads(ref, s, -1, ws);
    double sq = 0;
    for (const auto& p : ref) sq += p.param.grad().pow(2).sum().item<double>();
    ref_sq.push_back(sq);
    adam.step(0.01 * (s + 1));
  }
  std::vector<std::vector<double>> sq_by_rank(static_cast<size_t>(ws));
  run_ranks(ws, [&](int64_t r, const dhp::dist::Store& store) {
    dhp::dist::Group g(store, "zero", dhp::testing::first_ranks(ws), r, kTestTimeout);
    auto ps = make_params();
    dhp::parallel::Zero1AdamW z(ps, o, g, {}, bucket_bytes);
    EXPECT_EQ(z.total_numel(), 35 + 7 + 15);  // 57: padded to 58 on 2 ranks
    if (bucket_bytes == 0) EXPECT_LE(z.state_numel(), (z.total_numel() + ws - 1) / ws);
    else EXPECT_EQ(z.buckets().size(), 3u);  // every parameter is 20 bytes or more: one each
    for (int s = 0; s < 3; ++s) {
      set_grads(ps, s, r, ws);
      if (s == 1 && bucket_bytes > 0) {
        std::vector<dhp::dist::Work> works;
        for (size_t b = z.buckets().size(); b-- > 0;) works.push_back(z.start_bucket(b, g));
        for (size_t k = 0; k < works.size(); ++k) z.land_bucket(z.buckets().size() - 1 - k, works[k]);
        sq_by_rank[static_cast<size_t>(r)].push_back(z.grad_sq_norm().item<double>());
      } else if (s == 1) {  // step() reduces by itself otherwise (two buckets in flight)
        z.reduce_gradients();
        sq_by_rank[static_cast<size_t>(r)].push_back(z.grad_sq_norm().item<double>());
      } else if (s == 2 && bucket_bytes > 0) {
        z.reduce_gradients(1);  // one bucket at a time
      }
      z.step(0.01 * (s + 1));
      z.zero_grad();
    }
    for (size_t i = 0; i < ps.size(); ++i) {
      EXPECT_LT((ps[i].param - ref[i].param).abs().max().item<double>(), 1e-6) << ps[i].name;
    }
  });
  double sq = 0;
  for (const auto& v : sq_by_rank) sq += v.at(0);
  EXPECT_NEAR(sq, ref_sq[1], 1e-5 * ref_sq[1]);
}

TEST(Zero1, ReduceScatterSumsEachChunkInFp32) {
  for (int64_t ws : {2, 3}) {
    run_ranks(ws, [&](int64_t r, const dhp::dist::Store& store) {
      dhp::dist::Group g(store, "rs", dhp::testing::first_ranks(ws), r, kTestTimeout);
      // Member m sends (m + 1) * [1, 2, ..., 2 * ws] in bf16: chunk r sums to (ws(ws+1)/2) * [2r+1, 2r+2].
      auto x = (torch::arange(1, 2 * ws + 1, torch::kFloat32) * static_cast<float>(r + 1)).to(torch::kBFloat16);
      auto got = g.reduce_scatter_sum(x);
      EXPECT_EQ(got.scalar_type(), torch::kFloat32);
      const float k = static_cast<float>(ws * (ws + 1) / 2);
      auto want = torch::tensor({k * static_cast<float>(2 * r + 1), k * static_cast<float>(2 * r + 2)});
      EXPECT_TRUE(torch::equal(got, want)) << got << " vs " << want;
      EXPECT_THROW(g.reduce_scatter_sum(torch::zeros({2 * ws + 1})), dhp::Error);
    });
  }
}

TEST(Zero1, TwoRanksWithPaddingEqualAdamW) { check(2); }
TEST(Zero1, ThreeRanksEqualAdamW) { check(3); }
// Per-group rates and decay (per-module learning rates) as per-element state: "w" at half
// the rate with its own decay, "e" frozen by a zero rate, "b" on the defaults.
TEST(Zero1, PerGroupRatesAndDecayEqualAdamW) { check(2, {{"w", 0.5, 0.3}, {"e", 0.0, 0.0}}); }
// Buckets of one parameter each (20 bytes): rank r owns chunk r of each.
TEST(Zero1, BucketedLayoutEqualsAdamW) {
  check(2, {}, 20);
  check(3, {{"w", 0.5, 0.3}}, 20);
}

// Over the ranks, held() gives every element of every parameter to exactly one rank, at a
// place of its state that holds that element's master weight.
TEST(Zero1, EveryElementIsHeldOnceWhateverTheBuckets) {
  for (int64_t bucket_bytes : {0, 20, 100, 1 << 20}) {
    for (int64_t ws : {2, 3}) {
      auto ref = make_params();
      std::vector<torch::Tensor> count;
      for (const auto& p : ref) count.push_back(torch::zeros({p.param.numel()}, torch::kInt64));
      std::mutex mu;
      run_ranks(ws, [&](int64_t r, const dhp::dist::Store& store) {
        dhp::dist::Group g(store, "held", dhp::testing::first_ranks(ws), r, kTestTimeout);
        auto ps = make_params();
        dhp::parallel::Zero1AdamW z(ps, dhp::optim::AdamWOptions{}, g, {}, bucket_bytes);
        std::lock_guard<std::mutex> lock(mu);
        for (size_t i = 0; i < ps.size(); ++i) {
          const auto h = z.held(i);
          if (h.n == 0) continue;
          count[i].narrow(0, h.param_begin, h.n).add_(1);
          EXPECT_TRUE(torch::equal(z.master().narrow(0, h.state_begin, h.n),
                                   ps[i].param.detach().reshape({-1}).narrow(0, h.param_begin, h.n)))
              << ps[i].name << " bucket_bytes " << bucket_bytes << " ws " << ws;
        }
      });
      for (size_t i = 0; i < count.size(); ++i)
        EXPECT_TRUE(torch::equal(count[i], torch::ones_like(count[i]))) << ref[i].name << " bucket_bytes " << bucket_bytes;
    }
  }
}

}  // namespace
