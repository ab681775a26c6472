#include "dhp/models/qwen2_5_vl/hf.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <functional>

#include "dhp/core/error.h"
#include "dhp/core/log.h"
#include "dhp/io/safetensors.h"
#include "dhp/models/qwen2_5_vl/model.h"

namespace dhp::qwen {
namespace {

namespace fs = std::filesystem;
using io::Json;

// Field lookup in the first of `scopes` that has it.
struct Fields {
  std::vector<const Json*> scopes;
  std::string what;
  const Json* find(const std::string& key) const {
    for (const Json* s : scopes) {
      if (const Json* v = s->find(key)) return v;
    }
    return nullptr;
  }
  int64_t integer(const std::string& key) const {
    const Json* v = find(key);
    DHP_CHECK(v != nullptr, what, ": missing \"", key, "\"");
    return v->integer(what + " \"" + key + "\"");
  }
  int64_t integer(const std::string& key, int64_t def) const { return find(key) ? integer(key) : def; }
  double number(const std::string& key, double def) const {
    const Json* v = find(key);
    return v ? v->number(what + " \"" + key + "\"") : def;
  }
  bool boolean(const std::string& key, bool def) const {
    const Json* v = find(key);
    return v ? v->boolean(what + " \"" + key + "\"") : def;
  }
  std::vector<int64_t> ints(const Json& arr, const std::string& key) const {
    std::vector<int64_t> out;
    for (const auto& e : arr.elements(what + " \"" + key + "\"")) out.push_back(e.integer(what + " \"" + key + "\""));
    return out;
  }
};

Json int_array(const std::vector<int64_t>& v) {
  Json a = Json::array();
  for (auto x : v) a.push(Json(x));
  return a;
}

}  // namespace

ModelConfig config_from_hf(const Json& j, const std::string& what) {
  j.items(what);  // must be an object
  ModelConfig c;
  const Json* text_cfg = j.find("text_config");
  Fields t{{}, what};
  if (text_cfg) t.scopes.push_back(text_cfg);
  t.scopes.push_back(&j);
  c.text.vocab_size = t.integer("vocab_size");
  c.text.hidden_size = t.integer("hidden_size");
  c.text.num_layers = t.integer("num_hidden_layers");
  c.text.num_heads = t.integer("num_attention_heads");
  c.text.num_kv_heads = t.integer("num_key_value_heads", c.text.num_heads);
  c.text.intermediate_size = t.integer("intermediate_size");
  c.text.rms_norm_eps = t.number("rms_norm_eps", 1e-5);
  c.text.tie_word_embeddings = t.boolean("tie_word_embeddings", false);
  const Json* rope = t.find("rope_scaling");
  if (rope == nullptr || rope->is_null()) rope = t.find("rope_parameters");
  DHP_CHECK(rope != nullptr && rope->is_object(), what,
            ": needs \"rope_scaling\" or \"rope_parameters\" with \"mrope_section\" (Qwen2.5-VL's M-RoPE)");
  c.text.mrope_section = t.ints(rope->at("mrope_section", what + " rope settings"), "mrope_section");
  const Json* theta = rope->find("rope_theta");
  c.text.rope_theta = theta ? theta->number(what + " \"rope_theta\"") : t.number("rope_theta", 1000000.0);
  if (const Json* act = t.find("hidden_act")) {
    DHP_CHECK(act->str(what + " \"hidden_act\"") == "silu", what, ": hidden_act \"", act->str(), "\" (only silu)");
  }
  c.image_token_id = t.integer("image_token_id", 151655);
  c.video_token_id = t.integer("video_token_id", 151656);
  c.vision_start_token_id = t.integer("vision_start_token_id", 151652);
  c.vision_end_token_id = t.integer("vision_end_token_id", 151653);
  c.initializer_range = t.number("initializer_range", 0.02);

  const Json& vj = j.at("vision_config", what);
  Fields v{{&vj}, what + " vision_config"};
  c.vision.depth = v.integer("depth");
  c.vision.hidden_size = v.integer("hidden_size");
  c.vision.num_heads = v.integer("num_heads");
  c.vision.intermediate_size = v.integer("intermediate_size");
  c.vision.out_hidden_size = v.integer("out_hidden_size", c.text.hidden_size);
  c.vision.patch_size = v.integer("patch_size", 14);
  c.vision.temporal_patch_size = v.integer("temporal_patch_size", 2);
  c.vision.in_channels = v.find("in_channels") ? v.integer("in_channels") : v.integer("in_chans", 3);
  c.vision.spatial_merge_size = v.integer("spatial_merge_size", 2);
  c.vision.window_size = v.integer("window_size", 112);
  if (const Json* f = v.find("fullatt_block_indexes")) c.vision.fullatt_block_indexes = v.ints(*f, "fullatt_block_indexes");
  c.vision.tokens_per_second = v.integer("tokens_per_second", 4);  // Qwen2_5_VLVisionConfig's default
  if (const Json* act = v.find("hidden_act")) {
    DHP_CHECK(act->str(what + " vision_config \"hidden_act\"") == "silu", what, ": vision hidden_act \"", act->str(),
              "\" (only silu)");
  }
  try {
    c.validate();
  } catch (const Error& e) {
    DHP_FAIL(what, ": ", e.what());
  }
  return c;
}

Json config_to_hf(const ModelConfig& c, torch::ScalarType dtype) {
  DHP_CHECK(c.vision.rope_theta == 10000.0, "model.vision.rope_theta=", c.vision.rope_theta,
            ": Hugging Face's Qwen2.5-VL fixes the vision rotary base at 10000, so this model cannot be exported");
  Json j = Json::object();
  Json arch = Json::array();
  arch.push(Json("Qwen2_5_VLForConditionalGeneration"));
  j.set("architectures", std::move(arch));
  j.set("model_type", Json("qwen2_5_vl"));
  j.set("hidden_act", Json("silu"));
  j.set("vocab_size", Json(c.text.vocab_size));
  j.set("hidden_size", Json(c.text.hidden_size));
  j.set("intermediate_size", Json(c.text.intermediate_size));
  j.set("num_hidden_layers", Json(c.text.num_layers));
  j.set("num_attention_heads", Json(c.text.num_heads));
  j.set("num_key_value_heads", Json(c.text.num_kv_heads));
  j.set("rms_norm_eps", Json(c.text.rms_norm_eps));
  j.set("rope_theta", Json(c.text.rope_theta));
  j.set("tie_word_embeddings", Json(c.text.tie_word_embeddings));
  j.set("max_position_embeddings", Json(int64_t{128000}));
  j.set("max_window_layers", Json(c.text.num_layers));
  j.set("use_sliding_window", Json(false));
  j.set("sliding_window", Json(int64_t{32768}));
  j.set("attention_dropout", Json(0.0));
  j.set("initializer_range", Json(c.initializer_range));
  j.set("use_cache", Json(true));
  j.set("image_token_id", Json(c.image_token_id));
  j.set("video_token_id", Json(c.video_token_id));
  j.set("vision_start_token_id", Json(c.vision_start_token_id));
  j.set("vision_end_token_id", Json(c.vision_end_token_id));
  j.set("torch_dtype", Json(dtype == torch::kBFloat16 ? "bfloat16" : dtype == torch::kFloat16 ? "float16" : "float32"));
  Json rope = Json::object();
  rope.set("type", Json("mrope"));
  rope.set("mrope_section", int_array(c.text.mrope_section));
  j.set("rope_scaling", std::move(rope));
  Json v = Json::object();
  v.set("model_type", Json("qwen2_5_vl"));
  v.set("depth", Json(c.vision.depth));
  v.set("hidden_size", Json(c.vision.hidden_size));
  v.set("hidden_act", Json("silu"));
  v.set("intermediate_size", Json(c.vision.intermediate_size));
  v.set("num_heads", Json(c.vision.num_heads));
  v.set("in_channels", Json(c.vision.in_channels));
  v.set("out_hidden_size", Json(c.vision.out_hidden_size));
  v.set("patch_size", Json(c.vision.patch_size));
  v.set("spatial_merge_size", Json(c.vision.spatial_merge_size));
  v.set("temporal_patch_size", Json(c.vision.temporal_patch_size));
  v.set("window_size", Json(c.vision.window_size));
  v.set("fullatt_block_indexes", int_array(c.vision.fullatt_block_indexes));
  v.set("tokens_per_second", Json(c.vision.tokens_per_second));
  v.set("initializer_range", Json(c.initializer_range));
  j.set("vision_config", std::move(v));
  return j;
}

ModelConfig read_hf_config(const std::string& dir) {
  const auto path = (fs::path(dir) / "config.json").string();
  DHP_CHECK(fs::exists(path), "model directory ", dir, " has no config.json");
  return config_from_hf(Json::parse(io::read_file(path), path), path);
}

std::string canonical_name(const std::string& n) {
  const std::string lm = "model.language_model.", vis = "model.visual.";
  if (n.rfind(lm, 0) == 0) return "model." + n.substr(lm.size());
  if (n.rfind(vis, 0) == 0) return "visual." + n.substr(vis.size());
  return n;
}

HfWeights::HfWeights(const std::string& dir) : dir_(dir) {
  const fs::path d(dir);
  DHP_CHECK(fs::is_directory(d), "model directory ", dir, " does not exist");
  auto add = [&](const std::string& hf_name, const std::string& file) {
    const auto name = canonical_name(hf_name);
    DHP_CHECK(entries_.emplace(name, Entry{file, hf_name}).second, dir, ": tensor ", name, " appears twice (as ",
              hf_name, " in ", file, ")");
  };
  const auto index = d / "model.safetensors.index.json";
  if (fs::exists(index)) {
    const auto j = Json::parse(io::read_file(index.string()), index.string());
    for (const auto& [name, file] : j.at("weight_map", index.string()).items(index.string() + " weight_map")) {
      const auto& f = file.str(index.string() + " weight_map \"" + name + "\"");
      DHP_CHECK(f.find('/') == std::string::npos && !f.empty(), index.string(), ": shard name \"", f,
                "\" must be a file in the directory");
      add(name, f);
    }
    for (const auto& [name, e] : entries_) {
      const auto* t = reader(e.file).find(e.hf_name);
      DHP_CHECK(t != nullptr, index.string(), " maps ", e.hf_name, " to ", e.file, ", which does not hold it");
    }
  } else {
    DHP_CHECK(fs::exists(d / "model.safetensors"), "model directory ", dir,
              " has neither model.safetensors nor model.safetensors.index.json");
    for (const auto& t : reader("model.safetensors").tensors()) add(t.name, "model.safetensors");
  }
}

HfWeights::~HfWeights() = default;

const io::SafetensorsReader& HfWeights::reader(const std::string& file) const {
  auto it = readers_.find(file);
  if (it == readers_.end()) {
    it = readers_.emplace(file, std::make_unique<io::SafetensorsReader>((fs::path(dir_) / file).string())).first;
  }
  return *it->second;
}

std::vector<std::string> HfWeights::names() const {
  std::vector<std::string> out;
  for (const auto& kv : entries_) out.push_back(kv.first);
  return out;
}

bool HfWeights::contains(const std::string& name) const { return entries_.count(name) > 0; }

const HfWeights::Entry& HfWeights::entry(const std::string& name) const {
  auto it = entries_.find(name);
  DHP_CHECK(it != entries_.end(), dir_, ": no tensor ", name);
  return it->second;
}

std::string HfWeights::file_of(const std::string& name) const {
  return (fs::path(dir_) / entry(name).file).string();
}

std::vector<int64_t> HfWeights::shape(const std::string& name) const {
  const auto& e = entry(name);
  return reader(e.file).info(e.hf_name).shape;
}

torch::Tensor HfWeights::read(const std::string& name) const {
  const auto& e = entry(name);
  return reader(e.file).read(e.hf_name);
}

torch::Tensor HfWeights::read_rows(const std::string& name, int64_t start, int64_t count) const {
  const auto& e = entry(name);
  return reader(e.file).read_rows(e.hf_name, start, count);
}

torch::Tensor HfWeights::read_box(const std::string& name, const std::vector<int64_t>& offset,
                                 const std::vector<int64_t>& shape) const {
  const auto& e = entry(name);
  return reader(e.file).read_box(e.hf_name, offset, shape);
}

std::vector<std::string> load_hf_weights(const HfWeights& w, std::map<std::string, torch::Tensor>& params) {
  torch::NoGradGuard no_grad;
  for (auto& [name, p] : params) {
    DHP_CHECK(w.contains(name), "the model directory has no tensor for parameter ", name);
    const auto shape = w.shape(name);
    DHP_CHECK(shape == p.sizes().vec(), w.file_of(name), ": ", name, " has shape ", c10::IntArrayRef(shape),
              " but the model (from config.json) needs ", p.sizes());
    p.copy_(w.read(name));
  }
  return unused_hf_tensors(w, [&](const std::string& n) { return params.count(n) > 0; });
}

std::vector<std::string> unused_hf_tensors(const HfWeights& w, const std::function<bool(const std::string&)>& has) {
  const bool tied = !has("lm_head.weight");
  std::vector<std::string> unused;
  for (const auto& n : w.names()) {
    if (!has(n) && !(tied && n == "lm_head.weight")) unused.push_back(n);
  }
  if (!unused.empty()) {
    log_warn(w.dir() + ": " + std::to_string(unused.size()) + " tensor(s) the model does not use, ignored (first: " +
             unused.front() + ")");
  }
  return unused;
}

void load_hf_weights(const std::string& dir, Qwen2_5_VLImpl& model) {
  std::map<std::string, torch::Tensor> params;  // LoRA adapters are not base weights
  for (auto& kv : model.named_parameters(true))
    if (!is_lora_parameter(kv.key())) params[kv.key()] = kv.value();
  load_hf_weights(HfWeights(dir), params);
}

void save_hf(const std::string& dir, const std::map<std::string, torch::Tensor>& params, const ModelConfig& c,
             int64_t max_shard_bytes) {
  DHP_CHECK(max_shard_bytes > 0, "save_hf: max_shard_bytes must be > 0");
  DHP_CHECK(!params.empty(), "save_hf: no parameters to write");
  fs::create_directories(dir);
  const auto dtype = params.begin()->second.scalar_type();
  io::write_file_atomic((fs::path(dir) / "config.json").string(), config_to_hf(c, dtype).dump(2) + "\n");
  // Shards in name order, each up to max_shard_bytes (a larger tensor gets one of its own).
  std::vector<std::vector<std::pair<std::string, torch::Tensor>>> shards(1);
  int64_t in_shard = 0, total = 0;
  for (const auto& [name, t] : params) {
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    if (!shards.back().empty() && in_shard + bytes > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().emplace_back(name, t.detach().cpu());
    in_shard += bytes;
    total += bytes;
  }
  const std::map<std::string, std::string> meta{{"format", "pt"}};
  if (shards.size() == 1) {
    io::write_safetensors((fs::path(dir) / "model.safetensors").string(), shards[0], meta);
    fs::remove(fs::path(dir) / "model.safetensors.index.json");
    return;
  }
  Json map = Json::object();
  for (size_t i = 0; i < shards.size(); ++i) {
    char file[64];
    std::snprintf(file, sizeof(file), "model-%05zu-of-%05zu.safetensors", i + 1, shards.size());
    io::write_safetensors((fs::path(dir) / file).string(), shards[i], meta);
    for (const auto& kv : shards[i]) map.set(kv.first, Json(file));
  }
  Json index = Json::object();
  Json m = Json::object();
  m.set("total_size", Json(total));
  index.set("metadata", std::move(m));
  index.set("weight_map", std::move(map));
  // The index last: a directory with an index names only shards already complete.
  io::write_file_atomic((fs::path(dir) / "model.safetensors.index.json").string(), index.dump(2) + "\n");
  fs::remove(fs::path(dir) / "model.safetensors");
}

namespace {

// The grids of one kind of vision input ("image_grid_thw" / "video_grid_thw") and the row
// offset of each item in its pixel tensor, checked against that tensor.
struct VisionInputs {
  std::vector<GridTHW> grids;
  std::vector<int64_t> offsets;  // grids.size() + 1
  torch::Tensor pixels;
};

VisionInputs vision_inputs(const ModelConfig& c, const torch::Tensor& pixels, const torch::Tensor& grid_thw,
                           const char* pixels_name, const char* grid_name) {
  VisionInputs v;
  v.offsets = {0};
  if (!grid_thw.defined() || grid_thw.numel() == 0) {
    DHP_CHECK(!pixels.defined() || pixels.numel() == 0, pixels_name, " is given without ", grid_name);
    return v;
  }
  DHP_CHECK(grid_thw.dim() == 2 && grid_thw.size(1) == 3, grid_name, " must be (I, 3), got ", grid_thw.sizes());
  auto g = grid_thw.to(torch::kInt64).contiguous();
  for (int64_t i = 0; i < g.size(0); ++i) {
    GridTHW t{g[i][0].item<int64_t>(), g[i][1].item<int64_t>(), g[i][2].item<int64_t>()};
    DHP_CHECK(t[0] > 0 && t[1] > 0 && t[2] > 0 && t[1] % c.vision.spatial_merge_size == 0 &&
                  t[2] % c.vision.spatial_merge_size == 0,
              grid_name, " row ", i, " = [", t[0], ", ", t[1], ", ", t[2], "]: sizes must be positive and h, w ",
              "multiples of the merge size ", c.vision.spatial_merge_size);
    v.grids.push_back(t);
    v.offsets.push_back(v.offsets.back() + t[0] * t[1] * t[2]);
  }
  DHP_CHECK(pixels.defined() && pixels.dim() == 2 && pixels.size(0) == v.offsets.back() &&
                pixels.size(1) == c.vision.patch_dim(),
            pixels_name, " must be (", v.offsets.back(), ", ", c.vision.patch_dim(), ") for these grids, got ",
            pixels.defined() ? pixels.sizes() : c10::IntArrayRef{});
  v.pixels = pixels.to(torch::kFloat32).contiguous();
  return v;
}

}  // namespace

Batch forward_batch(const ModelConfig& c, const ProcessorInputs& in) {
  const auto& input_ids = in.input_ids;
  DHP_CHECK(input_ids.defined() && input_ids.dim() == 2 && input_ids.size(0) == 1 && input_ids.size(1) > 0,
            "input_ids must be (1, L) with L > 0 (one sample), got ", input_ids.defined() ? input_ids.sizes() : c10::IntArrayRef{});
  Batch b;
  b.input_ids = input_ids.reshape({-1}).to(torch::kInt64).contiguous();
  const int64_t L = b.input_ids.size(0);
  const auto images = vision_inputs(c, in.pixel_values, in.image_grid_thw, "pixel_values", "image_grid_thw");
  const auto videos = vision_inputs(c, in.pixel_values_videos, in.video_grid_thw, "pixel_values_videos", "video_grid_thw");
  std::vector<float> seconds;  // per video
  if (in.second_per_grid_ts.defined() && in.second_per_grid_ts.numel() > 0) {
    auto s = in.second_per_grid_ts.to(torch::kFloat32).reshape({-1}).contiguous();
    seconds.assign(s.data_ptr<float>(), s.data_ptr<float>() + s.numel());
    DHP_CHECK(seconds.size() == videos.grids.size(), "second_per_grid_ts has ", seconds.size(), " values for ",
              videos.grids.size(), " videos");
  } else {
    seconds.assign(videos.grids.size(), 1.0f);  // the model's default without second_per_grid_ts
  }
  std::vector<int64_t> ids(b.input_ids.data_ptr<int64_t>(), b.input_ids.data_ptr<int64_t>() + L);
  for (auto id : ids) DHP_CHECK(id >= 0 && id < c.text.vocab_size, "input id ", id, " outside the vocabulary of ", c.text.vocab_size);
  // Interleave images and videos in the order their pad runs appear.
  const int64_t unit = c.vision.spatial_merge_size * c.vision.spatial_merge_size;
  std::vector<torch::Tensor> pixels;
  std::vector<float> second_per_grid_t;
  size_t next_image = 0, next_video = 0;
  for (int64_t i = 0; i < L;) {
    if (!c.is_vision_pad(ids[i])) {
      ++i;
      continue;
    }
    const bool video = ids[i] == c.video_token_id;
    const auto& v = video ? videos : images;
    size_t& k = video ? next_video : next_image;
    DHP_CHECK(k < v.grids.size(), "input_ids hold more ", video ? "<|video_pad|>" : "<|image_pad|>", " runs than the ",
              v.grids.size(), " rows of ", video ? "video_grid_thw" : "image_grid_thw");
    const auto& g = v.grids[k];
    b.grid_thw.push_back(g);
    second_per_grid_t.push_back(video ? seconds[k] : 0.0f);
    pixels.push_back(v.pixels.narrow(0, v.offsets[k], v.offsets[k + 1] - v.offsets[k]));
    ++k;
    i += g[0] * g[1] * g[2] / unit;  // rope_index checks that the run has this length
  }
  DHP_CHECK(next_image == images.grids.size() && next_video == videos.grids.size(), "input_ids hold ", next_image,
            " <|image_pad|> (id ", c.image_token_id, ") and ", next_video, " <|video_pad|> (id ", c.video_token_id,
            ") runs but the inputs give ", images.grids.size(), " images and ", videos.grids.size(), " videos");
  if (!pixels.empty()) b.pixel_values = torch::cat(pixels, 0);
  const int64_t pads = b.input_ids.eq(c.image_token_id).logical_or(b.input_ids.eq(c.video_token_id)).sum().item<int64_t>();
  const int64_t rows = (images.offsets.back() + videos.offsets.back()) / unit;
  DHP_CHECK(pads == rows, "input_ids hold ", pads, " <|image_pad|> / <|video_pad|> tokens but the grids give ", rows,
            " merged vision tokens");
  b.position_ids = rope_index(ids, b.grid_thw, c, second_per_grid_t);
  b.targets = torch::zeros({L}, torch::kInt64);  // every position "has a target": logits for all
  b.cu_seqlens = {0, L};
  return b;
}

torch::Tensor forward_logits(Qwen2_5_VLImpl& model, const ProcessorInputs& in) {
  torch::NoGradGuard no_grad;
  return model.target_logits(forward_batch(model.cfg, in)).unsqueeze(0);
}

Batch forward_batch(const ModelConfig& c, const torch::Tensor& input_ids, const torch::Tensor& pixel_values,
                    const torch::Tensor& image_grid_thw) {
  return forward_batch(c, ProcessorInputs{input_ids, pixel_values, image_grid_thw, {}, {}, {}});
}

torch::Tensor forward_logits(Qwen2_5_VLImpl& model, const torch::Tensor& input_ids, const torch::Tensor& pixel_values,
                             const torch::Tensor& image_grid_thw) {
  return forward_logits(model, ProcessorInputs{input_ids, pixel_values, image_grid_thw, {}, {}, {}});
}

}  // namespace dhp::qwen
