// Jobs that span two hosts. The hosts are two network namespaces this test makes itself
// (`ip netns add`, a veth pair, addresses 10.213.X.1 and .2 of its own choosing): their
// processes reach each other only over that link, as two machines would, and share the
// file system (a shared checkpoint directory, unless a test hides it). Needs root (CI runs as
// root); where namespaces cannot be made, every test here is skipped with the reason.
//
// Shown: dhp, tp, zero3 and a disjoint placement (vision on one host, text on the other) over
// 2 hosts x 2 ranks give the losses of the same layout on 4 local ranks; a rank killed on one
// host ends the job on both, naming the rank and its host; a link taken down mid-run ends both
// within the collective timeout; another config on one host, or a checkpoint directory one
// host cannot see, is refused at start-up.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "files.h"
#include "runs.h"

namespace {

namespace fs = std::filesystem;
using dhp::testing::kTiny;
using dhp::testing::losses;
using Result = dhp::testing::ShellResult;

// A command with 240 s to run (several jobs on 2 cores).
Result sh(const std::string& cmd) { return dhp::testing::sh(cmd, 240); }


// dhp's layout on 4 ranks: vision sp=4 + ZeRO-1, text tp=2 x dp=2 (tp=4 would not divide the
// demo's 2 kv heads).
const std::string kDhp = " --set parallel.strategy=dhp --set parallel.text.tp=2";

// Two hosts: namespaces A and B joined by a veth pair, 10.213.N.1 (A) and 10.213.N.2 (B).
class TwoHosts : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string id = std::to_string(::getpid() % 100000);
    a_ = "dhpA" + id;
    b_ = "dhpB" + id;
    subnet_ = "10.213." + std::to_string(::getpid() % 250 + 1);
    const std::string va = "va" + id, vb = "vb" + id;
    auto r = sh("set -e; ip netns add " + a_ + "; ip netns add " + b_ + "; ip link add " + va + " type veth peer name " +
                vb + "; ip link set " + va + " netns " + a_ + "; ip link set " + vb + " netns " + b_ + "; ip -n " + a_ +
                " addr add " + subnet_ + ".1/24 dev " + va + "; ip -n " + b_ + " addr add " + subnet_ + ".2/24 dev " +
                vb + "; for n in " + a_ + " " + b_ + "; do ip -n $n link set lo up; done; ip -n " + a_ + " link set " +
                va + " up; ip -n " + b_ + " link set " + vb + " up");
    // Host names for the namespaces (the test gives each command its own UTS namespace and
    // name where a launcher reads it: torchrun's c10d rendezvous hands the workers the name of
    // its first agent's host as MASTER_ADDR); `ip netns exec` mounts /etc/netns/NS/hosts over
    // /etc/hosts, as a cluster's DNS would resolve them.
    for (const auto& ns : {a_, b_}) {
      fs::create_directories("/etc/netns/" + ns);
      std::ofstream("/etc/netns/" + ns + "/hosts") << "127.0.0.1 localhost\n" << subnet_ << ".1 " << name_a() << "\n"
                                                   << subnet_ << ".2 " << name_b() << "\n";
    }
    if (r.rc != 0) {
      skip_ = "cannot make two network namespaces here (needs root and iproute2): " + r.output;
      std::fprintf(stderr, "TwoHosts: SKIPPED: %s\n", skip_.c_str());
    }
    va_ = va;
    vb_ = vb;
  }
  static void TearDownTestSuite() {
    sh("ip netns del " + a_ + " 2>/dev/null; ip netns del " + b_ + " 2>/dev/null; rm -rf /etc/netns/" + a_ +
       " /etc/netns/" + b_ + "; true");
  }
  void SetUp() override {
    if (!skip_.empty()) GTEST_SKIP() << skip_;
  }

  static std::string master() { return subnet_ + ".1"; }
  static std::string name_a() { return "dhp-host-a" + std::to_string(::getpid() % 100000); }
  static std::string name_b() { return "dhp-host-b" + std::to_string(::getpid() % 100000); }
  // Runs the rest of the command line under `name` as the host name (a UTS namespace of its own).
  static std::string named(const std::string& name) {
    return "unshare -u bash -c 'hostname " + name + " && exec \"$0\" \"$@\"' ";
  }
  // `dhp train` on both hosts, 2 ranks each; `extra_b` is added on host B only, `wrap_b` runs
  // B's command (as "$@"). Waits for both; rc is the sum of their exit codes; the output has
  // host A's lines, then host B's.
  Result two_host_run(const std::string& args, const fs::path& out, const std::string& extra_b = "",
                      const std::string& wrap_b = "", int port = 0) {
    static int calls = 0;  // a port of its own per run (no wait for the last one's sockets)
    const std::string p = std::to_string(port ? port : 29000 + (::getpid() % 500) * 2 + 1000 * (++calls % 20));
    const std::string base = std::string(DHP_BINARY) + " train --nproc 2 --nnodes 2 --master-addr " + master() +
                             " --master-port " + p + args + " --out " + out.string();
    return sh("ip netns exec " + a_ + " " + named(name_a()) + base + " --node-rank 0 > " + out.string() +
              ".a.log 2>&1 & a=$!\n" + "ip netns exec " + b_ + " " + named(name_b()) + wrap_b + " " + base + " --node-rank 1" + extra_b + " > " + out.string() +
              ".b.log 2>&1; rb=$?\nwait $a; ra=$?\ncat " + out.string() + ".a.log; echo ----; cat " + out.string() +
              ".b.log\necho \"host A exit $ra, host B exit $rb\"\nexit $((ra + rb))");
  }
  static fs::path tmp(const std::string& name) {
    auto d = fs::temp_directory_path() / ("dhp-hosts-" + std::to_string(::getpid()) + "-" + name);
    fs::remove_all(d);
    return d;
  }

  static std::string a_, b_, va_, vb_, subnet_, skip_;
};
std::string TwoHosts::a_, TwoHosts::b_, TwoHosts::va_, TwoHosts::vb_, TwoHosts::subnet_, TwoHosts::skip_;

