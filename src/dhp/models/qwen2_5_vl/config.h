// Qwen2.5-VL configuration: the fields of Hugging Face's Qwen2_5_VLConfig that decide the
// math, with the presets (demo, bench, 3B, 7B, 32B, 72B) as functions, one place each.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dhp::qwen {

struct VisionConfig {
  int64_t depth = 32;                 // number of ViT blocks
  int64_t hidden_size = 1280;         // ViT width
  int64_t num_heads = 16;             // attention heads (head_dim = hidden/heads)
  int64_t intermediate_size = 3420;   // SwiGLU hidden width
  int64_t out_hidden_size = 2048;     // merger output = LLM hidden size
  int64_t patch_size = 14;            // spatial patch (pixels)
  int64_t temporal_patch_size = 2;    // frames per patch (a still image is repeated)
  int64_t in_channels = 3;            // RGB
  int64_t spatial_merge_size = 2;     // 2x2 patches merged into one LLM token
  int64_t window_size = 112;          // window attention side in pixels (8x8 patches)
  std::vector<int64_t> fullatt_block_indexes{7, 15, 23, 31};  // blocks with full attention
  double rope_theta = 10000.0;        // 2-D vision rotary base
  // Temporal M-RoPE positions per second of video: temporal patch t of a clip sampled at
  // second_per_grid_t seconds per patch sits at int(t * second_per_grid_t * tokens_per_second).
  int64_t tokens_per_second = 2;      // Qwen2.5-VL's released config.json (HF's class default: 4)

  template <class V>
  void visit(V& v) {
    v.field("depth", depth, "number of ViT blocks");
    v.field("hidden_size", hidden_size, "ViT width");
    v.field("num_heads", num_heads, "attention heads");
    v.field("intermediate_size", intermediate_size, "SwiGLU hidden width");
    v.field("out_hidden_size", out_hidden_size, "merger output width (= text.hidden_size)");
    v.field("patch_size", patch_size, "patch side in pixels");
    v.field("temporal_patch_size", temporal_patch_size, "frames per patch");
    v.field("in_channels", in_channels, "image channels");
    v.field("spatial_merge_size", spatial_merge_size, "patches merged per side");
    v.field("window_size", window_size, "window attention side in pixels");
    v.field("fullatt_block_indexes", fullatt_block_indexes, "blocks with full attention");
    v.field("rope_theta", rope_theta, "vision rotary base");
    v.field("tokens_per_second", tokens_per_second, "video temporal positions per second");
  }
  int64_t head_dim() const { return hidden_size / num_heads; }
  int64_t patch_dim() const { return in_channels * temporal_patch_size * patch_size * patch_size; }
};

struct TextConfig {
  int64_t vocab_size = 151936;
  int64_t hidden_size = 2048;
  int64_t num_layers = 36;
  int64_t num_heads = 16;
  int64_t num_kv_heads = 2;
  int64_t intermediate_size = 11008;
  double rope_theta = 1000000.0;
  double rms_norm_eps = 1e-6;
  std::vector<int64_t> mrope_section{16, 24, 24};  // rotary pairs for t, h, w (sum = head_dim/2)
  bool tie_word_embeddings = true;

  template <class V>
  void visit(V& v) {
    v.field("vocab_size", vocab_size, "vocabulary size");
    v.field("hidden_size", hidden_size, "decoder width");
    v.field("num_layers", num_layers, "decoder layers");
    v.field("num_heads", num_heads, "query heads");
    v.field("num_kv_heads", num_kv_heads, "key/value heads (GQA)");
    v.field("intermediate_size", intermediate_size, "SwiGLU hidden width");
    v.field("rope_theta", rope_theta, "M-RoPE base");
    v.field("rms_norm_eps", rms_norm_eps, "RMSNorm epsilon");
    v.field("mrope_section", mrope_section, "rotary pairs for t/h/w, sum = head_dim/2");
    v.field("tie_word_embeddings", tie_word_embeddings, "lm_head shares embed_tokens");
  }
  int64_t head_dim() const { return hidden_size / num_heads; }
};

struct ModelConfig {
  VisionConfig vision;
  TextConfig text;
  int64_t image_token_id = 151655;         // <|image_pad|>
  int64_t video_token_id = 151656;         // <|video_pad|>
  int64_t vision_start_token_id = 151652;  // <|vision_start|>
  int64_t vision_end_token_id = 151653;    // <|vision_end|>
  double initializer_range = 0.02;         // std of the normal init of weights

  template <class V>
  void visit(V& v) {
    v.section("vision", vision, "vision tower");
    v.section("text", text, "text decoder");
    visit_fields(v);
  }
  // The fields outside the two sections.
  template <class V>
  void visit_fields(V& v) {
    v.field("image_token_id", image_token_id, "<|image_pad|> id");
    v.field("video_token_id", video_token_id, "<|video_pad|> id");
    v.field("vision_start_token_id", vision_start_token_id, "<|vision_start|> id");
    v.field("vision_end_token_id", vision_end_token_id, "<|vision_end|> id");
    v.field("initializer_range", initializer_range, "std of the weight init");
  }
  // Throws dhp::Error naming the bad field and values.
  void validate() const;
  // Is `id` a token whose embedding a vision row replaces (<|image_pad|> or <|video_pad|>)?
  bool is_vision_pad(int64_t id) const { return id == image_token_id || id == video_token_id; }
};

// Presets. Names: "demo", "bench", "qwen2.5-vl-3b", "qwen2.5-vl-7b", "qwen2.5-vl-32b",
// "qwen2.5-vl-72b". Throws dhp::Error listing the known names.
ModelConfig preset(const std::string& name);
std::vector<std::string> preset_names();

struct ParamCount {
  int64_t vision = 0;  // patch embed + blocks + merger
  int64_t text = 0;    // embeddings + layers + norm + lm_head (when untied)
  int64_t total() const { return vision + text; }
};
// Exact parameter count computed from the shapes (no allocation).
ParamCount count_parameters(const ModelConfig& cfg);
// The elements of each part (one block or layer each; lm_head 0 when tied).
struct ParamSizes {
  int64_t patch_embed = 0, vision_block = 0, merger = 0;
  int64_t embed_tokens = 0, text_layer = 0, norm = 0, lm_head = 0;
};
ParamSizes parameter_sizes(const ModelConfig& cfg);

}  // namespace dhp::qwen
