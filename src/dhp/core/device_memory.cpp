#include "dhp/core/device_memory.h"

#include "dhp/core/build_config.h"
#include "dhp/core/error.h"
#include "dhp/core/memory.h"

#if DHP_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#endif

namespace dhp {
namespace {

#if DHP_WITH_CUDA
// Index 0 of the allocator's stat arrays is the aggregate over its pools (StatType::AGGREGATE).
constexpr size_t kAggregate = 0;
#endif

void check_cuda_build(const c10::Device& device) {
  DHP_CHECK(device.is_cpu() || DHP_WITH_CUDA, "device ", device.str(), ": this dhp is built against a libtorch without ",
            "CUDA (see README, Building for GPUs)");
}

}  // namespace

int64_t device_peak_bytes(const c10::Device& device) {
  if (device.is_cpu()) return memory_peak_bytes();
  check_cuda_build(device);
#if DHP_WITH_CUDA
  return c10::cuda::CUDACachingAllocator::getDeviceStats(device.index()).allocated_bytes[kAggregate].peak;
#else
  return 0;
#endif
}

void reset_device_peak(const c10::Device& device) {
  if (device.is_cpu()) return reset_memory_peak();
  check_cuda_build(device);
#if DHP_WITH_CUDA
  c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
#endif
}

void set_device_memory_limit(const c10::Device& device, int64_t bytes) {
  if (device.is_cpu()) return set_memory_limit(bytes);
  check_cuda_build(device);
#if DHP_WITH_CUDA
  size_t free_bytes = 0, total = 0;
  const int before = [] {
    int d = 0;
    cudaGetDevice(&d);
    return d;
  }();
  cudaSetDevice(device.index());
  const auto err = cudaMemGetInfo(&free_bytes, &total);
  cudaSetDevice(before);
  DHP_CHECK(err == cudaSuccess, "training.memory_limit on ", device.str(), ": cudaMemGetInfo failed: ",
            cudaGetErrorString(err));
  DHP_CHECK(bytes <= static_cast<int64_t>(total), "training.memory_limit=", format_bytes(bytes), " exceeds ",
            device.str(), "'s ", format_bytes(static_cast<int64_t>(total)));
  const double fraction = bytes > 0 ? static_cast<double>(bytes) / static_cast<double>(total) : 1.0;
  c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction, device.index());
#else
  (void)bytes;
#endif
}

void use_device(const c10::Device& device) {
  if (device.is_cpu()) return;
  check_cuda_build(device);
#if DHP_WITH_CUDA
  c10::cuda::set_device(device.index());
#endif
}

}  // namespace dhp
