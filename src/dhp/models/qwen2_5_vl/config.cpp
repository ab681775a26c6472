#include "dhp/models/qwen2_5_vl/config.h"

#include "dhp/core/error.h"

namespace dhp::qwen {
namespace {

ModelConfig real_model(int64_t hidden, int64_t layers, int64_t heads, int64_t kv,
                       int64_t inter, int64_t vision_inter, int64_t vocab, bool tied) {
  ModelConfig c;
  c.vision.intermediate_size = vision_inter;
  c.vision.out_hidden_size = hidden;
  c.text.hidden_size = hidden;
  c.text.num_layers = layers;
  c.text.num_heads = heads;
  c.text.num_kv_heads = kv;
  c.text.intermediate_size = inter;
  c.text.vocab_size = vocab;
  c.text.tie_word_embeddings = tied;
  return c;
}

}  // namespace

ModelConfig preset(const std::string& name) {
  if (name == "qwen2.5-vl-3b") return real_model(2048, 36, 16, 2, 11008, 3420, 151936, true);
  if (name == "qwen2.5-vl-7b") return real_model(3584, 28, 28, 4, 18944, 3420, 152064, false);
  if (name == "qwen2.5-vl-32b") return real_model(5120, 64, 40, 8, 27648, 3456, 152064, false);
  if (name == "qwen2.5-vl-72b") return real_model(8192, 80, 64, 8, 29568, 3456, 152064, false);
  if (name == "demo") {
    // Trains the synthetic shapes task in minutes on 2 CPU cores. Same structure as the real
    // model: window attention with full attention in some blocks, 2x2 merge, GQA, M-RoPE.
    ModelConfig c;
    c.vision.depth = 4;
    c.vision.hidden_size = 64;
    c.vision.num_heads = 4;
    c.vision.intermediate_size = 128;
    c.vision.out_hidden_size = 128;
    c.vision.fullatt_block_indexes = {1, 3};
    c.text.vocab_size = 64;
    c.text.hidden_size = 128;
    c.text.num_layers = 4;
    c.text.num_heads = 4;
    c.text.num_kv_heads = 2;
    c.text.intermediate_size = 256;
    c.text.rope_theta = 10000.0;
    c.text.mrope_section = {4, 6, 6};
    c.text.tie_word_embeddings = true;
    c.image_token_id = 5;
    c.vision_start_token_id = 3;
    c.vision_end_token_id = 4;
    c.video_token_id = 27;  // data/shapes.h's vocabulary
    return c;
  }
  if (name == "bench") {
    // Qwen2.5-VL's ratios scaled to a small CPU: narrow ViT, wider LLM, full attention in
    // one block of four, GQA.
    ModelConfig c;
    c.vision.depth = 8;
    c.vision.hidden_size = 256;
    c.vision.num_heads = 4;
    c.vision.intermediate_size = 688;
    c.vision.out_hidden_size = 1024;
    c.vision.fullatt_block_indexes = {3, 7};
    c.text.vocab_size = 8192;
    c.text.hidden_size = 1024;
    c.text.num_layers = 4;
    c.text.num_heads = 8;
    c.text.num_kv_heads = 2;
    c.text.intermediate_size = 2816;
    c.text.mrope_section = {16, 24, 24};
    c.text.tie_word_embeddings = false;
    c.image_token_id = 5;
    c.vision_start_token_id = 3;
    c.vision_end_token_id = 4;
    c.video_token_id = 27;  // data/shapes.h's vocabulary
    return c;
  }
  std::string names;
  for (const auto& n : preset_names()) names += (names.empty() ? "" : ", ") + n;
  DHP_FAIL("unknown model preset '", name, "'; known presets: ", names);
}

std::vector<std::string> preset_names() {
  return {"demo", "bench", "qwen2.5-vl-3b", "qwen2.5-vl-7b", "qwen2.5-vl-32b", "qwen2.5-vl-72b"};
}

void ModelConfig::validate() const {
  const auto& v = vision;
  const auto& t = text;
  DHP_CHECK(v.depth > 0 && v.hidden_size > 0 && v.num_heads > 0 && v.intermediate_size > 0,
            "model.vision: depth, hidden_size, num_heads, intermediate_size must be > 0");
  DHP_CHECK(v.hidden_size % v.num_heads == 0, "model.vision.num_heads=", v.num_heads,
            " does not divide model.vision.hidden_size=", v.hidden_size);
  DHP_CHECK(v.head_dim() % 4 == 0, "model.vision head_dim=", v.head_dim(),
            " must be a multiple of 4 (2-D rotary over h and w)");
  DHP_CHECK(v.out_hidden_size == t.hidden_size, "model.vision.out_hidden_size=",
            v.out_hidden_size, " must equal model.text.hidden_size=", t.hidden_size);
  DHP_CHECK(v.spatial_merge_size > 0 && v.patch_size > 0 && v.temporal_patch_size > 0,
            "model.vision: spatial_merge_size, patch_size, temporal_patch_size must be > 0");
  DHP_CHECK(v.window_size % (v.spatial_merge_size * v.patch_size) == 0 &&
                v.window_size >= v.spatial_merge_size * v.patch_size,
            "model.vision.window_size=", v.window_size, " must be a multiple of ",
            v.spatial_merge_size * v.patch_size, " (spatial_merge_size * patch_size)");
  for (auto i : v.fullatt_block_indexes) {
    DHP_CHECK(i >= 0 && i < v.depth, "model.vision.fullatt_block_indexes holds ", i,
              ", outside [0, depth=", v.depth, ")");
  }
  DHP_CHECK(t.vocab_size > 0 && t.hidden_size > 0 && t.num_layers > 0 && t.num_heads > 0 &&
                t.num_kv_heads > 0 && t.intermediate_size > 0,
            "model.text: sizes must be > 0");
  DHP_CHECK(t.hidden_size % t.num_heads == 0, "model.text.num_heads=", t.num_heads,
            " does not divide model.text.hidden_size=", t.hidden_size);
  DHP_CHECK(t.num_heads % t.num_kv_heads == 0, "model.text.num_kv_heads=", t.num_kv_heads,
            " does not divide model.text.num_heads=", t.num_heads);
  DHP_CHECK(t.head_dim() % 2 == 0, "model.text head_dim=", t.head_dim(), " must be even");
  DHP_CHECK(t.mrope_section.size() == 3, "model.text.mrope_section must have 3 entries (t, h, w), got ",
            t.mrope_section.size());
  int64_t sum = 0;
  for (auto s : t.mrope_section) sum += s;
  DHP_CHECK(sum == t.head_dim() / 2, "model.text.mrope_section sums to ", sum,
            " but must equal head_dim/2 = ", t.head_dim() / 2);
  const std::pair<const char*, int64_t> ids[] = {{"image_token_id", image_token_id},
                                                  {"video_token_id", video_token_id},
                                                  {"vision_start_token_id", vision_start_token_id},
                                                  {"vision_end_token_id", vision_end_token_id}};
  for (size_t i = 0; i < 4; ++i) {
    DHP_CHECK(ids[i].second >= 0 && ids[i].second < t.vocab_size, "model.", ids[i].first, "=", ids[i].second,
              " is outside the vocabulary [0, ", t.vocab_size, ")");
    for (size_t k = 0; k < i; ++k) {
      DHP_CHECK(ids[i].second != ids[k].second, "model.", ids[i].first, " and model.", ids[k].first,
                " are both ", ids[i].second, "; the special tokens must differ");
    }
  }
  DHP_CHECK(v.tokens_per_second > 0, "model.vision.tokens_per_second=", v.tokens_per_second, " must be > 0");
}

ParamSizes parameter_sizes(const ModelConfig& cfg) {
  const auto& v = cfg.vision;
  const auto& t = cfg.text;
  ParamSizes s;
  const int64_t hv = v.hidden_size;
  s.patch_embed = hv * v.patch_dim();
  s.vision_block = 2 * hv                                                 // norm1, norm2
                   + hv * 3 * hv + 3 * hv                                 // qkv
                   + hv * hv + hv                                         // proj
                   + 2 * (hv * v.intermediate_size + v.intermediate_size)  // gate, up
                   + v.intermediate_size * hv + hv;                       // down
  const int64_t merged = hv * v.spatial_merge_size * v.spatial_merge_size;
  s.merger = hv + merged * merged + merged + merged * v.out_hidden_size + v.out_hidden_size;
  const int64_t h = t.hidden_size, kvd = t.num_kv_heads * t.head_dim();
  s.embed_tokens = t.vocab_size * h;
  s.text_layer = 2 * h                               // two norms
                 + h * h + h + 2 * (h * kvd + kvd)   // q, k, v (bias)
                 + h * h                             // o (no bias)
                 + 3 * h * t.intermediate_size;      // gate, up, down (no bias)
  s.norm = h;
  s.lm_head = t.tie_word_embeddings ? 0 : t.vocab_size * h;
  return s;
}

ParamCount count_parameters(const ModelConfig& cfg) {
  const auto s = parameter_sizes(cfg);
  ParamCount p;
  p.vision = s.patch_embed + cfg.vision.depth * s.vision_block + s.merger;
  p.text = s.embed_tokens + cfg.text.num_layers * s.text_layer + s.norm + s.lm_head;
  return p;
}

}  // namespace dhp::qwen
