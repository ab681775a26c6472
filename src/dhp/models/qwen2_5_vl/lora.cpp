#include "dhp/models/qwen2_5_vl/lora.h"

#include <algorithm>
#include <set>

#include "dhp/core/error.h"

namespace dhp::qwen {
namespace {

// PEFT's rule: `name` is `suffix`, or ends with "." + suffix.
bool names_end_with(const std::string& name, const std::string& suffix) {
  if (name == suffix) return true;
  return name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0 &&
         name[name.size() - suffix.size() - 1] == '.';
}

// The short names a user can give for the linears of `parts`: each linear's last one or two
// components as it would write them (q_proj, attn.qkv, mlp.0, ...).
std::string names_there(const std::vector<AdaptableLinear>& linears, const std::set<std::string>& parts) {
  std::set<std::string> names;
  for (const auto& l : linears) {
    if (!parts.count(l.part)) continue;
    const auto last = l.name.rfind('.');
    const auto before = l.name.rfind('.', last - 1);
    const std::string tail = l.name.substr(last + 1);
    names.insert(tail == "0" || tail == "2" ? l.name.substr(before + 1) : tail);
  }
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

}  // namespace

std::vector<AdaptableLinear> adaptable_linears(const ModelConfig& cfg) {
  std::vector<AdaptableLinear> out;
  const auto& v = cfg.vision;
  const auto& t = cfg.text;
  const int64_t hv = v.hidden_size, iv = v.intermediate_size;
  for (int64_t b = 0; b < v.depth; ++b) {
    const std::string p = "visual.blocks." + std::to_string(b) + ".";
    out.push_back({p + "attn.qkv", "vision", hv, 3 * hv});
    out.push_back({p + "attn.proj", "vision", hv, hv});
    out.push_back({p + "mlp.gate_proj", "vision", hv, iv});
    out.push_back({p + "mlp.up_proj", "vision", hv, iv});
    out.push_back({p + "mlp.down_proj", "vision", iv, hv});
  }
  const int64_t merged = hv * v.spatial_merge_size * v.spatial_merge_size;
  out.push_back({"visual.merger.mlp.0", "merger", merged, merged});
  out.push_back({"visual.merger.mlp.2", "merger", merged, v.out_hidden_size});
  const int64_t h = t.hidden_size, kv = t.num_kv_heads * t.head_dim(), it = t.intermediate_size;
  for (int64_t l = 0; l < t.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    out.push_back({p + "self_attn.q_proj", "text", h, h});
    out.push_back({p + "self_attn.k_proj", "text", h, kv});
    out.push_back({p + "self_attn.v_proj", "text", h, kv});
    out.push_back({p + "self_attn.o_proj", "text", h, h});
    out.push_back({p + "mlp.gate_proj", "text", h, it});
    out.push_back({p + "mlp.up_proj", "text", h, it});
    out.push_back({p + "mlp.down_proj", "text", it, h});
  }
  return out;
}

bool lora_target_matches(const std::string& target, const std::string& name) {
  if (target.size() > 2 && target.compare(target.size() - 2, 2, ".*") == 0) {
    const auto dot = name.rfind('.');
    return dot != std::string::npos && names_end_with(name.substr(0, dot), target.substr(0, target.size() - 2));
  }
  return names_end_with(name, target);
}

bool is_lora_parameter(const std::string& name) {
  return names_end_with(name, "lora_A.weight") || names_end_with(name, "lora_B.weight");
}

std::vector<AdaptableLinear> adapted_linears(const ModelConfig& cfg, const LoraSpec& spec) {
  if (!spec.on()) return {};
  const std::set<std::string> parts(spec.modules.begin(), spec.modules.end());
  const auto all = adaptable_linears(cfg);
  std::vector<AdaptableLinear> out;
  for (const auto& target : spec.targets) {
    bool any = false;
    for (const auto& l : all) any = any || (parts.count(l.part) && lora_target_matches(target, l.name));
    std::string modules;
    for (const auto& m : spec.modules) modules += (modules.empty() ? "" : ", ") + m;
    DHP_CHECK(any, "lora.targets: '", target, "' names no linear of lora.modules [", modules, "]; the names there: ",
              names_there(all, parts));
  }
  for (const auto& l : all) {
    if (!spec.adapts(l.part)) continue;
    for (const auto& target : spec.targets) {
      if (lora_target_matches(target, l.name)) {
        out.push_back(l);
        break;
      }
    }
  }
  return out;
}

ParamCount count_adapter_parameters(const ModelConfig& cfg, const LoraSpec& spec) {
  ParamCount n;
  for (const auto& l : adapted_linears(cfg, spec)) (l.part == "text" ? n.text : n.vision) += spec.rank * (l.in + l.out);
  return n;
}

}  // namespace dhp::qwen
