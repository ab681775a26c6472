// Checkpoint management for a training job: saving the whole training state (every rank's
// pieces, rank 0's RNG state and the metadata) as one committed step-N directory, loading
// it back under any layout, and checkpoint.resume's choice of what to load. Collective over
// the job; errors on any rank reach every rank, and nothing already committed is lost.
// The file format: io/checkpoint_store.h and docs/checkpoint_format.md.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "dhp/train/config.h"
#include "dhp/train/parallel_model.h"

namespace dhp::train {

// Where a loaded checkpoint leaves the job.
struct Restored {
  int64_t step = 0;          // optimizer steps taken
  int64_t samples_seen = 0;  // the data stream's next position
};

// Writes the training state as checkpoint_root(cfg)/step-<step> and keeps the newest
// checkpoint.keep. `samples_seen`: the data stream's next position. Throws on every rank
// when any rank fails to write; the previous checkpoints stay. Returns the directory.
std::string save_checkpoint(ParallelModel& model, const Config& cfg, int64_t step, int64_t samples_seen);
// Restores parameters, optimizer state, step counts and rank 0's RNG from `dir`, saved
// under any layout. Throws naming the file on a missing, truncated or corrupted one.
Restored load_checkpoint(ParallelModel& model, const std::string& dir);
// checkpoint.resume: nothing (empty), a directory, or (auto) the newest usable checkpoint
// under checkpoint_root(cfg), falling back to older ones when one is unusable. Rank 0's
// listing decides so that every rank tries the same. Empty when nothing was loaded.
std::optional<Restored> resume(ParallelModel& model, const Config& cfg);
// A job spanning hosts (rt.local_world < rt.world) that saves or resumes checkpoints needs a
// checkpoint directory every host sees: the first rank of each host writes a file there,
// each reads the others', and all ranks throw dhp::Error naming a host that cannot see
// another's file. Collective over the job (through rt.store); nothing on one host.
void check_shared_checkpoint_dir(const Config& cfg, const Runtime& rt);

}  // namespace dhp::train
