// Single-process training: determinism, gradient accumulation parity, bf16 mixed
// precision, the optimizer and schedule, and that the demo task learns.
#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>

#include "dhp/core/op_profile.h"
#include "dhp/optim/adamw.h"
#include "support/grad_norm.h"
#include "dhp/train/parallel_model.h"
#include "dhp/train/metrics.h"
#include "dhp/train/trainer.h"
#include "errors.h"
#include "files.h"

namespace {

dhp::Config small_config(std::vector<std::string> sets = {}) {
  std::vector<std::string> base = {"data.batch_size=4", "data.min_side=56", "data.max_side=112",
                                   "training.steps=20", "training.warmup_steps=2", "data.eval_samples=8"};
  base.insert(base.end(), sets.begin(), sets.end());
  return dhp::load_config("", base);
}

std::vector<double> losses(dhp::train::Trainer& t, int n) {
  std::vector<double> out;
  for (int i = 0; i < n; ++i) out.push_back(t.train_step().loss);
  return out;
}

TEST(Train, SameSeedGivesBitIdenticalLosses) {
  dhp::train::Trainer a(small_config()), b(small_config());
  auto la = losses(a, 3), lb = losses(b, 3);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(la[i], lb[i]) << "step " << i;
  dhp::train::Trainer c(small_config({"training.seed=5"}));
  EXPECT_NE(losses(c, 1)[0], la[0]);
}

// A gradient that is not finite stops the run at that step, naming it, before the
// optimizer touches any parameter.
TEST(Train, NonFiniteGradientStopsBeforeAnyUpdate) {
  dhp::train::Trainer t(small_config());
  losses(t, 1);
  auto params = t.model().named_parameters();
  {
    torch::NoGradGuard g;
    params["model.norm.weight"][0] = std::numeric_limits<float>::quiet_NaN();
  }
  std::map<std::string, torch::Tensor> before;
  for (const auto& p : params) before[p.key()] = p.value().detach().clone();
  const auto error = dhp::testing::error_of([&] { t.train_step(); });
  EXPECT_NE(error.find("step 2: the gradient norm is NaN"), std::string::npos) << error;
  for (const auto& p : params) {
    EXPECT_TRUE(torch::equal(p.value().isnan(), before[p.key()].isnan())) << p.key();
    EXPECT_TRUE(torch::equal(torch::nan_to_num(p.value()), torch::nan_to_num(before[p.key()]))) << p.key();
  }
}

TEST(Train, MicroBatchesEqualOneBigBatch) {
  // Loss = mean over the global batch's answer tokens whatever the split, so the accumulated
  // gradients equal the one-batch gradients within fp32 summation-order noise.
  dhp::train::Trainer one(small_config()), four(small_config({"training.micro_batches=4"}));
  auto s1 = one.train_step(), s4 = four.train_step();
  EXPECT_NEAR(s1.loss, s4.loss, 1e-6 * s1.loss);
  EXPECT_NEAR(s1.grad_norm, s4.grad_norm, 1e-5 * s1.grad_norm);
  auto p1 = one.model().named_parameters(), p4 = four.model().named_parameters();
  for (auto& kv : p1) {
    auto g1 = kv.value().grad(), g4 = p4[kv.key()].grad();
    const double scale = g1.abs().max().item<double>() + 1e-12;
    EXPECT_LT((g1 - g4).abs().max().item<double>(), 1e-5 * scale) << kv.key();
  }
  auto l1 = losses(one, 2), l4 = losses(four, 2);
  for (int i = 0; i < 2; ++i) EXPECT_NEAR(l1[i], l4[i], 1e-5 * l1[i]) << "step " << i + 1;
}

TEST(Train, Bf16KeepsFp32MastersAndTracksFp32) {
  dhp::train::Trainer f(small_config()), h(small_config({"training.precision=bf16"}));
  EXPECT_EQ(h.model().named_parameters()["model.layers.0.mlp.up_proj.weight"].scalar_type(), torch::kBFloat16);
  auto lf = losses(f, 3), lh = losses(h, 3);
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(std::isfinite(lh[i]));
    EXPECT_NEAR(lh[i], lf[i], 0.05 * lf[i]) << "step " << i;
  }
}

TEST(Train, CheckpointedTrainingMatches) {
  dhp::train::Trainer a(small_config()), b(small_config({"training.activation_checkpointing=true"}));
  auto la = losses(a, 3), lb = losses(b, 3);
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(la[i], lb[i], 1e-6 * la[i]);
}

