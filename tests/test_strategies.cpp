// The strategy parity matrix: every supported vision x text strategy pair, on 2 and 4 ranks
// (threads), trains 3 optimizer steps of the demo-shaped model on packed samples with
// ragged image sizes and 2 micro-batches, fp32, and every step's loss and every final
// parameter (gathered from its shards) equal the single-process run's within 1e-5
// relative (parameters: ||p - p_ref|| / ||p_ref|| per tensor). The matrix is the table
// kCases; each row is one test.
//
// Two optimizer regimes per row:
//  * the default AdamW (eps 1e-8): losses compared. Its update m / (sqrt(v) + eps) is a
//    per-element normalisation, ill-conditioned wherever an element's gradient is small or
//    cancels across steps: there fp32 rounding of the gradient (~1e-7 relative, different
//    in any two mathematically equal computations) becomes ~1e-3 of that element's update.
//    Measured: two single-process runs that differ only in packing (micro_batches 1 vs 2)
//    already differ by ~1e-4 relative in the small-norm bias tensors after 3 steps.
//  * the same AdamW with eps = 1 (updates linear in the gradients, momentum SGD-like) and
//    lr 0.1 so parameters move as far as in the default regime: losses and all parameters
//    compared, so the final weights test the whole gradient path of every strategy.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <mutex>

#include "dhp/core/error.h"
#include "dhp/train/trainer.h"
#include "ranks.h"
#include "support/parity_matrix.h"

