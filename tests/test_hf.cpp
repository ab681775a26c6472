// Hugging Face interop: config.json in both of transformers' layouts, parameter names with
// the old and new prefixes, weights in one file or sharded with an index, the import ->
// export round trip byte for byte, and the errors a wrong directory gets.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "dhp/core/error.h"
#include "files.h"
#include "dhp/io/json.h"
#include "dhp/io/safetensors.h"
#include "dhp/models/qwen2_5_vl/hf.h"
#include "dhp/models/qwen2_5_vl/model.h"
#include "dhp/train/parallel_model.h"
#include "dhp/train/trainer.h"

namespace {

namespace fs = std::filesystem;
using dhp::io::Json;

using dhp::testing::slurp;
using dhp::testing::temp_dir;

// The config.json of the released Qwen2.5-VL-7B-Instruct (text fields at the top level).
const char* kReleased7B = R"({
  "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
  "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
  "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
  "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 128000,
  "max_window_layers": 28, "model_type": "qwen2_5_vl", "num_attention_heads": 28, "num_hidden_layers": 28,
  "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.41.2", "use_cache": true,
  "use_sliding_window": false,
  "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
    "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
    "spatial_patch_size": 14, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
    "tokens_per_second": 2, "temporal_patch_size": 2},
  "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 152064})";

// Newer transformers: text fields under text_config, rotary under rope_parameters.
const char* kNested7B = R"({
  "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
  "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
  "text_config": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "vocab_size": 152064, "hidden_act": "silu",
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}},
  "tie_word_embeddings": false,
  "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
    "in_channels": 3, "out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31]}})";

void expect_same(const dhp::qwen::ModelConfig& a, const dhp::qwen::ModelConfig& b) {
  EXPECT_EQ(a.vision.depth, b.vision.depth);
  EXPECT_EQ(a.vision.hidden_size, b.vision.hidden_size);
  EXPECT_EQ(a.vision.num_heads, b.vision.num_heads);
  EXPECT_EQ(a.vision.intermediate_size, b.vision.intermediate_size);
  EXPECT_EQ(a.vision.out_hidden_size, b.vision.out_hidden_size);
  EXPECT_EQ(a.vision.patch_size, b.vision.patch_size);
  EXPECT_EQ(a.vision.temporal_patch_size, b.vision.temporal_patch_size);
  EXPECT_EQ(a.vision.in_channels, b.vision.in_channels);
  EXPECT_EQ(a.vision.spatial_merge_size, b.vision.spatial_merge_size);
  EXPECT_EQ(a.vision.window_size, b.vision.window_size);
  EXPECT_EQ(a.vision.fullatt_block_indexes, b.vision.fullatt_block_indexes);
  EXPECT_EQ(a.text.vocab_size, b.text.vocab_size);
  EXPECT_EQ(a.text.hidden_size, b.text.hidden_size);
  EXPECT_EQ(a.text.num_layers, b.text.num_layers);
  EXPECT_EQ(a.text.num_heads, b.text.num_heads);
  EXPECT_EQ(a.text.num_kv_heads, b.text.num_kv_heads);
  EXPECT_EQ(a.text.intermediate_size, b.text.intermediate_size);
  EXPECT_DOUBLE_EQ(a.text.rope_theta, b.text.rope_theta);
  EXPECT_DOUBLE_EQ(a.text.rms_norm_eps, b.text.rms_norm_eps);
  EXPECT_EQ(a.text.mrope_section, b.text.mrope_section);
  EXPECT_EQ(a.text.tie_word_embeddings, b.text.tie_word_embeddings);
  EXPECT_EQ(a.image_token_id, b.image_token_id);
  EXPECT_EQ(a.vision_start_token_id, b.vision_start_token_id);
  EXPECT_EQ(a.vision_end_token_id, b.vision_end_token_id);
}

TEST(HfConfig, ReleasedAndNestedLayoutsGiveThe7BPreset) {
  const auto want = dhp::qwen::preset("qwen2.5-vl-7b");
  expect_same(dhp::qwen::config_from_hf(Json::parse(kReleased7B, "released"), "released"), want);
  expect_same(dhp::qwen::config_from_hf(Json::parse(kNested7B, "nested"), "nested"), want);
}