TEST_F(TwoHosts, StrategiesGiveTheLossesOfFourLocalRanks) {
  const std::vector<std::string> layouts = {
      " --set parallel.strategy=dhp --set parallel.text.tp=2",  // (text tp=4 would not divide 2 kv heads)
      " --set parallel.strategy=tp --set parallel.text.tp=2",
      " --set parallel.strategy=zero3",
      // vision on host A (ranks 0-1), text on host B (ranks 2-3): the redistribution crosses hosts.
      " --set parallel.strategy=dhp --set parallel.vision.ranks=[0,1] --set parallel.text.ranks=[2,3]"
      " --set training.micro_batches=2",
  };
  for (const auto& layout : layouts) {
    const auto local = tmp("local"), hosts = tmp("hosts");
    auto l = sh(std::string(DHP_BINARY) + " train --nproc 4" + layout + kTiny + " --out " + local.string());
    ASSERT_EQ(l.rc, 0) << l.output;
    auto h = two_host_run(layout + kTiny, hosts);
    ASSERT_EQ(h.rc, 0) << layout << "\n" << h.output;
    EXPECT_NE(h.output.find("node 1 of 2"), std::string::npos) << h.output;
    EXPECT_NE(h.output.find("connect over address " + subnet_ + ".2"), std::string::npos) << h.output;
    const auto want = losses(local), got = losses(hosts);
    ASSERT_EQ(want.size(), 3u) << l.output;
    ASSERT_EQ(got.size(), 3u) << h.output;
    // The same layout adds the same numbers in the same order, whatever carries them.
    for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got[i], want[i]) << layout << " step " << i + 1;
    fs::remove_all(local);
    fs::remove_all(hosts);
  }
}

