// The memory figures of the training device, one interface for CPU and GPU: on the CPU the
// accounting allocator's (memory.h); on a CUDA device the caching allocator's bytes held
// by tensors (what torch.cuda.max_memory_allocated reports), with training.memory_limit
// applied as the allocator's memory fraction of the device, so that an 80 GB GPU can be
// emulated on a bigger one. A CUDA allocation past the limit raises libtorch's CUDA "out of
// memory" error, which dhp bench classifies as an OOM like the CPU's OutOfMemory.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>

namespace dhp {

int64_t device_peak_bytes(const c10::Device& device);
// Resets the peak to what is held now (every step starts from its own).
void reset_device_peak(const c10::Device& device);
// Caps what tensors may hold on `device` (0 = no cap). Throws dhp::Error on a CUDA device in
// a build without CUDA, or when the cap exceeds the device's memory.
void set_device_memory_limit(const c10::Device& device, int64_t bytes);
// Makes a CUDA `device` this process's current device (what libtorch and NCCL use where no
// tensor names one: cuBLAS handles, streams); nothing for the CPU. Throws like the above in
// a build without CUDA.
void use_device(const c10::Device& device);

}  // namespace dhp
