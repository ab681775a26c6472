// The job's module layouts from the config: every module of the model (qwen::module_names():
// the vision encoder, then the text decoder) with its strategy, ranks and degrees,
// resolved from parallel.strategy (a named combination), parallel.<module>.* overrides and
// the number of ranks, and validated against the model and the data.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dhp/dist/layout.h"
#include "dhp/train/config.h"

namespace dhp::train {

// Every module's layout, in the model's module order: encoders first, the decoder (which
// takes their output rows and computes the loss) last.
struct Layouts {
  std::vector<dist::ModuleLayout> modules;
  const dist::ModuleLayout& decoder() const { return modules.back(); }
  // The layout of the module named `name`; throws dhp::Error listing the names.
  const dist::ModuleLayout& at(const std::string& name) const;
  // The most data-parallel replicas of any module.
  int64_t max_dp() const;
};

// The layouts of `cfg` on `world` ranks, validated (strategy names, rank lists inside the
// world and covering it, degrees that multiply to each module's ranks, heads / kv heads /
// vocabulary / MLP widths divisible, enough attention windows per micro-batch for sp).
// Throws dhp::Error naming the parallel.* keys and the numbers. parallel.strategy=auto must
// be resolved first (resolve_auto, auto_plan.h).
Layouts resolve_layouts(const Config& cfg, int64_t world);
// One line, e.g. "vision sp sp=4 zero=1 | text tp tp=2 dp=2" (each module's ranks added when they differ).
std::string describe(const Layouts& l);

}  // namespace dhp::train