// A rank on host B killed, then one that throws: both hosts exit non-zero at once, and both
// name that rank, its host and its error (host A's own ranks only lost their connections).
TEST_F(TwoHosts, AFailedRankEndsTheJobOnBothHostsAndIsNamed) {
  // The status of the rank that threw may be its exit code or, when its launcher stopped it
  // while it was still exiting, SIGTERM: its error is what names it.
  const std::vector<std::pair<std::string, std::string>> faults = {
      {" --inject-fault kill:3:2", "(killed by signal Killed)"},
      {" --inject-fault fail:2:2", "): injected failure on rank 2 at step 2"}};
  for (const auto& [fault, what] : faults) {
    const std::string rank = fault.find("kill") != std::string::npos ? "3" : "2";
    const std::string cause = "dhp: rank " + rank + " on " + name_b() + " (" + subnet_ + ".2) failed (";
    const auto out = tmp("fail" + rank);
    const auto t0 = std::chrono::steady_clock::now();
    auto r = two_host_run(kDhp + fault + kTiny, out);
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_NE(r.rc, 0) << r.output;
    EXPECT_NE(r.rc, 124) << "hung:\n" << r.output;
    EXPECT_LT(took, 60) << r.output;  // well within the 30 s collective timeout plus start-up
    const auto a = dhp::testing::slurp(out.string() + ".a.log"), b = dhp::testing::slurp(out.string() + ".b.log");
    for (const auto* log : {&a, &b}) {
      const auto at = log->find(cause);
      EXPECT_NE(at, std::string::npos) << fault << " (rc " << r.rc << ") host " << (log == &a ? "A" : "B") << ":\n"
                                       << *log;
      if (at != std::string::npos) EXPECT_NE(log->find(what, at), std::string::npos) << fault << ":\n" << *log;
    }
    EXPECT_NE(a.find("stopped the workers on this host"), std::string::npos) << fault << " host A:\n" << a;
    EXPECT_LT(losses(out).size(), 2u);
    fs::remove_all(out);
  }
}

TEST_F(TwoHosts, ALinkDownMidRunEndsBothHostsWithinTheTimeout) {
  const auto out = tmp("link");
  const std::string p = std::to_string(28000 + ::getpid() % 1000);
  const std::string base = std::string(DHP_BINARY) + " train --nproc 2 --nnodes 2 --master-addr " + master() +
                           " --master-port " + p + kDhp + kTiny +
                           " --set training.steps=200 --set parallel.timeout_s=10 --out " + out.string();
  auto r = sh("ip netns exec " + a_ + " " + base + " --node-rank 0 > " + out.string() + ".a.log 2>&1 & a=$!\n" +
              "ip netns exec " + b_ + " " + base + " --node-rank 1 > " + out.string() + ".b.log 2>&1 & b=$!\n" +
              "for i in $(seq 600); do [ \"$(wc -l < " + (out / "metrics.jsonl").string() +
              " 2>/dev/null || echo 0)\" -ge 2 ] && break; sleep 0.1; done\n" + "ip -n " + b_ + " link set " + vb_ +
              " down; t0=$(date +%s)\nwait $a; ra=$?; wait $b; rb=$?; echo took $(( $(date +%s) - t0 ))\n" + "ip -n " +
              b_ + " link set " + vb_ + " up\necho ra=$ra rb=$rb; [ $ra -ne 0 ] && [ $rb -ne 0 ]");
  EXPECT_EQ(r.rc, 0) << r.output << dhp::testing::slurp(out.string() + ".a.log") << dhp::testing::slurp(out.string() + ".b.log");
  const auto took = r.output.find("took ");
  ASSERT_NE(took, std::string::npos) << r.output;
  EXPECT_LT(std::stoi(r.output.substr(took + 5)), 10 + 30) << "the collective timeout is 10 s";
  EXPECT_GE(losses(out).size(), 2u);
  EXPECT_LT(losses(out).size(), 200u);
  fs::remove_all(out);
}

// GLOO_SOCKET_IFNAME, set per host to that host's own interface name, is what the groups
// use; a name the host does not have is refused naming the interfaces it has.
TEST_F(TwoHosts, GlooSocketIfnameNamesEachHostsInterface) {
  const auto out = tmp("ifname");
  auto r = sh("export GLOO_SOCKET_IFNAME=" + va_ + "; ip netns exec " + a_ + " " + named(name_a()) + DHP_BINARY +
              " train --nproc 2 --nnodes 2 --node-rank 0 --master-addr " + master() + " --master-port " +
              std::to_string(30500 + ::getpid() % 400) + " --set parallel.strategy=dp" + kTiny + " --out " + out.string() +
              " > " + out.string() + ".a.log 2>&1 & a=$!\nexport GLOO_SOCKET_IFNAME=" + vb_ + "; ip netns exec " + b_ +
              " " + named(name_b()) + DHP_BINARY + " train --nproc 2 --nnodes 2 --node-rank 1 --master-addr " + master() +
              " --master-port " + std::to_string(30500 + ::getpid() % 400) + " --set parallel.strategy=dp" + kTiny +
              " --out " + out.string() + " > " + out.string() + ".b.log 2>&1; rb=$?\nwait $a; ra=$?\nexit $((ra + rb))");
  const auto b = dhp::testing::slurp(out.string() + ".b.log");
  EXPECT_EQ(r.rc, 0) << r.output << b;
  EXPECT_NE(b.find("the job's groups connect over interface " + vb_ + " (" + subnet_ + ".2)"), std::string::npos) << b;
  EXPECT_EQ(losses(out).size(), 3u);
  // One rank of host B (as a launcher would start it), with a name host B does not have.
  r = sh("GLOO_SOCKET_IFNAME=eth9 RANK=2 WORLD_SIZE=4 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 MASTER_ADDR=" + master() +
         " ip netns exec " + b_ + " " + DHP_BINARY + " train --set parallel.strategy=dp" + kTiny + " --out " +
         out.string());
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.output.find("GLOO_SOCKET_IFNAME=eth9: this host has no interface 'eth9' with an IPv4 address; it has "),
            std::string::npos) << r.output;
  EXPECT_NE(r.output.find(vb_ + " (" + subnet_ + ".2)"), std::string::npos) << r.output;
  fs::remove_all(out);
}

