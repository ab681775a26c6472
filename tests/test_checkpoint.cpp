// Training checkpoints: the local-range -> global-box mapping (hand cases and every range
// of every shard of random shapes), bit-exact resume under each strategy (N steps, save,
// a fresh job loads and runs M more: the same losses and parameters, bit for bit, as
// N+M steps in one job), resharding (saved under one layout, loaded under another: the
// loaded parameters and optimizer state are bit-identical, and training continues like
// the single-process run within 1e-5), fallback to an older checkpoint when the newest is
// corrupted, keep-last-M.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <random>

#include "dhp/core/error.h"
#include "dhp/io/checkpoint_store.h"
#include "dhp/io/safetensors.h"
#include "dhp/models/qwen2_5_vl/hf.h"
#include "dhp/models/qwen2_5_vl/peft.h"
#include "dhp/train/checkpoint.h"
#include "dhp/train/trainer.h"
#include "files.h"
#include "ranks.h"

namespace {

namespace fs = std::filesystem;
using dhp::train::BoxSegment;
using dhp::train::map_to_global;

int64_t volume(const std::vector<int64_t>& s) {
  int64_t v = 1;
  for (auto d : s) v *= d;
  return v;
}

TEST(MapToGlobal, HandCases) {
  // (4, 6), elements [5, 19): one element, two whole rows, one element.
  auto s = map_to_global({4, 6}, {}, 0, 1, 5, 19);
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[0].offset, (std::vector<int64_t>{0, 5}));
  EXPECT_EQ(s[0].shape, (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(s[1].offset, (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(s[1].shape, (std::vector<int64_t>{2, 6}));
  EXPECT_EQ(s[1].flat, 1);
  EXPECT_EQ(s[2].offset, (std::vector<int64_t>{3, 0}));
  EXPECT_EQ(s[2].flat, 13);
  // A fused qkv (12, 2) cut in 3 blocks over tp=2: rank 1 holds global rows 2-3, 6-7, 10-11.
  auto q = map_to_global({12, 2}, {0, 3}, 1, 2, 0, 12);
  ASSERT_EQ(q.size(), 3u);
  for (int b = 0; b < 3; ++b) {
    EXPECT_EQ(q[b].offset, (std::vector<int64_t>{2 + 4 * b, 0}));
    EXPECT_EQ(q[b].shape, (std::vector<int64_t>{2, 2}));
    EXPECT_EQ(q[b].dim, 0);
    EXPECT_EQ(q[b].start, 2 * b);
  }
  // A row-parallel weight (3, 8) over tp=4, rank 2: columns 4-5 of every row.
  auto r = map_to_global({3, 8}, {1, 1}, 2, 4, 0, 6);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].offset, (std::vector<int64_t>{0, 4}));
  EXPECT_EQ(r[0].shape, (std::vector<int64_t>{3, 2}));
  EXPECT_THROW(map_to_global({3, 8}, {0, 1}, 0, 2, 0, 4), dhp::Error);  // 3 rows over tp=2
  EXPECT_THROW(map_to_global({4}, {}, 0, 1, 2, 5), dhp::Error);         // past the end
  EXPECT_TRUE(map_to_global({4}, {}, 0, 1, 2, 2).empty());
}

// The local shard a TP rank holds, cut the way the tensor-parallel layers cut it.
torch::Tensor local_shard(const torch::Tensor& g, const dhp::parallel::TpShard& how, int64_t rank, int64_t size) {
  if (how.dim < 0 || size == 1) return g;
  std::vector<int64_t> blocked(g.sizes().begin(), g.sizes().end());
  blocked[how.dim] /= how.parts;
  blocked.insert(blocked.begin() + how.dim, how.parts);
  const int64_t c = blocked[how.dim + 1] / size;
  auto s = g.reshape(blocked).narrow(how.dim + 1, rank * c, c);
  std::vector<int64_t> out(g.sizes().begin(), g.sizes().end());
  out[how.dim] = how.parts * c;
  return s.reshape(out);
}

TEST(MapToGlobal, EveryRangeOfEveryShardLandsOnItsElements) {
  std::mt19937 rng(7);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  for (int trial = 0; trial < 400; ++trial) {
    const int64_t nd = pick(1, 4);
    dhp::parallel::TpShard how;
    int64_t tp = 1;
    if (pick(0, 3) > 0) {
      how.dim = pick(0, nd - 1);
      how.parts = pick(1, 3);
      tp = pick(1, 4);
    }
    std::vector<int64_t> shape;
    for (int64_t k = 0; k < nd; ++k) shape.push_back(k == how.dim ? how.parts * tp * pick(1, 3) : pick(1, 5));
    auto g = torch::arange(volume(shape), torch::kFloat64).view(shape);
    for (int64_t r = 0; r < tp; ++r) {
      auto local = local_shard(g, how, r, tp).contiguous().view({-1});
      const int64_t n = local.numel();
      const int64_t b = pick(0, n), e = pick(b, n);
      int64_t covered = 0;
      for (const auto& s : map_to_global(shape, how, r, tp, b, e)) {
        auto v = local.narrow(0, b + s.flat, volume(s.contig)).view(s.contig);
        if (s.dim >= 0) v = v.narrow(s.dim, s.start, s.len);
        auto want = g;
        for (int64_t k = 0; k < nd; ++k) want = want.narrow(k, s.offset[k], s.shape[k]);
        ASSERT_TRUE(torch::equal(v, want)) << "trial " << trial << " rank " << r << " range " << b << ".." << e;
        covered += v.numel();
      }
      ASSERT_EQ(covered, e - b) << "trial " << trial;
    }
  }
}

// ---------------------------------------------------------------------------------------
// Training state round trips.

dhp::Config config(const std::vector<std::string>& sets, const std::string& root) {
  // The strategy matrix's model (8 query / 4 kv heads, so text tp=4 divides them).
  std::vector<std::string> base = {"data.batch_size=8", "training.micro_batches=2", "data.min_side=56",
                                   "data.max_side=168", "training.steps=4", "training.warmup_steps=1",
                                   "data.eval_samples=0", "model.text.num_heads=8", "model.text.num_kv_heads=4",
                                   "model.text.mrope_section=[2,3,3]", "parallel.timeout_s=60",
                                   "checkpoint.dir=" + root, "output.dir=" + root + "/run"};
  base.insert(base.end(), sets.begin(), sets.end());
  return dhp::load_config("", base);
}

struct TrainedRun {
  std::vector<double> losses;  // of the steps run here
  std::map<std::string, torch::Tensor> params;
  int64_t start_step = 0;
};

// Trains `steps` steps on `world` ranks (threads); saves after step `save_at` (0 = never).
TrainedRun train(int64_t world, const dhp::Config& cfg, int steps, int save_at,
          const std::function<void(dhp::train::Trainer&)>& after_load = {}) {
  std::mutex mu;
  TrainedRun got;
  auto body = [&](int64_t rank, const dhp::dist::Store* store) {
    dhp::train::Runtime rt;
    rt.rank = rank;
    rt.world = world;
    if (store) rt.store = std::make_shared<dhp::dist::Store>(*store);
    rt.timeout = dhp::testing::kTestTimeout;
    dhp::train::Trainer t(cfg, rt);
    const int64_t start = t.step();
    if (after_load) after_load(t);
    std::vector<double> losses;
    for (int i = 0; i < steps; ++i) {
      losses.push_back(t.train_step().loss);
      if (t.step() == save_at) t.save_checkpoint();
    }
    auto params = t.full_parameters();
    if (rank == 0) {
      std::lock_guard<std::mutex> lock(mu);
      got.losses = losses;
      got.params = params;
      got.start_step = start;
    }
  };
  if (world == 1) body(0, nullptr);
  else dhp::testing::run_ranks(world, [&](int64_t r, const dhp::dist::Store& s) { body(r, &s); });
  return got;
}

struct Strategy {
  const char* name;
  int64_t world;
  std::vector<std::string> sets;
};
void PrintTo(const Strategy& s, std::ostream* os) { *os << s.name; }

const std::vector<Strategy> kStrategies = {
    {"none_1", 1, {}},
    {"dp_2", 2, {"parallel.strategy=dp"}},
    {"tp_2", 2, {"parallel.strategy=tp"}},
    {"zero3_2", 2, {"parallel.strategy=zero3"}},
    {"dhp_2", 2, {"parallel.strategy=dhp"}},
    {"dhp_bf16_2", 2, {"parallel.strategy=dhp", "training.precision=bf16"}},
    {"tp_zero1_2", 2, {"parallel.strategy=tp", "parallel.text.zero=1", "parallel.vision.zero=1"}},
    // ZeRO-1's state laid out in 16 KiB buckets (rank r owns chunk r of each).
    {"dhp_buckets_2", 2, {"parallel.strategy=dhp", "parallel.bucket_mb=0.015625"}},
    {"sp2_tp2_disjoint_4", 4, {"parallel.strategy=dhp", "parallel.vision.ranks=[0,1]", "parallel.text.ranks=[2,3]",
                               "training.micro_batches=4"}},
    // Fine-tuning: checkpoints hold what trains; the frozen rest comes back from the seed.
    {"dhp_vision_frozen_2", 2, {"parallel.strategy=dhp", "model.vision.freeze=true", "model.merger.freeze=true"}},
    {"zero3_last_blocks_2", 2, {"parallel.strategy=zero3", "model.vision.trainable_blocks=[-1]",
                                "model.text.trainable_layers=[-1]"}},
    {"dhp_lora_2", 2, {"parallel.strategy=dhp", "lora.rank=4", "lora.targets=[q_proj,v_proj,down_proj]"}},
    {"zero3_lora_2", 2, {"parallel.strategy=zero3", "lora.rank=4", "lora.modules=[vision,text]",
                         "lora.targets=[qkv,q_proj,o_proj]"}},
};

// Every parameter in full right after a job of `world` ranks started under `cfg` (resuming).
std::map<std::string, torch::Tensor> params_at_load(int64_t world, const dhp::Config& cfg) {
  std::map<std::string, torch::Tensor> loaded;
  std::mutex mu;
  train(world, cfg, 0, 0, [&](dhp::train::Trainer& t) {
    auto p = t.full_parameters();
    if (t.is_main()) {
      std::lock_guard<std::mutex> lock(mu);
      loaded = p;
    }
  });
  return loaded;
}

void expect_same_params(const TrainedRun& got, const TrainedRun& want, const std::string& what) {
  ASSERT_EQ(got.params.size(), want.params.size()) << what;
  for (const auto& [name, p] : want.params) {
    ASSERT_TRUE(got.params.count(name)) << what << ": " << name;
    EXPECT_TRUE(torch::equal(got.params.at(name), p)) << what << ": " << name;
  }
}

class Resume : public ::testing::TestWithParam<Strategy> {};

// 4 steps in one job (saving after step 2) vs a fresh job resumed from step 2 running 2
// more: identical losses and parameters, bit for bit.
TEST_P(Resume, IsBitExact) {
  const auto& s = GetParam();
  dhp::testing::TempDir dir("ckpt-resume-" + std::string(s.name));
  const auto root = dir.path().string();
  const auto whole = train(s.world, config(s.sets, root), 4, 2);
  ASSERT_TRUE(fs::exists(dir.path() / "step-2" / "manifest.json"));
  auto sets = s.sets;
  sets.push_back("checkpoint.resume=" + (dir.path() / "step-2").string());
  const auto resumed = train(s.world, config(sets, root), 2, 0);
  EXPECT_EQ(resumed.start_step, 2);
  ASSERT_EQ(resumed.losses.size(), 2u);
  EXPECT_EQ(resumed.losses[0], whole.losses[2]);
  EXPECT_EQ(resumed.losses[1], whole.losses[3]);
  expect_same_params(resumed, whole, s.name);
}

INSTANTIATE_TEST_SUITE_P(Strategies, Resume, ::testing::ValuesIn(kStrategies),
                         [](const auto& info) { return std::string(info.param.name); });

// Every tensor of two checkpoints, bit for bit.
void expect_same_checkpoint(const std::string& a, const std::string& b) {
  dhp::io::CheckpointReader ra(a), rb(b);
  ASSERT_EQ(ra.manifest().step, rb.manifest().step);
  ASSERT_EQ(ra.manifest().tensors.size(), rb.manifest().tensors.size()) << a << " vs " << b;
  for (const auto& [name, rec] : ra.manifest().tensors) {
    ASSERT_TRUE(rb.has(name)) << name;
    EXPECT_TRUE(torch::equal(ra.read_full(name), rb.read_full(name))) << name;
  }
}

struct Reshard {
  const char* name;
  Strategy from, to;
};
void PrintTo(const Reshard& r, std::ostream* os) { *os << r.name; }

const std::vector<Reshard> kReshards = {
    {"dhp4_to_1", {"dhp_4", 4, {"parallel.strategy=dhp"}}, {"none_1", 1, {}}},
    {"tp2_to_tp4", {"tp_2", 2, {"parallel.strategy=tp"}}, {"tp_4", 4, {"parallel.strategy=tp"}}},
    {"zero3_2_to_dhp_2", {"zero3_2", 2, {"parallel.strategy=zero3"}}, {"dhp_2", 2, {"parallel.strategy=dhp"}}},
    // ZeRO-1 in 16 KiB buckets to one bucket: the same elements, laid out otherwise.
    {"dhp_buckets_to_dhp_2", {"dhp_buckets_2", 2, {"parallel.strategy=dhp", "parallel.bucket_mb=0.015625"}},
     {"dhp_2", 2, {"parallel.strategy=dhp"}}},
    {"1_to_dhp_sp2x2_tp2x2", {"none_1", 1, {}},
     {"sp2x2", 4, {"parallel.strategy=dhp", "parallel.vision.sp=2", "parallel.text.tp=2"}}},
};

class Resharding : public ::testing::TestWithParam<Reshard> {};

// Saved under A after 2 steps, loaded under B: B's parameters equal A's bit for bit, a
// checkpoint B writes at once equals A's tensor for tensor (optimizer state included), and
// B's next 2 losses equal the single-process run's within 1e-5 relative.
TEST_P(Resharding, LoadsExactlyAndContinuesLikeOneProcess) {
  const auto& c = GetParam();
  dhp::testing::TempDir dir_a("ckpt-reshard-a-" + std::string(c.name)), dir_b("ckpt-reshard-b-" + std::string(c.name)),
      dir_ref("ckpt-reshard-ref-" + std::string(c.name));
  const auto a = train(c.from.world, config(c.from.sets, dir_a.path().string()), 2, 2);
  const auto ref = train(1, config({}, dir_ref.path().string()), 4, 0);
  auto sets = c.to.sets;
  sets.push_back("checkpoint.resume=" + (dir_a.path() / "step-2").string());
  sets.push_back("checkpoint.dir=" + dir_b.path().string());
  std::map<std::string, torch::Tensor> loaded;
  std::mutex mu;
  const auto b = train(c.to.world, config(sets, dir_a.path().string()), 2, 0, [&](dhp::train::Trainer& t) {
    auto p = t.full_parameters();
    t.save_checkpoint();
    if (t.is_main()) {
      std::lock_guard<std::mutex> lock(mu);
      loaded = p;
    }
  });
  EXPECT_EQ(b.start_step, 2);
  TrainedRun at_load;
  at_load.params = loaded;
  expect_same_params(at_load, a, std::string(c.name) + " at load");
  expect_same_checkpoint((dir_a.path() / "step-2").string(), (dir_b.path() / "step-2").string());
  ASSERT_EQ(b.losses.size(), 2u);
  for (int i = 0; i < 2; ++i) EXPECT_NEAR(b.losses[i], ref.losses[2 + i], 1e-5 * ref.losses[2 + i]) << "step " << i + 3;
}

INSTANTIATE_TEST_SUITE_P(Layouts, Resharding, ::testing::ValuesIn(kReshards),
                         [](const auto& info) { return std::string(info.param.name); });

// A fine-tuning checkpoint holds the trainable parameters and their state only; it reshards
// (dhp -> zero3, bit for bit at load); resuming with another freeze setting is refused naming
// the keys; its parameters in full (dhp convert) are the run's, the frozen ones from the seed.
TEST(FineTuneCheckpoint, HoldsWhatTrainsReshardsAndRefusesOtherFreezing) {
  dhp::testing::TempDir dir("ckpt-finetune");
  const auto root = dir.path().string();
  const std::vector<std::string> tuning = {"model.vision.trainable_blocks=[-1]", "model.text.trainable_layers=[0]"};
  auto with_layout = [&](const std::string& strategy, std::vector<std::string> extra) {
    extra.push_back("parallel.strategy=" + strategy);
    extra.insert(extra.end(), tuning.begin(), tuning.end());
    return extra;
  };
  const auto a = train(2, config(with_layout("dhp", {}), root), 2, 2);
  const auto step2 = (dir.path() / "step-2").string();
  const auto cfg = config(with_layout("dhp", {}), root);
  {
    dhp::io::CheckpointReader r(step2);
    int64_t frozen = 0;
    for (const auto& [name, p] : a.params) {
      const bool trains = cfg.model.freezing.trainable(name, cfg.model.config);
      EXPECT_EQ(r.has("param/" + name), trains) << name;
      EXPECT_EQ(r.has("exp_avg/" + name), trains) << name;
      frozen += trains ? 0 : 1;
    }
    EXPECT_GT(frozen, 0);
    const auto full = dhp::train::checkpoint_parameters(r, /*masters=*/false);
    ASSERT_EQ(full.size(), a.params.size());
    for (const auto& [name, p] : a.params) EXPECT_TRUE(torch::equal(full.at(name), p)) << name;
  }
  TrainedRun at_load;
  at_load.params =
      params_at_load(2, config(with_layout("zero3", {"checkpoint.resume=" + step2, "checkpoint.dir=" + root + "/b"}), root));
  expect_same_params(at_load, a, "dhp -> zero3 at load");
  try {
    dhp::train::Trainer t(config({"checkpoint.resume=" + step2, "model.vision.freeze=true"}, root));
    ADD_FAILURE() << "resumed with another freeze setting";
  } catch (const dhp::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("model.vision.freeze: false there, true here"), std::string::npos) << m;
    EXPECT_NE(m.find("model.text.trainable_layers"), std::string::npos) << m;
  }
}

// LoRA: a checkpoint saved under dhp loads into tp (adapters cut like their weights) bit for
// bit; the HF export merges each adapter (W + alpha/r * B A, exactly that in fp32) and runs
// the same forward as base + adapters; the PEFT export has PEFT's keys and config and loads
// back (lora.from) to the same adapters; a PEFT directory of another rank or model is refused.
TEST(LoraExport, MergedAndPeftExportsReshardAndReload) {
  dhp::testing::TempDir dir("ckpt-lora");
  const auto root = dir.path().string();
  const std::vector<std::string> lora = {"lora.rank=4", "lora.alpha=8", "lora.targets=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"};
  auto sets = [&](std::vector<std::string> extra) {
    extra.insert(extra.end(), lora.begin(), lora.end());
    return extra;
  };
  const auto a = train(2, config(sets({"parallel.strategy=dhp"}), root), 2, 2);
  const auto cfg = config(sets({}), root);
  {  // A run's own exports (Trainer::run): both directories written.
    dhp::train::Trainer t(config(sets({"training.steps=1", "output.hf_export=true", "output.peft_export=true",
                                       "checkpoint.at_end=false", "output.dir=" + root + "/one"}), root));
    t.run();
    EXPECT_TRUE(fs::exists(dir.path() / "one" / "hf" / "model.safetensors"));
    EXPECT_TRUE(fs::exists(dir.path() / "one" / "peft" / "adapter_config.json"));
    dhp::io::SafetensorsReader r((dir.path() / "one" / "hf" / "model.safetensors").string());
    for (const auto& t : r.tensors()) EXPECT_EQ(t.name.find("lora_"), std::string::npos) << t.name;
  }
  const double scale = cfg.lora.spec().scale();
  auto merged = a.params;
  const int64_t n = dhp::qwen::merge_lora(merged, scale);
  EXPECT_EQ(n, static_cast<int64_t>(dhp::qwen::adapted_linears(cfg.model.config, cfg.lora.spec()).size()));
  for (const auto& l : dhp::qwen::adapted_linears(cfg.model.config, cfg.lora.spec())) {
    const auto& w = a.params.at(l.name + ".weight");
    const auto want = w + torch::matmul(a.params.at(l.name + ".lora_B.weight"), a.params.at(l.name + ".lora_A.weight")) * scale;
    EXPECT_TRUE(torch::equal(merged.at(l.name + ".weight"), want)) << l.name;
    EXPECT_FALSE(torch::equal(merged.at(l.name + ".weight"), w)) << l.name << ": the adapter changed nothing";
    EXPECT_FALSE(merged.count(l.name + ".lora_A.weight"));
  }
  const auto hf = dir.path() / "hf", peft = dir.path() / "peft";
  dhp::qwen::save_hf(hf.string(), merged, cfg.model.config);
  dhp::qwen::save_peft(peft.string(), a.params, cfg.lora.spec(), cfg.model.config, "");
  // Forward: base + adapters vs the merged directory, on a text sample.
  auto lora_model = dhp::train::build_model(cfg);
  auto plain = dhp::train::build_model(config({"model.from=" + hf.string()}, root));
  {
    torch::NoGradGuard no_grad;
    for (auto& kv : lora_model->named_parameters()) kv.value().copy_(a.params.at(kv.key()));
  }
  torch::manual_seed(5);
  const auto ids = torch::randint(10, cfg.model.config.text.vocab_size, {1, 24}, torch::kInt64);
  const auto want = dhp::qwen::forward_logits(*lora_model, ids, {}, {});
  const auto got = dhp::qwen::forward_logits(*plain, ids, {}, {});
  EXPECT_LT((got - want).abs().max().item<double>(), 1e-5 * (want.abs().max().item<double>() + 1));
  // PEFT: keys, config, and back into a model through lora.from.
  {
    dhp::io::SafetensorsReader r((peft / "adapter_model.safetensors").string());
    EXPECT_NE(r.find("base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight"), nullptr);
    EXPECT_NE(r.find("base_model.model.model.language_model.layers.0.mlp.down_proj.lora_B.weight"), nullptr);
    EXPECT_EQ(r.tensors().size(), 2 * static_cast<size_t>(n));
    const dhp::qwen::PeftAdapter p(peft.string());
    EXPECT_EQ(p.rank(), 4);
    EXPECT_EQ(p.alpha(), 8);
    EXPECT_EQ(p.target_modules().size(), static_cast<size_t>(n));
    EXPECT_EQ(p.target_modules().front(), "model.language_model.layers.0.self_attn.q_proj");
  }
  auto reloaded = dhp::train::build_model(config(sets({"lora.from=" + peft.string()}), root));
  int64_t adapters = 0;
  for (const auto& kv : reloaded->named_parameters()) {  // trained adapters, and the frozen base from the seed
    const bool adapter = dhp::qwen::is_lora_parameter(kv.key());
    adapters += adapter ? 1 : 0;
    if (adapter || !cfg.model.freezing.trainable(kv.key(), cfg.model.config))
      EXPECT_TRUE(torch::equal(kv.value(), a.params.at(kv.key()))) << kv.key();
  }
  EXPECT_EQ(adapters, 2 * n);
  auto peft_error = [&](const std::vector<std::string>& extra) {
    try {
      dhp::train::build_model(config(extra, root));
    } catch (const dhp::Error& e) {
      return std::string(e.what());
    }
    return std::string("<no error>");
  };
  auto other_rank = lora;
  other_rank[0] = "lora.rank=8";
  other_rank.push_back("lora.from=" + peft.string());
  EXPECT_NE(peft_error(other_rank).find("adapter_config.json: r is 4 but lora.rank is 8"), std::string::npos);
  auto wider = lora;
  wider.insert(wider.end(), {"lora.from=" + peft.string(), "model.text.intermediate_size=512"});
  EXPECT_NE(peft_error(wider).find("an adapter of another base model?"), std::string::npos) << peft_error(wider);
  auto fewer = std::vector<std::string>{"lora.rank=4", "lora.alpha=8", "lora.targets=[q_proj]", "lora.from=" + peft.string()};
  EXPECT_NE(peft_error(fewer).find("which lora.targets and lora.modules do not adapt"), std::string::npos);
  // dhp -> tp: the adapters follow their weights' cuts; the parameters at load are the saved ones.
  TrainedRun at_load;
  at_load.params = params_at_load(2, config(sets({"parallel.strategy=tp", "checkpoint.resume=" + (dir.path() / "step-2").string(),
                                                  "checkpoint.dir=" + root + "/b"}), root));
  expect_same_params(at_load, a, "lora dhp -> tp at load");
  // dhp convert's path: the checkpoint's parameters in full (frozen base from the seed).
  const auto full = dhp::train::checkpoint_parameters(dhp::io::CheckpointReader((dir.path() / "step-2").string()), false);
  for (const auto& [name, p] : a.params) EXPECT_TRUE(torch::equal(full.at(name), p)) << name;
}

// A bf16 run's checkpoint continues in fp32 from its fp32 masters.
TEST(Resharding, Bf16CheckpointLoadsIntoFp32FromTheMasters) {
  dhp::testing::TempDir dir("ckpt-bf16-fp32");
  const auto root = dir.path().string();
  train(2, config({"parallel.strategy=dhp", "training.precision=bf16"}, root), 2, 2);
  dhp::io::CheckpointReader r((dir.path() / "step-2").string());
  ASSERT_TRUE(r.has("master/model.norm.weight"));
  EXPECT_EQ(r.read_full("param/model.norm.weight").scalar_type(), torch::kBFloat16);
  const auto b = train(1, config({"checkpoint.resume=" + (dir.path() / "step-2").string()}, root), 0, 0);
  for (const auto& [name, p] : b.params) {
    EXPECT_EQ(p.scalar_type(), torch::kFloat32) << name;
    EXPECT_TRUE(torch::equal(p, r.read_full("master/" + name))) << name;
  }
}

// model.from under parallel layouts: each rank reads its own slices of the HF directory
// (TP shards, ZeRO-3 ranges) and the gathered parameters are the directory's, bit for bit
// (fp32; bf16: rounded once); the first step's loss equals the single-process run's.
TEST(StartFromHf, EveryLayoutLoadsItsSlicesExactly) {
  dhp::testing::TempDir dir("ckpt-from-hf");
  const auto root = dir.path().string();
  {
    auto cfg = config({"training.steps=1", "output.hf_export=true", "checkpoint.at_end=false"}, root);
    dhp::train::Trainer t(cfg);
    t.run();
  }
  const auto hf = (dir.path() / "run" / "hf").string();
  const auto ref = train(1, config({"model.from=" + hf}, root), 0, 0);
  const auto ref_step = train(1, config({"model.from=" + hf}, root), 1, 0);
  const dhp::qwen::HfWeights w(hf);
  ASSERT_EQ(w.names().size(), ref.params.size());
  for (const auto& [name, p] : ref.params) EXPECT_TRUE(torch::equal(p, w.read(name))) << name;
  for (const auto& s : {kStrategies[2], kStrategies[3], kStrategies[4], kStrategies[5], kStrategies[7]}) {
    auto sets = s.sets;
    sets.push_back("model.from=" + hf);
    const bool bf16 = std::string(s.name).find("bf16") != std::string::npos;
    const auto got = train(s.world, config(sets, root), 0, 0);
    ASSERT_EQ(got.params.size(), ref.params.size()) << s.name;
    for (const auto& [name, p] : ref.params) {
      EXPECT_TRUE(torch::equal(got.params.at(name), bf16 ? p.to(torch::kBFloat16) : p)) << s.name << " " << name;
    }
    if (!bf16) {
      const auto step = train(s.world, config(sets, root), 1, 0);
      EXPECT_NEAR(step.losses[0], ref_step.losses[0], 1e-5 * ref_step.losses[0]) << s.name;
    }
  }
}

// ---------------------------------------------------------------------------------------
// Damage, fallback, retention.

void flip_byte(const fs::path& file, int64_t from_end) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(-from_end, std::ios::end);
  char c = 0;
  f.read(&c, 1);
  f.seekp(-from_end, std::ios::end);
  c = static_cast<char>(c ^ 0x5A);
  f.write(&c, 1);
}

