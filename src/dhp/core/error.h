// Errors. Caller mistakes (bad config values, bad input files) throw dhp::Error with a
// message that names the bad value and where it came from; invariants use
// TORCH_INTERNAL_ASSERT. Library code never exits: only main() turns an exception into
// an exit code and one readable line.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace dhp {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {
template <class... Args>
std::string str_cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
}  // namespace detail

}  // namespace dhp

// DHP_CHECK(cond, parts...): throws dhp::Error(parts...) when cond is false.
#define DHP_CHECK(cond, ...)                                      \
  do {                                                            \
    if (!(cond)) {                                                \
      throw ::dhp::Error(::dhp::detail::str_cat(__VA_ARGS__));    \
    }                                                             \
  } while (0)

#define DHP_FAIL(...) throw ::dhp::Error(::dhp::detail::str_cat(__VA_ARGS__))
