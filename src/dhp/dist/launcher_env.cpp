#include "dhp/dist/launcher_env.h"

#include <cstdio>
#include <cstdlib>

#include "dhp/core/error.h"

namespace dhp::dist {
namespace {

std::optional<int64_t> env_int(const EnvLookup& env, const std::string& name) {
  const auto v = env(name);
  if (!v) return std::nullopt;
  char* end = nullptr;
  const long long x = std::strtoll(v->c_str(), &end, 10);
  DHP_CHECK(end && *end == '\0', "environment variable ", name, "='", *v, "' is not an integer");
  return x;
}

// "01-04" -> 01 02 03 04; "7" -> 7; a range keeps the width of its first bound.
void expand_range(const std::string& r, const std::string& list, std::vector<std::string>& out) {
  const auto dash = r.find('-');
  auto number = [&](const std::string& s) {
    DHP_CHECK(!s.empty() && s.find_first_not_of("0123456789") == std::string::npos, "host list '", list,
              "': '", r, "' is not a number or a range of numbers");
    return std::stoll(s);
  };
  if (dash == std::string::npos) {
    number(r);
    out.push_back(r);
    return;
  }
  const std::string a = r.substr(0, dash), b = r.substr(dash + 1);
  const long long lo = number(a), hi = number(b);
  DHP_CHECK(lo <= hi && hi - lo < 100000, "host list '", list, "': range '", r, "' is empty or too long");
  for (long long i = lo; i <= hi; ++i) {
    std::string s = std::to_string(i);
    if (s.size() < a.size()) s.insert(0, a.size() - s.size(), '0');
    out.push_back(s);
  }
}

// One item of a host list (no top-level comma): literal text and [..] groups, combined.
std::vector<std::string> expand_item(const std::string& item, const std::string& list) {
  std::vector<std::string> acc{""};
  size_t i = 0;
  while (i < item.size()) {
    if (item[i] != '[') {
      const size_t j = item.find('[', i);
      const std::string text = item.substr(i, j == std::string::npos ? std::string::npos : j - i);
      DHP_CHECK(text.find(']') == std::string::npos, "host list '", list, "': unmatched ']'");
      for (auto& a : acc) a += text;
      i = j == std::string::npos ? item.size() : j;
      continue;
    }
    const size_t close = item.find(']', i);
    DHP_CHECK(close != std::string::npos, "host list '", list, "': unmatched '['");
    std::vector<std::string> parts;
    const std::string inside = item.substr(i + 1, close - i - 1);
    size_t start = 0;
    for (size_t k = 0; k <= inside.size(); ++k) {
      if (k == inside.size() || inside[k] == ',') {
        expand_range(inside.substr(start, k - start), list, parts);
        start = k + 1;
      }
    }
    std::vector<std::string> next;
    for (const auto& a : acc)
      for (const auto& p : parts) next.push_back(a + p);
    acc = std::move(next);
    i = close + 1;
  }
  return acc;
}

// The variables of each launcher: rank, world size, local rank, local world size.
struct Names {
  const char *rank, *world, *local_rank, *local_world, *launcher;
};
const Names kTorchrun{"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "torchrun"};
const Names kSlurm{"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "srun"};
const Names kOpenMpi{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                     "OMPI_COMM_WORLD_LOCAL_SIZE", "mpirun"};
const Names kMpich{"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "mpirun"};

// Slurm: the tasks on this node, the node, and the first host of the step as the master.
void read_slurm(const EnvLookup& env, WorkerEnv& e) {
  e.node = env_int(env, "SLURM_NODEID").value_or(0);
  if (auto n = env_int(env, "SLURM_NTASKS_PER_NODE")) {
    e.local_world = *n;
  } else {
    for (const char* name : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
      if (auto spec = env(name)) {
        const auto per_node = expand_tasks_per_node(*spec);
        DHP_CHECK(e.node < static_cast<int64_t>(per_node.size()), name, "='", *spec, "' has no entry for SLURM_NODEID=",
                  e.node);
        e.local_world = per_node[static_cast<size_t>(e.node)];
        break;
      }
    }
  }
  if (!env("MASTER_ADDR")) {
    for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
      if (auto list = env(name)) {
        e.master_addr = expand_hostlist(*list).front();
        break;
      }
    }
  }
  if (!env("MASTER_PORT")) {
    if (auto id = env_int(env, "SLURM_JOB_ID")) e.master_port = static_cast<int>(10000 + *id % 20000);
  }
}

}  // namespace

EnvLookup process_env() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (!v || !*v) return std::nullopt;
    return std::string(v);
  };
}

std::vector<std::string> expand_hostlist(const std::string& list) {
  std::vector<std::string> out;
  int depth = 0;
  size_t start = 0;
  for (size_t i = 0; i <= list.size(); ++i) {
    if (i < list.size() && list[i] == '[') ++depth;
    if (i < list.size() && list[i] == ']') --depth;
    DHP_CHECK(depth >= 0 && depth <= 1, "host list '", list, "': unbalanced or nested brackets");
    if (i == list.size() || (list[i] == ',' && depth == 0)) {
      const std::string item = list.substr(start, i - start);
      DHP_CHECK(!item.empty(), "host list '", list, "': an empty host name");
      for (auto& h : expand_item(item, list)) out.push_back(std::move(h));
      start = i + 1;
    }
  }
  DHP_CHECK(depth == 0, "host list '", list, "': unmatched '['");
  return out;
}

std::vector<int64_t> expand_tasks_per_node(const std::string& spec) {
  std::vector<int64_t> out;
  size_t start = 0;
  for (size_t i = 0; i <= spec.size(); ++i) {
    if (i < spec.size() && spec[i] != ',') continue;
    const std::string item = spec.substr(start, i - start);
    long long tasks = 0, times = 1;
    char tail = 0;
    const bool ok = std::sscanf(item.c_str(), "%lld(x%lld)%c", &tasks, &times, &tail) == 2 ||
                    (std::sscanf(item.c_str(), "%lld%c", &tasks, &tail) == 1 && (times = 1));
    DHP_CHECK(ok && tasks >= 1 && times >= 1, "tasks per node '", spec, "': '", item, "' is not N or N(xM)");
    out.insert(out.end(), static_cast<size_t>(times), tasks);
    start = i + 1;
  }
  return out;
}

std::optional<WorkerEnv> worker_env(const EnvLookup& env) {
  const Names* found = nullptr;
  WorkerEnv e;
  for (const Names* n : {&kTorchrun, &kSlurm, &kOpenMpi, &kMpich}) {
    if (auto r = env_int(env, n->rank)) {
      found = n;
      e.rank = *r;
      break;
    }
  }
  if (!found) return std::nullopt;
  const bool torchrun = found == &kTorchrun;
  auto w = env_int(env, found->world);
  DHP_CHECK(w || !torchrun, "RANK is set but WORLD_SIZE is not");
  e.world = w.value_or(1);
  // torchrun's local rank defaults to the rank (one machine); the others' to 0.
  e.local_rank = env_int(env, found->local_rank).value_or(torchrun ? e.rank : 0);
  e.local_world = env_int(env, found->local_world).value_or(e.world);
  e.launcher = torchrun && env("DHP_LAUNCHED") ? "dhp" : found->launcher;
  if (torchrun) {
    e.node = env_int(env, "GROUP_RANK").value_or(0);
    e.agent_store = env("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True";
    if (e.agent_store) e.store_prefix = "/worker/attempt_" + env("TORCHELASTIC_RESTART_COUNT").value_or("0");
  }
  if (found == &kSlurm) read_slurm(env, e);
  DHP_CHECK(e.world >= 1 && e.rank >= 0 && e.rank < e.world, "rank ", e.rank, " is outside a world of ", e.world,
            " (from the ", e.launcher, " environment: ", found->rank, ", ", found->world, ")");
  DHP_CHECK(e.local_world >= 1 && e.local_world <= e.world && e.local_rank >= 0 && e.local_rank < e.local_world,
            "local rank ", e.local_rank, " of ", e.local_world, " ranks on this host does not fit a world of ", e.world,
            " (from the ", e.launcher, " environment: ", found->local_rank, ", ", found->local_world, ")");
  if (auto a = env("MASTER_ADDR")) {
    e.master_addr = *a;
  } else if (found == &kOpenMpi || found == &kMpich) {
    DHP_CHECK(e.single_host(), "this mpirun job spans hosts (", e.local_world, " of its ", e.world,
              " ranks on this one) but MASTER_ADDR is not set: MPI does not say which host runs rank 0. Pass the "
              "first host's address to every rank, e.g. mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=29500 "
              "(Open MPI) or -genv MASTER_ADDR <host of rank 0> (MPICH)");
  }
  if (auto p = env_int(env, "MASTER_PORT")) {
    DHP_CHECK(*p > 0 && *p < 65536, "MASTER_PORT=", *p, " is not a TCP port");
    e.master_port = static_cast<int>(*p);
  }
  return e;
}

}  // namespace dhp::dist