TEST(CheckpointDamage, AutoFallsBackToThePreviousAndAnExplicitOneIsRefused) {
  dhp::testing::TempDir dir("ckpt-damage");
  const auto root = dir.path().string();
  train(1, config({}, root), 2, 2);
  train(1, config({}, root), 4, 4);
  const auto newest = dir.path() / "step-4" / "rank-00000.safetensors";
  ASSERT_TRUE(fs::exists(newest));
  flip_byte(newest, 100);
  // Explicit: refused, naming the file and the checksum.
  try {
    train(1, config({"checkpoint.resume=" + (dir.path() / "step-4").string()}, root), 1, 0);
    ADD_FAILURE() << "a corrupted checkpoint was loaded";
  } catch (const dhp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank-00000.safetensors"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("checksum"), std::string::npos) << e.what();
  }
  // auto: step-4 is reported, step-2 is used.
  const auto r = train(1, config({"checkpoint.resume=auto"}, root), 0, 0);
  EXPECT_EQ(r.start_step, 2);
  // Truncated: named too.
  fs::resize_file(newest, fs::file_size(newest) / 2);
  try {
    dhp::io::CheckpointReader bad((dir.path() / "step-4").string());
    ADD_FAILURE() << "a truncated checkpoint opened";
  } catch (const dhp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank-00000.safetensors"), std::string::npos) << e.what();
  }
  EXPECT_EQ(train(1, config({"checkpoint.resume=auto"}, root), 0, 0).start_step, 2);
  // Every checkpoint damaged: auto stops with the reason instead of silently starting over.
  flip_byte(dir.path() / "step-2" / "rank-00000.safetensors", 100);
  EXPECT_THROW(train(1, config({"checkpoint.resume=auto"}, root), 0, 0), dhp::Error);
}

