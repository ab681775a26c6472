// Multi-process jobs for `dhp train` and `dhp forward`.
//
// Launcher (`--nproc N`, no rank in the environment): starts N copies of this binary with
// torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
// MASTER_ADDR, MASTER_PORT) and a store file of their attempt (DHP_STORE_FILE: on one host
// nothing listens on a socket but Gloo's pairs on 127.0.0.1), waits for them, and when one fails (non-zero exit or signal) stops the others
// (SIGTERM, then SIGKILL after a grace period), prints which rank failed with its error, and
// returns non-zero, or, with --max-restarts K, restarts the whole job from the newest complete
// checkpoint up to K times. SIGINT or SIGTERM to the launcher stops every worker (and is never
// restarted).
//
// Several hosts (`--nnodes M --node-rank R --master-addr A`): one launcher per host; node 0's
// hosts the job's TCPStore on A:--master-port, as torchrun's agent does
// (TORCHELASTIC_USE_AGENT_STORE=True: every worker connects as a client, under the keys of
// its attempt), the others connect to it, check that every node runs
// the same --nproc and that no node rank is taken twice, and start ranks R*N .. R*N+N-1. A
// failure on one host is posted to the store: the launchers of the other hosts stop their
// workers and name the rank, its host and its error.
//
// Workers: see dist/launcher_env.h for the environments of torchrun, srun and mpirun.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

namespace dhp::launch {

// The hosts of a job started by dhp's own launcher (--nnodes, --node-rank, --master-addr,
// --master-port).
struct Nodes {
  int64_t count = 1;
  int64_t rank = 0;
  std::string master_addr;  // "" = 127.0.0.1 (one host only)
  int master_port = 0;      // 0 = MASTER_PORT, else a free port (one host) or 29500 (several)
};

// Starts `nproc` workers running argv (this binary, same arguments) and supervises them.
// When a worker fails and fewer than `max_restarts` restarts were made, stops the others
// and starts all of them again with checkpoint.resume=auto (DHP_RESTART counts the
// restarts in their environment). `timeout`: how long the launchers of several hosts wait
// for each other. Returns the process exit code for the launcher.
int run_workers(int64_t nproc, const std::vector<std::string>& argv, int64_t max_restarts = 0, const Nodes& nodes = {},
                std::chrono::milliseconds timeout = std::chrono::minutes(5));

// This machine's host name (gethostname), for messages that name a host.
std::string host_name();

// Workers write their final error here (path in DHP_ERROR_FILE, set by the launcher) so
// that the launcher can report it. `lost_peer`: the error is a broken connection to another
// rank (a consequence of a failure elsewhere, not its cause).
void report_worker_error(const std::string& message, bool lost_peer = false);
// report_worker_error for an exception: a dist::CommError is a lost peer.
void report_worker_error(const std::exception& e);

}  // namespace dhp::launch