TEST_F(TwoHosts, AnotherConfigOnOneHostIsRefusedAtStartUp) {
  const auto out = tmp("config");
  auto r = two_host_run(" --set parallel.strategy=dp" + kTiny, out, " --set training.lr=0.5");
  EXPECT_NE(r.rc, 0) << r.output;
  const auto a = dhp::testing::slurp(out.string() + ".a.log"), b = dhp::testing::slurp(out.string() + ".b.log");
  for (const auto& log : {a, b}) {
    EXPECT_NE(log.find("run another dhp or another config than rank 0"), std::string::npos) << log;
    EXPECT_NE(log.find("rank 2 on " + name_b() + " (" + subnet_ + ".2): dhp "), std::string::npos) << log;
  }
  EXPECT_EQ(losses(out).size(), 0u);
  fs::remove_all(out);
}

// Host B mounts a directory of its own over the run's checkpoint directory (as a host whose
// "shared" path is a local disk would): refused at start-up on both hosts, naming the hosts.
TEST_F(TwoHosts, ACheckpointDirectoryOneHostCannotSeeIsRefused) {
  const auto out = tmp("unshared");
  fs::create_directories(out / "checkpoints");
  const std::string wrap = "unshare -m --propagation private bash -c 'mount -t tmpfs tmpfs " +
                           (out / "checkpoints").string() + " && exec \"$0\" \"$@\"'";
  auto r = two_host_run(" --set parallel.strategy=dp" + kTiny, out, "", wrap);
  EXPECT_NE(r.rc, 0) << r.output;
  EXPECT_NE(r.rc, 124) << r.output;
  const auto a = dhp::testing::slurp(out.string() + ".a.log"), b = dhp::testing::slurp(out.string() + ".b.log");
  for (const auto& log : {a, b}) {
    EXPECT_NE(log.find("is not one directory for every host of the job"), std::string::npos) << log;
    EXPECT_NE(log.find("shared file system"), std::string::npos) << log;
  }
  EXPECT_NE(a.find("cannot see the file that"), std::string::npos) << a;
  EXPECT_EQ(losses(out).size(), 0u);
  // The same run with the directory shared trains.
  auto ok = two_host_run(" --set parallel.strategy=dp" + kTiny, out);
  EXPECT_EQ(ok.rc, 0) << ok.output;
  EXPECT_EQ(losses(out).size(), 3u);
  EXPECT_TRUE(fs::exists(out / "checkpoints" / "step-3" / "manifest.json"));
  fs::remove_all(out);
}

