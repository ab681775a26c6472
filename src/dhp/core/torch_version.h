// The libtorch version dhp is compiled against, for the few places where the C++ API
// changed between 1.13 (Debian 12) and 2.x.
#pragma once

#include <torch/version.h>

// True when the libtorch is `major`.`minor` or newer (correct across major versions: 3.0
// is newer than 2.3).
#define DHP_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))