TEST(HfConfig, ExportReadsBackForEveryPreset) {
  for (const auto& name : dhp::qwen::preset_names()) {
    SCOPED_TRACE(name);
    const auto c = dhp::qwen::preset(name);
    const auto j = dhp::qwen::config_to_hf(c, torch::kBFloat16);
    EXPECT_EQ(j.at("torch_dtype").str(), "bfloat16");
    expect_same(dhp::qwen::config_from_hf(Json::parse(j.dump(2), "exported"), "exported"), c);
  }
}

TEST(HfConfig, ErrorsNameTheFileAndTheField) {
  auto j = Json::parse(kReleased7B, "x");
  auto no_hidden = Json::object();
  for (const auto& [k, v] : j.items()) {
    if (k != "hidden_size") no_hidden.set(k, v);
  }
  try {
    dhp::qwen::config_from_hf(no_hidden, "/m/config.json");
    ADD_FAILURE() << "accepted a config without hidden_size";
  } catch (const dhp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("/m/config.json: missing \"hidden_size\""), std::string::npos) << e.what();
  }
  auto bad_heads = j;
  bad_heads.set("num_attention_heads", Json(int64_t{27}));  // does not divide 3584
  EXPECT_THROW(dhp::qwen::config_from_hf(bad_heads, "c"), dhp::Error);
  auto no_rope = j;
  no_rope.set("rope_scaling", Json());
  try {
    dhp::qwen::config_from_hf(no_rope, "c");
    ADD_FAILURE();
  } catch (const dhp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("mrope_section"), std::string::npos) << e.what();
  }
}

TEST(HfNames, NewPrefixesMapToDhpNames) {
  EXPECT_EQ(dhp::qwen::canonical_name("model.language_model.layers.3.self_attn.q_proj.weight"),
            "model.layers.3.self_attn.q_proj.weight");
  EXPECT_EQ(dhp::qwen::canonical_name("model.visual.blocks.0.attn.qkv.bias"), "visual.blocks.0.attn.qkv.bias");
  EXPECT_EQ(dhp::qwen::canonical_name("lm_head.weight"), "lm_head.weight");
  EXPECT_EQ(dhp::qwen::canonical_name("visual.merger.mlp.0.weight"), "visual.merger.mlp.0.weight");
}

std::map<std::string, torch::Tensor> params_of(dhp::qwen::Qwen2_5_VLImpl& m) {
  std::map<std::string, torch::Tensor> out;
  for (auto& kv : m.named_parameters(true)) out[kv.key()] = kv.value();
  return out;
}

dhp::qwen::Qwen2_5_VL make_model(const dhp::qwen::ModelConfig& c, uint64_t seed, torch::ScalarType dt) {
  dhp::qwen::Qwen2_5_VL m(c);
  dhp::qwen::init_parameters(*m, seed, c.initializer_range);
  m->to(dt);
  return m;
}

// Import -> export gives byte-identical tensors and an equivalent config, in one file and
// sharded, fp32 and bf16, tied and untied embeddings.
TEST(HfWeights, RoundTripIsByteIdentical) {
  auto dir = temp_dir("hf_roundtrip");
  for (const bool tied : {true, false}) {
    for (const auto dt : {torch::kFloat32, torch::kBFloat16}) {
      for (const int64_t shard : {int64_t{1} << 40, int64_t{200000}}) {
        SCOPED_TRACE(std::string(tied ? "tied " : "untied ") + (dt == torch::kFloat32 ? "fp32 " : "bf16 ") +
                     std::to_string(shard));
        auto c = dhp::qwen::preset("demo");
        c.text.tie_word_embeddings = tied;
        auto a = make_model(c, 1, dt);
        const auto d1 = (dir / "a").string(), d2 = (dir / "b").string();
        fs::remove_all(d1);
        fs::remove_all(d2);
        dhp::qwen::save_hf(d1, params_of(*a), c, shard);
        EXPECT_EQ(fs::exists(fs::path(d1) / "model.safetensors.index.json"), shard < (1 << 20));
        // Import into a model built from the exported config.json, initialised differently.
        const auto c2 = dhp::qwen::read_hf_config(d1);
        expect_same(c2, c);
        auto b = make_model(c2, 2, dt);
        auto pb = params_of(*b);
        dhp::qwen::HfWeights w(d1);
        EXPECT_TRUE(dhp::qwen::load_hf_weights(w, pb).empty());
        for (const auto& [name, t] : params_of(*a)) EXPECT_TRUE(torch::equal(t, pb.at(name))) << name;
        dhp::qwen::save_hf(d2, pb, c2, shard);
        EXPECT_EQ(slurp(fs::path(d1) / "config.json"), slurp(fs::path(d2) / "config.json"));
        dhp::qwen::HfWeights w2(d2);
        ASSERT_EQ(w.names(), w2.names());
        for (const auto& name : w.names()) {
          const auto x = w.read(name), y = w2.read(name);
          ASSERT_EQ(x.scalar_type(), y.scalar_type());
          EXPECT_EQ(0, std::memcmp(x.data_ptr(), y.data_ptr(), x.numel() * x.element_size())) << name;
        }
      }
    }
  }
  fs::remove_all(dir);
}

