#include "dhp/models/qwen2_5_vl/freezing.h"

#include <algorithm>
#include <set>

#include "dhp/core/error.h"
#include "dhp/core/options.h"
#include "dhp/models/qwen2_5_vl/lora.h"

namespace dhp::qwen {
namespace {

// Index i of a list of `count` blocks, negative from the end; -1 when out of range.
int64_t block_index(int64_t i, int64_t count) {
  const int64_t k = i < 0 ? count + i : i;
  return k >= 0 && k < count ? k : -1;
}

void check_blocks(const std::vector<int64_t>& list, int64_t count, const char* key, bool frozen_whole,
                  const char* freeze_key) {
  if (list.empty()) return;
  DHP_CHECK(!frozen_whole, key, " lists trainable blocks but ", freeze_key,
            "=true freezes all of them; set one of the two");
  std::set<int64_t> seen;
  for (int64_t i : list) {
    const int64_t k = block_index(i, count);
    DHP_CHECK(k >= 0, key, " holds ", i, ", out of range for ", count, " blocks (0..", count - 1, ", or -", count,
              "..-1 from the end)");
    DHP_CHECK(seen.insert(k).second, key, " names block ", k, " twice (", i, ")");
  }
}

// "<prefix><i>." at the start of name -> i; -1 otherwise.
int64_t numbered(const std::string& name, const std::string& prefix) {
  if (name.compare(0, prefix.size(), prefix) != 0) return -1;
  const auto dot = name.find('.', prefix.size());
  if (dot == std::string::npos || dot == prefix.size()) return -1;
  int64_t i = 0;
  for (size_t c = prefix.size(); c < dot; ++c) {
    if (name[c] < '0' || name[c] > '9') return -1;
    i = i * 10 + (name[c] - '0');
  }
  return i;
}

bool listed(const std::vector<int64_t>& list, int64_t block, int64_t count) {
  if (list.empty()) return true;
  for (int64_t i : list)
    if (block_index(i, count) == block) return true;
  return false;
}

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// Collects "model.<part>.<key>" -> YAML text of every field.
struct SettingsCollector {
  std::string prefix;
  std::vector<std::pair<std::string, std::string>>& out;
  template <class T>
  void field(const char* name, const T& member, const char*) {
    out.emplace_back(prefix + name, detail::to_yaml_text(member));
  }
};

}  // namespace

void Freezing::validate(const ModelConfig& cfg) const {
  check_blocks(vision.trainable_blocks, cfg.vision.depth, "model.vision.trainable_blocks", vision.freeze,
               "model.vision.freeze");
  check_blocks(text.trainable_layers, cfg.text.num_layers, "model.text.trainable_layers", text.freeze,
               "model.text.freeze");
  DHP_CHECK(!cfg.text.tie_word_embeddings || text.freeze_lm_head == text.freeze_embeddings,
            "model.text.freeze_lm_head=", text.freeze_lm_head ? "true" : "false",
            " but model.text.freeze_embeddings=", text.freeze_embeddings ? "true" : "false",
            ": with tied embeddings (model.text.tie_word_embeddings) lm_head is embed_tokens; set both alike");
  const auto n = count_trainable(cfg, *this);
  DHP_CHECK(n.total() > 0 || !adapted.empty(), "model.vision.freeze, model.merger.freeze and model.text.* freeze every ",
            "parameter: nothing would train");
}

std::string part_of(const std::string& name) {
  if (starts_with(name, "visual.merger.")) return "merger";
  if (starts_with(name, "visual.")) return "vision";
  if (starts_with(name, "model.") || starts_with(name, "lm_head.") || name == "lm_head") return "text";
  return "";
}

bool Freezing::trainable(const std::string& name, const ModelConfig& cfg) const {
  if (is_lora_parameter(name)) return true;
  if (std::find(adapted.begin(), adapted.end(), part_of(name)) != adapted.end()) return false;
  if (starts_with(name, "visual.merger.")) return !merger.freeze;
  if (starts_with(name, "visual.")) {
    if (vision.freeze) return false;
    const int64_t b = numbered(name, "visual.blocks.");
    return b >= 0 ? listed(vision.trainable_blocks, b, cfg.vision.depth) : vision.trainable_blocks.empty();
  }
  if (starts_with(name, "model.") || starts_with(name, "lm_head.")) {
    if (text.freeze) return false;
    if (starts_with(name, "model.embed_tokens.")) return !text.freeze_embeddings;
    if (starts_with(name, "lm_head.")) return !text.freeze_lm_head;
    const int64_t l = numbered(name, "model.layers.");
    return l < 0 || listed(text.trainable_layers, l, cfg.text.num_layers);
  }
  return false;
}

bool Freezing::any() const {
  return !adapted.empty() || vision.freeze || !vision.trainable_blocks.empty() || merger.freeze || text.freeze ||
         !text.trainable_layers.empty() || text.freeze_embeddings || text.freeze_lm_head;
}

std::vector<std::pair<std::string, std::string>> Freezing::settings() const {
  std::vector<std::pair<std::string, std::string>> out;
  SettingsCollector v{"model.vision.", out}, m{"model.merger.", out}, t{"model.text.", out};
  // visit() is the config's two-way walk (it may write): it walks copies here.
  auto vision_copy = vision;
  auto merger_copy = merger;
  auto text_copy = text;
  vision_copy.visit(v);
  merger_copy.visit(m);
  text_copy.visit(t);
  return out;
}

ParamCount count_trainable(const ModelConfig& cfg, const Freezing& f) {
  const auto s = parameter_sizes(cfg);
  ParamCount n;
  auto adapted = [&](const char* part) { return std::find(f.adapted.begin(), f.adapted.end(), part) != f.adapted.end(); };
  if (!f.vision.freeze && !adapted("vision")) {
    const int64_t blocks = f.vision.trainable_blocks.empty() ? cfg.vision.depth
                                                             : static_cast<int64_t>(f.vision.trainable_blocks.size());
    n.vision += blocks * s.vision_block + (f.vision.trainable_blocks.empty() ? s.patch_embed : 0);
  }
  if (!f.merger.freeze && !adapted("merger")) n.vision += s.merger;
  if (!f.text.freeze && !adapted("text")) {
    const int64_t layers = f.text.trainable_layers.empty() ? cfg.text.num_layers
                                                           : static_cast<int64_t>(f.text.trainable_layers.size());
    n.text += layers * s.text_layer + s.norm;
    if (!f.text.freeze_embeddings) n.text += s.embed_tokens;
    if (!f.text.freeze_lm_head) n.text += s.lm_head;
  }
  return n;
}

}  // namespace dhp::qwen