// The same job under torchrun (Debian's python3-torch) on both hosts, static rendezvous: the
// agent on host A hosts the store and dhp's ranks connect to it as clients (rank 0 too). The
// losses equal 4 local ranks'. Then a rank killed mid-run under --max_restarts 1 with
// checkpoint.resume=auto: both hosts' agents restart their workers, which resume from the
// newest checkpoint and end with the uninterrupted run's losses.
TEST_F(TwoHosts, TorchrunOnBothHostsAndItsRestarts) {
  if (!fs::exists("/usr/bin/torchrun")) GTEST_SKIP() << "no /usr/bin/torchrun (Debian's python3-torch)";
  const auto local = tmp("trl"), hosts = tmp("trh"), killed = tmp("trk");
  const std::string job = kDhp + kTiny + " --set training.steps=6 --set checkpoint.every=2";
  auto l = sh(std::string(DHP_BINARY) + " train --nproc 4" + job + " --out " + local.string());
  ASSERT_EQ(l.rc, 0) << l.output;
  // torchrun on both hosts (static rendezvous on host A); rc is the sum of both.
  auto torchrun = [&](const fs::path& out, const std::string& flags, const std::string& args, int port) {
    // --redirects/--tee 2: Debian 12's torchrun (torch 1.13 under Python 3.11) cannot parse
    // their default 0 (Python 3.11 no longer iterates IntFlag's zero member): stderr is teed.
    const std::string head = "/usr/bin/torchrun --redirects 2 --tee 2 --nnodes 2 --nproc_per_node 2" + flags +
                             " --master_addr " + master() +
                             " --master_port " + std::to_string(port);
    const std::string tail = " --no_python " + std::string(DHP_BINARY) + " train" + args + " --out " + out.string();
    return sh("ip netns exec " + a_ + " " + head + " --node_rank 0" + tail + " > " + out.string() + ".a.log 2>&1 & a=$!\n" +
              "ip netns exec " + b_ + " " + head + " --node_rank 1" + tail + " > " + out.string() +
              ".b.log 2>&1; rb=$?\nwait $a; ra=$?\ncat " + out.string() + ".a.log; echo ----; cat " + out.string() +
              ".b.log\nexit $((ra + rb))");
  };
  const int port = 31000 + ::getpid() % 1000;
  auto h = torchrun(hosts, "", job, port);
  ASSERT_EQ(h.rc, 0) << h.output;
  const auto want = losses(local);
  ASSERT_EQ(want.size(), 6u);
  EXPECT_EQ(losses(hosts), want) << h.output;
  // Rank 3 (host B) killed before step 4, first attempt only: every step's loss equals the
  // uninterrupted run's.
  auto k = torchrun(killed, " --max_restarts 1", job + " --set checkpoint.resume=auto --inject-fault kill:3:4", port + 1);
  ASSERT_EQ(k.rc, 0) << k.output;
  EXPECT_NE(k.output.find("resumed from " + (killed / "checkpoints" / "step-2").string() + " at step 2"), std::string::npos)
      << k.output;
  EXPECT_EQ(losses(killed), want) << k.output;
  for (const auto& d : {local, hosts, killed}) fs::remove_all(d);
}

