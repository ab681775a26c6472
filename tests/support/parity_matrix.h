// The strategy parity matrix's layouts (tests/test_strategies.cpp trains each one against
// the single-process run; tests/test_transfers.cpp replays their schedules under NCCL's
// point-to-point rules): every supported vision x text strategy pair on 2 and 4 ranks, and
// the placements (unequal group sizes, disjoint and overlapping rank sets).
#pragma once

#include <cstdlib>
#include <ostream>
#include <string>
#include <vector>

#include "dhp/train/config.h"

namespace dhp::testing {

struct ParityCase {
  const char* name;
  int64_t world;
  std::vector<std::string> sets;  // parallel.* keys
};
// Test logs name the case instead of dumping its bytes.
inline void PrintTo(const ParityCase& c, std::ostream* os) { *os << c.name; }

inline std::vector<std::string> with(std::vector<std::string> sets, const std::string& extra) {
  sets.push_back(extra);
  return sets;
}

// Vision on rank 0 alone, text tp=2 on ranks 1-2; vision sp=2 on 0-1, text tp=2 on 2-3.
inline const std::vector<std::string> kVisionOneTextTp2 = {
    "parallel.strategy=custom", "parallel.vision.strategy=none", "parallel.vision.ranks=[0]",
    "parallel.text.strategy=tp", "parallel.text.ranks=[1,2]", "training.micro_batches=4"};
inline const std::vector<std::string> kSp2TextTp2Disjoint = {"parallel.strategy=dhp", "parallel.vision.ranks=[0,1]",
                                                      "parallel.text.ranks=[2,3]", "training.micro_batches=4"};

// Named combinations and custom pairs. Degrees left out are derived (see resolve_layouts).
inline const std::vector<ParityCase>& parity_matrix() {
  static const std::vector<ParityCase> cases = {
    // 2 ranks: the named combinations
    {"dhp_2", 2, {"parallel.strategy=dhp"}},
    {"tp_2", 2, {"parallel.strategy=tp"}},
    {"zero3_2", 2, {"parallel.strategy=zero3"}},
    {"dp_2", 2, {"parallel.strategy=dp"}},
    // 2 ranks: every other vision x text pair
    {"sp_zero3_2", 2, {"parallel.strategy=custom", "parallel.vision.strategy=sp", "parallel.text.strategy=zero3"}},
    {"sp_dp_2", 2, {"parallel.strategy=custom", "parallel.vision.strategy=sp", "parallel.text.strategy=dp"}},
    {"sp_zero0_tp_2", 2, {"parallel.strategy=dhp", "parallel.vision.zero=0"}},
    {"tp_zero3_2", 2, {"parallel.strategy=custom", "parallel.vision.strategy=tp", "parallel.text.strategy=zero3"}},
    {"tp_dp_2", 2, {"parallel.strategy=custom", "parallel.vision.strategy=tp", "parallel.text.strategy=dp"}},
    {"zero3_tp_2", 2, {"parallel.strategy=custom", "parallel.vision.strategy=zero3", "parallel.text.strategy=tp"}},
    {"zero3_dp_2", 2, {"parallel.strategy=custom", "parallel.vision.strategy=zero3", "parallel.text.strategy=dp"}},
    {"dp_tp_2", 2, {"parallel.strategy=custom", "parallel.vision.strategy=dp", "parallel.text.strategy=tp"}},
    {"dp_zero3_2", 2, {"parallel.strategy=custom", "parallel.vision.strategy=dp", "parallel.text.strategy=zero3"}},
    {"tp_zero1_2", 2, {"parallel.strategy=tp", "parallel.text.zero=1", "parallel.vision.zero=1"}},
    // 4 ranks
    {"dhp_4", 4, {"parallel.strategy=dhp"}},
    {"tp_4", 4, {"parallel.strategy=tp"}},
    {"zero3_4", 4, {"parallel.strategy=zero3"}},
    {"dp_4", 4, {"parallel.strategy=dp"}},
    {"sp4_tp2x2_4", 4, {"parallel.strategy=dhp", "parallel.text.tp=2"}},        // vision 1 replica, text 2
    {"sp2x2_tp2x2_4", 4, {"parallel.strategy=dhp", "parallel.vision.sp=2", "parallel.text.tp=2"}},
    {"dp4_tp2x2_4", 4, {"parallel.strategy=custom", "parallel.vision.strategy=dp", "parallel.text.strategy=tp",
                        "parallel.text.tp=2"}},
    {"tp2x2_zero3_4", 4, {"parallel.strategy=custom", "parallel.vision.strategy=tp", "parallel.vision.tp=2",
                          "parallel.text.strategy=zero3"}},
    {"zero3_tp4_4", 4, {"parallel.strategy=custom", "parallel.vision.strategy=zero3", "parallel.text.strategy=tp"}},
    {"sp4_dp_4", 4, {"parallel.strategy=custom", "parallel.vision.strategy=sp", "parallel.text.strategy=dp"}},
    {"tp4_zero3_4", 4, {"parallel.strategy=custom", "parallel.vision.strategy=tp", "parallel.text.strategy=zero3"}},
    // Replicas taking contiguous runs of samples instead of balancing by cost (the default)
    {"zero3_contiguous_4", 4, {"parallel.strategy=zero3", "parallel.balance=contiguous"}},
    {"dp4_tp2x2_contiguous_4", 4, {"parallel.strategy=custom", "parallel.vision.strategy=dp",
                                   "parallel.text.strategy=tp", "parallel.text.tp=2", "parallel.balance=contiguous"}},
    // Placement: unequal group sizes, disjoint and overlapping rank sets, 4 micro-batches.
    {"sp2_tp2x2_overlap_mb4_4", 4, {"parallel.strategy=dhp", "parallel.vision.ranks=[0,1]", "parallel.text.tp=2",
                                    "training.micro_batches=4"}},
    {"v1_tp2_disjoint_3", 3, kVisionOneTextTp2},
    {"v1_tp2_disjoint_seq_3", 3, with(kVisionOneTextTp2, "parallel.pipeline=false")},
    {"sp2_tp2_disjoint_4", 4, kSp2TextTp2Disjoint},
    {"sp2_tp2_disjoint_seq_4", 4, with(kSp2TextTp2Disjoint, "parallel.pipeline=false")},
    {"v1_dp3_disjoint_4", 4, {"parallel.strategy=custom", "parallel.vision.strategy=none", "parallel.vision.ranks=[0]",
                              "parallel.text.strategy=dp", "parallel.text.ranks=[1,2,3]"}},
    {"sp4_tp2_overlap_4", 4, {"parallel.strategy=dhp", "parallel.text.ranks=[2,3]"}},
    {"zero3_v2_tp2_disjoint_4", 4, {"parallel.strategy=custom", "parallel.vision.strategy=zero3",
                                    "parallel.vision.ranks=[2,3]", "parallel.text.strategy=tp",
                                    "parallel.text.ranks=[0,1]", "training.micro_batches=4"}},
};
  return cases;
}

// The matrix's config: demo widths with 8 query / 4 kv heads so text tp=4 divides them;
// images 56..168 px; then the row's keys.
// Fine-tuning rows (model.* freezing settings on top of a layout): each trains against the
// single-process run with the same settings, its frozen parameters bit-identical after
// training (tests/test_strategies.cpp).
struct FineTuneCase {
  const char* name;
  int64_t world;
  std::vector<std::string> layout;  // parallel.* keys
  std::vector<std::string> tuning;  // model.* fine-tuning keys
};
inline void PrintTo(const FineTuneCase& c, std::ostream* os) { *os << c.name; }

// The vision encoder frozen whole (no gradients go back: a forward-only vision group);
// the last blocks of each tower trainable (and the text embeddings, tied to lm_head, frozen).
inline const std::vector<std::string> kVisionFrozen = {"model.vision.freeze=true", "model.merger.freeze=true"};
inline const std::vector<std::string> kLastBlocks = {"model.vision.trainable_blocks=[-1]",
                                                     "model.text.trainable_layers=[-1]",
                                                     "model.text.freeze_embeddings=true", "model.text.freeze_lm_head=true"};

inline const std::vector<std::string> kLoraText = {
    "lora.rank=4", "lora.alpha=8", "lora.modules=[text]",
    "lora.targets=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]", "model.vision.freeze=true",
    "model.merger.freeze=true"};
inline const std::vector<std::string> kLoraVision = {"lora.rank=4", "lora.alpha=8", "lora.modules=[vision,merger]",
                                                     "lora.targets=[qkv,attn.proj,mlp.*]"};

inline const std::vector<FineTuneCase>& fine_tune_matrix() {
  static const std::vector<FineTuneCase> cases = {
    {"vision_frozen_dhp_2", 2, {"parallel.strategy=dhp"}, kVisionFrozen},
    {"vision_frozen_zero3_2", 2, {"parallel.strategy=zero3"}, kVisionFrozen},
    {"vision_frozen_tp_zero1_2", 2, {"parallel.strategy=tp", "parallel.text.zero=1", "parallel.vision.zero=1"},
     kVisionFrozen},
    {"vision_frozen_sp2_tp2_disjoint_4", 4, kSp2TextTp2Disjoint, kVisionFrozen},
    {"vision_frozen_v1_tp2_disjoint_seq_3", 3, with(kVisionOneTextTp2, "parallel.pipeline=false"), kVisionFrozen},
    {"last_blocks_dhp_2", 2, {"parallel.strategy=dhp"}, kLastBlocks},
    {"last_blocks_zero3_2", 2, {"parallel.strategy=zero3"}, kLastBlocks},
    {"last_blocks_tp_4", 4, {"parallel.strategy=tp"}, kLastBlocks},
    {"last_blocks_dp_2", 2, {"parallel.strategy=dp"}, kLastBlocks},
    {"merger_only_sp2_tp2_disjoint_4", 4, kSp2TextTp2Disjoint, {"model.vision.freeze=true", "model.text.freeze=true"}},
    // LoRA on the decoder (every linear, vision frozen) and on the vision tower (the text trains).
    {"lora_text_dhp_2", 2, {"parallel.strategy=dhp"}, kLoraText},
    {"lora_text_tp_4", 4, {"parallel.strategy=tp"}, kLoraText},
    {"lora_text_zero3_2", 2, {"parallel.strategy=zero3"}, kLoraText},
    {"lora_text_tp_zero1_2", 2, {"parallel.strategy=tp", "parallel.text.zero=1", "parallel.vision.zero=1"}, kLoraText},
    {"lora_vision_sp2_tp2_disjoint_4", 4, kSp2TextTp2Disjoint, kLoraVision},
    {"lora_vision_tp_2", 2, {"parallel.strategy=tp"}, kLoraVision},
    {"lora_vision_zero3_dp_2", 2, {"parallel.strategy=custom", "parallel.vision.strategy=zero3",
                                   "parallel.text.strategy=dp"}, kLoraVision},
  };
  return cases;
}

inline dhp::Config parity_config(const std::vector<std::string>& sets) {
  // Demo widths with 8 query / 4 kv heads so text tp=4 divides them; images 56..168 px.
  std::vector<std::string> base = {"data.batch_size=8", "training.micro_batches=2", "data.min_side=56",
                                   "data.max_side=168", "training.steps=10", "training.warmup_steps=1",
                                   "data.eval_samples=0", "model.text.num_heads=8", "model.text.num_kv_heads=4",
                                   "model.text.mrope_section=[2,3,3]", "parallel.timeout_s=60"};
  // DHP_TEST_DEVICE=cuda (bench/device/run.sh): every rank on cuda:0 over Gloo (NCCL refuses
  // two ranks on one GPU), so that one GPU runs the whole matrix.
  if (const char* d = std::getenv("DHP_TEST_DEVICE"); d && *d) {
    base.push_back(std::string("training.device=") + d);
    base.push_back("parallel.backend=gloo");
  }
  base.insert(base.end(), sets.begin(), sets.end());
  return dhp::load_config("", base);
}

}  // namespace dhp::testing
