// Whole-model tests: parameter counts, every preset's forward/backward at reduced depth,
// activation checkpointing gives equal gradients, HF parameter names, init independence,
// packed samples never attend across their boundaries.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dhp/data/shapes.h"
#include "dhp/models/qwen2_5_vl/model.h"
#include "dhp/train/trainer.h"

namespace {

using dhp::qwen::GridTHW;

int64_t numel(torch::nn::Module& m) {
  int64_t n = 0;
  for (auto& p : m.parameters()) n += p.numel();
  return n;
}

TEST(ParamCount, PresetsMatchTheReleasedModels) {
  struct Want { const char* name; double vision, text; };
  // Billions, as published for Qwen2.5-VL: the vision tower is ~0.67B (its merger grows with
  // the LLM width: 0.67B at 3B up to 0.70B at 72B); text 3.09/7.62/32.76/72.71B.
  for (auto w : {Want{"qwen2.5-vl-3b", 0.67, 3.09}, Want{"qwen2.5-vl-7b", 0.67, 7.62},
                 Want{"qwen2.5-vl-32b", 0.67, 32.76}, Want{"qwen2.5-vl-72b", 0.67, 72.71}}) {
    auto p = dhp::qwen::count_parameters(dhp::qwen::preset(w.name));
    EXPECT_GE(p.vision / 1e9, w.vision - 0.005) << w.name;
    EXPECT_LE(p.vision / 1e9, w.vision + 0.04) << w.name;
    EXPECT_NEAR(p.text / 1e9, w.text, 0.01 * w.text) << w.name;
  }
}

TEST(ParamCount, FormulaEqualsTheModulesTiedAndUntied) {
  for (bool tied : {true, false}) {
    auto c = dhp::qwen::preset("demo");
    c.text.tie_word_embeddings = tied;
    dhp::qwen::Qwen2_5_VL m(c);
    EXPECT_EQ(numel(*m), dhp::qwen::count_parameters(c).total()) << "tied=" << tied;
  }
}

TEST(Model, ParameterNamesAreHuggingFaces) {
  auto c = dhp::qwen::preset("demo");
  c.text.tie_word_embeddings = false;
  dhp::qwen::Qwen2_5_VL m(c);
  auto names = m->named_parameters().keys();
  std::set<std::string> have(names.begin(), names.end());
  for (const char* n : {"visual.patch_embed.proj.weight", "visual.blocks.0.norm1.weight",
                        "visual.blocks.0.attn.qkv.weight", "visual.blocks.0.attn.qkv.bias",
                        "visual.blocks.3.attn.proj.bias", "visual.blocks.0.mlp.gate_proj.bias",
                        "visual.blocks.0.mlp.down_proj.weight", "visual.merger.ln_q.weight",
                        "visual.merger.mlp.0.weight", "visual.merger.mlp.2.bias",
                        "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.bias",
                        "model.layers.0.self_attn.k_proj.bias", "model.layers.3.self_attn.o_proj.weight",
                        "model.layers.0.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight",
                        "model.layers.0.post_attention_layernorm.weight", "model.norm.weight",
                        "lm_head.weight"}) {
    EXPECT_TRUE(have.count(n)) << n;
  }
  EXPECT_FALSE(have.count("model.layers.0.self_attn.o_proj.bias"));
  EXPECT_FALSE(have.count("model.layers.0.mlp.gate_proj.bias"));
  EXPECT_EQ(m->named_parameters()["visual.patch_embed.proj.weight"].sizes(),
            (torch::IntArrayRef{64, 3, 2, 14, 14}));
}

TEST(Model, InitDependsOnSeedAndNameOnly) {
  auto c = dhp::qwen::preset("demo");
  dhp::qwen::Qwen2_5_VL a(c), b(c);
  torch::manual_seed(123);  // global RNG state must not matter
  dhp::qwen::init_parameters(*a, 42, 0.02);
  torch::manual_seed(999);
  dhp::qwen::init_parameters(*b, 42, 0.02);
  for (auto& kv : a->named_parameters()) {
    EXPECT_TRUE(torch::equal(kv.value(), b->named_parameters()[kv.key()])) << kv.key();
  }
  auto q = a->named_parameters()["model.layers.0.self_attn.q_proj.weight"].clone();
  auto k = a->named_parameters()["model.layers.1.self_attn.q_proj.weight"];
  EXPECT_FALSE(torch::equal(q, k));
  EXPECT_NEAR(q.std().item<double>(), 0.02, 0.002);
  dhp::qwen::init_parameters(*b, 43, 0.02);
  EXPECT_FALSE(torch::equal(q, b->named_parameters()["model.layers.0.self_attn.q_proj.weight"]));
}

// A tiny batch for a config: one image of `side` px and one text-only sample.
dhp::qwen::Batch tiny_batch(const dhp::qwen::ModelConfig& c, int64_t side) {
  const int64_t m = c.vision.spatial_merge_size, P = c.vision.patch_size;
  const int64_t g = side / P, n_img = g * g / (m * m);
  dhp::data::Sample s1;
  s1.pixel_values = torch::randn({g * g, c.vision.patch_dim()});
  s1.grids = {GridTHW{1, g, g}};
  s1.ids = {10, c.vision_start_token_id};
  for (int64_t i = 0; i < n_img; ++i) s1.ids.push_back(c.image_token_id);
  for (int64_t t : {c.vision_end_token_id, 11L, 12L, 13L, 14L}) s1.ids.push_back(t);
  s1.labels.assign(s1.ids.size(), -100);
  s1.labels[s1.ids.size() - 2] = 13;
  s1.labels[s1.ids.size() - 1] = 14;
  dhp::data::Sample s2;
  s2.ids = {20, 21, 22, 23};
  s2.labels = {-100, -100, 22, 23};
  return dhp::data::collate({s1, s2}, c);
}

class PresetForwardBackward : public ::testing::TestWithParam<std::string> {};

TEST_P(PresetForwardBackward, RealWidthsAtReducedDepth) {
  auto c = dhp::qwen::preset(GetParam());
  c.vision.depth = 2;
  c.vision.fullatt_block_indexes = {1};
  c.text.num_layers = 1;
  c.text.vocab_size = 4096;  // keeps the embedding small; widths, heads and GQA are real
  c.image_token_id = 100;
  c.vision_start_token_id = 101;
  c.vision_end_token_id = 102;
  c.video_token_id = 103;
  dhp::qwen::Qwen2_5_VL m(c);
  dhp::qwen::init_parameters(*m, 0, c.initializer_range);
  torch::manual_seed(0);
  auto b = tiny_batch(c, 112);  // 8x8 patches: one window, 16 LLM tokens
  auto out = m->forward(b);
  EXPECT_EQ(out.num_tokens, 4);
  const double loss = out.loss_sum.item<double>() / 4;
  EXPECT_TRUE(std::isfinite(loss));
  // Near-uniform at init: log(V) plus the spread of sqrt(hidden)*std logits, a few nats.
  EXPECT_GT(loss, std::log(4096.0) - 1.0);
  EXPECT_LT(loss, std::log(4096.0) + c.text.hidden_size * std::pow(c.initializer_range, 2) + 3.0);
  out.loss_sum.backward();
  for (const char* n : {"visual.patch_embed.proj.weight", "visual.blocks.0.attn.qkv.weight",
                        "model.layers.0.self_attn.k_proj.weight", "model.embed_tokens.weight"}) {
    auto g = m->named_parameters()[n].grad();
    ASSERT_TRUE(g.defined()) << n;
    EXPECT_GT(g.abs().sum().item<double>(), 0) << n;
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, PresetForwardBackward,
                         ::testing::Values("demo", "bench", "qwen2.5-vl-3b", "qwen2.5-vl-7b",
                                           "qwen2.5-vl-32b", "qwen2.5-vl-72b"),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (auto& ch : s) if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return s;
                         });

TEST(Model, ActivationCheckpointingGivesEqualGrads) {
  auto c = dhp::qwen::preset("demo");
  torch::manual_seed(3);
  auto b = tiny_batch(c, 168);  // 12x12 patches: several windows
  std::map<std::string, torch::Tensor> grads[2];
  double losses[2];
  for (int ck = 0; ck < 2; ++ck) {
    dhp::qwen::Qwen2_5_VL m(c);
    dhp::qwen::init_parameters(*m, 1, 0.05);
    m->set_activation_checkpointing(ck == 1);
    auto out = m->forward(b);
    out.loss_sum.backward();
    losses[ck] = out.loss_sum.item<double>();
    for (auto& kv : m->named_parameters()) grads[ck][kv.key()] = kv.value().grad().clone();
  }
  EXPECT_EQ(losses[0], losses[1]);
  for (auto& kv : grads[0]) {
    const double scale = kv.second.abs().max().item<double>() + 1e-12;
    EXPECT_LT((kv.second - grads[1][kv.first]).abs().max().item<double>(), 1e-6 * scale) << kv.first;
  }
}

// Freezing: the tensors apply_freezing leaves trainable add up to count_trainable's formula;
// with checkpointing on, frozen blocks before the first trainable one get no gradient and
// the trainable ones the same gradients as without freezing.
TEST(ParamCount, TrainableCountAndGradientsFollowTheFreezing) {
  auto c = dhp::qwen::preset("demo");
  dhp::qwen::Freezing f;
  f.vision.trainable_blocks = {2, -1};
  f.text.trainable_layers = {-1};
  f.text.freeze_embeddings = f.text.freeze_lm_head = true;
  torch::manual_seed(3);
  auto b = tiny_batch(c, 112);
  std::map<std::string, torch::Tensor> grads[2];
  for (int frozen = 0; frozen < 2; ++frozen) {
    dhp::qwen::Qwen2_5_VL m(c);
    dhp::qwen::init_parameters(*m, 1, 0.05);
    m->set_activation_checkpointing(true);
    if (frozen) EXPECT_GT(dhp::qwen::apply_freezing(*m, f, c), 0);
    int64_t trainable = 0;
    for (const auto& p : m->parameters())
      if (p.requires_grad()) trainable += p.numel();
    if (frozen) EXPECT_EQ(trainable, dhp::qwen::count_trainable(c, f).total());
    m->forward(b).loss_sum.backward();
    for (auto& kv : m->named_parameters())
      if (kv.value().grad().defined()) grads[frozen][kv.key()] = kv.value().grad().clone();
  }
  int64_t with_grad = 0;
  for (const auto& [name, g] : grads[0]) {
    const bool trains = f.trainable(name, c);
    ASSERT_EQ(grads[1].count(name) > 0, trains) << name;
    if (!trains) continue;
    ++with_grad;
    EXPECT_TRUE(torch::allclose(grads[1].at(name), g, 1e-5, 1e-7)) << name;
  }
  EXPECT_GT(with_grad, 0);
}

// Packing: the loss of samples concatenated into one row (vision patches and tokens, with
// cu_seqlens) is the sum of each sample's loss alone, and so are the gradients; any
// attention across a boundary (vision window/full, text causal) would change them.
TEST(Model, PackedSamplesDoNotAttendAcrossBoundaries) {
  auto c = dhp::qwen::preset("demo");
  dhp::data::ShapesOptions so;
  so.min_side = 56;
  so.max_side = 168;
  dhp::data::ShapesDataset ds(c, so);
  std::vector<dhp::data::Sample> samples;
  for (int i = 0; i < 3; ++i) samples.push_back(ds.get(i));
  dhp::qwen::Qwen2_5_VL m(c);
  dhp::qwen::init_parameters(*m, 1, 0.05);
  auto grads = [&] {
    std::map<std::string, torch::Tensor> g;
    for (auto& kv : m->named_parameters()) {
      g[kv.key()] = kv.value().grad().clone();
      kv.value().mutable_grad().zero_();
    }
    return g;
  };
  auto packed = m->forward(dhp::data::collate(samples, c));
  packed.loss_sum.backward();
  const auto packed_grads = grads();
  double alone = 0;
  int64_t targets = 0;
  for (const auto& s : samples) {
    auto out = m->forward(dhp::data::collate({s}, c));
    out.loss_sum.backward();
    alone += out.loss_sum.item<double>();
    targets += out.num_tokens;
  }
  const auto alone_grads = grads();  // accumulated over the three
  EXPECT_EQ(packed.num_tokens, targets);
  EXPECT_NEAR(packed.loss_sum.item<double>(), alone, 1e-6 * alone);
  for (const auto& [name, g] : packed_grads) {
    const double scale = g.abs().max().item<double>() + 1e-12;
    EXPECT_LT((g - alone_grads.at(name)).abs().max().item<double>(), 1e-5 * scale) << name;
  }
}

TEST(Model, ImageTokenCountMismatchIsAClearError) {
  auto c = dhp::qwen::preset("demo");
  dhp::qwen::Qwen2_5_VL m(c);
  auto b = tiny_batch(c, 56);
  b.grid_thw[0] = GridTHW{1, 4, 8};  // claims 8 merged tokens, 4 in the text
  b.pixel_values = torch::randn({32, c.vision.patch_dim()});
  EXPECT_THROW(m->forward(b), dhp::Error);
}

}  // namespace
