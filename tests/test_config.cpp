// Config loading: defaults, files, --set, and errors that name the key and its origin.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include <torch/types.h>

#include "dhp/core/memory.h"
#include "dhp/train/config.h"
#include "errors.h"

namespace {

using dhp::testing::error_of;

std::string write_tmp(const std::string& name, const std::string& text) {
  const std::string path = testing::TempDir() + name;
  std::ofstream(path) << text;
  return path;
}

TEST(Config, DefaultsAreTheDemo) {
  auto c = dhp::load_config("", {});
  EXPECT_EQ(c.model.preset, "demo");
  EXPECT_EQ(c.model.config.text.hidden_size, dhp::qwen::preset("demo").text.hidden_size);
  EXPECT_EQ(c.training.precision, "fp32");
  EXPECT_EQ(c.parallel.strategy, "none");
}

// The shipped configs load and validate (the README runs them); the moving-task demo is the
// 8-frame task at the sides it states.
TEST(Config, ShippedConfigsLoad) {
  int64_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator(std::string(DHP_SOURCE_DIR) + "/configs")) {
    if (e.path().extension() != ".yaml") continue;
    EXPECT_NO_THROW(dhp::load_config(e.path().string(), {})) << e.path();
    ++n;
  }
  EXPECT_GE(n, 5);
  const auto moving = dhp::load_config(std::string(DHP_SOURCE_DIR) + "/configs/demo_moving.yaml", {});
  EXPECT_EQ(moving.data.frames, 8);
  EXPECT_EQ(moving.data.min_side, 56);
  EXPECT_EQ(moving.data.max_side, 84);
  EXPECT_EQ(moving.training.steps, 3000);
}

TEST(Config, FileThenSetsInOrder) {
  auto f = write_tmp("a.yaml", "model:\n  preset: qwen2.5-vl-7b\n  text:\n    num_layers: 2\ntraining:\n  steps: 7\n");
  auto c = dhp::load_config(f, {"training.steps=9", "model.vision.fullatt_block_indexes=[0, 3]",
                                "model.vision.depth=4"});
  EXPECT_EQ(c.model.config.text.hidden_size, 3584);  // from the preset
  EXPECT_EQ(c.model.config.text.num_layers, 2);      // file override
  EXPECT_EQ(c.training.steps, 9);                    // --set wins
  EXPECT_EQ(c.model.config.vision.fullatt_block_indexes, (std::vector<int64_t>{0, 3}));
}

TEST(Config, UnknownKeyNamesKeyAndFile) {
  auto f = write_tmp("b.yaml", "training:\n  stepz: 3\n");
  auto msg = error_of([&] { dhp::load_config(f, {}); });
  EXPECT_NE(msg.find("unknown key 'training.stepz'"), std::string::npos) << msg;
  EXPECT_NE(msg.find(f), std::string::npos) << msg;
  EXPECT_NE(msg.find("steps"), std::string::npos) << msg;  // lists the known keys
  auto top = error_of([&] { dhp::load_config("", {"trainig.steps=3"}); });
  EXPECT_NE(top.find("unknown key 'trainig'"), std::string::npos) << top;
  EXPECT_NE(top.find("--set trainig.steps=3"), std::string::npos) << top;
}

TEST(Config, BadValuesNameKeyTypeAndOrigin) {
  auto msg = error_of([] { dhp::load_config("", {"training.steps=abc"}); });
  EXPECT_NE(msg.find("'training.steps'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("integer"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'abc'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--set training.steps=abc"), std::string::npos) << msg;
  EXPECT_NE(error_of([] { dhp::load_config("", {"training.steps=1.5"}); }).find("integer"), std::string::npos);
  EXPECT_NE(error_of([] { dhp::load_config("", {"training.activation_checkpointing=maybe"}); }).find("true or false"),
            std::string::npos);
  EXPECT_NE(error_of([] { dhp::load_config("", {"model.vision.fullatt_block_indexes=3"}); }).find("list"),
            std::string::npos);
  EXPECT_NE(error_of([] { dhp::load_config("", {"training=3"}); }).find("must be a map"), std::string::npos);
}

