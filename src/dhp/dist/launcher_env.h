// What the launcher that started this process says about the job: this rank, the world,
// the ranks on this host, and where the job's store is. Torch-free; reads the environment
// through a lookup so that tests can hand it any launcher's variables.
//
//   torchrun   RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (the node),
//              MASTER_ADDR, MASTER_PORT; TORCHELASTIC_USE_AGENT_STORE=True when the agent on
//              node 0 hosts the store (static rendezvous): then every rank, rank 0 too,
//              connects as a client, under the keys of attempt TORCHELASTIC_RESTART_COUNT.
//   dhp        the same variables, set by `dhp train --nproc/--nnodes` (DHP_LAUNCHED=1).
//   srun       SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, the tasks on this
//              node from SLURM_NTASKS_PER_NODE or SLURM_STEP_TASKS_PER_NODE ("2(x3),1");
//              MASTER_ADDR defaults to the first host of SLURM_STEP_NODELIST /
//              SLURM_JOB_NODELIST (expanded here: "node[01-04,07]"), MASTER_PORT to
//              10000 + SLURM_JOB_ID mod 20000, so that every task of a job agrees.
//   mpirun     OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE} (Open MPI) or PMI_RANK,
//              PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS (MPICH); MPI does not say which host
//              runs rank 0, so a job spanning hosts needs MASTER_ADDR (refused without it,
//              saying how to pass it); on one host it defaults to 127.0.0.1.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace dhp::dist {

// Returns the value of an environment variable, or nullopt when it is unset or empty.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;
// This process's environment.
EnvLookup process_env();

struct WorkerEnv {
  int64_t rank = 0, world = 1, local_rank = 0, local_world = 1;
  int64_t node = 0;  // this host's index in the job (GROUP_RANK, SLURM_NODEID; 0 when unknown)
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string launcher;       // "torchrun", "dhp", "srun", "mpirun"
  bool agent_store = false;   // the launcher hosts the store: rank 0 connects as a client too
  std::string store_prefix;   // the keys of this attempt ("" unless the store outlives attempts)
  // Every rank of the job runs on this host.
  bool single_host() const { return local_world == world; }
};

// The rank this process was started as, if the environment names one. Throws dhp::Error
// naming the variable for a malformed value or a job that cannot meet (see above).
std::optional<WorkerEnv> worker_env(const EnvLookup& env = process_env());

// Slurm's host lists: "a,b", "node[01-04,07]" (zero padding kept), "r[1-2]-n[1-2]"
// (every combination, in order). Throws dhp::Error naming the list when it does not parse.
std::vector<std::string> expand_hostlist(const std::string& list);
// Slurm's tasks per node: "2(x3),1" -> {2, 2, 2, 1}.
std::vector<int64_t> expand_tasks_per_node(const std::string& spec);

}  // namespace dhp::dist
