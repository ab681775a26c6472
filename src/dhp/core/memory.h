// Per-process memory accounting for CPU tensors.
//
// install_memory_accounting() replaces libtorch's CPU allocator by one that counts live and
// peak bytes of every CPU tensor allocation and, when a limit is set, throws
// dhp::OutOfMemory instead of allocating past it. This lets a CPU run show where a strategy
// would run out of device memory. Counters are atomic; the allocator is thread-safe.
#pragma once

#include <cstdint>
#include <string>

#include "dhp/core/error.h"

namespace dhp {

class OutOfMemory : public Error {
 public:
  explicit OutOfMemory(const std::string& what) : Error(what) {}
};

// Installs the accounting allocator (idempotent). Call early in main or a test. Also tunes
// glibc malloc for training (large blocks stay in the heap, freed memory is kept; see
// memory.cpp): process-wide, like the allocator itself.
void install_memory_accounting();
bool memory_accounting_installed();

// Limit on live CPU tensor bytes; 0 = unlimited.
void set_memory_limit(int64_t bytes);
int64_t memory_limit();

int64_t memory_live_bytes();
int64_t memory_peak_bytes();
// Resets the peak to the current live bytes.
void reset_memory_peak();
// With DHP_MEMTRACE=1 in the environment: prints "[mem] WHAT live L peak P" (MiB) to
// stderr, to find where a step's peak comes from. Otherwise does nothing.
void memory_mark(const char* what);

// "1.5GiB", "512MiB", "2000000" -> bytes. Throws dhp::Error naming `what` on bad text.
int64_t parse_bytes(const std::string& text, const std::string& what);
// 1610612736 -> "1.50 GiB".
std::string format_bytes(int64_t bytes);

}  // namespace dhp