TEST(Config, ValidationErrorsNameTheNumbers) {
  auto m = error_of([] { dhp::load_config("", {"model.text.num_kv_heads=3"}); });
  EXPECT_NE(m.find("num_kv_heads=3"), std::string::npos) << m;
  auto r = error_of([] { dhp::load_config("", {"model.text.mrope_section=[1, 2, 3]"}); });
  EXPECT_NE(r.find("sums to 6"), std::string::npos) << r;
  auto p = error_of([] { dhp::load_config("", {"model.preset=qwen9"}); });
  EXPECT_NE(p.find("unknown model preset 'qwen9'"), std::string::npos) << p;
  EXPECT_NE(p.find("qwen2.5-vl-72b"), std::string::npos) << p;
  EXPECT_NE(error_of([] { dhp::load_config("", {"training.precision=fp8"}); }).find("fp8"), std::string::npos);
  EXPECT_NE(error_of([] { dhp::load_config("", {"training.micro_batches=99"}); }).find("micro_batches=99"),
            std::string::npos);
  EXPECT_NE(error_of([] { dhp::load_config("", {"training.memory_limit=3 parsecs"}); }).find("unit"),
            std::string::npos);
}

TEST(Config, DeviceIsCpuCudaOrCudaIndex) {
  EXPECT_EQ(dhp::load_config("", {}).training.device, "cpu");
  for (const char* ok : {"cpu", "cuda", "cuda:0", "cuda:12"}) {
    EXPECT_EQ(dhp::load_config("", {std::string("training.device=") + ok}).training.device, ok);
  }
  for (const char* bad : {"gpu", "CUDA", "cuda:x", "cuda:-1", "cuda:123456", "mps"}) {
    auto msg = error_of([&] { dhp::load_config("", {std::string("training.device=") + bad}); });
    EXPECT_NE(msg.find("training.device='" + std::string(bad) + "'"), std::string::npos) << bad << ": " << msg;
    EXPECT_NE(msg.find("cpu, cuda or cuda:N"), std::string::npos) << msg;
  }
  // "cuda:" is YAML for a map: the loader's type error names the key and where it came from.
  auto msg = error_of([] { dhp::load_config("", {"training.device=cuda:"}); });
  EXPECT_NE(msg.find("'training.device' (from --set training.device=cuda:)"), std::string::npos) << msg;
}

TEST(Config, SyntaxErrorsGiveLineAndMissingFilesTheirPath) {
  auto f = write_tmp("c.yaml", "training:\n  steps: [1,\n");
  auto msg = error_of([&] { dhp::load_config(f, {}); });
  EXPECT_NE(msg.find("YAML syntax error in " + f), std::string::npos) << msg;
  EXPECT_NE(msg.find("line"), std::string::npos) << msg;
  auto miss = error_of([] { dhp::load_config("/nonexistent/x.yaml", {}); });
  EXPECT_NE(miss.find("/nonexistent/x.yaml"), std::string::npos) << miss;
  EXPECT_NE(error_of([] { dhp::load_config("", {"no_equals_sign"}); }).find("key=value"), std::string::npos);
}

TEST(Config, ResolvedConfigRoundTrips) {
  auto c = dhp::load_config("", {"training.lr=0.0003", "model.text.num_layers=3", "output.dir=x y"});
  auto text = dhp::to_yaml(c, true);
  auto f = write_tmp("d.yaml", text);
  auto d = dhp::load_config(f, {});
  EXPECT_EQ(dhp::to_yaml(d), dhp::to_yaml(c));
  EXPECT_DOUBLE_EQ(d.training.lr, 0.0003);
  EXPECT_EQ(d.output.dir, "x y");
}