// Slurm over both hosts: the test's controller and a node daemon on host A, a node daemon on
// host B (each under its host's name; entered with nsenter so that the daemons keep this
// machine's cgroup mounts), then `srun -N 2 -n 4` from host A: dhp takes MASTER_ADDR from
// SLURM_JOB_NODELIST (host A's name), the port from the job id and the tasks per node from
// SLURM_STEP_TASKS_PER_NODE ("2(x2)"), and trains like 4 local ranks.
TEST_F(TwoHosts, SrunOverBothHosts) {
  if (std::system("command -v slurmctld slurmd srun munge nsenter > /dev/null 2>&1") != 0)
    GTEST_SKIP() << "no Slurm here (Debian's slurm-wlm)";
  const auto dir = tmp("slurm");
  fs::create_directories(dir / "state");
  for (const auto& n : {name_a(), name_b()}) fs::create_directories(dir / ("spool-" + n));
  const int port = 18000 + (::getpid() % 400) * 2;
  {
    std::ofstream c(dir / "slurm.conf");
    c << "ClusterName=dhptest2\nSlurmctldHost=" << name_a() << "(" << master() << ")\nSlurmctldPort=" << port
      << "\nSlurmdPort=" << port + 1 << "\nSlurmUser=root\nSlurmdUser=root\nAuthType=auth/munge\n"
      << "StateSaveLocation=" << (dir / "state").string() << "\nSlurmdSpoolDir=" << dir.string() << "/spool-%n"
      << "\nSlurmctldPidFile=" << (dir / "ctld.pid").string() << "\nSlurmdPidFile=" << dir.string() << "/d-%n.pid"
      << "\nSlurmctldLogFile=" << (dir / "ctld.log").string() << "\nSlurmdLogFile=" << dir.string() << "/d-%n.log"
      << "\nProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nMpiDefault=none\n"
      << "SchedulerType=sched/builtin\nSelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\n"
      << "JobCompType=jobcomp/none\nAccountingStorageType=accounting_storage/none\nReturnToService=2\n"
      << "NodeName=" << name_a() << " NodeAddr=" << master() << " CPUs=2 State=UNKNOWN\n"
      << "NodeName=" << name_b() << " NodeAddr=" << subnet_ << ".2 CPUs=2 State=UNKNOWN\n"
      << "PartitionName=dhp Nodes=" << name_a() << "," << name_b()
      << " Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE\n";
  }
  // Runs `script` (a file) on a host: its network, its name, its /etc/hosts.
  auto on = [&](const std::string& ns, const std::string& name, const std::string& script) {
    return "nsenter --net=/run/netns/" + ns + " unshare -m -u --propagation private bash -c 'mount --bind /etc/netns/" +
           ns + "/hosts /etc/hosts && hostname " + name + " && exec bash " + script + "'";
  };
  const std::string conf = "export SLURM_CONF=" + (dir / "slurm.conf").string() + "\n";
  std::ofstream(dir / "a.sh") << conf << "slurmctld && slurmd -N " << name_a() << "\n";
  std::ofstream(dir / "b.sh") << conf << "slurmd -N " << name_b() << "\n";
  std::ofstream(dir / "wait.sh") << conf << "for i in $(seq 100); do [ \"$(sinfo -h -o %t | sort -u)\" = idle ] && exit 0; "
                                 << "sleep 0.2; done; sinfo; exit 1\n";
  const auto run = dir / "run", local = dir / "local";
  std::ofstream(dir / "srun.sh") << conf << "srun -N 2 -n 4 --ntasks-per-node 2 -O " << DHP_BINARY
                                 << " train --set parallel.strategy=zero3" << kTiny << " --out " << run.string() << "\n";
  auto up = sh("munge -n > /dev/null 2>&1 || { mkdir -p /run/munge && chown munge:munge /run/munge && "
               "su -s /bin/sh munge -c /usr/sbin/munged; sleep 1; }\n" + on(a_, name_a(), (dir / "a.sh").string()) +
               " && " + on(b_, name_b(), (dir / "b.sh").string()) + " && " + on(a_, name_a(), (dir / "wait.sh").string()));
  auto stop = [&] {
    sh("kill $(cat " + dir.string() + "/d-*.pid " + (dir / "ctld.pid").string() + " 2>/dev/null) 2>/dev/null; true");
  };
  if (up.rc != 0) {
    const std::string why = up.output + dhp::testing::slurp(dir / "ctld.log");
    stop();
    GTEST_SKIP() << "Slurm's daemons do not start on the two hosts here: " << why;
  }
  auto b = sh(on(a_, name_a(), (dir / "srun.sh").string()));
  stop();
  auto l = sh(std::string(DHP_BINARY) + " train --nproc 4 --set parallel.strategy=zero3" + kTiny + " --out " +
              local.string());
  ASSERT_EQ(l.rc, 0) << l.output;
  ASSERT_EQ(b.rc, 0) << b.output;
  EXPECT_NE(b.output.find("rank 2 on " + name_b() + ": the job's groups connect over address " + subnet_ + ".2; store " +
                          name_a() + ":"),
            std::string::npos) << b.output;
  EXPECT_EQ(losses(run).size(), 3u) << b.output;
  EXPECT_EQ(losses(run), losses(local));
  fs::remove_all(dir);
}

