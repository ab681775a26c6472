// The message of the dhp::Error that a call throws, for tests that check what an error says.
#pragma once

#include <functional>
#include <string>

#include "dhp/core/error.h"

namespace dhp::testing {

// f()'s dhp::Error message, or "<no error>" when it returns.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const dhp::Error& e) {
    return e.what();
  }
  return "<no error>";
}

}  // namespace dhp::testing