TEST(HfWeights, ReadsNewPrefixesAndConvertsDtypes) {
  auto dir = temp_dir("hf_prefix");
  auto c = dhp::qwen::preset("demo");
  auto a = make_model(c, 3, torch::kFloat32);
  std::vector<std::pair<std::string, torch::Tensor>> renamed;
  for (const auto& [name, t] : params_of(*a)) {
    std::string hf = name;
    if (name.rfind("model.", 0) == 0) hf = "model.language_model." + name.substr(6);
    if (name.rfind("visual.", 0) == 0) hf = "model.visual." + name.substr(7);
    renamed.emplace_back(hf, t.detach().to(torch::kBFloat16));  // stored in bf16
  }
  dhp::io::write_safetensors((dir / "model.safetensors").string(), renamed);
  dhp::io::write_file_atomic((dir / "config.json").string(), dhp::qwen::config_to_hf(c, torch::kBFloat16).dump());
  auto b = make_model(c, 4, torch::kFloat32);
  auto pb = params_of(*b);
  dhp::qwen::HfWeights w(dir.string());
  EXPECT_TRUE(dhp::qwen::load_hf_weights(w, pb).empty());
  for (const auto& [name, t] : params_of(*a)) {
    EXPECT_TRUE(torch::equal(t.to(torch::kBFloat16).to(torch::kFloat32), pb.at(name))) << name;
  }
  fs::remove_all(dir);
}

