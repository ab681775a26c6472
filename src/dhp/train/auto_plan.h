// parallel.strategy: auto: the planner (docs/cost_model.md) picks the layout for the machine
// the job runs on, from its calibration (dhp plan --calibrate --ranks N), the model and the
// data of the config, and says why.
#pragma once

#include <string>
#include <vector>

#include "dhp/plan/cost_model.h"
#include "dhp/train/config.h"

namespace dhp::train {

// The config with parallel.strategy=auto replaced by the fastest predicted layout that
// fits on `world` ranks of this machine, and training.micro_batches by that layout's
// fastest count that fits (auto_micro_batches; unchanged for any other strategy). Deterministic
// for a given calibration file, so every rank of a job makes the same choice. `why` gets a
// few lines: the choice, its predicted step time and memory, the runners-up, and how many
// plans were rejected and for what. Throws when the calibration file is missing (naming
// the command that makes it) or no plan fits.
Config resolve_auto(const Config& cfg, int64_t world, std::string* why = nullptr);

// The micro-batch counts auto considers: the powers of two dividing data.batch_size and
// the configured training.micro_batches; under packing (data.pack_tokens, where the count
// sets the global batch) the configured one only.
std::vector<int64_t> auto_micro_batches(const Config& cfg);

// "1 micro-batch", "4 micro-batches": how auto's choice is spelled in its log and in dhp bench.
std::string micro_batches_phrase(int64_t micro_batches);

// The --set KEY=VALUE overrides that give a config the parallel section of `cfg` (every
// parallel.strategy and parallel.<module>.* key but timeout_s and pipeline) and its
// training.micro_batches: how the launcher hands the layout it chose for auto to its
// workers.
std::vector<std::string> pinned_parallel_sets(const Config& cfg);

// The calibration file resolve_auto reads for `world` ranks.
std::string auto_calibration_path(int64_t world);

// Mean text tokens (besides the image's) and answer tokens of the shapes task's samples.
std::pair<int64_t, int64_t> shapes_text_tokens(const Config& cfg);

// Frames per clip of the config's data: the moving task's data.frames, 0 (images) otherwise.
int64_t clip_frames(const Config& cfg);

// What the runtime configured by `cfg` does that the cost model needs: dhp's CPU attention
// block (on a cluster that runs it, attention_block > 0) and whether every rank draws its
// samples inside the step (the shapes task), and its gradient buckets (size, how many in flight).
void apply_runtime(const Config& cfg, plan::Cluster& c, plan::Workload& w);

}  // namespace dhp::train