TEST(Train, LearnsTheShapesTask) {
  auto cfg = small_config({"training.steps=40", "data.batch_size=8", "training.lr=3e-3"});
  dhp::train::Trainer t(cfg);
  auto l = losses(t, 40);
  EXPECT_LT(l.back(), 0.5 * l.front()) << l.front() << " -> " << l.back();
}

// The step's phases in metrics.jsonl, and DHP_PROFILE's trace of exactly the chosen step.
TEST(Train, PhaseTimesAndOneStepProfile) {
  dhp::testing::TempDir dir("train_profile");
  const auto trace_dir = dir.path() / "trace";
  setenv("DHP_PROFILE", trace_dir.c_str(), 1);
  setenv("DHP_PROFILE_STEP", "2", 1);
  {
    dhp::train::Trainer t(small_config({"training.steps=2", "data.eval_samples=0", "checkpoint.at_end=false",
                                        "output.dir=" + (dir.path() / "run").string()}));
    t.run();
  }
  unsetenv("DHP_PROFILE");
  unsetenv("DHP_PROFILE_STEP");
  std::ifstream trace(trace_dir / "rank0.trace.json");
  ASSERT_TRUE(trace.good()) << "no trace written";
  std::stringstream ss;
  ss << trace.rdbuf();
  EXPECT_NE(ss.str().find("aten::mm"), std::string::npos);
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(trace_dir), std::filesystem::directory_iterator()), 1);
  std::ifstream metrics(dir.path() / "run" / "metrics.jsonl");
  std::string line;
  int lines = 0;
  while (std::getline(metrics, line)) {
    ++lines;
    // Each a positive time (the list: its first rank's).
    for (const std::string key : {"\"samples_s\": ", "\"update_s\": ", "\"update_s_per_rank\": ["}) {
      const auto at = line.find(key);
      ASSERT_NE(at, std::string::npos) << key << " missing in " << line;
      EXPECT_GT(std::atof(line.c_str() + at + key.size()), 0) << key << " in " << line;
    }
  }
  EXPECT_EQ(lines, 2);
}

// training.profile_every: the profiled step's line breaks it down per rank, its parts adding
// up to the step; the other steps' lines have no breakdown.
TEST(Train, ProfiledStepBreaksTheStepDownByKind) {
  dhp::testing::TempDir dir("train_breakdown");
  {
    dhp::train::Trainer t(small_config({"training.steps=3", "training.profile_every=2", "data.eval_samples=0",
                                        "checkpoint.at_end=false", "output.dir=" + (dir.path() / "run").string()}));
    t.run();
  }
  std::ifstream metrics(dir.path() / "run" / "metrics.jsonl");
  std::string line;
  int lines = 0;
  while (std::getline(metrics, line)) {
    ++lines;
    const auto n = YAML::Load(line);
    if (lines != 2) {
      EXPECT_FALSE(n["breakdown_per_rank"]) << "step " << lines;
      continue;
    }
    ASSERT_TRUE(n["breakdown_per_rank"]) << line;
    double sum = 0;
    for (const char* part : dhp::train::kBreakdownParts) {
      const auto v = n["breakdown_per_rank"][part].as<std::vector<double>>();
      ASSERT_EQ(v.size(), 1u) << part;
      EXPECT_GE(v[0], 0) << part;
      sum += v[0];
    }
    for (const char* part : {"gemm_s", "attention_s", "elementwise_s", "update_s", "data_s"})
      EXPECT_GT(n["breakdown_per_rank"][part][0].as<double>(), 0) << part;
    const double step = n["step_time_s"].as<double>();
    EXPECT_GE(sum, 0.999 * step);
    EXPECT_LE(sum, 1.001 * step + 1e-4);  // "other" is what the rest leaves
  }
  EXPECT_EQ(lines, 3);
}

