// ProcessGroups: the communicators of one module on this rank, built once from a
// validated ModuleLayout and passed explicitly (no global group state).
#pragma once

#include "dhp/dist/comm.h"
#include "dhp/dist/layout.h"

namespace dhp::dist {

struct ProcessGroups {
  bool member = false;  // does this rank run the module?
  Group module;         // all ranks of the module (never connected: nothing communicates on it)
  Group tp, sp, dp;     // this rank's sub-groups (groups of one when the degree is 1)
  Group data;           // sp x dp with this rank's tp coordinate (the sp or dp group when one is 1)
  Group grads;          // the data group's members again, for gradient reductions that overlap the
                        // backward (connected only when asked for and the strategy uses `data`)
};

// The sub-groups a strategy communicates on (the others are made unconnected: an NCCL
// communicator costs GPU memory). none / dp: data; sp: sp, data; tp: tp, data; zero3: dp.
struct GroupUse {
  bool tp = false, sp = false, dp = false, data = false;
};
GroupUse groups_used(Strategy s);

// Collective over all ranks of the job (each builds the groups it belongs to, in the fixed
// order tp, sp, dp, data, so no two ranks wait on each other crosswise). A rank outside
// the layout returns {member = false} at once. The groups the module's strategy uses are
// connected on `backend`, with this rank's tensors on `device`; the others are not.
// `grads_group`: connect `grads` too (built last).
ProcessGroups make_process_groups(const Store& store, const ModuleLayout& layout, int64_t global_rank,
                                  std::chrono::milliseconds timeout, Backend backend = Backend::kGloo,
                                  torch::Device device = torch::Device(torch::kCPU), bool grads_group = false);

}  // namespace dhp::dist
