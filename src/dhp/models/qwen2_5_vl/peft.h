// PEFT LoRA adapter directories for Qwen2.5-VL: adapter_config.json and
// adapter_model.safetensors, as Hugging Face PEFT writes and loads them, and merging adapters
// into their base weights (the Hugging Face export of a LoRA run).
//
// Keys: "base_model.model.<module>.lora_A.weight" / "...lora_B.weight" with the module named
// as transformers (4.52 and later) names it inside Qwen2_5_VLForConditionalGeneration:
// model.language_model.layers.N.self_attn.q_proj, model.visual.blocks.N.attn.qkv,
// model.visual.merger.mlp.0. Reading also takes the older model.layers.* / visual.* names.
// adapter_config.json: peft_type LORA, r, lora_alpha, lora_dropout, target_modules (the
// full module names adapted, so that PEFT adapts exactly those), bias "none",
// base_model_name_or_path (model.from, when there was one).
#pragma once

#include <torch/types.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dhp/models/qwen2_5_vl/config.h"
#include "dhp/models/qwen2_5_vl/lora.h"

namespace dhp::io {
class SafetensorsReader;
}

namespace dhp::qwen {

// "visual.blocks.0.attn.qkv" -> "model.visual.blocks.0.attn.qkv",
// "model.layers.0.self_attn.q_proj" -> "model.language_model.layers.0.self_attn.q_proj".
std::string peft_module_name(const std::string& dhp_module);

class PeftAdapter {
 public:
  // Reads DIR/adapter_config.json and opens DIR/adapter_model.safetensors; throws naming the
  // file when either is missing or malformed, or is not a LoRA adapter.
  explicit PeftAdapter(const std::string& dir);
  ~PeftAdapter();
  const std::string& dir() const { return dir_; }
  int64_t rank() const { return r_; }
  double alpha() const { return alpha_; }
  const std::vector<std::string>& target_modules() const { return targets_; }
  const std::string& base_model() const { return base_; }
  // dhp parameter names (canonical: model.layers.N...lora_A.weight), sorted.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const;
  std::vector<int64_t> shape(const std::string& name) const;
  torch::Tensor read_box(const std::string& name, const std::vector<int64_t>& offset,
                         const std::vector<int64_t>& shape) const;
  // Throws naming adapter_config.json when its r or lora_alpha differ from `spec`, or naming
  // the adapter file when it holds adapters of linears `spec` does not adapt (another
  // targets or modules setting) or misses some it does.
  void check_matches(const LoraSpec& spec, const ModelConfig& cfg) const;

 private:
  std::string dir_, file_, base_;
  int64_t r_ = 0;
  double alpha_ = 0;
  std::vector<std::string> targets_;
  std::map<std::string, std::string> keys_;  // dhp name -> key in the file
  std::unique_ptr<io::SafetensorsReader> reader_;
};

// Writes DIR/adapter_config.json and DIR/adapter_model.safetensors (atomically) from the
// adapters among `params` (full tensors by dhp name). `base_model`: model.from, or "".
void save_peft(const std::string& dir, const std::map<std::string, torch::Tensor>& params, const LoraSpec& spec,
               const ModelConfig& cfg, const std::string& base_model);

// In place: each adapted weight W becomes W + scale * B @ A (computed in fp32, stored in W's
// dtype) and the adapters are removed. Returns the number of weights merged. Throws when an
// adapter has no weight beside it.
int64_t merge_lora(std::map<std::string, torch::Tensor>& params, double scale);

}  // namespace dhp::qwen
