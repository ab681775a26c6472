#include "dhp/core/machine.h"

#include <dlfcn.h>
#include <torch/csrc/autograd/profiler_legacy.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>

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

double gemm_gflops(c10::ScalarType dtype, int64_t n, int reps) {
  auto a = torch::randn({n, n}).to(dtype), b = torch::randn({n, n}).to(dtype);
  torch::NoGradGuard no_grad;
  torch::matmul(a, b);  // warm-up
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    auto c = torch::matmul(a, b);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 2.0 * static_cast<double>(n * n * n) / s / 1e9);
  }
  return best;
}

double gemm_peak_gflops(c10::ScalarType dtype, bool quick) {
  double best = 0;
  for (int64_t n : quick ? std::vector<int64_t>{1024} : std::vector<int64_t>{512, 1024, 2048}) {
    best = std::max(best, gemm_gflops(dtype, n, quick ? 2 : 4));
  }
  return best;
}

struct StepProfiler::Impl {
  std::unique_ptr<torch::autograd::profiler::RecordProfile> record;
};

StepProfiler::StepProfiler(int64_t step, int64_t rank) {
  const char* dir = std::getenv("DHP_PROFILE");
  if (!dir || !*dir) return;
  const char* at = std::getenv("DHP_PROFILE_STEP");
  if (step != (at && *at ? std::atoll(at) : 3)) return;
  std::filesystem::create_directories(dir);
  impl_ = std::make_unique<Impl>();
  impl_->record = std::make_unique<torch::autograd::profiler::RecordProfile>(
      (std::filesystem::path(dir) / ("rank" + std::to_string(rank) + ".trace.json")).string());
}

StepProfiler::~StepProfiler() = default;

}  // namespace dhp
