// LoRA on Qwen2.5-VL (the settings; torch-free, so that the planner counts with them): which
// linears get a low-rank adapter (nn::LinearImpl::add_lora, applied by qwen::apply_lora in
// model.h), named as Hugging Face and PEFT name them.
//
// Targets match a linear's name as PEFT's target_modules list does: the name itself or its
// last components ("q_proj" matches model.layers.3.self_attn.q_proj); a trailing ".*" matches
// any last component after that prefix ("mlp.*": the MLP's gate_proj, up_proj, down_proj, and
// the merger's mlp.0, mlp.2). Only the linears of the parts in `modules` are candidates:
//   vision  visual.blocks.<i>.attn.{qkv,proj}, visual.blocks.<i>.mlp.{gate,up,down}_proj
//   merger  visual.merger.mlp.{0,2}
//   text    model.layers.<i>.self_attn.{q,k,v,o}_proj, model.layers.<i>.mlp.{gate,up,down}_proj
// With LoRA on, every base parameter of those parts is frozen (Freezing::adapted) and only the
// adapters train there; the other parts follow model.*.freeze as usual.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dhp/models/qwen2_5_vl/config.h"

namespace dhp::qwen {

struct LoraSpec {
  int64_t rank = 0;    // 0: off
  double alpha = 16;   // scale = alpha / rank
  double dropout = 0;  // on each adapter's input, while training
  std::vector<std::string> targets;  // module names (see above)
  std::vector<std::string> modules;  // parts: vision, merger, text
  bool on() const { return rank > 0; }
  double scale() const { return alpha / static_cast<double>(rank); }
  // Does LoRA adapt linears of `part` (vision, merger, text)?
  bool adapts(const std::string& part) const {
    if (!on()) return false;
    for (const auto& m : modules)
      if (m == part) return true;
    return false;
  }
};

// A linear that can take an adapter: its Hugging Face module name (no ".weight"), its part,
// and its shape.
struct AdaptableLinear {
  std::string name;
  std::string part;  // vision, merger, text
  int64_t in = 0, out = 0;
};
// Every such linear of the architecture, in model order.
std::vector<AdaptableLinear> adaptable_linears(const ModelConfig& cfg);
// The linears `spec` adapts (none when off). Throws dhp::Error naming a target that matches
// nothing in spec.modules, with the names that do exist there.
std::vector<AdaptableLinear> adapted_linears(const ModelConfig& cfg, const LoraSpec& spec);
// Does `target` name the linear `name` (PEFT's rule, plus the ".*" form)?
bool lora_target_matches(const std::string& target, const std::string& name);
// Is `name` an adapter parameter (...lora_A.weight / ...lora_B.weight)?
bool is_lora_parameter(const std::string& name);
// Adapter parameters per module (rank x (in + out) per adapted linear).
ParamCount count_adapter_parameters(const ModelConfig& cfg, const LoraSpec& spec);

}  // namespace dhp::qwen
