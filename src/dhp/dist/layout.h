// ModuleLayout: which global ranks one module (vision tower, text decoder, or any other
// stage of a model) runs on, its strategy and its parallel degrees. A value, validated once
// with the numbers in the message; rank arithmetic (coordinates, the members of each
// sub-group) is pure and local. Nothing here knows a model: validation takes the few
// numbers a layout must divide (ModuleDims), which the model provides.
//
// Order of the degrees inside the module's rank list: tp varies fastest, then sp, then dp.
// Module rank i (the i-th entry of `ranks`) has
//   tp_rank = i % tp,  sp_rank = (i / tp) % sp,  dp_rank = i / (tp * sp).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace dhp::dist {

// How one module is parallelized. Parsed once from the config (parse_strategy); past that
// point code holds this value and never compares names.
enum class Strategy {
  kNone,              // "none": one process, the whole module
  kDataParallel,      // "dp": whole replicas, gradients summed (optionally ZeRO-1)
  kSequenceParallel,  // "sp": Ulysses over the sequence (x dp), ZeRO-1 by default
  kTensorParallel,    // "tp": Megatron tensor parallelism (x dp)
  kZero3,             // "zero3": fully sharded data parallelism
};
// The config's name: none, dp, sp, tp, zero3.
const char* strategy_name(Strategy s);
// `value` as a strategy among `allowed`; throws dhp::Error naming `key`, the value and the
// valid names.
Strategy parse_strategy(const std::string& value, const std::string& key, const std::vector<Strategy>& allowed);
// Every strategy: none, sp, tp, zero3, dp.
const std::vector<Strategy>& all_strategies();

// The numbers of one module that its degrees must divide; the model provides them
// (e.g. qwen::vision_dims). `name` appears in every message.
struct ModuleDims {
  std::string name;                                        // "vision", "text"
  std::vector<Strategy> strategies;                        // those the module supports
  std::vector<std::pair<std::string, int64_t>> sp_divides;  // e.g. {"vision num_heads", 16}
  std::vector<std::pair<std::string, int64_t>> tp_divides;  // e.g. {"vocab_size", 151936}
};

struct ModuleLayout {
  std::string name = "text";             // the module: messages, group names, metrics
  Strategy strategy = Strategy::kNone;
  std::vector<int64_t> ranks;            // global ranks of the module, in module-rank order
  int64_t dp = 1;                        // data-parallel replicas
  int64_t sp = 1;                        // sequence-parallel (Ulysses) degree
  int64_t tp = 1;                        // tensor-parallel degree
  int64_t zero = 0;                      // ZeRO stage: 0, 1 (optimizer state sharded over dp*sp) or 3

  int64_t size() const { return static_cast<int64_t>(ranks.size()); }
  // Throws dhp::Error naming the module, the bad value and the numbers it must fit.
  void validate(const ModuleDims& dims, int64_t world_size) const;

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
