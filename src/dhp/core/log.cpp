#include "dhp/core/log.h"

#include <atomic>
#include <cstdio>
#include <mutex>

namespace dhp {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
std::mutex g_mu;
}  // namespace

void set_log_level(LogLevel level) { g_level = static_cast<int>(level); }
LogLevel log_level() { return static_cast<LogLevel>(g_level.load()); }

void log(LogLevel level, const std::string& message) {
  if (static_cast<int>(level) < g_level.load()) return;
  static const char* names[] = {"debug", "info", "warn", "error"};
  std::lock_guard<std::mutex> lock(g_mu);
  std::fprintf(stderr, "[dhp %s] %s\n", names[static_cast<int>(level)], message.c_str());
  std::fflush(stderr);
}

}  // namespace dhp