// Fine-tuning keys: model.vision.freeze / trainable_blocks, model.merger.freeze,
// model.text.freeze / trainable_layers / freeze_embeddings / freeze_lm_head; which names
// train, the counts, and bad values named with their key.
TEST(Config, FreezingKeysDecideWhatTrains) {
  auto c = dhp::load_config("", {"model.vision.trainable_blocks=[-1, 0]", "model.merger.freeze=true",
                                 "model.text.trainable_layers=[1]", "model.text.freeze_embeddings=true",
                                 "model.text.freeze_lm_head=true"});
  const auto& f = c.model.freezing;
  const auto& m = c.model.config;
  const int64_t last = m.vision.depth - 1;
  ASSERT_GE(last, 2);
  EXPECT_TRUE(f.trainable("visual.blocks.0.attn.qkv.weight", m));
  EXPECT_TRUE(f.trainable("visual.blocks." + std::to_string(last) + ".norm1.weight", m));
  EXPECT_FALSE(f.trainable("visual.blocks.1.mlp.down_proj.weight", m));
  EXPECT_FALSE(f.trainable("visual.patch_embed.proj.weight", m));
  EXPECT_FALSE(f.trainable("visual.merger.mlp.0.weight", m));
  EXPECT_TRUE(f.trainable("model.layers.1.self_attn.q_proj.weight", m));
  EXPECT_FALSE(f.trainable("model.layers.0.self_attn.q_proj.weight", m));
  EXPECT_FALSE(f.trainable("model.embed_tokens.weight", m));
  EXPECT_TRUE(f.trainable("model.norm.weight", m));
  EXPECT_FALSE(f.encoder_frozen());
  EXPECT_TRUE(f.any());
  const auto s = dhp::qwen::parameter_sizes(m);
  const auto n = dhp::qwen::count_trainable(m, f);
  EXPECT_EQ(n.vision, 2 * s.vision_block);
  EXPECT_EQ(n.text, s.text_layer + s.norm);
  // The resolved config round-trips the settings.
  auto again = dhp::load_config(write_tmp("f.yaml", dhp::to_yaml(c)), {});
  EXPECT_EQ(dhp::to_yaml(again), dhp::to_yaml(c));
  EXPECT_FALSE(dhp::load_config("", {}).model.freezing.any());
  EXPECT_TRUE(dhp::load_config("", {"model.vision.freeze=true", "model.merger.freeze=true"}).model.freezing.encoder_frozen());

  auto err = [](const std::vector<std::string>& sets) { return error_of([&] { dhp::load_config("", sets); }); };
  EXPECT_NE(err({"model.vision.trainable_blocks=[99]"}).find("model.vision.trainable_blocks holds 99, out of range"),
            std::string::npos);
  EXPECT_NE(err({"model.text.trainable_layers=[0, -" + std::to_string(c.model.config.text.num_layers) + "]"})
                .find("model.text.trainable_layers names block 0 twice"),
            std::string::npos);
  // [] is the default's spelling in a resolved config (every block trains), not an error.
  EXPECT_FALSE(dhp::load_config("", {"model.vision.trainable_blocks=[]"}).model.freezing.any());
  EXPECT_NE(err({"model.vision.trainable_blocks=[1]", "model.vision.freeze=true"}).find("set one of the two"),
            std::string::npos);
  EXPECT_NE(err({"model.text.freeze_lm_head=true"}).find("with tied embeddings"), std::string::npos);
  EXPECT_NE(err({"model.vision.freeze=true", "model.merger.freeze=true", "model.text.freeze=true"})
                .find("nothing would train"),
            std::string::npos);
  EXPECT_NE(err({"model.merger.frieze=true"}).find("model.merger.frieze"), std::string::npos);
  EXPECT_NE(err({"model.vision.freeze=maybe"}).find("model.vision.freeze"), std::string::npos);
}

