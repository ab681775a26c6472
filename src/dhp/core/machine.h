// What this process runs on: CPU threads and the BLAS behind libtorch's fp32 GEMMs.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <string>

namespace dhp {

// "OpenBLAS 0.3.21 core SkylakeX" when libtorch's BLAS is OpenBLAS, else "unknown BLAS".
std::string blas_description();
// Non-empty when the BLAS runs slow generic kernels (OpenBLAS detected a generic CPU, as under
// some hypervisors): a hint saying how to select the right kernels. dhp never sets it itself.
std::string blas_hint();

// Best GFLOP/s of an n x n x n matmul in `dtype` over `reps` timed runs (after a warm-up),
// with this process's intra-op threads.
double gemm_gflops(c10::ScalarType dtype, int64_t n, int reps);
// The GEMM peak: the best of gemm_gflops over square sizes 512, 1024, 2048 (1024 only when quick).
double gemm_peak_gflops(c10::ScalarType dtype, bool quick = false);

// Op-level profile of one training step for diagnosis: with DHP_PROFILE=DIR in the
// environment, the step numbered DHP_PROFILE_STEP (default 3) of each rank is recorded with
// libtorch's profiler and written as a Chrome trace to DIR/rank<R>.trace.json. Construct
// before the step and destroy after it; does nothing otherwise. (libtorch's legacy profiler:
// the one version-specific call, here.)
class StepProfiler {
 public:
  StepProfiler(int64_t step, int64_t rank);
  ~StepProfiler();
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dhp
