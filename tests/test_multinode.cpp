// Jobs over several hosts, in pieces: each launcher's environment (torchrun with its agent
// store, srun's host lists, mpirun), the transport a rank's groups use, and the start-up check
// that every rank runs the same job. The jobs themselves run on network namespaces in
// test_hosts.cpp.
#include <gtest/gtest.h>

#include <map>
#include <thread>

#include "dhp/dist/comm.h"
#include "dhp/dist/launcher_env.h"
#include "dhp/dist/transport.h"
#include "errors.h"

// EXPECT that `expr` throws a dhp::Error whose message contains `text`.
#define DHP_EXPECT_ERROR(expr, text)                                                       \
  do {                                                                                     \
    const std::string dhp_message = dhp::testing::error_of([&] { (void)(expr); });        \
    EXPECT_NE(dhp_message.find(text), std::string::npos) << "message: " << dhp_message;  \
  } while (0)

namespace {

using dhp::dist::EnvLookup;
using dhp::dist::worker_env;

EnvLookup env_of(const std::map<std::string, std::string>& vars) {
  return [vars](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end() || it->second.empty()) return std::nullopt;
    return it->second;
  };
}

TEST(LauncherEnv, NoLauncherNoRank) { EXPECT_FALSE(worker_env(env_of({{"PATH", "/bin"}}))); }

TEST(LauncherEnv, TorchrunAcrossNodesWithTheAgentsStore) {
  auto e = worker_env(env_of({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
                              {"GROUP_RANK", "1"}, {"MASTER_ADDR", "10.1.2.3"}, {"MASTER_PORT", "29400"},
                              {"TORCHELASTIC_USE_AGENT_STORE", "True"}, {"TORCHELASTIC_RESTART_COUNT", "2"}}));
  ASSERT_TRUE(e);
  EXPECT_EQ(e->launcher, "torchrun");
  EXPECT_EQ(e->rank, 5);
  EXPECT_EQ(e->world, 8);
  EXPECT_EQ(e->local_rank, 1);
  EXPECT_EQ(e->local_world, 4);
  EXPECT_EQ(e->node, 1);
  EXPECT_FALSE(e->single_host());
  EXPECT_TRUE(e->agent_store);
  EXPECT_EQ(e->store_prefix, "/worker/attempt_2");  // torch.distributed's own prefix
  EXPECT_EQ(e->master_addr, "10.1.2.3");
  EXPECT_EQ(e->master_port, 29400);
  // The c10d rendezvous (no agent store): rank 0 hosts the store, keys unprefixed.
  e = worker_env(env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"TORCHELASTIC_USE_AGENT_STORE", "False"}}));
  ASSERT_TRUE(e);
  EXPECT_FALSE(e->agent_store);
  EXPECT_EQ(e->store_prefix, "");
  EXPECT_TRUE(e->single_host());  // LOCAL_WORLD_SIZE unset: one host
  e = worker_env(env_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"DHP_LAUNCHED", "1"}}));
  EXPECT_EQ(e->launcher, "dhp");
}

TEST(LauncherEnv, BadValuesAreNamed) {
  DHP_EXPECT_ERROR(worker_env(env_of({{"RANK", "x1"}})), "RANK='x1' is not an integer");
  DHP_EXPECT_ERROR(worker_env(env_of({{"RANK", "1"}})), "WORLD_SIZE is not");
  DHP_EXPECT_ERROR(worker_env(env_of({{"RANK", "4"}, {"WORLD_SIZE", "4"}})), "rank 4 is outside a world of 4");
  DHP_EXPECT_ERROR(worker_env(env_of({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "3"}, {"LOCAL_WORLD_SIZE", "2"}})),
                   "local rank 3 of 2 ranks");
  DHP_EXPECT_ERROR(worker_env(env_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}})),
                   "MASTER_PORT=70000 is not a TCP port");
}

