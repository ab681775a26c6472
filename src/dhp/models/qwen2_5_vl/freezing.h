// Which parameters of Qwen2.5-VL train (fine-tuning controls): whole parts frozen
// (model.vision.freeze, model.merger.freeze, model.text.freeze), or only some blocks of a
// tower trainable (model.vision.trainable_blocks, model.text.trainable_layers), and the text
// embeddings and lm_head on their own. Torch-free (the planner counts with it).
//
// The parts, by Hugging Face parameter name:
//   vision   visual.patch_embed.*, visual.blocks.<i>.*     (model.vision.*)
//   merger   visual.merger.*                               (model.merger.freeze)
//   text     model.layers.<i>.*, model.norm.*              (model.text.*)
//            model.embed_tokens.*  (model.text.freeze_embeddings), lm_head.* (freeze_lm_head)
// Block lists: indexes of the blocks that train, the others frozen; a negative index counts
// from the end (-1 = the last block), so [-2, -1] is "the last two". A list also freezes the
// parts before the first block (the patch embedding); the text decoder's final norm, its
// embeddings and lm_head follow their own settings. Empty = every block trains.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dhp/models/qwen2_5_vl/config.h"

namespace dhp::qwen {

struct VisionFreezing {
  bool freeze = false;
  std::vector<int64_t> trainable_blocks;
  template <class V>
  void visit(V& v) {
    v.field("freeze", freeze, "fine-tuning: freeze the vision tower (patch embedding and blocks; not the merger)");
    v.field("trainable_blocks", trainable_blocks,
            "fine-tuning: only these ViT blocks train (negative = from the end: [-2, -1] is the last two); the "
            "patch embedding and the other blocks are frozen (empty = all train)");
  }
};

struct MergerFreezing {
  bool freeze = false;
  template <class V>
  void visit(V& v) {
    v.field("freeze", freeze, "fine-tuning: freeze the vision merger (the projector into the text width)");
  }
};

struct TextFreezing {
  bool freeze = false;
  std::vector<int64_t> trainable_layers;
  bool freeze_embeddings = false;
  bool freeze_lm_head = false;
  template <class V>
  void visit(V& v) {
    v.field("freeze", freeze, "fine-tuning: freeze the whole text decoder (layers, norm, embeddings, lm_head)");
    v.field("trainable_layers", trainable_layers,
            "fine-tuning: only these decoder layers train (negative = from the end); the others are frozen (empty = "
            "all train); the final norm, embeddings and lm_head follow their own settings");
    v.field("freeze_embeddings", freeze_embeddings, "fine-tuning: freeze model.embed_tokens");
    v.field("freeze_lm_head", freeze_lm_head,
            "fine-tuning: freeze lm_head (with tied embeddings it is embed_tokens: set both alike)");
  }
};

struct Freezing {
  VisionFreezing vision;
  MergerFreezing merger;
  TextFreezing text;
  // Parts whose base parameters LoRA freezes (lora.modules when lora.rank > 0; set by the
  // config, not a key of its own): there only the adapters (...lora_A/B.weight) train.
  std::vector<std::string> adapted;

  // Throws dhp::Error naming the key: block indexes out of range or repeated, a list beside
  // freeze=true, freeze_lm_head != freeze_embeddings with tied embeddings, nothing trainable.
  void validate(const ModelConfig& cfg) const;
  // Does the parameter `name` (Hugging Face name) train? Adapters always do; names of no
  // part never.
  bool trainable(const std::string& name, const ModelConfig& cfg) const;
  bool any() const;  // anything frozen at all (LoRA's frozen base included)
  // No parameter of the vision encoder (tower and merger) trains: no gradient goes back to it.
  bool encoder_frozen() const { return vision.freeze && merger.freeze; }
  // Every setting as "model.<part>.<key>" -> its YAML text (to compare two runs').
  std::vector<std::pair<std::string, std::string>> settings() const;
};

// Trainable base parameters per module (the same split as count_parameters), exact, from
// shapes; LoRA's adapters not included (count_adapter_parameters, lora.h).
ParamCount count_trainable(const ModelConfig& cfg, const Freezing& freezing);
// The part ("vision", "merger", "text") a parameter or module name belongs to; "" for none.
std::string part_of(const std::string& name);

}  // namespace dhp::qwen
