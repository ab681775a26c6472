// Minimal logging to stderr and wall-clock timing.
#pragma once

#include <chrono>
#include <string>

namespace dhp {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

void set_log_level(LogLevel level);
LogLevel log_level();
// Writes "[dhp LEVEL] message\n" to stderr when level >= log_level(). Thread-safe.
void log(LogLevel level, const std::string& message);
inline void log_info(const std::string& m) { log(LogLevel::kInfo, m); }
inline void log_warn(const std::string& m) { log(LogLevel::kWarn, m); }

// Seconds since construction (steady clock).
class Timer {
 public:
  Timer() : start_(std::chrono::steady_clock::now()) {}
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  void reset() { start_ = std::chrono::steady_clock::now(); }

 private:
  std::chrono::steady_clock::time_point start_;
};

}  // namespace dhp