TEST(LauncherEnv, SlurmHostLists) {
  using V = std::vector<std::string>;
  EXPECT_EQ(dhp::dist::expand_hostlist("node07"), V({"node07"}));
  EXPECT_EQ(dhp::dist::expand_hostlist("node[01-04,07]"), V({"node01", "node02", "node03", "node04", "node07"}));
  EXPECT_EQ(dhp::dist::expand_hostlist("a1,gpu[9-11],b"), V({"a1", "gpu9", "gpu10", "gpu11", "b"}));
  EXPECT_EQ(dhp::dist::expand_hostlist("r[1-2]-n[08-09]"), V({"r1-n08", "r1-n09", "r2-n08", "r2-n09"}));
  EXPECT_EQ(dhp::dist::expand_hostlist("n[098-100]"), V({"n098", "n099", "n100"}));
  DHP_EXPECT_ERROR(dhp::dist::expand_hostlist("node[01-04"), "unmatched '['");
  DHP_EXPECT_ERROR(dhp::dist::expand_hostlist("node[4-1]"), "range '4-1' is empty");
  DHP_EXPECT_ERROR(dhp::dist::expand_hostlist("node[a-b]"), "'a-b' is not a number");
  DHP_EXPECT_ERROR(dhp::dist::expand_hostlist("a,,b"), "an empty host name");
  using I = std::vector<int64_t>;
  EXPECT_EQ(dhp::dist::expand_tasks_per_node("2(x3),1"), I({2, 2, 2, 1}));
  EXPECT_EQ(dhp::dist::expand_tasks_per_node("4"), I({4}));
  DHP_EXPECT_ERROR(dhp::dist::expand_tasks_per_node("2(x)"), "'2(x)' is not N or N(xM)");
}

TEST(LauncherEnv, SlurmDerivesTheMasterFromTheJob) {
  const std::map<std::string, std::string> vars = {
      {"SLURM_PROCID", "3"},      {"SLURM_NTASKS", "5"}, {"SLURM_LOCALID", "0"}, {"SLURM_NODEID", "1"},
      {"SLURM_JOB_ID", "123456"}, {"SLURM_STEP_TASKS_PER_NODE", "3,2"},
      {"SLURM_JOB_NODELIST", "gpu[07-08]"}};
  auto e = worker_env(env_of(vars));
  ASSERT_TRUE(e);
  EXPECT_EQ(e->launcher, "srun");
  EXPECT_EQ(e->rank, 3);
  EXPECT_EQ(e->world, 5);
  EXPECT_EQ(e->node, 1);
  EXPECT_EQ(e->local_world, 2);  // the second node's entry
  EXPECT_EQ(e->master_addr, "gpu07");
  EXPECT_EQ(e->master_port, 10000 + 123456 % 20000);
  auto with = vars;
  with["MASTER_ADDR"] = "10.0.0.9";
  with["MASTER_PORT"] = "29501";
  with["SLURM_NTASKS_PER_NODE"] = "3";
  with["SLURM_LOCALID"] = "2";
  e = worker_env(env_of(with));
  EXPECT_EQ(e->master_addr, "10.0.0.9");
  EXPECT_EQ(e->master_port, 29501);
  EXPECT_EQ(e->local_world, 3);
  EXPECT_EQ(e->local_rank, 2);
  with = vars;
  with["SLURM_NODEID"] = "2";
  DHP_EXPECT_ERROR(worker_env(env_of(with)), "SLURM_STEP_TASKS_PER_NODE='3,2' has no entry for SLURM_NODEID=2");
}

