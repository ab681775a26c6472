#include "dhp/core/memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <malloc.h>

#include <cstdlib>
#include "dhp/core/torch_version.h"

#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>

namespace dhp {
namespace {

std::atomic<int64_t> g_live{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_limit{0};
std::atomic<bool> g_installed{false};

// Every block carries a 64-byte header holding its size, so the data pointer can be its
// own deleter context (libtorch's raw_allocate requires that) and alignment stays 64.
constexpr size_t kHeader = 64;

void delete_block(void* data) {
  if (data == nullptr) return;
  char* base = static_cast<char*>(data) - kHeader;
  int64_t bytes = 0;
  std::memcpy(&bytes, base, sizeof(bytes));
  g_live.fetch_sub(bytes, std::memory_order_relaxed);
  c10::free_cpu(base);
}

class AccountingAllocator final : public c10::Allocator {
 public:
#if DHP_TORCH_AT_LEAST(2, 3)
  c10::DataPtr allocate(size_t n) override { return do_allocate(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
#else
  c10::DataPtr allocate(size_t n) const override { return do_allocate(n); }
#endif
  c10::DeleterFnPtr raw_deleter() const override { return &delete_block; }

 private:
  c10::DataPtr do_allocate(size_t n) const {
    const auto bytes = static_cast<int64_t>(n);
    const int64_t live = g_live.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    const int64_t limit = g_limit.load(std::memory_order_relaxed);
    if (limit > 0 && live > limit) {
      g_live.fetch_sub(bytes, std::memory_order_relaxed);
      throw OutOfMemory("out of memory: allocating " + format_bytes(bytes) + " with " +
                        format_bytes(live - bytes) + " live would exceed the memory limit of " +
                        format_bytes(limit) + " (--memory-limit)");
    }
    int64_t peak = g_peak.load(std::memory_order_relaxed);
    while (live > peak && !g_peak.compare_exchange_weak(peak, live)) {
    }
    void* base = nullptr;
    try {
      base = c10::alloc_cpu(n + kHeader);
    } catch (...) {
      g_live.fetch_sub(bytes, std::memory_order_relaxed);
      throw;
    }
    std::memcpy(base, &bytes, sizeof(bytes));
    void* data = static_cast<char*>(base) + kHeader;
    return c10::DataPtr(data, data, &delete_block, c10::Device(c10::DeviceType::CPU));
  }
};

}  // namespace

void install_memory_accounting() {
  static std::once_flag once;
  std::call_once(once, [] {
    // glibc serves blocks above its (adaptive) mmap threshold with fresh mmaps, and returns
    // freed heap tops to the system: a training step then pays page faults to zero the same
    // hundreds of MB every step (measured: step times 2x longer and erratic, system time
    // ~half of user time). Keep blocks up to 32 MiB (glibc's maximum threshold) in the heap,
    // and keep freed memory for the next step. Environment settings (MALLOC_*_) win.
    if (!std::getenv("MALLOC_MMAP_THRESHOLD_")) mallopt(M_MMAP_THRESHOLD, 32 << 20);
    if (!std::getenv("MALLOC_TRIM_THRESHOLD_")) mallopt(M_TRIM_THRESHOLD, 1 << 30);
    if (!std::getenv("MALLOC_TOP_PAD_")) mallopt(M_TOP_PAD, 256 << 20);
    static AccountingAllocator alloc;
    c10::SetCPUAllocator(&alloc, /*priority=*/100);
    g_installed = true;
  });
}

bool memory_accounting_installed() { return g_installed.load(); }
void set_memory_limit(int64_t bytes) { g_limit = bytes < 0 ? 0 : bytes; }
int64_t memory_limit() { return g_limit.load(); }
int64_t memory_live_bytes() { return g_live.load(); }
int64_t memory_peak_bytes() { return g_peak.load(); }
void reset_memory_peak() { g_peak = g_live.load(); }

void memory_mark(const char* what) {
  static const bool on = [] {
    const char* e = std::getenv("DHP_MEMTRACE");
    return e != nullptr && std::string(e) == "1";
  }();
  if (!on) return;
  const char* rank = std::getenv("RANK");
  std::fprintf(stderr, "[mem %s] %-28s live %8.1f MiB peak %8.1f MiB\n", rank ? rank : "0", what,
               g_live.load() / 1048576.0, g_peak.load() / 1048576.0);
}

int64_t parse_bytes(const std::string& text, const std::string& what) {
  size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(text, &pos);
  } catch (const std::exception&) {
    DHP_FAIL(what, ": expected a size like 2GiB, 512MiB or 1000000, got '", text, "'");
  }
  std::string unit = text.substr(pos);
  for (auto& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  double mult = 1;
  if (unit.empty() || unit == "b") mult = 1;
  else if (unit == "kib" || unit == "k") mult = 1024.0;
  else if (unit == "mib" || unit == "m") mult = 1024.0 * 1024;
  else if (unit == "gib" || unit == "g") mult = 1024.0 * 1024 * 1024;
  else if (unit == "kb") mult = 1e3;
  else if (unit == "mb") mult = 1e6;
  else if (unit == "gb") mult = 1e9;
  else DHP_FAIL(what, ": unknown size unit '", unit, "' in '", text, "' (use B, KiB, MiB, GiB, KB, MB, GB)");
  DHP_CHECK(v >= 0 && std::isfinite(v), what, ": size must be >= 0, got '", text, "'");
  return static_cast<int64_t>(v * mult);
}

std::string format_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (std::abs(v) >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[64];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
  return buf;
}

}  // namespace dhp
