#include "launch.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>

#include "dhp/core/error.h"
#include "dhp/dist/comm.h"
#include "dhp/dist/transport.h"

extern char** environ;

namespace dhp::launch {
namespace {

std::optional<int64_t> env_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  DHP_CHECK(end && *end == '\0', "environment variable ", name, "='", v, "' is not an integer");
  return x;
}


volatile sig_atomic_t g_stop_signal = 0;
void on_signal(int sig) { g_stop_signal = sig; }

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("killed by signal ") + strsignal(WTERMSIG(status));
  return "status " + std::to_string(status);
}

std::string read_file(const std::filesystem::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

std::string host_name() {
  char name[256] = {};
  ::gethostname(name, sizeof(name) - 1);
  return name;
}

void report_worker_error(const std::string& message, bool lost_peer) {
  const char* path = std::getenv("DHP_ERROR_FILE");
  if (!path || !*path) return;
  if (std::filesystem::exists(path)) return;  // the first error is the cause
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(
                      std::chrono::system_clock::now().time_since_epoch()).count();
  std::ofstream f(path);
  f << us << "\n" << (lost_peer ? "lost-peer" : "error") << "\n" << message;
}

void report_worker_error(const std::exception& e) {
  report_worker_error(e.what(), dynamic_cast<const dist::CommError*>(&e) != nullptr);
}

namespace {

// Runs `fn` on a thread of its own and waits at most `deadline` for it: a store call over a
// link that went down must not stall the supervision of the local workers.
template <class T>
std::optional<T> bounded(std::function<T()> fn, std::chrono::milliseconds deadline) {
  auto result = std::make_shared<std::promise<std::optional<T>>>();
  auto future = result->get_future();
  std::thread([fn = std::move(fn), result] {
    try {
      result->set_value(fn());
    } catch (...) {
      result->set_value(std::nullopt);
    }
  }).detach();
  if (future.wait_for(deadline) != std::future_status::ready) return std::nullopt;
  return future.get();
}

// The job's store as the launchers see it: hosted by node 0's launcher, the others connect.
// Failures are posted under the attempt's keys: the first one posted is the job's cause.
class LauncherStore {
 public:
  LauncherStore(const Nodes& nodes, int port, std::chrono::milliseconds timeout)
      : nodes_(nodes),
        store_(dist::make_tcp_store(nodes.master_addr.empty() ? "127.0.0.1" : nodes.master_addr, port, 0,
                                    nodes.rank == 0, timeout)) {}

  // Every node's launcher says who it is; checks that node ranks are unique and that every
  // node starts the same number of workers. Returns this host's label.
  void meet(int64_t nproc, const std::string& host) {
    const std::string me = std::to_string(nodes_.rank);
    const int64_t claims = store_.add("dhp-launch/claims/" + me, 1);
    DHP_CHECK(claims == 1, "--node-rank ", nodes_.rank, " is taken: another launcher of this job already started as ",
              "node ", nodes_.rank, " (each host needs its own --node-rank, 0 .. ", nodes_.count - 1, ")");
    store_.set("dhp-launch/node/" + me, std::to_string(nproc) + "\n" + host);
    for (int64_t k = 0; k < nodes_.count; ++k) {
      const auto v = store_.get("dhp-launch/node/" + std::to_string(k));
      const auto nl = v.find('\n');
      DHP_CHECK(std::stoll(v.substr(0, nl)) == nproc, "node ", k, " (", v.substr(nl + 1), ") starts --nproc ",
                v.substr(0, nl), " but node ", nodes_.rank, " (", host, ") starts --nproc ", nproc,
                ": every node must start the same number of workers");
    }
  }

  // Posts a failure of this host (the first one posted wins). Bounded: false when the store
  // could not be reached.
  bool post(int64_t attempt, const std::string& cause) {
    auto s = store_;
    const auto key = "dhp-launch/attempt_" + std::to_string(attempt);
    return bounded<bool>([s, key, cause] {
      if (s.add(key + "/failures", 1) == 1) s.set(key + "/cause", cause);
      return true;
    }, std::chrono::seconds(5)).value_or(false);
  }

  // The cause posted for this attempt, if any (nullopt also when the store does not answer
  // within `deadline`; after one such silence the store counts as lost and is not asked again).
  std::optional<std::string> cause(int64_t attempt, std::chrono::milliseconds deadline) {
    if (lost_) return std::nullopt;
    auto s = store_;
    const auto key = "dhp-launch/attempt_" + std::to_string(attempt) + "/cause";
    auto r = bounded<std::optional<std::string>>([s, key] { return s.try_get(key); }, deadline);
    if (!r) lost_ = true;
    return r ? *r : std::nullopt;
  }

  // After a successful run: node 0 keeps the store up until every launcher is done with it.
  void finish() {
    auto s = store_;
    bounded<int64_t>([s] { return s.add("dhp-launch/done", 1); }, std::chrono::seconds(5));
    if (nodes_.rank != 0) return;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (std::chrono::steady_clock::now() < until) {
      auto n = bounded<int64_t>([s] { return s.add("dhp-launch/done", 0); }, std::chrono::seconds(1));
      if (!n || *n >= nodes_.count) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

  const dist::Store& store() const { return store_; }

 private:
  Nodes nodes_;
  dist::Store store_;
  bool lost_ = false;
};

// The environment of each worker: this process's, with the job's variables set.
std::vector<std::string> worker_environment(const std::vector<std::pair<std::string, std::string>>& set) {
  std::vector<std::string> out;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    const auto name = kv.substr(0, kv.find('='));
    bool replaced = false;
    for (const auto& [n, v] : set) replaced = replaced || n == name;
    if (!replaced) out.push_back(kv);
  }
  for (const auto& [n, v] : set)
    if (!v.empty()) out.push_back(n + "=" + v);  // empty: unset
  return out;
}

struct Job {
  int64_t nproc = 1;
  Nodes nodes;
  int port = 0;      // the store's, on several hosts (0 on one host: a store file)
  std::string host;  // this host, for messages
  int64_t first_rank() const { return nodes.rank * nproc; }
  int64_t world() const { return nodes.count * nproc; }
};

// Forks and execs the workers of one attempt, each with its rank's environment (prepared
// before the fork: the child only calls execve, as is safe beside the store's threads).
std::vector<pid_t> start_workers(const Job& job, const std::vector<std::string>& argv, int64_t restart,
                                 const std::filesystem::path& errdir) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const std::string addr = job.nodes.master_addr.empty() ? "127.0.0.1" : job.nodes.master_addr;
  std::vector<std::vector<std::string>> envs;
  for (int64_t r = 0; r < job.nproc; ++r) {
    envs.push_back(worker_environment({
        {"RANK", std::to_string(job.first_rank() + r)},
        {"LOCAL_RANK", std::to_string(r)},
        {"WORLD_SIZE", std::to_string(job.world())},
        {"LOCAL_WORLD_SIZE", std::to_string(job.nproc)},
        {"GROUP_RANK", std::to_string(job.nodes.rank)},
        {"MASTER_ADDR", addr},
        {"MASTER_PORT", job.port > 0 ? std::to_string(job.port) : ""},
        {"TORCHELASTIC_USE_AGENT_STORE", "True"},
        {"TORCHELASTIC_RESTART_COUNT", std::to_string(restart)},
        {"DHP_LAUNCHED", "1"},
        {"DHP_RESTART", std::to_string(restart)},
        {"DHP_ERROR_FILE", (errdir / ("rank" + std::to_string(r))).string()},
        // One host: the workers meet through a file of this attempt (nothing listens).
        {"DHP_STORE_FILE", job.nodes.count == 1 ? (errdir / "store").string() : ""},
    }));
  }
  if (job.nodes.count > 1) {
    std::fprintf(stderr, "dhp: node %lld of %lld (%s): starting %lld workers, ranks %lld-%lld (store %s:%d)\n",
                 static_cast<long long>(job.nodes.rank), static_cast<long long>(job.nodes.count), job.host.c_str(),
                 static_cast<long long>(job.nproc), static_cast<long long>(job.first_rank()),
                 static_cast<long long>(job.first_rank() + job.nproc - 1), addr.c_str(), job.port);
  } else {
    std::fprintf(stderr, "dhp: starting %lld workers (store %s)\n", static_cast<long long>(job.nproc),
                 (errdir / "store").c_str());
  }
  // This binary by its own path (not /proc/self/exe), so that the workers are named dhp in ps.
  std::error_code ec;
  const std::string self = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  const char* exe = ec || self.empty() ? "/proc/self/exe" : self.c_str();
  std::vector<pid_t> pids;
  for (int64_t r = 0; r < job.nproc; ++r) {
    std::vector<char*> envp;
    for (auto& kv : envs[r]) envp.push_back(kv.data());
    envp.push_back(nullptr);
    const pid_t pid = ::fork();
    DHP_CHECK(pid >= 0, "fork failed for rank ", job.first_rank() + r, ": ", std::strerror(errno));
    if (pid == 0) {
      ::execve(exe, args.data(), envp.data());
      static const char msg[] = "dhp: cannot start a worker (execve failed)\n";
      (void)!::write(2, msg, sizeof(msg) - 1);
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  return pids;
}

// How the workers of one attempt ended.
struct Ending {
  std::vector<int> statuses;  // waitpid status per local worker
  int64_t failed = -1;        // first local worker that failed by itself (-1: none)
  int64_t killed = -1;        // first local worker killed by a signal the launcher did not send
  std::string remote;         // the cause another host posted, when that stopped these workers
};

// Waits for every worker; once one fails, the launcher is signalled or `remote_cause` (asked
// every 250 ms) names a failure elsewhere, stops the others with SIGTERM, and with SIGKILL
// after 5 s of grace.
Ending supervise(const std::vector<pid_t>& pids, const std::function<std::optional<std::string>()>& remote_cause) {
  const int64_t nproc = static_cast<int64_t>(pids.size());
  Ending e;
  e.statuses.assign(static_cast<size_t>(nproc), 0);
  int64_t alive = nproc;
  std::vector<bool> done(static_cast<size_t>(nproc), false);
  auto stop_all = [&](int sig) {
    for (int64_t r = 0; r < nproc; ++r)
      if (!done[r]) ::kill(pids[r], sig);
  };
  bool stopping = false, escalated = false;
  auto stop_deadline = std::chrono::steady_clock::time_point::max();
  auto next_poll = std::chrono::steady_clock::now();
  while (alive > 0) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      for (int64_t r = 0; r < nproc; ++r) {
        if (pids[r] != pid) continue;
        done[r] = true;
        --alive;
        const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        e.statuses[r] = status;
        // A worker that exits with an error failed by itself (also after the stop began: its
        // error may be the cause, see below); one killed by a signal failed unless we sent it.
        const bool errored = WIFEXITED(status) && WEXITSTATUS(status) != 0;
        if ((errored || (!ok && !stopping)) && e.failed < 0) e.failed = r;
        // Killed by a signal we did not send (SIGTERM when stopping, SIGKILL after the grace):
        // the cause, whatever errors the others then report about their broken connections.
        if (WIFSIGNALED(status) && e.killed < 0) {
          const int sig = WTERMSIG(status);
          if (!((sig == SIGTERM && stopping) || (sig == SIGKILL && escalated))) e.killed = r;
        }
      }
      continue;
    }
    if (!stopping && remote_cause && std::chrono::steady_clock::now() >= next_poll) {
      next_poll = std::chrono::steady_clock::now() + std::chrono::milliseconds(250);
      if (auto c = remote_cause()) e.remote = *c;
    }
    if ((e.failed >= 0 || g_stop_signal || !e.remote.empty()) && !stopping) {
      stopping = true;
      if (g_stop_signal) std::fprintf(stderr, "dhp: %s: stopping all workers\n", strsignal(g_stop_signal));
      stop_all(SIGTERM);
      stop_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    }
    if (stopping && std::chrono::steady_clock::now() > stop_deadline) {
      stop_all(SIGKILL);
      escalated = true;
      stop_deadline = std::chrono::steady_clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return e;
}

// What a local worker's failure says: "rank R on HOST failed (STATUS): ERROR", and whether
// it is a cause (an error of its own, or killed from outside) or only a lost connection.
struct Failure {
  std::string text;
  bool cause = false;
};

// The failure of this host's attempt. Several ranks may fail together (the others'
// collectives break when one exits): a worker killed from outside is the cause, else the
// first error written that is not a lost connection, else the first lost connection.
Failure local_failure(const Ending& e, const Job& job, const std::filesystem::path& errdir) {
  int64_t failed = e.killed >= 0 ? e.killed : e.failed;
  std::string err;
  bool cause = e.killed >= 0;
  long long first = -1;
  for (int pass = 0; pass < 2 && e.killed < 0 && first < 0; ++pass) {
    for (int64_t r = 0; r < static_cast<int64_t>(e.statuses.size()); ++r) {
      const std::string text = read_file(errdir / ("rank" + std::to_string(r)));
      const auto nl = text.find('\n');
      if (nl == std::string::npos) continue;
      const auto nl2 = text.find('\n', nl + 1);
      const long long t = std::atoll(text.substr(0, nl).c_str());
      const bool lost = text.compare(nl + 1, nl2 - nl - 1, "lost-peer") == 0;
      if (lost != (pass == 1)) continue;  // causes first
      if (first < 0 || t < first) {
        first = t;
        failed = r;
        err = nl2 == std::string::npos ? "" : text.substr(nl2 + 1);
        cause = !lost;
      }
    }
  }
  if (failed < 0) failed = 0;
  Failure f;
  f.cause = cause || (e.failed >= 0 && first < 0);  // an error with no report (e.g. exec failed)
  f.text = "rank " + std::to_string(job.first_rank() + failed) + (job.nodes.count > 1 ? " on " + job.host : "") +
           " failed (" + describe_status(e.statuses[failed]) + ")" + (err.empty() ? "" : ": " + err);
  return f;
}

// Reports why an attempt failed. With several hosts, the cause may be elsewhere: a failure
// of this host's own is posted; one that is only lost connections waits (up to 5 s) for the
// cause another host posts, and names it.
void report_failure(const Ending& e, const Job& job, const std::filesystem::path& errdir, LauncherStore* store,
                    int64_t attempt) {
  const std::string here = job.nodes.count > 1 ? " on this host" : "";
  if (!e.remote.empty() && e.failed < 0) {
    std::fprintf(stderr, "dhp: %s; stopped the workers on this host\n", e.remote.c_str());
    return;
  }
  const auto f = local_failure(e, job, errdir);
  if (store && job.nodes.count > 1) {
    std::optional<std::string> elsewhere = e.remote.empty() ? std::nullopt : std::optional<std::string>(e.remote);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    if (f.cause) store->post(attempt, f.text);
    while (!f.cause && !elsewhere && std::chrono::steady_clock::now() < until) {
      elsewhere = store->cause(attempt, std::chrono::seconds(1));
      if (!elsewhere) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (!f.cause && !elsewhere) store->post(attempt, f.text);
    if (!f.cause && elsewhere) {
      std::fprintf(stderr, "dhp: %s; stopped the workers on this host (%s)\n", elsewhere->c_str(), f.text.c_str());
      return;
    }
  }
  std::fprintf(stderr, "dhp: %s; stopped the other workers%s\n", f.text.c_str(), here.c_str());
}

int run_attempt(const Job& job, const std::vector<std::string>& argv, int64_t restart, LauncherStore* store,
                bool& worker_failed) {
  namespace fs = std::filesystem;
  worker_failed = false;
  const fs::path errdir = fs::temp_directory_path() / ("dhp-errors-" + std::to_string(::getpid()));
  fs::remove_all(errdir);
  fs::create_directories(errdir);
  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  std::function<std::optional<std::string>()> remote;
  if (store && job.nodes.count > 1)
    remote = [store, restart] { return store->cause(restart, std::chrono::seconds(1)); };
  const auto ending = supervise(start_workers(job, argv, restart, errdir), remote);
  int rc = 0;
  if (ending.failed >= 0 || !ending.remote.empty()) {
    report_failure(ending, job, errdir, store, restart);
    rc = 1;
    worker_failed = !g_stop_signal;
  } else if (g_stop_signal) {
    rc = 128 + g_stop_signal;
  }
  std::error_code ec;
  fs::remove_all(errdir, ec);
  return rc;
}

}  // namespace

int run_workers(int64_t nproc, const std::vector<std::string>& argv, int64_t max_restarts, const Nodes& nodes,
                std::chrono::milliseconds timeout) {
  DHP_CHECK(nproc >= 1, "--nproc must be >= 1, got ", nproc);
  DHP_CHECK(max_restarts >= 0, "--max-restarts must be >= 0, got ", max_restarts);
  DHP_CHECK(nodes.count >= 1, "--nnodes must be >= 1, got ", nodes.count);
  DHP_CHECK(nodes.rank >= 0 && nodes.rank < nodes.count, "--node-rank ", nodes.rank, " is outside 0 .. ",
            nodes.count - 1, " (--nnodes ", nodes.count, ")");
  DHP_CHECK(nodes.count == 1 || !nodes.master_addr.empty(),
            "--nnodes ", nodes.count, " needs --master-addr: the address of node 0's host, which every host reaches");
  DHP_CHECK(nodes.count == 1 || max_restarts == 0,
            "--max-restarts is not supported with --nnodes > 1: dhp's launchers do not restart hosts together; run "
            "each host under torchrun --nnodes ... --max-restarts K (its agents do) with checkpoint.resume=auto");
  Job job;
  job.nproc = nproc;
  job.nodes = nodes;
  if (nodes.master_port > 0) {
    job.port = nodes.master_port;
  } else if (std::getenv("MASTER_PORT")) {
    job.port = static_cast<int>(*env_int("MASTER_PORT"));
  } else if (nodes.count > 1) {
    job.port = 29500;
  }  // one host: the workers meet through a file, no port
  job.host = host_name();
  if (nodes.count > 1) job.host += " (" + dist::local_address_towards(nodes.master_addr) + ")";
  // Several hosts: the job's store lives in node 0's launcher (the workers connect as clients),
  // so that it outlives any worker and the launchers of other hosts can read a failure's cause.
  // One host: a store file per attempt (start_workers), and no launcher store.
  std::unique_ptr<LauncherStore> store;
  if (nodes.count > 1) {
    store = std::make_unique<LauncherStore>(nodes, job.port, timeout);
    store->meet(nproc, job.host);
  }
  auto args = argv;
  for (int64_t restart = 0;; ++restart) {
    bool worker_failed = false;
    const int rc = run_attempt(job, args, restart, store.get(), worker_failed);
    if (rc == 0 && store) store->finish();
    if (rc == 0 || !worker_failed || restart >= max_restarts) {
      if (rc != 0 && worker_failed && max_restarts > 0) {
        std::fprintf(stderr, "dhp: giving up after %lld restart(s) (--max-restarts %lld)\n",
                     static_cast<long long>(restart), static_cast<long long>(max_restarts));
      }
      return rc;
    }
    std::fprintf(stderr, "dhp: restart %lld of %lld: restarting all %lld workers from the newest complete checkpoint\n",
                 static_cast<long long>(restart + 1), static_cast<long long>(max_restarts),
                 static_cast<long long>(nproc));
    if (restart == 0) {  // later --set win: every restart resumes from the newest checkpoint
      args.push_back("--set");
      args.push_back("checkpoint.resume=auto");
    }
  }
}

}  // namespace dhp::launch