TEST(LauncherEnv, MpirunNeedsTheMasterAcrossHosts) {
  std::map<std::string, std::string> vars = {{"OMPI_COMM_WORLD_RANK", "1"},
                                             {"OMPI_COMM_WORLD_SIZE", "4"},
                                             {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                             {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}};
  DHP_EXPECT_ERROR(worker_env(env_of(vars)), "MASTER_ADDR is not set");
  DHP_EXPECT_ERROR(worker_env(env_of(vars)), "mpirun -x MASTER_ADDR=");
  vars["MASTER_ADDR"] = "hostA";
  auto e = worker_env(env_of(vars));
  ASSERT_TRUE(e);
  EXPECT_EQ(e->launcher, "mpirun");
  EXPECT_EQ(e->master_addr, "hostA");
  EXPECT_EQ(e->master_port, 29500);
  // On one host loopback is unambiguous; MPICH's variables.
  e = worker_env(env_of({{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "2"}}));
  ASSERT_TRUE(e);
  EXPECT_EQ(e->master_addr, "127.0.0.1");
  EXPECT_EQ(e->local_rank, 1);
}

TEST(Transport, LoopbackOnOneHostTheRouteToTheMasterAcrossHosts) {
  dhp::dist::WorkerEnv one;
  one.world = one.local_world = 4;
  EXPECT_EQ(dhp::dist::choose_transport(one, "", "parallel.socket_ifname").address, "127.0.0.1");
  EXPECT_TRUE(dhp::dist::choose_transport(one, "", "parallel.socket_ifname").interfaces.empty());
  EXPECT_EQ(dhp::dist::local_address_towards("127.0.0.1"), "127.0.0.1");
  auto named = dhp::dist::choose_transport(one, "lo", "GLOO_SOCKET_IFNAME");
  EXPECT_EQ(named.interfaces, std::vector<std::string>({"lo"}));
  EXPECT_EQ(named.describe(), "interface lo (127.0.0.1)");
  DHP_EXPECT_ERROR(dhp::dist::choose_transport(one, "lo,nosuch0", "GLOO_SOCKET_IFNAME"),
                   "GLOO_SOCKET_IFNAME=lo,nosuch0: this host has no interface 'nosuch0'");
  DHP_EXPECT_ERROR(dhp::dist::choose_transport(one, "nosuch0", "parallel.socket_ifname"), "it has lo (127.0.0.1)");
  dhp::dist::WorkerEnv two = one;
  two.local_world = 2;
  two.master_addr = "127.0.0.1";
  DHP_EXPECT_ERROR(dhp::dist::choose_transport(two, "", "parallel.socket_ifname"),
                   "MASTER_ADDR=127.0.0.1 is this host's loopback, but the job spans hosts");
  two.master_addr = "no-such-host.invalid";
  DHP_EXPECT_ERROR(dhp::dist::choose_transport(two, "", "parallel.socket_ifname"),
                   "MASTER_ADDR=no-such-host.invalid does not resolve");
}

// Four ranks as threads: the same fingerprint passes; one rank with another config stops
// every rank, naming that rank and its host.
TEST(SameJob, ADifferentConfigIsRefusedOnEveryRank) {
  for (int odd : {-1, 2}) {
    auto store = dhp::dist::make_hash_store();
    std::vector<std::string> errors(4);
    std::vector<std::thread> ranks;
    for (int r = 0; r < 4; ++r) {
      ranks.emplace_back([&, r] {
        try {
          dhp::dist::check_same_job(store, r, 4, r == odd ? "dhp 0.1.0, config bbb" : "dhp 0.1.0, config aaa",
                                    "host" + std::to_string(r / 2));
        } catch (const dhp::Error& e) {
          errors[r] = e.what();
        }
      });
    }
    for (auto& t : ranks) t.join();
    for (int r = 0; r < 4; ++r) {
      if (odd < 0) {
        EXPECT_EQ(errors[r], "") << r;
      } else {
        EXPECT_NE(errors[r].find("1 rank(s) run another dhp or another config than rank 0"), std::string::npos)
            << errors[r];
        EXPECT_NE(errors[r].find("rank 2 on host1: dhp 0.1.0, config bbb"), std::string::npos) << errors[r];
      }
    }
  }
}

}  // namespace