TEST(Train, OperatorsAreSortedByKind) {
  EXPECT_EQ(dhp::op_kind("aten::mm"), "gemm");
  EXPECT_EQ(dhp::op_kind("aten::addmm"), "gemm");
  EXPECT_EQ(dhp::op_kind("AddmmBackward0"), "gemm");
  EXPECT_EQ(dhp::op_kind("aten::convolution"), "gemm");
  EXPECT_EQ(dhp::op_kind("dhp::attention"), "attention");
  EXPECT_EQ(dhp::op_kind("torch::autograd::CppNode<dhp::nn::VarlenAttentionFn>"), "attention");
  EXPECT_EQ(dhp::op_kind("aten::add_"), "elementwise");
  EXPECT_EQ(dhp::op_kind("aten::softmax"), "elementwise");
  // Own time only: a matmul's time is its mm's, and nothing is counted twice.
  dhp::OpProfile p;
  auto a = torch::randn({256, 256}), b = torch::randn({256, 256});
  for (int i = 0; i < 4; ++i) (void)torch::matmul(a, b);
  for (int i = 0; i < 4; ++i) (void)(a.exp() + b.exp());
  const auto t = p.times();
  EXPECT_GT(t.gemm_s, 0);
  EXPECT_GT(t.elementwise_s, 0);
  EXPECT_EQ(t.attention_s, 0);
  EXPECT_GE(t.ops, 16);
}

TEST(Optim, LrScheduleWarmupThenCosine) {
  EXPECT_DOUBLE_EQ(dhp::optim::lr_at(0, 100, 10, 1.0, 0.1), 0.1);
  EXPECT_DOUBLE_EQ(dhp::optim::lr_at(9, 100, 10, 1.0, 0.1), 1.0);
  EXPECT_NEAR(dhp::optim::lr_at(10, 100, 10, 1.0, 0.1), 1.0, 1e-12);
  EXPECT_NEAR(dhp::optim::lr_at(55, 100, 10, 1.0, 0.1), 0.55, 1e-12);  // half-way: mean of lr and min
  EXPECT_NEAR(dhp::optim::lr_at(100, 100, 10, 1.0, 0.1), 0.1, 1e-12);
}

TEST(Optim, AdamWStepByHandWithDecayOnlyOnMatrices) {
  auto w = torch::ones({1, 2}).requires_grad_(true);
  auto b = torch::ones({2}).requires_grad_(true);
  dhp::optim::AdamWOptions o;
  o.weight_decay = 0.5;
  o.beta1 = 0.9;
  o.beta2 = 0.99;
  o.eps = 0;
  dhp::optim::AdamW opt({{"w", w, true}, {"b", b, false}}, o);
  w.mutable_grad() = torch::tensor({{2.f, -4.f}});
  b.mutable_grad() = torch::tensor({3.f, 0.5f});
  opt.step(0.1);
  // First step: m/bc1 = g, v/bc2 = g^2 -> update = lr * sign(g); w also decays by lr*wd.
  EXPECT_NEAR(w[0][0].item<float>(), 1 * (1 - 0.05) - 0.1, 1e-6);
  EXPECT_NEAR(w[0][1].item<float>(), 1 * (1 - 0.05) + 0.1, 1e-6);
  EXPECT_NEAR(b[0].item<float>(), 1 - 0.1, 1e-6);
  EXPECT_NEAR(b[1].item<float>(), 1 - 0.1, 1e-6);
}

// Per-group settings: the longest prefix wins; a group's lr scales the step (and the decay,
// which is lr x wd), its weight decay replaces the default, and parameters without decay
// (norms, biases) keep none.
TEST(Optim, GroupsScaleTheRateAndSetTheDecayByLongestPrefix) {
  dhp::optim::AdamWOptions o;
  o.weight_decay = 0.5;
  o.beta1 = 0.9;
  o.beta2 = 0.99;
  o.eps = 0;
  o.groups = {{"visual.", 2.0, -1}, {"visual.merger.", 0.5, 0.0}, {"model.", 0.0, 0.0}};
  using dhp::optim::settings_for;
  EXPECT_EQ(settings_for({"visual.blocks.0.w", {}, true}, o).lr_scale, 2.0);
  EXPECT_EQ(settings_for({"visual.blocks.0.w", {}, true}, o).weight_decay, 0.5);  // the default decay
  EXPECT_EQ(settings_for({"visual.merger.w", {}, true}, o).lr_scale, 0.5);       // longer prefix wins
  EXPECT_EQ(settings_for({"visual.merger.w", {}, true}, o).weight_decay, 0.0);
  EXPECT_EQ(settings_for({"visual.blocks.0.b", {}, false}, o).weight_decay, 0.0);  // no decay on biases
  EXPECT_EQ(settings_for({"lm_head.weight", {}, true}, o).lr_scale, 1.0);          // no group: defaults
  auto v = torch::ones({1, 2}).requires_grad_(true), m = torch::ones({2}).requires_grad_(true);
  auto t = torch::ones({2}).requires_grad_(true);
  dhp::optim::AdamW opt({{"visual.blocks.0.w", v, true}, {"visual.merger.w", m, true}, {"model.w", t, true}}, o);
  v.mutable_grad() = torch::tensor({{2.f, -4.f}});
  m.mutable_grad() = torch::tensor({3.f, -1.f});
  t.mutable_grad() = torch::tensor({1.f, 1.f});
  opt.step(0.1);
  // First step: update = lr x scale x sign(g); decay by lr x scale x wd.
  EXPECT_NEAR(v[0][0].item<float>(), 1 * (1 - 0.2 * 0.5) - 0.2, 1e-6);
  EXPECT_NEAR(v[0][1].item<float>(), 1 * (1 - 0.2 * 0.5) + 0.2, 1e-6);
  EXPECT_NEAR(m[0].item<float>(), 1 - 0.05, 1e-6);
  EXPECT_NEAR(m[1].item<float>(), 1 + 0.05, 1e-6);
  EXPECT_TRUE(torch::equal(t, torch::ones({2})));  // rate 0: unchanged, bit for bit
}

