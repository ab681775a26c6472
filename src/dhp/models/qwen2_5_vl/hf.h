// Hugging Face model directories for Qwen2.5-VL: config.json <-> ModelConfig, parameter
// names, and the weights in model.safetensors or sharded model-0000i-of-0000n.safetensors
// with model.safetensors.index.json.
//
// config.json: both layouts transformers writes are read: the text fields at the top level
// (released Qwen2.5-VL checkpoints) or under "text_config" (newer transformers), rotary
// settings under "rope_scaling" or "rope_parameters", the vision tower under
// "vision_config" ("in_channels" or the older "in_chans"). Exported directories use the
// top-level layout, which every transformers version with Qwen2.5-VL reads.
// Names: dhp's parameter names are Hugging Face's (visual.blocks.N.attn.qkv.weight,
// model.layers.N.self_attn.q_proj.weight, lm_head.weight); the newer prefixes
// model.visual. and model.language_model. are read as visual. and model.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dhp/io/json.h"
#include "dhp/models/qwen2_5_vl/config.h"
#include "dhp/models/qwen2_5_vl/model.h"

namespace dhp::io {
class SafetensorsReader;
}

namespace dhp::qwen {

class Qwen2_5_VLImpl;

// Throws dhp::Error naming `what` (the file) and the field.
ModelConfig config_from_hf(const io::Json& j, const std::string& what);
io::Json config_to_hf(const ModelConfig& c, torch::ScalarType dtype);
// Reads DIR/config.json.
ModelConfig read_hf_config(const std::string& dir);

// "model.language_model.layers.0.mlp.up_proj.weight" -> "model.layers.0.mlp.up_proj.weight",
// "model.visual.blocks.0..." -> "visual.blocks.0..."; other names unchanged.
std::string canonical_name(const std::string& hf_name);

// The weights of a directory: one safetensors file or an index of shards. Files are
// opened (mapped) on first use; reads copy only what is asked for.
class HfWeights {
 public:
  explicit HfWeights(const std::string& dir);
  ~HfWeights();
  // dhp names (canonical) of every tensor in the directory, sorted.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const;
  std::vector<int64_t> shape(const std::string& name) const;
  torch::Tensor read(const std::string& name) const;
  // Rows [start, start + count) along dim 0.
  torch::Tensor read_rows(const std::string& name, int64_t start, int64_t count) const;
  // The box [offset, offset + shape) (reads only its bytes).
  torch::Tensor read_box(const std::string& name, const std::vector<int64_t>& offset,
                         const std::vector<int64_t>& shape) const;
  const std::string& dir() const { return dir_; }
  // The file holding a tensor (for messages).
  std::string file_of(const std::string& name) const;

 private:
  struct Entry {
    std::string file, hf_name;
  };
  const Entry& entry(const std::string& name) const;  // throws naming the directory
  const io::SafetensorsReader& reader(const std::string& file) const;
  std::string dir_;
  std::map<std::string, Entry> entries_;
  mutable std::map<std::string, std::unique_ptr<io::SafetensorsReader>> readers_;
};

// Copies every parameter of `params` (dhp names -> tensors of the model's shapes) from the
// directory, converting dtypes. Missing tensors or shape mismatches are errors naming the
// parameter, the file and both shapes; tensors in the directory that the model does not
// have are returned (the caller logs them). A tied model ignores lm_head.weight.
std::vector<std::string> load_hf_weights(const HfWeights& w, std::map<std::string, torch::Tensor>& params);
// The directory's tensors for which `has` (a model parameter name) is false, ignoring
// lm_head.weight for a tied model (no such parameter); logs a warning naming the count and
// the first when there are any.
std::vector<std::string> unused_hf_tensors(const HfWeights& w, const std::function<bool(const std::string&)>& has);
// Loads every parameter of `model` from the directory `dir` as above and logs a warning
// naming the tensors of the directory the model does not use.
void load_hf_weights(const std::string& dir, Qwen2_5_VLImpl& model);

// Writes an HF directory: config.json and the tensors as model.safetensors, or as shards
// of at most `max_shard_bytes` with model.safetensors.index.json when they do not fit in
// one. Every file is written atomically. Tensors are written in the given dtype.
void save_hf(const std::string& dir, const std::map<std::string, torch::Tensor>& params, const ModelConfig& c,
             int64_t max_shard_bytes = 5LL << 30);

// One sample as Hugging Face's Qwen2.5-VL processor gives it, by its names: input_ids (1, L)
// int64; pixel_values (N, patch_dim) with image_grid_thw (I, 3) int64; pixel_values_videos
// (M, patch_dim) with video_grid_thw (V, 3) int64 and second_per_grid_ts (V) (absent: 1.0 s
// per temporal patch, as the model assumes). Either pair may be undefined or empty.
struct ProcessorInputs {
  torch::Tensor input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw, second_per_grid_ts;
};
// The one-sample batch of those inputs with a target at every position: images and videos
// interleaved in the order their <|image_pad|> / <|video_pad|> runs appear. Checks the shapes
// and that each run matches its grid, naming the inputs.
Batch forward_batch(const ModelConfig& c, const ProcessorInputs& in);
// Logits of every position, (1, L, vocab) fp32.
torch::Tensor forward_logits(Qwen2_5_VLImpl& model, const ProcessorInputs& in);
// The same for a sample with images only.
Batch forward_batch(const ModelConfig& c, const torch::Tensor& input_ids, const torch::Tensor& pixel_values,
                    const torch::Tensor& image_grid_thw);
torch::Tensor forward_logits(Qwen2_5_VLImpl& model, const torch::Tensor& input_ids, const torch::Tensor& pixel_values,
                             const torch::Tensor& image_grid_thw);

}  // namespace dhp::qwen
