// The whole demo model with the text decoder tensor-parallel over 2 ranks (threads):
// the loss equals the single-process loss and every gradient equals the matching slice of
// the single-process gradient (fp32, 1e-5 relative); the shards start as exact slices of
// the single-process weights.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dhp/core/error.h"
#include "dhp/data/shapes.h"
#include "dhp/parallel/data_parallel.h"
#include "dhp/models/qwen2_5_vl/parallelize.h"
#include "dhp/parallel/vocab_parallel.h"
#include "ranks.h"

namespace {

using dhp::testing::kTestTimeout;
using dhp::testing::run_ranks;

// The slice of `full` this rank's shard `part` corresponds to: same shape -> whole; fewer
// rows -> rows of rank r; fewer columns -> columns of rank r.
torch::Tensor matching_slice(const torch::Tensor& full, const torch::Tensor& part, int64_t r) {
  if (full.sizes() == part.sizes()) return full;
  const int64_t dim = full.size(0) != part.size(0) ? 0 : 1;
  return full.narrow(dim, r * part.size(dim), part.size(dim));
}

class TextTensorParallel : public ::testing::TestWithParam<bool> {};

TEST_P(TextTensorParallel, DemoModelLossAndGradsEqualSingleProcess) {
  auto cfg = dhp::qwen::preset("demo");
  cfg.text.tie_word_embeddings = GetParam();
  auto batch = dhp::data::collate(dhp::testing::shapes_samples(cfg, 3, 56, 168), cfg);

  dhp::qwen::Qwen2_5_VL ref(cfg);
  dhp::qwen::init_parameters(*ref, 7, 0.05);
  auto out = ref->forward(batch);
  out.loss_sum.backward();
  const double loss = out.loss_sum.item<double>();
  auto ref_params = ref->named_parameters();

  run_ranks(2, [&](int64_t r, const dhp::dist::Store& store) {
    dhp::dist::Group tp(store, "tp", {0, 1}, r, kTestTimeout);
    dhp::qwen::Qwen2_5_VL m(cfg);
    dhp::qwen::init_parameters(*m, 7, 0.05);
    dhp::qwen::parallelize_text_tp(*m, tp);
    auto params = m->named_parameters();
    EXPECT_EQ(params.size(), ref_params.size());  // same names
    EXPECT_EQ(params["model.layers.0.self_attn.k_proj.weight"].size(0), cfg.text.num_kv_heads * cfg.text.head_dim() / 2);
    EXPECT_EQ(params["model.embed_tokens.weight"].size(0), cfg.text.vocab_size / 2);  // vocab-parallel
    auto o = m->forward(batch);
    EXPECT_NEAR(o.loss_sum.item<double>(), loss, 1e-5 * std::abs(loss));
    o.loss_sum.backward();
    for (auto& kv : params) {
      const auto& full = ref_params[kv.key()];
      auto want = matching_slice(full.grad(), kv.value(), r);
      auto wval = matching_slice(full, kv.value(), r);
      EXPECT_TRUE(torch::equal(kv.value(), wval)) << kv.key() << ": shard is not the slice of the full weight";
      const double scale = want.abs().max().item<double>() + 1e-12;
      EXPECT_LT((kv.value().grad() - want).abs().max().item<double>(), 1e-5 * scale) << kv.key();
    }
  });
}

INSTANTIATE_TEST_SUITE_P(TiedAndUntied, TextTensorParallel, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "tied" : "untied"; });

