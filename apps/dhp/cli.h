// What the dhp commands share: the flag walker, the flags common to several commands, the
// worker runtime from a launcher's environment, and the commands themselves (one file
// each, cmd_<name>.cpp; main.cpp dispatches). A command returns the exit code and throws
// dhp::Error for anything the user got wrong; only main turns that into a message.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dhp/core/error.h"
#include "dhp/train/parallel_model.h"
#include "dhp/dist/launcher_env.h"
#include "dhp/train/config.h"
#include "launch.h"

namespace dhp::cli {

// --config and --set, as every command that reads a config prints them in --help.
extern const char* const kConfigFlags;

struct Args {
  std::string config;
  std::vector<std::string> sets;
  std::string out;
  bool help = false;
  bool all = false;
  bool print_schedule = false;
  bool resume = false;
  int64_t nproc = 1;
  int64_t max_restarts = 0;
  launch::Nodes nodes;  // --nnodes, --node-rank, --master-addr, --master-port
  std::vector<std::string> faults;  // --inject-fault (dhp train; tests)
};

// Walks the flags of argv from `first`: "--flag VALUE" or "--flag=VALUE" (split at the
// first '=', so "--set=a.b=1" works too).
class Flags {
 public:
  Flags(int argc, char** argv, int first) : argc_(argc), argv_(argv), i_(first - 1) {}
  // Advances to the next flag; false at the end.
  bool next() {
    if (++i_ >= argc_) return false;
    flag_ = argv_[i_];
    has_value_ = false;
    const auto eq = flag_.find('=');
    if (flag_.rfind("--", 0) == 0 && eq != std::string::npos) {
      value_ = flag_.substr(eq + 1);
      flag_ = flag_.substr(0, eq);
      has_value_ = true;
    }
    return true;
  }
  const std::string& flag() const { return flag_; }
  const char* raw() const { return argv_[i_]; }
  // The flag's value; throws naming the flag when there is none.
  std::string value() {
    if (has_value_) return value_;
    DHP_CHECK(i_ + 1 < argc_, flag_, " needs a value");
    return argv_[++i_];
  }

 private:
  int argc_;
  char** argv_;
  int i_;
  std::string flag_, value_;
  bool has_value_ = false;
};

// Parses the flags shared by the subcommands among `allowed`; throws dhp::Error on an unknown flag.
Args parse(int argc, char** argv, int first, const std::vector<std::string>& allowed);
// The job's rank, world and store from a launcher's environment (one process without one):
// the store (a client of the launcher's under torchrun's agent store, else rank 0 hosts it),
// the transport of its groups (dist/transport.h, parallel.socket_ifname) and the start-up check
// that every rank runs the same dhp and config (dist::check_same_job).
train::Runtime worker_runtime(const std::optional<dist::WorkerEnv>& env, const Config& cfg);
// What every rank of a job must share: dhp's version, its libtorch, the commit it was
// configured at, and a hash of the resolved config.
std::string job_fingerprint(const Config& cfg);
// An integer flag value / a comma-separated list of them; throws naming the flag.
int64_t parse_int(const std::string& flag, const std::string& v);
double parse_double(const std::string& flag, const std::string& v);  // finite numbers only
std::vector<int64_t> parse_int_list(const std::string& flag, const std::string& v);

// The commands: argv[first..] are the command's own flags.
int cmd_train(int argc, char** argv, int first);
int cmd_bench(int argc, char** argv, int first);
int cmd_plan(int argc, char** argv, int first);
int cmd_params(int argc, char** argv, int first);
int cmd_config(int argc, char** argv, int first);
int cmd_forward(int argc, char** argv, int first);
int cmd_convert(int argc, char** argv, int first);
int cmd_tokenize(int argc, char** argv, int first);
int cmd_data(int argc, char** argv, int first);

}  // namespace dhp::cli