// LoRA keys: the adapted linears follow lora.targets / lora.modules (PEFT's matching, and
// NAME.*), the base there is frozen, and bad values are named.
TEST(Config, LoraKeysChooseTheAdaptedLinears) {
  auto c = dhp::load_config("", {"lora.rank=8", "lora.modules=[vision,text]", "lora.targets=[q_proj,mlp.*]"});
  const auto& m = c.model.config;
  const auto adapted = dhp::qwen::adapted_linears(m, c.lora.spec());
  // Per vision block gate/up/down (mlp.*), per text layer q_proj and gate/up/down.
  EXPECT_EQ(adapted.size(), static_cast<size_t>(3 * m.vision.depth + 4 * m.text.num_layers));
  EXPECT_EQ(adapted.front().name, "visual.blocks.0.mlp.gate_proj");
  const auto& f = c.model.freezing;
  EXPECT_FALSE(f.trainable("visual.blocks.0.mlp.gate_proj.weight", m));
  EXPECT_TRUE(f.trainable("visual.blocks.0.mlp.gate_proj.lora_A.weight", m));
  EXPECT_TRUE(f.trainable("visual.merger.mlp.0.weight", m));  // not in lora.modules: trains
  EXPECT_FALSE(f.trainable("model.embed_tokens.weight", m));
  EXPECT_FALSE(f.encoder_frozen());
  const auto n = dhp::qwen::count_adapter_parameters(m, c.lora.spec());
  const int64_t hv = m.vision.hidden_size, iv = m.vision.intermediate_size, h = m.text.hidden_size,
                it = m.text.intermediate_size;
  EXPECT_EQ(n.vision, m.vision.depth * 8 * 3 * (hv + iv));
  EXPECT_EQ(n.text, m.text.num_layers * 8 * (2 * h + 3 * (h + it)));
  EXPECT_TRUE(dhp::qwen::lora_target_matches("attn.proj", "visual.blocks.3.attn.proj"));
  EXPECT_FALSE(dhp::qwen::lora_target_matches("proj", "visual.blocks.3.attn.qkv"));
  EXPECT_FALSE(dhp::qwen::lora_target_matches("q_proj", "model.layers.0.self_attn.qq_proj"));

  auto err = [](const std::vector<std::string>& sets) { return error_of([&] { dhp::load_config("", sets); }); };
  EXPECT_NE(err({"lora.rank=-1"}).find("lora.rank must be >= 0"), std::string::npos);
  const auto none = err({"lora.rank=4", "lora.targets=[qkv]"});  // qkv is the vision tower's; modules = [text]
  EXPECT_NE(none.find("lora.targets: 'qkv' names no linear of lora.modules [text]"), std::string::npos) << none;
  EXPECT_NE(none.find("q_proj"), std::string::npos) << none;
  const auto both = err({"lora.rank=4", "model.text.freeze=true"});
  EXPECT_NE(both.find("lora.modules has text and model.text.freeze"), std::string::npos) << both;
  EXPECT_NE(err({"lora.rank=4", "lora.modules=[audio]"}).find("lora.modules has 'audio'"), std::string::npos);
  EXPECT_NE(err({"lora.from=/x"}).find("lora.from=/x needs lora.rank > 0"), std::string::npos);
  EXPECT_NE(err({"output.peft_export=true"}).find("needs LoRA adapters"), std::string::npos);
  EXPECT_NE(err({"lora.rank=4", "lora.dropout=1"}).find("lora.dropout must be in [0, 1)"), std::string::npos);
}

TEST(Memory, ParseAndFormatBytes) {
  EXPECT_EQ(dhp::parse_bytes("2GiB", "x"), 2LL << 30);
  EXPECT_EQ(dhp::parse_bytes("512MiB", "x"), 512LL << 20);
  EXPECT_EQ(dhp::parse_bytes("1000", "x"), 1000);
  EXPECT_EQ(dhp::parse_bytes("1.5kb", "x"), 1500);
  EXPECT_THROW(dhp::parse_bytes("lots", "x"), dhp::Error);
  EXPECT_EQ(dhp::format_bytes(1536), "1.50 KiB");
}

TEST(Memory, AccountingCountsAndEnforcesTheLimit) {
  ASSERT_TRUE(dhp::memory_accounting_installed());
  const int64_t before = dhp::memory_live_bytes();
  {
    auto t = torch::empty({1 << 20}, torch::kFloat32);  // 4 MiB
    EXPECT_GE(dhp::memory_live_bytes() - before, 4 << 20);
    EXPECT_GE(dhp::memory_peak_bytes(), dhp::memory_live_bytes());
  }
  EXPECT_LT(dhp::memory_live_bytes() - before, 4 << 20);
  dhp::set_memory_limit(dhp::memory_live_bytes() + (8 << 20));
  EXPECT_NO_THROW(torch::empty({1 << 20}));
  EXPECT_THROW(torch::empty({4 << 20}), dhp::OutOfMemory);  // 16 MiB > 8 MiB headroom
  dhp::set_memory_limit(0);
  EXPECT_NO_THROW(torch::empty({4 << 20}));
}

}  // namespace
