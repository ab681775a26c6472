// ProcessGroups: the communicators of one module on this rank, built once from a
// validated ModuleLayout and passed explicitly (no global group state).
#pragma once

#include "dhp/dist/comm.h"
#include "dhp/dist/layout.h"

namespace dhp::dist {

struct ProcessGroups {
  bool member = false;  // does this rank run the module?
  Group module;         // all ranks of the module
  Group tp, sp, dp;     // this rank's sub-groups (groups of one when the degree is 1)
  Group data;           // sp x dp with this rank's tp coordinate (the sp or dp group when one is 1)
};

// Collective over all ranks of the job (each builds the groups it belongs to, in the fixed
// order module, tp, sp, dp, so no two ranks wait on each other crosswise). A rank outside
// the layout returns {member = false} at once.
ProcessGroups make_process_groups(const Store& store, const ModuleLayout& layout, int64_t global_rank,
                                  std::chrono::milliseconds timeout);

}  // namespace dhp::dist