TEST(CheckpointDamage, AutoWithNoCheckpointStartsFresh) {
  dhp::testing::TempDir dir("ckpt-none");
  EXPECT_EQ(train(1, config({"checkpoint.resume=auto"}, dir.path().string()), 0, 0).start_step, 0);
  EXPECT_THROW(train(1, config({"checkpoint.resume=" + (dir.path() / "step-9").string()}, dir.path().string()), 0, 0),
               dhp::Error);
}

TEST(CheckpointRun, SavesEveryKAndKeepsTheNewestM) {
  dhp::testing::TempDir dir("ckpt-keep");
  auto cfg = config({"checkpoint.every=1", "checkpoint.keep=2", "training.steps=3"}, dir.path().string());
  dhp::train::Trainer t(cfg);
  t.run();
  const auto all = dhp::io::list_checkpoints(dir.path().string());
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].first, 3);
  EXPECT_EQ(all[1].first, 2);
  // The run continues bit-exactly from its newest checkpoint: resuming at the end runs no step.
  cfg.checkpoint.resume = "auto";
  dhp::train::Trainer again(cfg);
  EXPECT_EQ(again.step(), 3);
  EXPECT_THROW(config({"checkpoint.every=-1"}, dir.path().string()), dhp::Error);
  EXPECT_THROW(config({"checkpoint.keep=-2"}, dir.path().string()), dhp::Error);
}

}  // namespace
