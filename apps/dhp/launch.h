// Multi-process jobs for `dhp train`.
//
// Launcher (`--nproc N`, no rank in the environment): starts N copies of this binary with
// torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT; a free port on 127.0.0.1 unless MASTER_PORT is set), waits for them, and
// when one fails (non-zero exit or signal) stops the others (SIGTERM, then SIGKILL after a
// grace period), prints which rank failed with its error, and returns non-zero, or, with
// --max-restarts K, restarts the whole job from the newest complete checkpoint up to K
// times. SIGINT or SIGTERM to the launcher stops every worker (and is never restarted).
//
// Worker: the environment of torchrun (--no-python), srun (SLURM_PROCID, SLURM_NTASKS,
// SLURM_LOCALID) or mpirun (OMPI_COMM_WORLD_*, PMI_RANK/PMI_SIZE) names this process's
// rank; it meets the others through a TCP store at MASTER_ADDR:MASTER_PORT
// (default 127.0.0.1:29500).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dhp::launch {

struct WorkerEnv {
  int64_t rank = 0, world = 1, local_rank = 0, local_world = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string launcher;  // "torchrun", "srun", "mpirun", "dhp"
};

// The rank this process was started as, if the environment names one.
std::optional<WorkerEnv> worker_env();

// Starts `nproc` workers running argv (this binary, same arguments) and supervises them.
// When a worker fails and fewer than `max_restarts` restarts were made, stops the others
// and starts all of them again with checkpoint.resume=auto (DHP_RESTART counts the
// restarts in their environment). Returns the process exit code for the launcher.
int run_workers(int64_t nproc, const std::vector<std::string>& argv, int64_t max_restarts = 0);

// Workers write their final error here (path in DHP_ERROR_FILE, set by the launcher) so
// that the launcher can report it.
void report_worker_error(const std::string& message);

}  // namespace dhp::launch
