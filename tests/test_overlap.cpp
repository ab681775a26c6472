// Communication beside compute: collectives started without waiting (dist::Work), and the
// GradReducer that starts a module's gradient reductions bucket by bucket during the last
// backward. The reduced gradients must be exactly those of the reduction at the end of the
// step (same buckets, same sums), whatever the order the gradients come in, whether a rank
// ran a backward at all, and a parameter whose gradient comes in two parts must never be
// reduced before its second part.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include "dhp/core/error.h"
#include "dhp/parallel/data_parallel.h"
#include "ranks.h"

namespace {

using dhp::testing::kTestTimeout;
using dhp::testing::run_ranks;

TEST(Overlap, StartedCollectivesReturnTheirSumsWhenWaitedFor) {
  run_ranks(2, [](int64_t r, const dhp::dist::Store& store) {
    dhp::dist::Group a(store, "a", {0, 1}, r, kTestTimeout), b(store, "b", {0, 1}, r, kTestTimeout);
    const float k = static_cast<float>(r + 1);
    auto x = torch::full({1000}, k), h = torch::full({6}, k).to(torch::kBFloat16);
    auto rs = torch::arange(1, 5, torch::kFloat32) * k;
    const auto before = dhp::dist::comm_stats();
    auto wx = a.start_all_reduce_sum(x);
    auto wh = a.start_all_reduce_sum(h);
    auto wr = a.start_reduce_scatter_sum(rs);
    // Another group communicates meanwhile.
    auto y = torch::full({3}, k);
    b.all_reduce_sum_(y);
    EXPECT_TRUE(torch::equal(y, torch::full({3}, 3.f)));
    EXPECT_FALSE(wx.waited());
    EXPECT_TRUE(torch::equal(wx.wait(), torch::full({1000}, 3.f)));
    EXPECT_TRUE(torch::equal(x, torch::full({1000}, 3.f)));  // in place
    EXPECT_TRUE(wx.waited());
    EXPECT_FALSE(wx.wait().defined());  // a second wait has nothing more
    auto hs = wh.wait();
    EXPECT_EQ(hs.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(torch::equal(h, torch::full({6}, 3.f).to(torch::kBFloat16)));
    // Member m sends (m+1) * [1, 2, 3, 4]: chunk r sums to 3 * [2r+1, 2r+2].
    auto got = wr.wait();
    EXPECT_TRUE(torch::equal(got, torch::tensor({3.f * static_cast<float>(2 * r + 1), 3.f * static_cast<float>(2 * r + 2)})))
        << got;
    const auto after = dhp::dist::comm_stats();
    EXPECT_EQ(after.calls - before.calls, 4);  // three started ones, counted when waited for, and b's
    EXPECT_THROW(a.start_reduce_scatter_sum(torch::zeros({3})), dhp::Error);
  });
}

// A chain of four linears (8 parameters); rank r's input differs, so the gradients do.
struct Chain {
  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  Chain() {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
    for (int i = 0; i < 4; ++i) {
      params.push_back(torch::empty({6, 6}).normal_(0, 0.5, gen).requires_grad_(true));
      params.push_back(torch::empty({6}).normal_(0, 0.5, gen).requires_grad_(true));
      names.push_back("l" + std::to_string(i) + ".weight");
      names.push_back("l" + std::to_string(i) + ".bias");
    }
  }
  torch::Tensor loss(int64_t rank, int step) const {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 * rank + step);
    auto x = torch::empty({3, 6}).normal_(0, 1, gen);
    for (size_t i = 0; i < params.size(); i += 2) x = torch::tanh(torch::linear(x, params[i], params[i + 1]));
    return x.pow(2).sum();
  }
  void zero_grad() {
    for (auto& p : params) p.mutable_grad() = torch::Tensor();
  }
};

// DP all-reduce buckets over `g`, two parameters (one linear) each; counts the starts.
dhp::parallel::GradReducer make_reducer(Chain& c, const dhp::dist::Group& g, bool overlap,
                                        std::vector<size_t>* order = nullptr, int64_t in_flight = 2,
                                        std::vector<std::string>* events = nullptr) {
  std::vector<std::pair<size_t, size_t>> runs;
  for (size_t i = 0; i < c.params.size(); i += 2) runs.emplace_back(i, i + 2);
  auto ps = c.params;
  auto start = [ps, runs, &g, order, events](size_t b) {
    if (order) order->push_back(b);
    if (events) events->push_back("s" + std::to_string(b));
    std::vector<torch::Tensor> parts;
    for (size_t i = runs[b].first; i < runs[b].second; ++i)
      parts.push_back(ps[i].grad().defined() ? ps[i].grad().reshape({-1}) : torch::zeros({ps[i].numel()}));
    return g.start_all_reduce_sum(torch::cat(parts));
  };
  auto land = [ps, runs, events](size_t b, dhp::dist::Work& w) {
    if (events) events->push_back("l" + std::to_string(b));
    auto flat = w.wait();
    int64_t off = 0;
    for (size_t i = runs[b].first; i < runs[b].second; ++i) {
      auto p = ps[i];
      p.mutable_grad() = flat.narrow(0, off, p.numel()).view(p.sizes()).clone();
      off += p.numel();
    }
  };
  return dhp::parallel::GradReducer(c.params, c.names, runs, start, land, overlap, in_flight);
}

// Rank 1 runs no backward at step `idle_step` (a replica without input).
std::vector<torch::Tensor> train(int64_t r, const dhp::dist::Group& g, bool overlap, int idle_step,
                                 std::vector<int64_t>* early = nullptr) {
  Chain c;
  std::vector<size_t> order;
  auto red = make_reducer(c, g, overlap, &order);
  for (int s = 0; s < 3; ++s) {
    c.zero_grad();
    red.arm();
    if (!(r == 1 && s == idle_step)) c.loss(r, s).backward();
    red.finish();
    if (early) early->push_back(red.started_early());
    torch::NoGradGuard no_grad;
    for (auto& p : c.params) p.sub_(0.1 * p.grad());
  }
  // Every step started the buckets from the last (the backward's order).
  EXPECT_EQ(order, (std::vector<size_t>{3, 2, 1, 0, 3, 2, 1, 0, 3, 2, 1, 0}));
  return c.params;
}

TEST(Overlap, BucketsStartDuringBackwardFromTheSecondStepAndSumTheSame) {
  run_ranks(2, [](int64_t r, const dhp::dist::Store& store) {
    dhp::dist::Group g(store, "g", {0, 1}, r, kTestTimeout);
    std::vector<int64_t> early;
    const auto overlapped = train(r, g, true, /*idle_step=*/-1, &early);
    const auto at_end = train(r, g, false, -1);
    // Step 1 checks that gradients come whole, steps 2 and 3 start all 4 buckets early.
    EXPECT_EQ(early, (std::vector<int64_t>{0, 4, 8}));
    for (size_t i = 0; i < at_end.size(); ++i) EXPECT_TRUE(torch::equal(overlapped[i], at_end[i])) << i;
  });
}

TEST(Overlap, ARankWithoutBackwardStartsEveryBucketAtTheEnd) {
  run_ranks(2, [](int64_t r, const dhp::dist::Store& store) {
    dhp::dist::Group g(store, "g", {0, 1}, r, kTestTimeout);
    std::vector<int64_t> early;
    const auto overlapped = train(r, g, true, /*idle_step=*/2, &early);
    const auto at_end = train(r, g, false, 2);
    EXPECT_EQ(early.back() - early[1], r == 0 ? 4 : 0);  // rank 1 had nothing to start during step 3
    for (size_t i = 0; i < at_end.size(); ++i) EXPECT_TRUE(torch::equal(overlapped[i], at_end[i])) << i;
  });
}

// parallel.buckets_in_flight: a bucket starts only after the one in_flight before it landed
// (each holds its flat copies until then); the sums are the same whatever the bound.
TEST(Overlap, AtMostInFlightBucketsAreStartedAndNotLanded) {
  run_ranks(2, [](int64_t r, const dhp::dist::Store& store) {
    dhp::dist::Group g(store, "g", {0, 1}, r, kTestTimeout);
    auto run = [&](bool overlap, int64_t in_flight, std::vector<std::string>* events, int64_t* most) {
      Chain c;
      auto red = make_reducer(c, g, overlap, nullptr, in_flight, events);
      for (int s = 0; s < 3; ++s) {
        if (events) events->clear();
        c.zero_grad();
        red.arm();
        c.loss(r, s).backward();
        red.finish();
        torch::NoGradGuard no_grad;
        for (auto& p : c.params) p.sub_(0.1 * p.grad());
      }
      *most = red.most_in_flight();
      return c.params;
    };
    int64_t most = 0;
    std::vector<std::string> events;
    const auto reference = run(false, 8, nullptr, &most);
    EXPECT_EQ(most, 4);  // every bucket at once
    for (const bool overlap : {false, true}) {
      for (const int64_t in_flight : {1, 2}) {
        const auto got = run(overlap, in_flight, &events, &most);
        EXPECT_EQ(most, in_flight) << overlap;
        for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(torch::equal(got[i], reference[i])) << i;
        if (in_flight == 2) {  // the last step: from the last bucket, each start after the landing two before
          EXPECT_EQ(events, (std::vector<std::string>{"s3", "s2", "l3", "s1", "l2", "s0", "l1", "l0"})) << overlap;
        }
      }
    }
  });
}

// A gradient in two parts (two backwards after arm(), as a parameter used across re-entrant
// checkpoints would give): seen in the first armed step, the reducer never starts early.
TEST(Overlap, GradientsInTwoPartsKeepTheReductionAtTheEnd) {
  run_ranks(2, [](int64_t r, const dhp::dist::Store& store) {
    dhp::dist::Group g(store, "g", {0, 1}, r, kTestTimeout);
    Chain c;
    auto red = make_reducer(c, g, true);
    for (int s = 0; s < 3; ++s) {
      c.zero_grad();
      red.arm();
      c.loss(r, s).backward();
      c.loss(r, s + 10).backward();
      red.finish();
      EXPECT_EQ(red.started_early(), 0);
      EXPECT_FALSE(red.overlapping());
    }
    // The sum of both parts on both ranks.
    Chain ref;
    for (int64_t q = 0; q < 2; ++q) {
      ref.loss(q, 2).backward();
      ref.loss(q, 12).backward();
    }
    for (size_t i = 0; i < c.params.size(); ++i) {
      EXPECT_TRUE(torch::allclose(c.params[i].grad(), ref.params[i].grad(), 1e-6, 1e-6)) << c.names[i];
    }
  });
}

// The same after the reducer started overlapping: the sum would miss the second part, so
// finish() says which parameter and how to turn overlap off.
TEST(Overlap, AGradientThatArrivesAfterItsBucketStartedIsAnError) {
  run_ranks(2, [](int64_t r, const dhp::dist::Store& store) {
    dhp::dist::Group g(store, "g", {0, 1}, r, kTestTimeout);
    Chain c;
    auto red = make_reducer(c, g, true);
    c.zero_grad();
    red.arm();
    c.loss(r, 0).backward();
    red.finish();
    ASSERT_TRUE(red.overlapping());
    c.zero_grad();
    red.arm();
    c.loss(r, 1).backward();
    c.loss(r, 2).backward();
    try {
      red.finish();
      ADD_FAILURE() << "no error";
    } catch (const dhp::Error& e) {
      EXPECT_NE(std::string(e.what()).find("gradient of l3."), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("parallel.overlap: false"), std::string::npos) << e.what();
    }
  });
}

TEST(Overlap, BucketRunsCloseAtTheirSize) {
  using Runs = std::vector<std::pair<size_t, size_t>>;
  EXPECT_EQ(dhp::parallel::bucket_runs({4, 4, 4, 4, 4}, 8), (Runs{{0, 2}, {2, 4}, {4, 5}}));
  EXPECT_EQ(dhp::parallel::bucket_runs({20, 1, 1}, 8), (Runs{{0, 1}, {1, 3}}));
  EXPECT_EQ(dhp::parallel::bucket_runs({4, 4, 4}, 0), (Runs{{0, 3}}));
  EXPECT_TRUE(dhp::parallel::bucket_runs({}, 8).empty());
}

}  // namespace
