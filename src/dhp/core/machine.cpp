#include "dhp/core/machine.h"

#include <dlfcn.h>

#include <cstdlib>
#include <fstream>

namespace dhp {
namespace {

std::string openblas_call(const char* symbol) {
  using Fn = char* (*)();
  auto fn = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, symbol));
  if (fn == nullptr) return "";
  const char* s = fn();
  return s ? std::string(s) : std::string();
}

bool cpu_has(const std::string& flag) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) == 0) return line.find(" " + flag) != std::string::npos;
  }
  return false;
}

}  // namespace

std::string blas_description() {
  const std::string core = openblas_call("openblas_get_corename");
  if (core.empty()) return "unknown BLAS";
  std::string config = openblas_call("openblas_get_config");
  return (config.empty() ? std::string("OpenBLAS") : config.substr(0, config.find(' ', 9))) + " core " + core;
}

std::string blas_hint() {
  const std::string core = openblas_call("openblas_get_corename");
  if (core.empty()) return "";
  const bool generic = core == "Prescott" || core == "Core2" || core == "Nehalem" || core == "Katmai";
  if (!generic) return "";
  const char* set = std::getenv("OPENBLAS_CORETYPE");
  std::string want = cpu_has("avx512f") ? "SkylakeX" : cpu_has("avx2") ? "Haswell" : "";
  std::string hint = "OpenBLAS uses its generic '" + core + "' kernels on this CPU";
  if (set) return hint + " (OPENBLAS_CORETYPE=" + set + " is set)";
  if (want.empty()) return "";
  return hint + "; fp32 GEMMs may run several times faster with OPENBLAS_CORETYPE=" + want +
         " in the environment";
}

}  // namespace dhp