namespace {

using dhp::testing::run_ranks;

using dhp::testing::ParityCase;
using dhp::testing::kSp2TextTp2Disjoint;
using dhp::testing::kVisionOneTextTp2;
using dhp::testing::with;
using Case = ParityCase;
const std::vector<Case>& kCases = dhp::testing::parity_matrix();

constexpr int kSteps = 3;
constexpr double kRel = 1e-5;

dhp::Config config(const std::vector<std::string>& sets) { return dhp::testing::parity_config(sets); }

// Rank `rank` of `world` ranks as threads sharing `store`.
dhp::train::Runtime rank_runtime(int64_t rank, int64_t world, const dhp::dist::Store& store) {
  dhp::train::Runtime rt;
  rt.rank = rank;
  rt.world = world;
  rt.store = std::make_shared<dhp::dist::Store>(store);
  rt.timeout = dhp::testing::kTestTimeout;
  return rt;
}

const std::vector<std::string> kLinearAdam = {"training.eps=1", "training.lr=0.1", "training.min_lr=0.01"};

struct TrainedRun {
  std::vector<double> losses;
  std::map<std::string, torch::Tensor> params;
};

TrainedRun train_single(const std::vector<std::string>& sets) {
  TrainedRun out;
  dhp::train::Trainer t(config(sets));
  for (int i = 0; i < kSteps; ++i) out.losses.push_back(t.train_step().loss);
  out.params = t.full_parameters();
  return out;
}

const TrainedRun& reference(bool linear) {
  static TrainedRun adam = train_single({}), lin = train_single(kLinearAdam);
  return linear ? lin : adam;
}

TrainedRun train_parallel(const Case& c, const std::vector<std::string>& extra) {
  auto sets = c.sets;
  sets.insert(sets.end(), extra.begin(), extra.end());
  auto cfg = config(sets);
  std::mutex mu;
  TrainedRun got;
  run_ranks(c.world, [&](int64_t rank, const dhp::dist::Store& store) {
    dhp::train::Trainer t(cfg, rank_runtime(rank, c.world, store));
    std::vector<double> losses;
    for (int i = 0; i < kSteps; ++i) losses.push_back(t.train_step().loss);
    auto params = t.full_parameters();
    if (rank == 0) {
      std::lock_guard<std::mutex> lock(mu);
      got.losses = losses;
      got.params = params;
    }
  });
  return got;
}

void expect_losses(const TrainedRun& got, const TrainedRun& ref, const char* regime) {
  ASSERT_EQ(got.losses.size(), static_cast<size_t>(kSteps)) << regime;
  for (int i = 0; i < kSteps; ++i) {
    EXPECT_NEAR(got.losses[i], ref.losses[i], kRel * std::abs(ref.losses[i])) << regime << " step " << i + 1;
  }
}

class StrategyParity : public ::testing::TestWithParam<Case> {};

TEST_P(StrategyParity, LossesAndParametersEqualSingleProcess) {
  const auto& c = GetParam();
  ASSERT_NO_THROW(dhp::train::resolve_layouts(config(c.sets), c.world));
  expect_losses(train_parallel(c, {}), reference(false), "default AdamW");
  const auto got = train_parallel(c, kLinearAdam);
  const auto& ref = reference(true);
  expect_losses(got, ref, "linear AdamW");
  ASSERT_EQ(got.params.size(), ref.params.size());
  double worst = 0;
  std::string worst_name;
  for (const auto& [name, want] : ref.params) {
    auto it = got.params.find(name);
    ASSERT_NE(it, got.params.end()) << name;
    ASSERT_EQ(it->second.sizes(), want.sizes()) << name;
    const double rel = (it->second - want).norm().item<double>() / (want.norm().item<double>() + 1e-12);
    EXPECT_LT(rel, kRel) << name;
    if (rel > worst) worst = rel, worst_name = name;
  }
  std::printf("[ %s ] worst parameter difference %.2e relative (%s)\n", c.name, worst, worst_name.c_str());
}

INSTANTIATE_TEST_SUITE_P(Matrix, StrategyParity, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

// The same matrix on video: every sample a clip of the moving task (4 frames = 2 temporal
// patches, 56..168 px, 1 s per temporal patch in the M-RoPE positions), so sequence
// parallelism splits clips on window boundaries across their frames. The linear regime only
// (losses and every parameter): it is the stronger of the two.
const std::vector<std::string> kVideo = {"data.frames=4", "training.eps=1", "training.lr=0.1", "training.min_lr=0.01"};

class VideoStrategyParity : public ::testing::TestWithParam<Case> {};

TEST_P(VideoStrategyParity, LossesAndParametersEqualSingleProcess) {
  const auto& c = GetParam();
  static const TrainedRun ref = train_single(kVideo);
  const auto got = train_parallel(c, kVideo);
  expect_losses(got, ref, "video, linear AdamW");
  ASSERT_EQ(got.params.size(), ref.params.size());
  double worst = 0;
  for (const auto& [name, want] : ref.params) {
    auto it = got.params.find(name);
    ASSERT_NE(it, got.params.end()) << name;
    const double rel = (it->second - want).norm().item<double>() / (want.norm().item<double>() + 1e-12);
    EXPECT_LT(rel, kRel) << name;
    worst = std::max(worst, rel);
  }
  std::printf("[ %s video ] worst parameter difference %.2e relative\n", c.name, worst);
}

INSTANTIATE_TEST_SUITE_P(Matrix, VideoStrategyParity, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

// The pipelined and the sequential schedule compute the same thing, bit for bit: each
// module runs the same micro-batches with the same collectives in the same order.
TEST(StrategySchedules, PipelinedEqualsSequentialExactly) {
  for (const auto& sets : {kVisionOneTextTp2, kSp2TextTp2Disjoint}) {
    const int64_t world = sets == kVisionOneTextTp2 ? 3 : 4;
    const auto piped = train_parallel({"piped", world, sets}, {});
    const auto seq = train_parallel({"seq", world, with(sets, "parallel.pipeline=false")}, {});
    ASSERT_EQ(piped.losses.size(), seq.losses.size());
    for (size_t i = 0; i < piped.losses.size(); ++i) EXPECT_EQ(piped.losses[i], seq.losses[i]) << "step " << i + 1;
    ASSERT_EQ(piped.params.size(), seq.params.size());
    for (const auto& [name, p] : piped.params) EXPECT_TRUE(torch::equal(p, seq.params.at(name))) << name;
  }
}

// Communication beside compute (parallel.overlap) changes no bit over several micro-batches:
// gradient reductions started during the last backward (on a group of their own; 16 KiB
// buckets, so that every module has several), all-reduced (dp, tp x dp) or reduce-scattered
// (ZeRO-1), and from the second step they do start during the backward; ZeRO-3's prefetched
// gathers (which do serve) and its reduce-scatters landing later. (4 micro-batches on 2 ranks.)
TEST(StrategyOverlap, ReductionsDuringBackwardChangeNoBit) {
  for (const auto& c : kCases) {
    const std::string name = c.name;
    if (name != "dp_2" && name != "dhp_2" && name != "dp4_tp2x2_4" && name != "sp2x2_tp2x2_4" && name != "zero3_2" &&
        name != "zero3_4")
      continue;
    const bool zero3 = name.rfind("zero3", 0) == 0;
    TrainedRun runs[2];
    dhp::parallel::ReductionCounts counts[2];
    for (int overlap = 0; overlap < 2; ++overlap) {
      auto sets = c.sets;
      sets.push_back("parallel.bucket_mb=0.015625");
      // 4 micro-batches on 2 ranks; on 4, dp=4 needs 4 samples per micro-batch: 2 of them.
      sets.push_back(c.world == 2 ? "training.micro_batches=4" : "training.micro_batches=2");
      sets.push_back(overlap ? "parallel.overlap=true" : "parallel.overlap=false");
      const auto cfg = config(sets);
      std::mutex mu;
      run_ranks(c.world, [&](int64_t rank, const dhp::dist::Store& store) {
        dhp::train::Trainer t(cfg, rank_runtime(rank, c.world, store));
        std::vector<double> losses;
        for (int i = 0; i < kSteps; ++i) losses.push_back(t.train_step().loss);
        auto params = t.full_parameters();
        if (rank != 0) return;
        std::lock_guard<std::mutex> lock(mu);
        runs[overlap] = {losses, params};
        counts[overlap] = t.parallel_model().reduction_counts();
      });
    }
    EXPECT_EQ(runs[0].losses, runs[1].losses) << name;
    for (const auto& [p, want] : runs[0].params) EXPECT_TRUE(torch::equal(runs[1].params.at(p), want)) << name << " " << p;
    EXPECT_EQ(counts[0].early, 0) << name;
    EXPECT_EQ(counts[0].prefetched, 0) << name;
    EXPECT_EQ(counts[1].buckets, counts[0].buckets) << name;
    if (zero3) {
      EXPECT_GT(counts[1].prefetched, 0) << name;
    } else {
      // Step 1 reduces at the end; steps 2 and 3 start some of their buckets during the backward.
      EXPECT_GT(counts[1].early, 0) << name << ": " << counts[1].buckets << " buckets";
    }
    std::printf("[ %s ] %lld of %lld buckets started during a backward, %lld gathers prefetched\n", c.name,
                static_cast<long long>(counts[1].early), static_cast<long long>(counts[1].buckets),
                static_cast<long long>(counts[1].prefetched));
  }
}

// Per-module learning rates and weight decay (optim::ParamGroup: per-parameter scalars in
// AdamW, per-element slices under ZeRO-1, named slices under ZeRO-3) train like one process
// with the same settings, in the linear regime where parameters are compared; and a module at
// rate 0 and decay 0 is left bit-identical while its merger and the decoder train.
TEST(StrategyParity, PerModuleRatesEqualSingleProcess) {
  const std::vector<std::string> rates = {"training.lr_vision=0.03", "training.lr_merger=0.2",
                                          "training.weight_decay_text=0.3", "training.lr_text=0.05",
                                          "training.weight_decay=0.1"};
  auto sets = kLinearAdam;
  sets.insert(sets.end(), rates.begin(), rates.end());
  const auto ref = train_single(sets);
  for (const char* s : {"dhp", "zero3", "tp"}) {
    const auto got = train_parallel({s, 2, {std::string("parallel.strategy=") + s}}, sets);
    expect_losses(got, ref, s);
    ASSERT_EQ(got.params.size(), ref.params.size()) << s;
    for (const auto& [name, want] : ref.params) {
      const double rel = (got.params.at(name) - want).norm().item<double>() / (want.norm().item<double>() + 1e-12);
      EXPECT_LT(rel, kRel) << s << " " << name;
    }
  }
  auto frozen = kLinearAdam;
  frozen.insert(frozen.end(), {"training.lr_vision=0", "training.weight_decay_vision=0"});
  dhp::train::Trainer fresh(config(frozen));
  const auto before = fresh.full_parameters();
  const auto after = train_parallel({"dhp", 2, {"parallel.strategy=dhp"}}, frozen).params;
  int64_t kept = 0, moved = 0;
  for (const auto& [name, p] : before) {
    const bool tower = name.rfind("visual.", 0) == 0 && name.rfind("visual.merger.", 0) != 0;
    const bool same = torch::equal(after.at(name), p);
    EXPECT_EQ(same, tower) << name;
    (same ? kept : moved) += 1;
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(moved, 0);
}

// Fine-tuning rows: each layout with frozen parts trains like one process with the same
// settings (linear regime: losses and every parameter within kRel), and every frozen
// parameter is bit-identical to its initial value while the trainable ones moved.
class FineTuneParity : public ::testing::TestWithParam<dhp::testing::FineTuneCase> {};

TEST_P(FineTuneParity, EqualsSingleProcessAndLeavesFrozenParametersUntouched) {
  const auto& c = GetParam();
  auto sets = kLinearAdam;
  sets.insert(sets.end(), c.tuning.begin(), c.tuning.end());
  static std::map<std::vector<std::string>, TrainedRun> refs;  // one reference per setting
  if (!refs.count(sets)) refs[sets] = train_single(sets);
  const auto& ref = refs.at(sets);
  const auto cfg = config(sets);
  const auto got = train_parallel({c.name, c.world, c.layout}, sets);
  expect_losses(got, ref, "linear AdamW");
  dhp::train::Trainer fresh(cfg);
  const auto before = fresh.full_parameters();
  ASSERT_EQ(got.params.size(), before.size());
  int64_t frozen = 0, trained = 0;
  for (const auto& [name, want] : ref.params) {
    const auto& p = got.params.at(name);
    const double rel = (p - want).norm().item<double>() / (want.norm().item<double>() + 1e-12);
    EXPECT_LT(rel, kRel) << name;
    if (cfg.model.freezing.trainable(name, cfg.model.config)) {
      ++trained;
      EXPECT_FALSE(torch::equal(p, before.at(name))) << name << " trains but did not move";
    } else {
      ++frozen;
      EXPECT_TRUE(torch::equal(p, before.at(name))) << name << " is frozen but changed";
    }
  }
  EXPECT_GT(frozen, 0);
  EXPECT_GT(trained, 0);
}

INSTANTIATE_TEST_SUITE_P(Matrix, FineTuneParity, ::testing::ValuesIn(dhp::testing::fine_tune_matrix()),
                         [](const auto& info) { return std::string(info.param.name); });

// bf16 compute (fp32 masters): every named combination runs, its collectives carrying bf16
// activations and gradients, and its losses stay within bf16 rounding of one process
// (bf16 keeps 8 significant bits, ~4e-3 relative; sums in other orders differ by a few of
// those). Tolerance 1e-2 relative, over 3 steps.
TEST(StrategyPrecision, Bf16StrategiesTrackTheSingleProcessBf16Run) {
  const std::vector<std::string> bf16 = {"training.precision=bf16"};
  const auto ref = train_single(bf16);
  for (const char* s : {"dhp", "tp", "zero3"}) {
    const auto got = train_parallel({s, 2, {std::string("parallel.strategy=") + s}}, bf16);
    ASSERT_EQ(got.losses.size(), ref.losses.size()) << s;
    for (size_t i = 0; i < ref.losses.size(); ++i) {
      EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-2 * ref.losses[i]) << s << " step " << i + 1;
      std::printf("[ bf16 %s ] step %zu loss %.6f vs %.6f (%.1e relative)\n", s, i + 1, got.losses[i], ref.losses[i],
                  std::abs(got.losses[i] - ref.losses[i]) / ref.losses[i]);
    }
  }
}

// What each strategy holds per rank (ModuleStrategy::held), against one process's whole
// model: replicated modules hold everything on every rank, ZeRO-1 splits the optimizer
// state, TP splits the sharded matrices, ZeRO-3 splits everything (padding aside).
TEST(StrategyAccounting, HeldElementsFollowTheStrategy) {
  using dhp::parallel::HeldElements;
  const auto whole = [](const std::string& module) {
    dhp::train::ParallelModel pm(config({}), dhp::train::resolve_layouts(config({}), 1), dhp::train::Runtime{});
    return pm.held(module);
  };
  const HeldElements v = whole("vision"), t = whole("text");
  EXPECT_GT(v.parameters, 0);
  EXPECT_EQ(v.optimizer_state, 2 * v.parameters);  // fp32: the two moments, no masters
  EXPECT_EQ(t.optimizer_state, 2 * t.parameters);
  auto per_rank = [](const std::vector<std::string>& sets) {
    const auto cfg = config(sets);
    std::vector<std::pair<HeldElements, HeldElements>> out(2);
    run_ranks(2, [&](int64_t rank, const dhp::dist::Store& store) {
      dhp::train::ParallelModel pm(cfg, dhp::train::resolve_layouts(cfg, 2), rank_runtime(rank, 2, store));
      out[static_cast<size_t>(rank)] = {pm.held("vision"), pm.held("text")};
    });
    return out;
  };
  const auto dhp_layout = per_rank({"parallel.strategy=dhp"});  // vision sp + ZeRO-1, text tp
  for (const auto& [vision, text] : dhp_layout) {
    EXPECT_EQ(vision.parameters, v.parameters);
    EXPECT_GE(vision.optimizer_state, v.optimizer_state / 2);          // a half of the flat vector,
    EXPECT_LE(vision.optimizer_state, v.optimizer_state / 2 + 2 * 2);  // padded to the group
    EXPECT_LT(text.parameters, t.parameters * 3 / 4);  // matrices and vocabulary halved, norms whole
    EXPECT_EQ(text.optimizer_state, 2 * text.parameters);
  }
  EXPECT_GT(dhp_layout[0].second.parameters + dhp_layout[1].second.parameters, t.parameters);
  const auto zero3 = per_rank({"parallel.strategy=zero3"});
  int64_t vision_sum = 0;
  for (const auto& [vision, text] : zero3) {
    vision_sum += vision.parameters;
    EXPECT_LE(vision.parameters, v.parameters / 2 + 200);  // one padded slice of every parameter
    EXPECT_LE(text.parameters, t.parameters / 2 + 200);
  }
  EXPECT_GE(vision_sum, v.parameters);
  // A frozen module holds its parameters but no optimizer state; a partly frozen one, state
  // for what trains only.
  const auto frozen = per_rank({"parallel.strategy=dhp", "model.vision.freeze=true", "model.merger.freeze=true"});
  for (const auto& [vision, text] : frozen) {
    EXPECT_EQ(vision.parameters, v.parameters);
    EXPECT_EQ(vision.trainable, 0);
    EXPECT_EQ(vision.optimizer_state, 0);
    EXPECT_EQ(text.trainable, text.parameters);
  }
  const auto merger = per_rank({"parallel.strategy=zero3", "model.vision.freeze=true"});
  const auto mc = config({}).model.config;
  const int64_t merger_params = dhp::qwen::parameter_sizes(mc).merger;
  int64_t merger_sum = 0;
  for (const auto& [vision, text] : merger) {
    merger_sum += vision.trainable;
    EXPECT_LT(vision.trainable, vision.parameters / 2);
    EXPECT_EQ(vision.optimizer_state, 2 * vision.trainable);
  }
  EXPECT_GE(merger_sum, merger_params);      // the merger's slices, padded
  EXPECT_LE(merger_sum, merger_params + 20);
}

// How a micro-batch's samples go to each module's data-parallel replicas: two large images
// then two small ones. By cost, each replica takes one of each; contiguous, the first replica
// takes both large ones. Modules on the same ranks in the same replicas (dp | dp) share one
// assignment; a one-replica vision module (sp) takes everything while the text replicas
// balance on their own.
TEST(StrategyBalance, ReplicasTakeSamplesByCost) {
  using Assign = dhp::parallel::ReplicaSamples;
  const auto mc = config({}).model.config;
  auto sample = [&](int64_t grid) {
    dhp::data::Sample s;
    s.grids = {{1, grid, grid}};
    s.ids.assign(4, 1);
    s.ids.insert(s.ids.end(), static_cast<size_t>(grid * grid / 4), mc.image_token_id);
    s.ids.insert(s.ids.end(), {7, 8, 9});
    s.labels.assign(s.ids.size(), -100);
    s.labels.back() = 9;
    return s;
  };
  const std::vector<dhp::data::Sample> mb = {sample(12), sample(12), sample(2), sample(2)};
  auto assignments = [&](const std::vector<std::string>& sets) {
    const auto cfg = config(sets);
    std::vector<std::vector<Assign>> out(2);
    std::vector<std::vector<bool>> encodes(2);
    run_ranks(2, [&](int64_t rank, const dhp::dist::Store& store) {
      dhp::train::ParallelModel pm(cfg, dhp::train::resolve_layouts(cfg, 2), rank_runtime(rank, 2, store));
      out[static_cast<size_t>(rank)] = pm.assign(mb);
      encodes[static_cast<size_t>(rank)] = pm.encodes(mb);
    });
    EXPECT_EQ(out[0], out[1]) << "every rank computes the same assignment";
    return std::make_pair(out[0], encodes);
  };
  const auto [dp, dp_encodes] = assignments({"parallel.strategy=dp"});
  EXPECT_EQ(dp, (std::vector<Assign>{{{0, 2}, {1, 3}}, {{0, 2}, {1, 3}}}));
  EXPECT_EQ(dp_encodes, (std::vector<std::vector<bool>>{{true, false, true, false}, {false, true, false, true}}));
  const auto [sp_dp, sp_dp_encodes] = assignments(
      {"parallel.strategy=custom", "parallel.vision.strategy=sp", "parallel.text.strategy=dp"});
  EXPECT_EQ(sp_dp, (std::vector<Assign>{{{0, 1, 2, 3}}, {{0, 2}, {1, 3}}}));
  EXPECT_EQ(sp_dp_encodes[0], std::vector<bool>(4, true));
  const auto [contiguous, unused] = assignments({"parallel.strategy=dp", "parallel.balance=contiguous"});
  EXPECT_EQ(contiguous, (std::vector<Assign>{{{0, 1}, {2, 3}}, {{0, 1}, {2, 3}}}));
  EXPECT_THROW(config({"parallel.balance=sizes"}).validate(), dhp::Error);
}

TEST(StrategyLayouts, ImpossibleLayoutsAreRefusedWithTheNumbers) {
  auto expect_error = [](const std::vector<std::string>& sets, int64_t world, const std::string& part) {
    try {
      dhp::train::resolve_layouts(config(sets), world);
      ADD_FAILURE() << "accepted; expected an error containing '" << part << "'";
    } catch (const dhp::Error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  expect_error({}, 2, "parallel.strategy=none runs on one process");
  expect_error({"parallel.strategy=tp"}, 3, "does not divide");           // tp=3 vs 4 vision heads
  expect_error({"parallel.strategy=dhp", "parallel.text.tp=3"}, 4, "parallel.text.tp=3 does not divide the 4 ranks");
  expect_error({"parallel.strategy=dhp"}, 8, "sp=8 does not divide vision num_heads=4");
  expect_error({"parallel.strategy=dp"}, 8, "replicas need at least 8 samples per micro-batch");
  expect_error({"parallel.strategy=dhp", "data.batch_size=2", "training.micro_batches=1"}, 4,
               "needs at least one attention window per rank, but a vision replica may get only 2 window(s)");
  ASSERT_NO_THROW(dhp::train::resolve_layouts(
      config({"parallel.strategy=dhp", "data.batch_size=2", "training.micro_batches=1", "data.min_side=224",
              "data.max_side=224"}), 4));
  expect_error({"parallel.strategy=custom", "parallel.vision.strategy=dp"}, 2, "parallel.vision.strategy and parallel.text.strategy");
  expect_error({"parallel.strategy=dhp", "parallel.vision.ranks=[0]", "parallel.text.ranks=[1]"}, 3,
               "rank 2 of the 3 runs no module");
  expect_error({"parallel.strategy=dhp", "parallel.vision.ranks=[0,4]"}, 4, "vision rank 4 is outside the world of 4");
  expect_error({"parallel.strategy=dhp", "parallel.vision.ranks=[0]", "parallel.text.ranks=[0,1,2]"}, 3,
               "text tp=3 does not divide text num_heads=8");
  expect_error({"parallel.strategy=custom", "parallel.vision.strategy=none", "parallel.vision.ranks=[0,1]",
                "parallel.text.strategy=tp"}, 2, "parallel.vision.strategy=none runs on one process, but the module has the 2 ranks of parallel.vision.ranks");
}

}  // namespace