TEST(HfWeights, WrongDirectoriesAreRefusedByName) {
  auto dir = temp_dir("hf_bad");
  auto c = dhp::qwen::preset("demo");
  auto a = make_model(c, 5, torch::kFloat32);
  auto pa = params_of(*a);
  EXPECT_THROW(dhp::qwen::HfWeights((dir / "nothing").string()), dhp::Error);
  EXPECT_THROW(dhp::qwen::HfWeights(dir.string()), dhp::Error);  // no weights file
  // A tensor with the wrong shape: the message names the parameter, the file and both shapes.
  auto wrong = pa;
  wrong["model.norm.weight"] = torch::ones({7});
  dhp::qwen::save_hf(dir.string(), wrong, c);
  {
    dhp::qwen::HfWeights w(dir.string());
    auto target = pa;
    try {
      dhp::qwen::load_hf_weights(w, target);
      ADD_FAILURE() << "loaded a wrong shape";
    } catch (const dhp::Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("model.norm.weight has shape [7]"), std::string::npos) << m;
      EXPECT_NE(m.find("model.safetensors"), std::string::npos) << m;
    }
  }
  // A missing tensor, and an extra one reported as unused.
  auto fewer = pa;
  fewer.erase("visual.merger.ln_q.weight");
  fewer["extra.weight"] = torch::ones({2});
  dhp::qwen::save_hf(dir.string(), fewer, c);
  {
    dhp::qwen::HfWeights w(dir.string());
    auto target = pa;
    EXPECT_THROW(dhp::qwen::load_hf_weights(w, target), dhp::Error);
    target.erase("visual.merger.ln_q.weight");
    const auto unused = dhp::qwen::load_hf_weights(w, target);
    ASSERT_EQ(unused.size(), 1u);
    EXPECT_EQ(unused[0], "extra.weight");
  }
  // An index that names a shard without the tensor.
  dhp::qwen::save_hf(dir.string(), pa, c, 100000);
  auto idx = Json::parse(slurp(dir / "model.safetensors.index.json"), "index");
  auto map = idx.at("weight_map");
  const auto first = map.items().front().first;
  std::string other;
  for (const auto& [k, v] : map.items()) {
    if (v.str() != map.items().front().second.str()) other = v.str();
  }
  ASSERT_FALSE(other.empty());
  map.set(first, Json(other));
  idx.set("weight_map", map);
  dhp::io::write_file_atomic((dir / "model.safetensors.index.json").string(), idx.dump());
  try {
    dhp::qwen::HfWeights w(dir.string());
    ADD_FAILURE() << "accepted an index pointing at the wrong shard";
  } catch (const dhp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not hold it"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

// A run that exports its model, and a run that starts from that directory: the second
// run's model is the first one's trained model, in fp32 and converted to bf16.
TEST(HfTraining, ExportThenStartFrom) {
  auto dir = temp_dir("hf_train");
  const std::vector<std::string> base = {"data.batch_size=2", "data.min_side=56", "data.max_side=56",
                                         "training.steps=2", "data.eval_samples=0"};
  auto sets = base;
  sets.push_back("output.dir=" + (dir / "a").string());
  sets.push_back("output.hf_export=true");
  dhp::train::Trainer a(dhp::load_config("", sets));
  a.run();
  const auto hf = (dir / "a" / "hf").string();
  ASSERT_TRUE(fs::exists(fs::path(hf) / "config.json"));
  std::map<std::string, torch::Tensor> trained;
  for (auto& kv : a.model().named_parameters(true)) trained[kv.key()] = kv.value().detach().clone();
  for (const char* precision : {"fp32", "bf16"}) {
    auto b_sets = base;
    b_sets.push_back(std::string("model.from=") + hf);
    b_sets.push_back(std::string("training.precision=") + precision);
    const auto cfg = dhp::load_config("", b_sets);
    expect_same(cfg.model.config, dhp::qwen::preset("demo"));
    auto m = dhp::train::build_model(cfg);
    for (auto& kv : m->named_parameters(true)) {
      const auto want = trained.at(kv.key()).to(kv.value().scalar_type());
      EXPECT_TRUE(torch::equal(kv.value(), want)) << precision << " " << kv.key();
    }
  }
  // A directory that is not a model is named in the error, with the key it came from.
  try {
    dhp::load_config("", {"model.from=" + (dir / "missing").string()});
    ADD_FAILURE();
  } catch (const dhp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.from"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("has no config.json"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

// forward_logits over a sample with two images: every position's logits equal the
// training path's target logits; bad inputs are named.
TEST(HfForward, LogitsOfEveryPositionEqualTheTrainingPath) {
  auto c = dhp::qwen::preset("demo");
  auto m = make_model(c, 6, torch::kFloat32);
  std::vector<dhp::qwen::GridTHW> grids = {{1, 4, 6}, {1, 2, 2}};
  std::vector<int64_t> ids = {10, 11, c.vision_start_token_id};
  for (int i = 0; i < 6; ++i) ids.push_back(c.image_token_id);
  ids.push_back(c.vision_end_token_id);
  ids.push_back(12);
  ids.push_back(c.vision_start_token_id);
  ids.push_back(c.image_token_id);
  ids.push_back(c.vision_end_token_id);
  ids.push_back(13);
  const int64_t L = static_cast<int64_t>(ids.size());
  torch::manual_seed(7);
  auto pixels = torch::randn({28, c.vision.patch_dim()});
  auto grid = torch::tensor({1, 4, 6, 1, 2, 2}, torch::kInt64).view({2, 3});
  auto input_ids = torch::tensor(ids, torch::kInt64).view({1, L});
  auto logits = dhp::qwen::forward_logits(*m, input_ids, pixels, grid);
  ASSERT_EQ(logits.sizes(), (std::vector<int64_t>{1, L, c.text.vocab_size}));
  dhp::qwen::Batch b;
  b.input_ids = input_ids.view({L});
  b.pixel_values = pixels;
  b.grid_thw = grids;
  b.position_ids = dhp::qwen::rope_index(ids, grids, c);
  b.targets = torch::full({L}, 1, torch::kInt64);
  b.cu_seqlens = {0, L};
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::allclose(logits[0], m->target_logits(b), 1e-6, 1e-6));
  // Text only, and the errors.
  auto text = torch::tensor({10, 11, 12}, torch::kInt64).view({1, 3});
  EXPECT_EQ(dhp::qwen::forward_logits(*m, text, {}, {}).size(1), 3);
  EXPECT_THROW(dhp::qwen::forward_logits(*m, input_ids, pixels.narrow(0, 0, 20), grid), dhp::Error);
  EXPECT_THROW(dhp::qwen::forward_logits(*m, text, pixels, grid), dhp::Error);  // no <|image_pad|>
  EXPECT_THROW(dhp::qwen::forward_logits(*m, input_ids.view({L}), pixels, grid), dhp::Error);
}

}  // namespace