TEST(VocabParallel, CrossEntropyEqualsTheFullOne) {
  torch::manual_seed(2);
  auto logits = (torch::randn({7, 10}) * 3).requires_grad_(true);
  auto tgt = torch::tensor({0, 9, 4, 5, 2, 7, 3}, torch::kInt64);
  auto ref = torch::nn::functional::cross_entropy(logits, tgt, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
  auto dref = torch::autograd::grad({ref.sum()}, {logits})[0];
  // Group of one: the whole vocabulary.
  auto one = dhp::parallel::vocab_parallel_cross_entropy(logits, tgt, 0, dhp::dist::Group());
  EXPECT_LT((one - ref).abs().max().item<double>(), 1e-5);
  run_ranks(2, [&](int64_t r, const dhp::dist::Store& store) {
    dhp::dist::Group g(store, "tp", {0, 1}, r, kTestTimeout);
    auto shard = logits.detach().narrow(1, 5 * r, 5).clone().requires_grad_(true);
    auto l = dhp::parallel::vocab_parallel_cross_entropy(shard, tgt, 5 * r, g);
    EXPECT_LT((l - ref).abs().max().item<double>(), 1e-5);
    l.sum().backward();
    EXPECT_LT((shard.grad() - dref.narrow(1, 5 * r, 5)).abs().max().item<double>(), 1e-5);
  });
}

TEST(TextTensorParallel, RefusesTpNotDividingKvHeads) {
  auto cfg = dhp::qwen::preset("demo");  // 2 kv heads
  run_ranks(4, [&](int64_t r, const dhp::dist::Store& store) {
    dhp::dist::Group tp(store, "tp4", {0, 1, 2, 3}, r, kTestTimeout);
    dhp::qwen::Qwen2_5_VL m(cfg);
    EXPECT_THROW(dhp::qwen::parallelize_text_tp(*m, tp), dhp::Error);
  });
}

}  // namespace

namespace {

TEST(DataParallel, TpTimesDpGradsEqualTheWholeBatch) {
  // 4 ranks: text tp=2 x dp=2. Each replica takes half the samples; the loss is divided by
  // the global batch's target count; after the bucketed DP all-reduce every shard's
  // gradient equals the slice of the single-process gradient over the whole batch.
  auto cfg = dhp::qwen::preset("demo");
  auto all = dhp::testing::shapes_samples(cfg, 4, 56, 112);
  auto whole = dhp::data::collate(all, cfg);
  const double n_tgt = static_cast<double>(whole.num_target_tokens());
  dhp::qwen::Qwen2_5_VL ref(cfg);
  dhp::qwen::init_parameters(*ref, 3, 0.05);
  (ref->forward(whole).loss_sum / n_tgt).backward();
  auto ref_params = ref->named_parameters();
  run_ranks(4, [&](int64_t r, const dhp::dist::Store& store) {
    const int64_t tp_rank = r % 2, dp_rank = r / 2;
    dhp::dist::Group tp(store, "tp" + std::to_string(dp_rank), {2 * dp_rank, 2 * dp_rank + 1}, r, kTestTimeout);
    dhp::dist::Group dp(store, "dp" + std::to_string(tp_rank), {tp_rank, tp_rank + 2}, r, kTestTimeout);
    dhp::qwen::Qwen2_5_VL m(cfg);
    dhp::qwen::init_parameters(*m, 3, 0.05);
    dhp::qwen::parallelize_text_tp(*m, tp);
    auto mine = dhp::data::collate({all[2 * dp_rank], all[2 * dp_rank + 1]}, cfg);
    (m->forward(mine).loss_sum / n_tgt).backward();
    std::vector<torch::Tensor> ps;
    for (auto& kv : m->named_parameters()) ps.push_back(kv.value());
    const int64_t calls = dhp::parallel::all_reduce_grads(ps, dp, 64 << 10);
    EXPECT_GT(calls, 1);                                 // bucketed ...
    EXPECT_LT(calls, static_cast<int64_t>(ps.size()));   // ... not one call per parameter
    for (auto& kv : m->named_parameters()) {
      auto want = matching_slice(ref_params[kv.key()].grad(), kv.value(), tp_rank);
      const double scale = want.abs().max().item<double>() + 1e-12;
      EXPECT_LT((kv.value().grad() - want).abs().max().item<double>(), 1e-5 * scale) << kv.key();
    }
  });
}

}  // namespace
