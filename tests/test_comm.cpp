// Groups over Gloo (ranks as threads) and the collectives-as-autograd-functions, with a
// tensor-parallel SwiGLU proven equal to the single-process one (values and gradients).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dhp/core/error.h"
#include "dhp/nn/layers.h"
#include "dhp/dist/process_groups.h"
#include "dhp/parallel/mappings.h"
#include "dhp/parallel/tensor_parallel.h"
#include "ranks.h"

namespace {

using dhp::testing::kTestTimeout;
using dhp::testing::run_ranks;

TEST(Comm, GroupOfOneIsANoOp) {
  dhp::dist::Group g;
  auto t = torch::ones({3});
  g.all_reduce_sum_(t);
  EXPECT_TRUE(torch::equal(t, torch::ones({3})));
  EXPECT_TRUE(torch::equal(g.all_gather(t, 0), t));
  EXPECT_EQ(dhp::parallel::copy_to_group(t, g).data_ptr(), t.data_ptr());
}

TEST(Comm, AllReduceGatherAndRaggedAllToAll) {
  run_ranks(3, [](int64_t r, const dhp::dist::Store& store) {
    dhp::dist::Group g(store, "all", {0, 1, 2}, r, kTestTimeout);
    EXPECT_EQ(g.rank(), r);
    auto t = torch::full({2}, static_cast<float>(r + 1));
    g.all_reduce_sum_(t);
    EXPECT_TRUE(torch::equal(t, torch::full({2}, 6.f)));
    auto ga = g.all_gather(torch::full({1, 2}, static_cast<float>(r)), 0);
    EXPECT_TRUE(torch::equal(ga, torch::tensor({0.f, 0.f, 1.f, 1.f, 2.f, 2.f}).view({3, 2})));
    // Rank r sends (j + 1) rows valued 10*r + j to rank j.
    std::vector<int64_t> send, recv;
    std::vector<torch::Tensor> rows;
    for (int64_t j = 0; j < 3; ++j) {
      send.push_back(j + 1);
      recv.push_back(r + 1);
      rows.push_back(torch::full({j + 1, 2}, static_cast<float>(10 * r + j)));
    }
    auto out = g.all_to_all(torch::cat(rows, 0), send, recv);
    ASSERT_EQ(out.size(0), 3 * (r + 1));
    for (int64_t j = 0; j < 3; ++j) {
      EXPECT_TRUE(torch::equal(out.narrow(0, j * (r + 1), r + 1), torch::full({r + 1, 2}, static_cast<float>(10 * j + r))));
    }
  });
}

// 16-bit floats: Gloo has no bf16, so Group sums them in fp32 and moves them as bits.
TEST(Comm, Bf16CollectivesAndPointToPoint) {
  run_ranks(2, [](int64_t r, const dhp::dist::Store& store) {
    dhp::dist::Group g(store, "bf16", {0, 1}, r, kTestTimeout);
    auto x = torch::tensor({1.5f, -2.25f, 3.0f}).mul(r + 1).to(torch::kBFloat16);  // exact in bf16
    auto sum = x.clone();
    g.all_reduce_sum_(sum);
    EXPECT_EQ(sum.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(torch::equal(sum, torch::tensor({4.5f, -6.75f, 9.0f}).to(torch::kBFloat16)));
    auto mx = x.clone();
    g.all_reduce_max_(mx);
    EXPECT_TRUE(torch::equal(mx, torch::tensor({3.0f, -2.25f, 6.0f}).to(torch::kBFloat16)));
    auto ga = g.all_gather(x.view({1, 3}), 0);
    EXPECT_EQ(ga.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(torch::equal(ga[1 - r], (r == 0 ? x * 2 : x / 2)));
    auto a2a = g.all_to_all(torch::stack({x, x}), {1, 1}, {1, 1});
    EXPECT_TRUE(torch::equal(a2a[r], x));
    if (r == 0) {
      g.send(x, 1, 7);
      g.wait_sends();
    } else {
      auto got = torch::empty({3}, torch::kBFloat16);
      g.recv(got, 0, 7);
      EXPECT_TRUE(torch::equal(got, x / 2));
    }
  });
}

TEST(Comm, SubgroupsOfDisjointRanks) {
  run_ranks(4, [](int64_t r, const dhp::dist::Store& store) {
    const std::vector<int64_t> mine = r < 2 ? std::vector<int64_t>{0, 1} : std::vector<int64_t>{2, 3};
    dhp::dist::Group g(store, r < 2 ? "a" : "b", mine, r, kTestTimeout);
    auto t = torch::full({1}, static_cast<float>(r));
    g.all_reduce_sum_(t);
    EXPECT_EQ(t.item<float>(), r < 2 ? 1.f : 5.f);
  });
}

TEST(Comm, MissingMemberTimesOutInsteadOfHanging) {
  auto store = dhp::dist::make_hash_store();
  auto start = std::chrono::steady_clock::now();
  EXPECT_ANY_THROW(dhp::dist::Group(store, "lonely", {0, 1}, 0, std::chrono::milliseconds(1500)));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  EXPECT_THROW(dhp::dist::Group(store, "x", {1, 2}, 0, kTestTimeout), dhp::Error);  // not a member
}

TEST(Mappings, TensorParallelSwiGLUEqualsSingleProcess) {
  // Column-parallel gate/up (output rows split), row-parallel down (input columns split):
  // out = reduce_from(down_k(silu(gate_k(copy_to(x))) * up_k(x))) equals the full MLP.
  const int64_t D = 8, I = 12, S = 5, tp = 2;
  torch::manual_seed(0);
  dhp::nn::SwiGLU full(D, I, true);
  auto x = torch::randn({S, D}).requires_grad_(true);
  auto dy = torch::randn({S, D});
  auto y = full(x);
  y.backward(dy);
  run_ranks(tp, [&](int64_t r, const dhp::dist::Store& store) {
    dhp::dist::Group g(store, "tp", {0, 1}, r, kTestTimeout);
    const int64_t n = I / tp;
    auto slice_rows = [&](const torch::Tensor& w) { return w.narrow(0, r * n, n).detach().clone().requires_grad_(true); };
    auto gw = slice_rows(full->gate_proj->weight), gb = slice_rows(full->gate_proj->bias);
    auto uw = slice_rows(full->up_proj->weight), ub = slice_rows(full->up_proj->bias);
    auto dw = full->down_proj->weight.narrow(1, r * n, n).detach().clone().requires_grad_(true);
    auto db = full->down_proj->bias.detach().clone().requires_grad_(true);
    auto xl = x.detach().clone().requires_grad_(true);
    auto xin = dhp::parallel::copy_to_group(xl, g);
    auto h = torch::silu(torch::addmm(gb, xin, gw.t())) * torch::addmm(ub, xin, uw.t());
    // The bias of a row-parallel layer is added once, after the reduction.
    auto yl = dhp::parallel::reduce_from_group(torch::matmul(h, dw.t()), g) + db;
    EXPECT_LT((yl - y).abs().max().item<double>(), 1e-5);
    yl.backward(dy);
    EXPECT_LT((xl.grad() - x.grad()).abs().max().item<double>(), 1e-5);
    EXPECT_LT((gw.grad() - full->gate_proj->weight.grad().narrow(0, r * n, n)).abs().max().item<double>(), 1e-5);
    EXPECT_LT((ub.grad() - full->up_proj->bias.grad().narrow(0, r * n, n)).abs().max().item<double>(), 1e-5);
    EXPECT_LT((dw.grad() - full->down_proj->weight.grad().narrow(1, r * n, n)).abs().max().item<double>(), 1e-5);
    EXPECT_LT((db.grad() - full->down_proj->bias.grad()).abs().max().item<double>(), 1e-5);
  });
}

TEST(Mappings, GatherAndScatterAreDuals) {
  torch::manual_seed(1);
  auto full = torch::randn({4, 6});
  auto dfull = torch::randn({4, 6});
  run_ranks(2, [&](int64_t r, const dhp::dist::Store& store) {
    dhp::dist::Group g(store, "sp", {0, 1}, r, kTestTimeout);
    auto x = full.detach().clone().requires_grad_(true);
    auto shard = dhp::parallel::scatter_to_group(x, g, 1);  // (4, 3)
    EXPECT_TRUE(torch::equal(shard, full.narrow(1, 3 * r, 3)));
    auto back = dhp::parallel::gather_from_group(shard * 2, g, 1);  // (4, 6)
    EXPECT_TRUE(torch::equal(back, full * 2));
    back.backward(dfull);
    // d/dx of gather(scatter(x) * 2): 2 * dfull on the own slice, gathered -> 2 * dfull everywhere.
    EXPECT_TRUE(torch::allclose(x.grad(), dfull * 2));
  });
}

}  // namespace

namespace {

TEST(ProcessGroups, BuiltFromALayoutOnDisjointRanks) {
  // 6 ranks: vision sp=2 on {0, 1}; text tp=2 x dp=2 on {2, 3, 4, 5}.
  auto model = dhp::qwen::preset("qwen2.5-vl-7b");
  dhp::dist::ModuleLayout vision, text;
  vision.name = "vision";
  vision.strategy = dhp::dist::Strategy::kSequenceParallel;
  vision.ranks = {0, 1};
  vision.sp = 2;
  text.name = "text";
  text.strategy = dhp::dist::Strategy::kTensorParallel;
  text.ranks = {2, 3, 4, 5};
  text.tp = 2;
  text.dp = 2;
  vision.validate(dhp::testing::dims_of(model, "vision"), 6);
  text.validate(dhp::testing::dims_of(model, "text"), 6);
  run_ranks(6, [&](int64_t r, const dhp::dist::Store& store) {
    auto v = dhp::dist::make_process_groups(store, vision, r, kTestTimeout);
    auto t = dhp::dist::make_process_groups(store, text, r, kTestTimeout);
    EXPECT_EQ(v.member, r < 2);
    EXPECT_EQ(t.member, r >= 2);
    if (v.member) {
      EXPECT_EQ(v.sp.ranks(), (std::vector<int64_t>{0, 1}));
      EXPECT_EQ(v.tp.size(), 1);
      auto x = torch::full({1}, 1.f);
      v.sp.all_reduce_sum_(x);
      EXPECT_EQ(x.item<float>(), 2.f);
    }
    if (t.member) {
      EXPECT_EQ(t.tp.ranks(), r < 4 ? (std::vector<int64_t>{2, 3}) : (std::vector<int64_t>{4, 5}));
      EXPECT_EQ(t.dp.ranks(), r % 2 == 0 ? (std::vector<int64_t>{2, 4}) : (std::vector<int64_t>{3, 5}));
      auto x = torch::full({1}, static_cast<float>(r));
      t.dp.all_reduce_sum_(x);
      EXPECT_EQ(x.item<float>(), r % 2 == 0 ? 6.f : 8.f);
      // The module group is never used: it has no communicator and says so when called.
      EXPECT_FALSE(t.module.connected());
      EXPECT_EQ(t.module.size(), 4);
      auto y = torch::full({1}, static_cast<float>(r));
      EXPECT_THROW(t.module.all_reduce_sum_(y), dhp::Error);
    }
  });
}

// Only the groups a strategy communicates on get a communicator (under NCCL each costs GPU
// memory); the others know their members and refuse to communicate.
TEST(ProcessGroups, OnlyTheGroupsAStrategyUsesAreConnected) {
  auto layout = [](dhp::dist::Strategy s, int64_t sp, int64_t tp, int64_t dp) {
    dhp::dist::ModuleLayout l;
    l.name = "m";
    l.strategy = s;
    l.ranks = {0, 1, 2, 3};
    l.sp = sp;
    l.tp = tp;
    l.dp = dp;
    return l;
  };
  using S = dhp::dist::Strategy;
  const auto sp = layout(S::kSequenceParallel, 2, 1, 2), tp = layout(S::kTensorParallel, 1, 2, 2),
             z3 = layout(S::kZero3, 1, 1, 4);
  run_ranks(4, [&](int64_t r, const dhp::dist::Store& store) {
    auto a = dhp::dist::make_process_groups(store, sp, r, kTestTimeout);
    EXPECT_TRUE(a.sp.connected() && a.data.connected());
    EXPECT_FALSE(a.dp.connected());  // sp x dp reduces on data; dp alone is never used
    EXPECT_EQ(a.dp.size(), 2);
    EXPECT_FALSE(a.module.connected());
    auto x = torch::ones({1});
    a.data.all_reduce_sum_(x);
    EXPECT_EQ(x.item<float>(), 4.f);
    EXPECT_THROW(a.dp.all_reduce_sum_(x), dhp::Error);
    auto b = dhp::dist::make_process_groups(store, tp, r, kTestTimeout);
    EXPECT_TRUE(b.tp.connected() && b.dp.connected() && b.data.connected());
    EXPECT_EQ(b.data.ranks(), b.dp.ranks());
    auto c = dhp::dist::make_process_groups(store, z3, r, kTestTimeout);
    EXPECT_TRUE(c.dp.connected());
    EXPECT_EQ(c.dp.size(), 4);
  });
  EXPECT_FALSE(dhp::dist::groups_used(S::kZero3).data);
  EXPECT_TRUE(dhp::dist::groups_used(S::kDataParallel).data);
}

}  // namespace

namespace {

TEST(TensorParallel, ColumnThenRowLinearEqualsTheFullPair) {
  torch::manual_seed(4);
  auto a = dhp::nn::make_linear(6, 8, true), b = dhp::nn::make_linear(8, 6, true);
  auto x = torch::randn({2, 3, 6}).requires_grad_(true);
  auto dy = torch::randn({2, 3, 6});
  auto y = b(torch::gelu(a(x)));
  y.backward(dy);
  run_ranks(2, [&](int64_t r, const dhp::dist::Store& store) {
    dhp::dist::Group g(store, "tp", {0, 1}, r, kTestTimeout);
    dhp::parallel::ColumnParallelLinear col(*a, g);
    dhp::parallel::RowParallelLinear row(*b, g);
    EXPECT_EQ(col->weight.sizes(), (torch::IntArrayRef{4, 6}));
    EXPECT_EQ(row->weight.sizes(), (torch::IntArrayRef{6, 4}));
    auto xl = x.detach().clone().requires_grad_(true);
    auto yl = row(torch::gelu(col(xl)));
    EXPECT_LT((yl - y).abs().max().item<double>(), 1e-5);
    yl.backward(dy);
    EXPECT_LT((xl.grad() - x.grad()).abs().max().item<double>(), 1e-5);
    EXPECT_LT((col->weight.grad() - a->weight.grad().narrow(0, 4 * r, 4)).abs().max().item<double>(), 1e-5);
    EXPECT_LT((col->bias.grad() - a->bias.grad().narrow(0, 4 * r, 4)).abs().max().item<double>(), 1e-5);
    EXPECT_LT((row->weight.grad() - b->weight.grad().narrow(1, 4 * r, 4)).abs().max().item<double>(), 1e-5);
    EXPECT_LT((row->bias.grad() - b->bias.grad()).abs().max().item<double>(), 1e-5);
  });
  run_ranks(3, [&](int64_t r, const dhp::dist::Store& store) {
    dhp::dist::Group g(store, "tp3", {0, 1, 2}, r, kTestTimeout);
    EXPECT_THROW(dhp::parallel::ColumnParallelLinear(*a, g), dhp::Error);  // 8 rows over 3 ranks
  });
}

}  // namespace