// torchrun's c10d rendezvous across the hosts: the agents meet at host A's endpoint, agree
// on MASTER_ADDR (host A's name) and a port, and dhp's rank 0 hosts the job's store there.
TEST_F(TwoHosts, TorchrunWithTheC10dRendezvous) {
  if (!fs::exists("/usr/bin/torchrun")) GTEST_SKIP() << "no /usr/bin/torchrun (Debian's python3-torch)";
  const auto local = tmp("c10l"), hosts = tmp("c10h");
  const std::string job = " --set parallel.strategy=zero3" + kTiny;
  auto l = sh(std::string(DHP_BINARY) + " train --nproc 4" + job + " --out " + local.string());
  ASSERT_EQ(l.rc, 0) << l.output;
  const std::string cmd = "/usr/bin/torchrun --redirects 2 --tee 2 --nnodes 2 --nproc_per_node 2 --rdzv_backend c10d "
                          "--rdzv_id dhp-test --rdzv_endpoint " + master() + ":" + std::to_string(32000 + ::getpid() % 1000) +
                          " --no_python " + DHP_BINARY + " train" + job + " --out " + hosts.string();
  auto h = sh("ip netns exec " + a_ + " " + named(name_a()) + cmd + " > " + hosts.string() + ".a.log 2>&1 & a=$!\n" +
              "ip netns exec " + b_ + " " + named(name_b()) + cmd + " > " + hosts.string() + ".b.log 2>&1; rb=$?\nwait $a; ra=$?\ncat " + hosts.string() +
              ".a.log; echo ----; cat " + hosts.string() + ".b.log\nexit $((ra + rb))");
  ASSERT_EQ(h.rc, 0) << h.output;
  EXPECT_NE(h.output.find("on " + name_b() + ": the job's groups connect over address " + subnet_ + ".2"),
            std::string::npos) << h.output;
  EXPECT_EQ(losses(hosts), losses(local)) << h.output;
  EXPECT_EQ(losses(hosts).size(), 3u);
  fs::remove_all(local);
  fs::remove_all(hosts);
}

// A job of dhp's launcher on one host stays on loopback: every TCP socket of its processes
// (listening or connected), sampled while it trains, is on 127.0.0.1 (the store is a file;
// Gloo's pairs bind 127.0.0.1).
TEST(OneHost, ListensOnLoopbackOnly) {
  if (std::system("command -v ss > /dev/null 2>&1") != 0) GTEST_SKIP() << "no ss (iproute2)";
  const auto out = fs::temp_directory_path() / ("dhp-loopback-" + std::to_string(::getpid()));
  auto r = sh(std::string(DHP_BINARY) + " train --nproc 2 --set parallel.strategy=dhp" + kTiny +
              " --set training.steps=40 --out " + out.string() + " > /dev/null 2>&1 & job=$!\n" +
              "while kill -0 $job 2>/dev/null; do\n" +
              // this job's processes only (the launcher and its workers), not other tests' dhp
              "  p=\"$job$(pgrep -P $job | sed 's/^/|/' | tr -d '\\n')\"; ss -Htanp | grep -E \"pid=($p),\"; sleep 0.1\n" +
              "done\nwait $job");
  EXPECT_EQ(r.rc, 0) << r.output;
  int sockets = 0;
  std::istringstream lines(r.output);
  for (std::string line; std::getline(lines, line);) {
    if (line.find("pid=") == std::string::npos) continue;
    ++sockets;
    std::istringstream fields(line);
    std::string state, recv_q, send_q, local, peer;
    fields >> state >> recv_q >> send_q >> local >> peer;
    EXPECT_EQ(local.rfind("127.0.0.1:", 0), 0u) << "beyond loopback: " << line;
    if (state != "LISTEN") EXPECT_EQ(peer.rfind("127.0.0.1:", 0), 0u) << "beyond loopback: " << line;
  }
  EXPECT_GT(sockets, 0) << "no socket of the job was seen while it ran:\n" << r.output;
  fs::remove_all(out);
}

// mpirun (Open MPI) on one host: its variables name the ranks, MASTER_ADDR defaults to
// loopback there, and the job trains like dhp's own launcher.
TEST(Mpirun, OneHostTrainsLikeDhpsLauncher) {
  if (std::system("command -v mpirun > /dev/null 2>&1") != 0) GTEST_SKIP() << "no mpirun (Debian's openmpi-bin)";
  const auto own = fs::temp_directory_path() / ("dhp-mpi-own-" + std::to_string(::getpid()));
  const auto mpi = fs::temp_directory_path() / ("dhp-mpi-" + std::to_string(::getpid()));
  auto a = sh(std::string(DHP_BINARY) + " train --nproc 2 --set parallel.strategy=dp" + kTiny + " --out " + own.string());
  ASSERT_EQ(a.rc, 0) << a.output;
  auto b = sh("mpirun --allow-run-as-root --oversubscribe -np 2 -x MASTER_PORT=" + std::to_string(33000 + ::getpid() % 1000) +
              " " + DHP_BINARY + " train --set parallel.strategy=dp" + kTiny + " --out " + mpi.string());
  ASSERT_EQ(b.rc, 0) << b.output;
  EXPECT_EQ(losses(mpi), losses(own)) << b.output;
  EXPECT_EQ(losses(mpi).size(), 3u);
  fs::remove_all(own);
  fs::remove_all(mpi);
}

