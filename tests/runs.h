// Helpers of the tests that run the dhp binary: a shell command line with a hard time limit,
// the losses a run wrote, and the flags of a tiny 3-step training run.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace dhp::testing {

struct ShellResult {
  int rc = -1;  // the command's exit code; 124 when it ran past the limit
  std::string output;  // stdout and stderr together
};

// Runs `cmd` (any bash, quotes included: it is written to a script) under `timeout limit_s`.
inline ShellResult sh(const std::string& cmd, int limit_s = 120) {
  namespace fs = std::filesystem;
  static int calls = 0;
  const std::string stem = "dhp-sh-" + std::to_string(::getpid()) + "-" + std::to_string(++calls);
  const fs::path script = fs::temp_directory_path() / (stem + ".sh"), out = fs::temp_directory_path() / (stem + ".log");
  {
    std::ofstream f(script);
    f << cmd << "\n";
  }
  const int status = std::system(("timeout " + std::to_string(limit_s) + " bash " + script.string() + " > " +
                                  out.string() + " 2>&1").c_str());
  ShellResult r;
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream f(out);
  std::stringstream ss;
  ss << f.rdbuf();
  r.output = ss.str();
  fs::remove(out);
  fs::remove(script);
  return r;
}

// The "loss" of each line of DIR/metrics.jsonl.
inline std::vector<double> losses(const std::filesystem::path& dir) {
  std::vector<double> out;
  std::ifstream f(dir / "metrics.jsonl");
  std::string line;
  while (std::getline(f, line)) {
    const auto p = line.find("\"loss\": ");
    if (p != std::string::npos) out.push_back(std::stod(line.substr(p + 8)));
  }
  return out;
}

// A tiny run: 3 steps of 4 small images, no evaluation, a 30 s collective timeout.
inline const std::string kTiny =
    " --set training.steps=3 --set data.batch_size=4 --set data.min_side=56 --set data.max_side=112"
    " --set data.eval_samples=0 --set parallel.timeout_s=30";

}  // namespace dhp::testing
