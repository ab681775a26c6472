#include "dhp/dist/process_groups.h"

namespace dhp::dist {
namespace {

std::string group_name(const ModuleLayout& l, const char* axis, const std::vector<int64_t>& ranks) {
  std::string n = l.name + "/" + axis;
  for (auto r : ranks) n += "/" + std::to_string(r);
  return n;
}

Group sub_group(const Store& store, const ModuleLayout& l, const char* axis, const std::vector<int64_t>& ranks,
                int64_t global_rank, std::chrono::milliseconds timeout) {
  if (ranks.size() == 1) return Group();
  return Group(store, group_name(l, axis, ranks), ranks, global_rank, timeout);
}

}  // namespace

ProcessGroups make_process_groups(const Store& store, const ModuleLayout& layout, int64_t global_rank,
                                  std::chrono::milliseconds timeout) {
  ProcessGroups pg;
  const int64_t i = layout.module_rank(global_rank);
  if (i < 0) return pg;
  pg.member = true;
  pg.module = sub_group(store, layout, "module", layout.ranks, global_rank, timeout);
  pg.tp = sub_group(store, layout, "tp", layout.tp_group(i), global_rank, timeout);
  pg.sp = sub_group(store, layout, "sp", layout.sp_group(i), global_rank, timeout);
  pg.dp = sub_group(store, layout, "dp", layout.dp_group(i), global_rank, timeout);
  if (layout.sp == 1) pg.data = pg.dp;
  else if (layout.dp == 1) pg.data = pg.sp;
  else pg.data = sub_group(store, layout, "data", layout.data_group(i), global_rank, timeout);
  return pg;
}

}  // namespace dhp::dist
