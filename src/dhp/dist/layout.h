// ModuleLayout: which global ranks one module (vision tower or text decoder) runs on, and
// its parallel degrees. A value, validated once with the numbers in the message; rank
// arithmetic (coordinates, the members of each sub-group) is pure and local.
//
// Order of the degrees inside the module's rank list: tp varies fastest, then sp, then dp.
// Module rank i (the i-th entry of `ranks`) has
//   tp_rank = i % tp,  sp_rank = (i / tp) % sp,  dp_rank = i / (tp * sp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dhp/models/qwen2_5_vl/config.h"

namespace dhp::dist {

enum class ModuleKind { kVision, kText };

struct ModuleLayout {
  ModuleKind kind = ModuleKind::kText;
  std::string strategy = "none";  // vision: none, sp, tp, zero3, dp; text: none, tp, zero3, dp
  std::vector<int64_t> ranks;     // global ranks of the module, in module-rank order
  int64_t dp = 1;                 // data-parallel replicas
  int64_t sp = 1;                 // sequence-parallel (Ulysses) degree
  int64_t tp = 1;                 // tensor-parallel degree
  int64_t zero = 0;               // ZeRO stage: 0, 1 (optimizer state sharded over dp*sp) or 3

  int64_t size() const { return static_cast<int64_t>(ranks.size()); }
  const char* name() const { return kind == ModuleKind::kVision ? "vision" : "text"; }
  // Throws dhp::Error naming the module, the bad value and the numbers it must fit.
  void validate(const qwen::ModelConfig& model, int64_t world_size) const;

  // Position of `global_rank` in `ranks`, or -1 when the module does not run there.
  int64_t module_rank(int64_t global_rank) const;
  struct Coord {
    int64_t tp = 0, sp = 0, dp = 0;
  };
  Coord coord(int64_t module_rank) const;
  // Global ranks of the sub-groups that contain `module_rank`, in sub-group rank order.
  std::vector<int64_t> tp_group(int64_t module_rank) const;
  std::vector<int64_t> sp_group(int64_t module_rank) const;
  std::vector<int64_t> dp_group(int64_t module_rank) const;
  // The sp x dp ranks that share `module_rank`'s tp coordinate: where replicated
  // parameters' gradients are summed and ZeRO shards optimizer state.
  std::vector<int64_t> data_group(int64_t module_rank) const;
};

// 0..n-1.
std::vector<int64_t> iota_ranks(int64_t n);

}  // namespace dhp::dist
