#include "launch.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "dhp/core/error.h"

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

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  DHP_CHECK(fd >= 0, "cannot open a socket to find a free port: ", std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  ::close(fd);
  DHP_CHECK(ok, "cannot find a free port on 127.0.0.1: ", std::strerror(errno));
  return ntohs(a.sin_port);
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

std::optional<WorkerEnv> worker_env() {
  // Each launcher's variables: rank, world size, local rank, local world size.
  struct Names {
    const char *rank, *world, *local_rank, *local_world, *launcher;
  };
  static const Names kLaunchers[] = {
      {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "torchrun"},
      {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "srun"},
      {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
       "mpirun"},
      {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "mpirun"},
  };
  WorkerEnv e;
  const Names* found = nullptr;
  for (const auto& n : kLaunchers) {
    if (auto r = env_int(n.rank)) {
      found = &n;
      e.rank = *r;
      break;
    }
  }
  if (!found) return std::nullopt;
  const bool torchrun = found == &kLaunchers[0];
  auto w = env_int(found->world);
  DHP_CHECK(w || !torchrun, "RANK is set but WORLD_SIZE is not");
  e.world = w.value_or(1);
  // torchrun's local rank defaults to the rank (one machine); the others' to 0.
  e.local_rank = env_int(found->local_rank).value_or(torchrun ? e.rank : 0);
  e.local_world = env_int(found->local_world).value_or(e.world);
  e.launcher = torchrun && std::getenv("DHP_LAUNCHED") ? "dhp" : found->launcher;
  DHP_CHECK(e.world >= 1 && e.rank >= 0 && e.rank < e.world, "rank ", e.rank, " is outside a world of ", e.world,
            " (from the ", e.launcher, " environment)");
  if (const char* a = std::getenv("MASTER_ADDR"); a && *a) e.master_addr = a;
  if (auto p = env_int("MASTER_PORT")) {
    DHP_CHECK(*p > 0 && *p < 65536, "MASTER_PORT=", *p, " is not a TCP port");
    e.master_port = static_cast<int>(*p);
  }
  return e;
}

void report_worker_error(const std::string& message) {
  const char* path = std::getenv("DHP_ERROR_FILE");
  if (!path || !*path) return;
  if (std::filesystem::exists(path)) return;  // the first error is the cause
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(
                      std::chrono::system_clock::now().time_since_epoch()).count();
  std::ofstream f(path);
  f << us << "\n" << message;
}

namespace {

// One attempt: starts the workers, waits for all of them. rc 0 on success; `worker_failed`
// tells a worker's failure (restartable) from a stop asked of the launcher.
// Forks and execs the workers of one attempt, each with its rank's environment.
std::vector<pid_t> start_workers(int64_t nproc, const std::vector<std::string>& argv, int64_t restart, int port,
                                 const std::filesystem::path& errdir) {
  std::vector<pid_t> pids;
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::fprintf(stderr, "dhp: starting %lld workers (rendezvous 127.0.0.1:%d)\n", static_cast<long long>(nproc), port);
  for (int64_t r = 0; r < nproc; ++r) {
    const pid_t pid = ::fork();
    DHP_CHECK(pid >= 0, "fork failed for rank ", r, ": ", std::strerror(errno));
    if (pid == 0) {
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      ::setenv("DHP_LAUNCHED", "1", 1);
      ::setenv("DHP_RESTART", std::to_string(restart).c_str(), 1);
      ::setenv("DHP_ERROR_FILE", (errdir / ("rank" + std::to_string(r))).c_str(), 1);
      ::execv("/proc/self/exe", args.data());
      std::fprintf(stderr, "dhp: cannot start worker %lld: %s\n", static_cast<long long>(r), std::strerror(errno));
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  return pids;
}

// How the workers of one attempt ended.
struct Ending {
  std::vector<int> statuses;  // waitpid status per rank
  int64_t failed = -1;        // first rank that failed by itself (-1: none)
  int64_t killed = -1;        // first rank killed by a signal the launcher did not send
};

// Waits for every worker; once one fails (or the launcher is signalled) stops the others with
// SIGTERM, and with SIGKILL after 5 s of grace.
Ending supervise(const std::vector<pid_t>& pids) {
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
    if ((e.failed >= 0 || g_stop_signal) && !stopping) {
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

// Names the rank that caused a failed attempt. Several ranks may fail together (the others'
// collectives break when one exits): a worker killed from outside is the cause, else the
// first error written (any rank that recorded one counts, even one stopped while exiting).
void report_failure(const Ending& e, const std::filesystem::path& errdir) {
  int64_t failed = e.killed >= 0 ? e.killed : e.failed;
  std::string err;
  long long first = -1;
  for (int64_t r = 0; r < static_cast<int64_t>(e.statuses.size()) && e.killed < 0; ++r) {
    const std::string text = read_file(errdir / ("rank" + std::to_string(r)));
    const auto nl = text.find('\n');
    const long long t = nl == std::string::npos ? -1 : std::atoll(text.substr(0, nl).c_str());
    if (t >= 0 && (first < 0 || t < first)) {
      first = t;
      failed = r;
      err = text.substr(nl + 1);
    }
  }
  std::fprintf(stderr, "dhp: rank %lld failed (%s)%s%s; stopped the other workers\n", static_cast<long long>(failed),
               describe_status(e.statuses[failed]).c_str(), err.empty() ? "" : ": ", err.c_str());
}

int run_attempt(int64_t nproc, const std::vector<std::string>& argv, int64_t restart, bool& worker_failed) {
  namespace fs = std::filesystem;
  worker_failed = false;
  const int port = std::getenv("MASTER_PORT") ? static_cast<int>(*env_int("MASTER_PORT")) : free_port();
  const fs::path errdir = fs::temp_directory_path() / ("dhp-errors-" + std::to_string(::getpid()));
  fs::create_directories(errdir);
  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  const auto ending = supervise(start_workers(nproc, argv, restart, port, errdir));
  int rc = 0;
  if (ending.failed >= 0) {
    report_failure(ending, errdir);
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

int run_workers(int64_t nproc, const std::vector<std::string>& argv, int64_t max_restarts) {
  DHP_CHECK(nproc >= 1, "--nproc must be >= 1, got ", nproc);
  DHP_CHECK(max_restarts >= 0, "--max-restarts must be >= 0, got ", max_restarts);
  auto args = argv;
  for (int64_t restart = 0;; ++restart) {
    bool worker_failed = false;
    const int rc = run_attempt(nproc, args, restart, worker_failed);
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
