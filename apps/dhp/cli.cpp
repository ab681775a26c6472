#include "cli.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <torch/version.h>

#include "dhp/core/log.h"
#include "dhp/dist/comm.h"

namespace dhp::cli {

const char* const kConfigFlags = R"(  --config FILE     YAML config (sections model, data, training, parallel, output)
  --set KEY=VALUE   override one key, VALUE parsed as YAML (repeatable), e.g.
                    --set training.steps=100 --set model.text.num_layers=2
)";

Args parse(int argc, char** argv, int first, const std::vector<std::string>& allowed) {
  Args a;
  auto ok = [&](const std::string& f) {
    for (const auto& x : allowed) if (x == f) return true;
    return false;
  };
  Flags flags(argc, argv, first);
  while (flags.next()) {
    const std::string& f = flags.flag();
    auto next = [&] { return flags.value(); };
    if (f == "-h" || f == "--help") {
      a.help = true;
    } else if (!ok(f)) {
      DHP_FAIL("unknown option '", flags.raw(), "' (see --help)");
    } else if (f == "--config") {
      a.config = next();
    } else if (f == "--set") {
      a.sets.push_back(next());
    } else if (f == "--out") {
      a.out = next();
    } else if (f == "--all") {
      a.all = true;
    } else if (f == "--print-schedule") {
      a.print_schedule = true;
    } else if (f == "--inject-fault") {
      a.faults.push_back(next());
    } else if (f == "--resume") {
      a.resume = true;
    } else if (f == "--master-addr") {
      a.nodes.master_addr = next();
      DHP_CHECK(!a.nodes.master_addr.empty(), "--master-addr needs a host name or address");
    } else if (f == "--nnodes" || f == "--node-rank" || f == "--master-port") {
      const int64_t x = parse_int(f, next());
      if (f == "--nnodes") {
        DHP_CHECK(x >= 1, "--nnodes expects a positive integer, got ", x);
        a.nodes.count = x;
      } else if (f == "--node-rank") {
        DHP_CHECK(x >= 0, "--node-rank expects a non-negative integer, got ", x);
        a.nodes.rank = x;
      } else {
        DHP_CHECK(x > 0 && x < 65536, "--master-port expects a TCP port (1-65535), got ", x);
        a.nodes.master_port = static_cast<int>(x);
      }
    } else if (f == "--nproc" || f == "--max-restarts") {
      const std::string v = next();
      int64_t x = -1;
      try {
        size_t used = 0;
        x = std::stoll(v, &used);
        if (used != v.size()) x = -1;
      } catch (const std::exception&) {
      }
      DHP_CHECK(x >= (f == "--nproc" ? 1 : 0), f, " expects a ", f == "--nproc" ? "positive" : "non-negative",
                " integer, got '", v, "'");
      (f == "--nproc" ? a.nproc : a.max_restarts) = x;
    }
  }
  return a;
}

std::string job_fingerprint(const Config& cfg) {
  Config resolved = cfg;  // to_yaml visits (non-const)
  const std::string yaml = to_yaml(resolved);
  uint64_t h = 1469598103934665603ull;  // FNV-1a, 64 bits
  for (unsigned char c : yaml) h = (h ^ c) * 1099511628211ull;
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(h));
  return std::string("dhp ") + DHP_VERSION + " (commit " + DHP_GIT_COMMIT + ", libtorch " + TORCH_VERSION +
         "), config " + hex;
}

dhp::train::Runtime worker_runtime(const std::optional<dhp::dist::WorkerEnv>& env, const Config& cfg) {
  dhp::train::Runtime rt;
  rt.timeout = cfg.parallel.timeout();
  if (env) {
    // The launcher counts the job's restarts in DHP_RESTART (launch.h), torchrun's agents in
    // TORCHELASTIC_RESTART_COUNT.
    for (const char* var : {"DHP_RESTART", "TORCHELASTIC_RESTART_COUNT"}) {
      if (const char* n = std::getenv(var); n && *n) {
        rt.restart = std::atoll(n);
        break;
      }
    }
    rt.rank = env->rank;
    rt.world = env->world;
    rt.local_world = env->local_world;
    rt.local_rank = env->local_rank;
    if (rt.world > 1) {
      auto transport = dhp::dist::process_transport(*env, cfg.parallel.socket_ifname);
      const std::string name = dhp::launch::host_name();
      // Named by the address its groups use (the first named interface's, when named).
      const std::string address =
          transport.interfaces.empty() ? transport.address : dhp::dist::interface_address(transport.interfaces[0]);
      const std::string host = name + (env->single_host() ? "" : " (" + address + ")");
      if (env->local_rank == 0 && !env->single_host())
        log_info("rank " + std::to_string(rt.rank) + " on " + name + ": the job's groups connect over " +
                 transport.describe() + "; store " + env->master_addr + ":" + std::to_string(env->master_port));
      // Under an agent store (torchrun's static rendezvous, dhp's own launcher) rank 0 is a
      // client like the others, under the keys of its attempt.
      // dhp's launcher on one host: a store file (nothing listens); otherwise c10d's TCPStore.
      const char* file = std::getenv("DHP_STORE_FILE");
      auto store = file && *file && env->single_host()
                       ? dhp::dist::make_file_store(file, rt.world)
                       : dhp::dist::make_tcp_store(env->master_addr, env->master_port, rt.world,
                                                   rt.rank == 0 && !env->agent_store, rt.timeout, std::move(transport));
      if (!env->store_prefix.empty()) store = store.prefixed(env->store_prefix);
      dhp::dist::check_same_job(store, rt.rank, rt.world, job_fingerprint(cfg), host);
      rt.store = std::make_shared<dhp::dist::Store>(std::move(store));
      rt.host = host;
    }
  }
  return rt;
}

int64_t parse_int(const std::string& flag, const std::string& v) {
  try {
    size_t used = 0;
    const long long x = std::stoll(v, &used);
    if (used == v.size()) return x;
  } catch (const std::exception&) {
  }
  DHP_FAIL(flag, " expects an integer, got '", v, "'");
}

double parse_double(const std::string& flag, const std::string& v) {
  try {
    size_t used = 0;
    const double x = std::stod(v, &used);
    if (used == v.size() && std::isfinite(x)) return x;
  } catch (const std::exception&) {
  }
  DHP_FAIL(flag, " expects a number, got '", v, "'");
}

std::vector<int64_t> parse_int_list(const std::string& flag, const std::string& v) {
  std::vector<int64_t> out;
  std::string cur;
  for (char c : v + ",") {
    if (c == ',') {
      if (!cur.empty()) out.push_back(parse_int(flag, cur));
      cur.clear();
    } else if (c != ' ') {
      cur += c;
    }
  }
  DHP_CHECK(!out.empty(), flag, " needs a comma-separated list of integers, got '", v, "'");
  return out;
}

}  // namespace dhp::cli
