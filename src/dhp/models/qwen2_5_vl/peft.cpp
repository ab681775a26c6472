#include "dhp/models/qwen2_5_vl/peft.h"

#include <torch/torch.h>

#include <filesystem>
#include <set>

#include "dhp/core/error.h"
#include "dhp/io/files.h"
#include "dhp/io/json.h"
#include "dhp/io/safetensors.h"
#include "dhp/models/qwen2_5_vl/hf.h"

namespace dhp::qwen {
namespace fs = std::filesystem;
using io::Json;

namespace {

const std::string kPrefix = "base_model.model.";
const char* kSuffixes[] = {".lora_A.weight", ".lora_B.weight"};

// "x.lora_A.weight" -> "x" (the module), "" when `name` is no adapter.
std::string module_of(const std::string& name) {
  for (const char* s : kSuffixes) {
    const std::string suffix(s);
    if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
      return name.substr(0, name.size() - suffix.size());
  }
  return "";
}

}  // namespace

std::string peft_module_name(const std::string& m) {
  if (m.rfind("visual.", 0) == 0) return "model." + m;
  if (m.rfind("model.", 0) == 0) return "model.language_model." + m.substr(6);
  return m;
}

PeftAdapter::~PeftAdapter() = default;

PeftAdapter::PeftAdapter(const std::string& dir) : dir_(dir) {
  const auto cfg_path = (fs::path(dir) / "adapter_config.json").string();
  file_ = (fs::path(dir) / "adapter_model.safetensors").string();
  DHP_CHECK(fs::is_directory(dir), "PEFT adapter directory ", dir, " does not exist");
  DHP_CHECK(fs::exists(cfg_path), cfg_path, " does not exist: ", dir, " is not a PEFT adapter directory");
  const auto j = Json::parse(io::read_file(cfg_path), cfg_path);
  if (const auto* t = j.find("peft_type"); t && !t->is_null()) {
    DHP_CHECK(t->str(cfg_path + " peft_type") == "LORA", cfg_path, ": peft_type is ", t->str(), ", not LORA");
  }
  r_ = j.at("r", cfg_path).integer(cfg_path + " r");
  alpha_ = j.at("lora_alpha", cfg_path).number(cfg_path + " lora_alpha");
  if (const auto* b = j.find("base_model_name_or_path"); b && b->is_string()) base_ = b->str();
  if (const auto* t = j.find("target_modules"); t && t->is_array()) {
    for (const auto& e : t->elements(cfg_path + " target_modules")) targets_.push_back(e.str(cfg_path + " target_modules"));
  }
  DHP_CHECK(fs::exists(file_), file_, " does not exist (the adapter weights of ", dir, ")");
  reader_ = std::make_unique<io::SafetensorsReader>(file_);
  for (const auto& t : reader_->tensors()) {
    std::string key = t.name;
    DHP_CHECK(key.rfind(kPrefix, 0) == 0 && !module_of(key).empty(), file_, ": tensor ", key,
              " is not a LoRA adapter of a base model (base_model.model.<module>.lora_A/B.weight)");
    const std::string name = canonical_name(key.substr(kPrefix.size()));
    DHP_CHECK(keys_.emplace(name, key).second, file_, ": adapter ", name, " appears twice");
  }
}

std::vector<std::string> PeftAdapter::names() const {
  std::vector<std::string> out;
  for (const auto& [n, k] : keys_) out.push_back(n);
  return out;
}

bool PeftAdapter::contains(const std::string& name) const { return keys_.count(name) > 0; }

std::vector<int64_t> PeftAdapter::shape(const std::string& name) const {
  return reader_->info(keys_.at(name)).shape;
}

torch::Tensor PeftAdapter::read_box(const std::string& name, const std::vector<int64_t>& offset,
                                    const std::vector<int64_t>& shape) const {
  return reader_->read_box(keys_.at(name), offset, shape);
}

void PeftAdapter::check_matches(const LoraSpec& spec, const ModelConfig& cfg) const {
  const auto cfg_path = (fs::path(dir_) / "adapter_config.json").string();
  DHP_CHECK(r_ == spec.rank, cfg_path, ": r is ", r_, " but lora.rank is ", spec.rank, "; set lora.rank=", r_);
  DHP_CHECK(alpha_ == spec.alpha, cfg_path, ": lora_alpha is ", alpha_, " but lora.alpha is ", spec.alpha,
            "; set lora.alpha=", alpha_);
  std::set<std::string> want;
  for (const auto& l : adapted_linears(cfg, spec)) {
    want.insert(l.name);
    for (const char* s : kSuffixes) {
      const std::string n = l.name + s;
      DHP_CHECK(contains(n), file_, " has no adapter ", n, " that lora.targets and lora.modules ask for (trained with ",
                "other targets? its target_modules: ", targets_.size(), " names in adapter_config.json)");
      const auto have = shape(n);
      const std::vector<int64_t> need =
          s == std::string(".lora_A.weight") ? std::vector<int64_t>{spec.rank, l.in} : std::vector<int64_t>{l.out, spec.rank};
      DHP_CHECK(have == need, file_, ": adapter ", n, " has shape ", c10::IntArrayRef(have), ", this model needs ",
                c10::IntArrayRef(need), " (an adapter of another base model?)");
    }
  }
  for (const auto& [name, key] : keys_) {
    DHP_CHECK(want.count(module_of(name)), file_, " holds an adapter of ", module_of(name),
              ", which lora.targets and lora.modules do not adapt (trained with other targets, or on another model)");
  }
}

void save_peft(const std::string& dir, const std::map<std::string, torch::Tensor>& params, const LoraSpec& spec,
               const ModelConfig& cfg, const std::string& base_model) {
  fs::create_directories(dir);
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  Json targets = Json::array();
  for (const auto& l : adapted_linears(cfg, spec)) {
    targets.push(Json(peft_module_name(l.name)));
    for (const char* s : kSuffixes) {
      const std::string n = l.name + s;
      auto it = params.find(n);
      DHP_CHECK(it != params.end(), "PEFT export: no adapter ", n, " among the trained parameters");
      tensors.emplace_back(kPrefix + peft_module_name(l.name) + s, it->second.detach().cpu().contiguous());
    }
  }
  DHP_CHECK(!tensors.empty(), "PEFT export: the model has no LoRA adapters (lora.rank is 0)");
  Json c = Json::object();
  c.set("peft_type", Json(std::string("LORA")));
  c.set("task_type", Json(std::string("CAUSAL_LM")));
  c.set("base_model_name_or_path", base_model.empty() ? Json() : Json(base_model));
  c.set("r", Json(spec.rank));
  c.set("lora_alpha", Json(spec.alpha));
  c.set("lora_dropout", Json(spec.dropout));
  c.set("target_modules", targets);
  c.set("bias", Json(std::string("none")));
  c.set("fan_in_fan_out", Json(false));
  c.set("inference_mode", Json(true));
  c.set("use_rslora", Json(false));
  c.set("use_dora", Json(false));
  c.set("modules_to_save", Json());
  io::write_safetensors((fs::path(dir) / "adapter_model.safetensors").string(), tensors, {{"format", "pt"}});
  io::write_file_atomic((fs::path(dir) / "adapter_config.json").string(), c.dump(2) + "\n");
}

int64_t merge_lora(std::map<std::string, torch::Tensor>& params, double scale) {
  torch::NoGradGuard no_grad;
  std::vector<std::string> modules;
  const std::string a_suffix = kSuffixes[0];
  for (const auto& [name, t] : params) {
    if (name.size() > a_suffix.size() && name.compare(name.size() - a_suffix.size(), a_suffix.size(), a_suffix) == 0)
      modules.push_back(module_of(name));
  }
  for (const auto& m : modules) {
    const auto a = params.find(m + ".lora_A.weight"), b = params.find(m + ".lora_B.weight");
    const auto w = params.find(m + ".weight");
    DHP_CHECK(b != params.end() && w != params.end(), "merging LoRA: ", m, " has an adapter but no ",
              b == params.end() ? "lora_B" : "weight");
    auto merged = w->second.to(torch::kFloat32) +
                  torch::matmul(b->second.to(torch::kFloat32), a->second.to(torch::kFloat32)) * scale;
    w->second = merged.to(w->second.scalar_type());
    params.erase(a);
    params.erase(b);
  }
  return static_cast<int64_t>(modules.size());
}

}  // namespace dhp::qwen
