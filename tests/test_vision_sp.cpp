// Vision sequence parallelism (Ulysses over ragged window shards): the demo model with its
// vision tower on sp=2 and sp=4 gives the single-process loss, and after summing the vision
// gradients over the SP group every gradient equals the single-process one (1e-5 relative).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dhp/core/error.h"
#include "dhp/data/shapes.h"
#include "dhp/parallel/data_parallel.h"
#include "dhp/models/qwen2_5_vl/parallelize.h"
#include "dhp/parallel/sequence_parallel.h"
#include "ranks.h"

namespace {

using dhp::testing::kTestTimeout;
using dhp::testing::run_ranks;

TEST(VisionSp, WindowShardsAreWholeWindowsAndBalanced) {
  // windows of 64, 64, 32, 64, 16 patches
  std::vector<int64_t> cu = {0, 64, 128, 160, 224, 240};
  EXPECT_EQ(dhp::parallel::window_shards(cu, 1), (std::vector<int64_t>{240}));
  EXPECT_EQ(dhp::parallel::window_shards(cu, 2), (std::vector<int64_t>{64, 176}));
  auto four = dhp::parallel::window_shards(cu, 4);
  int64_t sum = 0;
  for (auto r : four) {
    EXPECT_GT(r, 0);
    sum += r;
  }
  EXPECT_EQ(sum, 240);
  EXPECT_EQ(dhp::parallel::window_shards(cu, 5), (std::vector<int64_t>{64, 64, 32, 64, 16}));
  EXPECT_THROW(dhp::parallel::window_shards(cu, 6), dhp::Error);
}

void check_sp(int64_t sp, int images = 3, int64_t min_side = 112, int64_t max_side = 224, bool checkpoint = false) {
  auto cfg = dhp::qwen::preset("demo");  // 4 vision heads
  auto batch = dhp::data::collate(dhp::testing::shapes_samples(cfg, images, min_side, max_side), cfg);
  dhp::qwen::Qwen2_5_VL ref(cfg);
  dhp::qwen::init_parameters(*ref, 5, 0.05);
  auto out = ref->forward(batch);
  out.loss_sum.backward();
  const double loss = out.loss_sum.item<double>();
  auto ref_params = ref->named_parameters();
  run_ranks(sp, [&](int64_t r, const dhp::dist::Store& store) {
    dhp::dist::Group g(store, "sp", dhp::testing::first_ranks(sp), r, kTestTimeout);
    dhp::qwen::Qwen2_5_VL m(cfg);
    dhp::qwen::init_parameters(*m, 5, 0.05);
    m->set_activation_checkpointing(checkpoint);
    dhp::qwen::parallelize_vision_sp(*m, g);
    auto o = m->forward(batch);
    EXPECT_NEAR(o.loss_sum.item<double>(), loss, 1e-5 * loss);
    o.loss_sum.backward();
    std::vector<torch::Tensor> vision;
    for (auto& kv : m->named_parameters()) {
      if (kv.key().rfind("visual.", 0) == 0) vision.push_back(kv.value());
    }
    dhp::parallel::all_reduce_grads(vision, g);
    for (auto& kv : m->named_parameters()) {
      const auto& want = ref_params[kv.key()].grad();
      const double scale = want.abs().max().item<double>() + 1e-12;
      EXPECT_LT((kv.value().grad() - want).abs().max().item<double>(), 1e-5 * scale) << kv.key();
    }
  });
}

TEST(VisionSp, TwoRanksEqualSingleProcess) { check_sp(2); }
TEST(VisionSp, FourRanksEqualSingleProcess) { check_sp(4); }
// Fewer images than ranks: one image of 4-9 windows split across 4 ranks, its full-attention
// blocks spanning every shard.
TEST(VisionSp, OneImageSplitAcrossFourRanks) { check_sp(4, 1, 224, 336); }
// Activation checkpointing: every block recomputed in backward, Ulysses all-to-alls too.
TEST(VisionSp, CheckpointedBlocksEqualSingleProcess) { check_sp(2, 3, 112, 224, /*checkpoint=*/true); }

}  // namespace