// training.lr_* / weight_decay_* become parameter groups: a rate as a scale of training.lr,
// unset parts left out; bad values are refused naming the key.
TEST(Optim, PerModuleSettingsBecomeGroups) {
  auto o = dhp::train::optimizer_options(
      dhp::load_config("", {"training.lr=0.01", "training.lr_vision=0.001", "training.weight_decay_merger=0"}));
  ASSERT_EQ(o.groups.size(), 4u);  // every part, once any is set
  EXPECT_EQ(o.groups[0].prefix, "visual.");
  EXPECT_NEAR(o.groups[0].lr_scale, 0.1, 1e-12);
  EXPECT_EQ(o.groups[0].weight_decay, -1);  // the default decay
  EXPECT_EQ(o.groups[1].prefix, "visual.merger.");
  EXPECT_EQ(o.groups[1].lr_scale, 1.0);  // the merger keeps training.lr, not the tower's
  EXPECT_EQ(o.groups[1].weight_decay, 0.0);
  // The merger's own group is what keeps it off the tower's rate.
  EXPECT_EQ(dhp::optim::settings_for({"visual.merger.mlp.0.weight", {}, true}, o).lr_scale, 1.0);
  EXPECT_NEAR(dhp::optim::settings_for({"visual.blocks.0.attn.qkv.weight", {}, true}, o).lr_scale, 0.1, 1e-12);
  EXPECT_TRUE(dhp::train::optimizer_options(dhp::load_config("", {})).groups.empty());
  const auto text = dhp::train::optimizer_options(dhp::load_config("", {"training.lr_text=0"})).groups;
  ASSERT_EQ(text.size(), 4u);
  EXPECT_EQ(text[2].prefix, "model.");
  EXPECT_EQ(text[2].lr_scale, 0.0);
  EXPECT_EQ(text[3].prefix, "lm_head");
  EXPECT_EQ(text[3].lr_scale, 0.0);
  EXPECT_EQ(text[0].lr_scale, 1.0);
  auto msg = dhp::testing::error_of([] { dhp::load_config("", {"training.lr_merger=-0.5"}); });
  EXPECT_NE(msg.find("training.lr_merger=-0.5 must be >= 0, or -1 for the default (training.lr)"), std::string::npos)
      << msg;
}

TEST(Optim, ClipByGlobalNorm) {
  auto a = torch::zeros({2}).requires_grad_(true), b = torch::zeros({1}).requires_grad_(true);
  a.mutable_grad() = torch::tensor({3.f, 0.f});
  b.mutable_grad() = torch::tensor({4.f});
  std::vector<dhp::optim::NamedParam> ps = {{"a", a, true}, {"b", b, true}};
  EXPECT_NEAR(dhp::testing::clip_grad_norm(ps, 1.0), 5.0, 1e-6);
  EXPECT_NEAR(dhp::testing::grad_norm(ps), 1.0, 1e-5);
  EXPECT_NEAR(dhp::testing::clip_grad_norm(ps, 10.0), 1.0, 1e-5);  // under the limit: unchanged
  EXPECT_NEAR(dhp::testing::grad_norm(ps), 1.0, 1e-5);
}

}  // namespace