// Slurm on this machine: a controller and a node daemon of the test's own (a config in a
// temporary directory, ports of its own, the system's munged), then `srun -n 2 dhp train`:
// dhp takes its ranks from SLURM_PROCID / SLURM_NTASKS, MASTER_ADDR from SLURM_JOB_NODELIST
// (this host's name) and MASTER_PORT from the job id, and trains like `dhp train --nproc 2`.
TEST(Slurm, SrunTrainsLikeDhpsLauncher) {
  if (std::system("command -v slurmctld slurmd srun munge > /dev/null 2>&1") != 0)
    GTEST_SKIP() << "no Slurm here (Debian's slurm-wlm)";
  const auto dir = fs::temp_directory_path() / ("dhp-slurm-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "state");
  fs::create_directories(dir / "spool");
  char name[256] = {};
  ::gethostname(name, sizeof(name) - 1);
  const int port = 16000 + (::getpid() % 400) * 2;
  {
    std::ofstream c(dir / "slurm.conf");
    c << "ClusterName=dhptest\nSlurmctldHost=" << name << "(127.0.0.1)\nSlurmctldPort=" << port
      << "\nSlurmdPort=" << port + 1 << "\nSlurmUser=root\nSlurmdUser=root\nAuthType=auth/munge\n"
      << "StateSaveLocation=" << (dir / "state").string() << "\nSlurmdSpoolDir=" << (dir / "spool").string()
      << "\nSlurmctldPidFile=" << (dir / "ctld.pid").string() << "\nSlurmdPidFile=" << (dir / "d.pid").string()
      << "\nSlurmctldLogFile=" << (dir / "ctld.log").string() << "\nSlurmdLogFile=" << (dir / "d.log").string()
      << "\nProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nMpiDefault=none\n"
      << "SchedulerType=sched/builtin\nSelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\n"
      << "JobCompType=jobcomp/none\nAccountingStorageType=accounting_storage/none\nReturnToService=2\n"
      << "NodeName=" << name << " NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN\n"
      << "PartitionName=dhp Nodes=" << name << " Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE\n";
  }
  const std::string conf = "export SLURM_CONF=" + (dir / "slurm.conf").string() + "\n";
  // munged: the system's, started when it is not running.
  auto up = sh("munge -n > /dev/null 2>&1 || { mkdir -p /run/munge && chown munge:munge /run/munge && "
               "su -s /bin/sh munge -c /usr/sbin/munged; sleep 1; }\nmunge -n | unmunge > /dev/null\n" + conf +
               "slurmctld && slurmd || exit 1\nfor i in $(seq 100); do sinfo -h -o %t 2>/dev/null | grep -q idle && exit 0; "
               "sleep 0.2; done; exit 1");
  auto stop = [&] {
    sh("kill $(cat " + (dir / "d.pid").string() + " " + (dir / "ctld.pid").string() + " 2>/dev/null) 2>/dev/null; true");
  };
  if (up.rc != 0) {
    const std::string why = up.output + dhp::testing::slurp(dir / "ctld.log") + dhp::testing::slurp(dir / "d.log");
    stop();
    GTEST_SKIP() << "Slurm's daemons do not start here: " << why;
  }
  const auto own = dir / "own", slurm = dir / "run";
  auto a = sh(std::string(DHP_BINARY) + " train --nproc 2 --set parallel.strategy=dp" + kTiny + " --out " + own.string());
  auto b = sh(conf + "srun -n 2 -O bash -c 'echo task $SLURM_PROCID of $SLURM_NTASKS on $SLURM_JOB_NODELIST job " +
              "$SLURM_JOB_ID; exec \"$0\" \"$@\"' " + DHP_BINARY + " train --set parallel.strategy=dp" + kTiny +
              " --out " + slurm.string());
  stop();
  ASSERT_EQ(a.rc, 0) << a.output;
  ASSERT_EQ(b.rc, 0) << b.output;
  EXPECT_NE(b.output.find("task 1 of 2 on " + std::string(name)), std::string::npos) << b.output;
  EXPECT_EQ(losses(slurm).size(), 3u) << b.output;
  EXPECT_EQ(losses(slurm), losses(own));
  fs::remove_all(dir);
}

}  // namespace
