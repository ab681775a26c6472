#include "dhp/dist/process_groups.h"

namespace dhp::dist {
namespace {

std::string group_name(const ModuleLayout& l, const char* axis, const std::vector<int64_t>& ranks) {
  std::string n = l.name + "/" + axis;
  for (auto r : ranks) n += "/" + std::to_string(r);
  return n;
}

}  // namespace

GroupUse groups_used(Strategy s) {
  GroupUse u;
  switch (s) {
    case Strategy::kNone:
    case Strategy::kDataParallel:
      u.data = true;
      break;
    case Strategy::kSequenceParallel:
      u.sp = u.data = true;
      break;
    case Strategy::kTensorParallel:
      u.tp = u.data = true;
      break;
    case Strategy::kZero3:
      u.dp = true;
      break;
  }
  return u;
}

ProcessGroups make_process_groups(const Store& store, const ModuleLayout& layout, int64_t global_rank,
                                  std::chrono::milliseconds timeout, Backend backend, torch::Device device,
                                  bool grads_group) {
  ProcessGroups pg;
  const int64_t i = layout.module_rank(global_rank);
  if (i < 0) return pg;
  pg.member = true;
  auto group = [&](bool used, const char* axis, const std::vector<int64_t>& ranks) {
    if (ranks.size() == 1) return Group();
    if (!used) return Group::unconnected(group_name(layout, axis, ranks), ranks, global_rank);
    return Group(store, group_name(layout, axis, ranks), ranks, global_rank, timeout, backend, device);
  };
  const auto use = groups_used(layout.strategy);
  pg.module = group(false, "module", layout.ranks);
  pg.tp = group(use.tp, "tp", layout.tp_group(i));
  // The data group is the sp or the dp group itself when the other degree is 1.
  pg.sp = group(use.sp || (use.data && layout.dp == 1), "sp", layout.sp_group(i));
  pg.dp = group(use.dp || (use.data && layout.sp == 1), "dp", layout.dp_group(i));
  if (layout.sp == 1) pg.data = pg.dp;
  else if (layout.dp == 1) pg.data = pg.sp;
  else pg.data = group(use.data, "data", layout.data_group(i));
  const auto data_ranks = layout.sp == 1 ? layout.dp_group(i) : layout.dp == 1 ? layout.sp_group(i) : layout.data_group(i);
  pg.grads = group(use.data && grads_group, "grads", data_ranks);
  return pg;
}

}  // namespace dhp::dist
