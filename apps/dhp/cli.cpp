#include "cli.h"

#include <cstdlib>
#include <string>

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

dhp::train::Runtime worker_runtime(const std::optional<dhp::launch::WorkerEnv>& env, double timeout_s) {
  dhp::train::Runtime rt;
  rt.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  if (env) {
    // The launcher counts the job's restarts in DHP_RESTART (launch.h).
    if (const char* n = std::getenv("DHP_RESTART"); n && *n) rt.restart = std::atoll(n);
    rt.rank = env->rank;
    rt.world = env->world;
    rt.local_world = env->local_world;
    rt.local_rank = env->local_rank;
    if (rt.world > 1) {
      rt.store = std::make_shared<dhp::dist::Store>(
          dhp::dist::make_tcp_store(env->master_addr, env->master_port, rt.world, rt.rank == 0, rt.timeout));
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
