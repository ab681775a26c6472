#include "dhp/dist/layout.h"

#include <algorithm>
#include <set>

#include <c10/util/Exception.h>  // TORCH_INTERNAL_ASSERT

#include "dhp/core/error.h"

namespace dhp::dist {
namespace {

void check_divides(const ModuleLayout& l, const char* degree, int64_t d, const std::string& what, int64_t n) {
  DHP_CHECK(n % d == 0, l.name, " ", degree, "=", d, " does not divide ", what, "=", n);
}

std::string names_of(const std::vector<Strategy>& list) {
  std::string s;
  for (auto k : list) s += (s.empty() ? "" : ", ") + std::string(strategy_name(k));
  return s;
}

}  // namespace

const char* strategy_name(Strategy s) {
  switch (s) {
    case Strategy::kNone: return "none";
    case Strategy::kDataParallel: return "dp";
    case Strategy::kSequenceParallel: return "sp";
    case Strategy::kTensorParallel: return "tp";
    case Strategy::kZero3: return "zero3";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown strategy ", static_cast<int>(s));
}

const std::vector<Strategy>& all_strategies() {
  static const std::vector<Strategy> all = {Strategy::kNone, Strategy::kSequenceParallel, Strategy::kTensorParallel,
                                            Strategy::kZero3, Strategy::kDataParallel};
  return all;
}

Strategy parse_strategy(const std::string& value, const std::string& key, const std::vector<Strategy>& allowed) {
  for (auto k : allowed) {
    if (value == strategy_name(k)) return k;
  }
  DHP_FAIL(key, "='", value, "' is not one of ", names_of(allowed));
}

std::vector<int64_t> iota_ranks(int64_t n) {
  std::vector<int64_t> r(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) r[static_cast<size_t>(i)] = i;
  return r;
}

void ModuleLayout::validate(const ModuleDims& dims, int64_t world_size) const {
  const auto& ok = dims.strategies;
  DHP_CHECK(std::find(ok.begin(), ok.end(), strategy) != ok.end(), name, " strategy '", strategy_name(strategy),
            "' is not one of ", names_of(ok));
  DHP_CHECK(!ranks.empty(), name, " runs on no ranks");
  DHP_CHECK(dp >= 1 && sp >= 1 && tp >= 1, name, " degrees must be >= 1, got dp=", dp, " sp=", sp, " tp=", tp);
  std::set<int64_t> seen;
  for (auto r : ranks) {
    DHP_CHECK(r >= 0 && r < world_size, name, " rank ", r, " is outside the world of ", world_size, " ranks");
    DHP_CHECK(seen.insert(r).second, name, " lists rank ", r, " twice");
  }
  DHP_CHECK(dp * sp * tp == size(), name, " degrees dp=", dp, " x sp=", sp, " x tp=", tp, " = ", dp * sp * tp,
            " but the module has ", size(), " ranks");
  DHP_CHECK(zero == 0 || zero == 1 || zero == 3, name, " zero=", zero, " must be 0, 1 or 3");
  DHP_CHECK(sp == 1 || strategy == Strategy::kSequenceParallel, name, " sp=", sp, " needs the strategy sp (got '",
            strategy_name(strategy), "')");
  DHP_CHECK(tp == 1 || strategy == Strategy::kTensorParallel, name, " tp=", tp, " needs the strategy tp (got '",
            strategy_name(strategy), "')");
  DHP_CHECK(strategy != Strategy::kNone || size() == 1, name, " strategy none runs on one rank, got ", size());
  DHP_CHECK(strategy != Strategy::kZero3 || zero == 3 || zero == 0, name, " strategy zero3 cannot use zero=", zero);
  for (const auto& [what, n] : dims.sp_divides) check_divides(*this, "sp", sp, what, n);
  for (const auto& [what, n] : dims.tp_divides) check_divides(*this, "tp", tp, what, n);
}

int64_t ModuleLayout::module_rank(int64_t global_rank) const {
  auto it = std::find(ranks.begin(), ranks.end(), global_rank);
  return it == ranks.end() ? -1 : static_cast<int64_t>(it - ranks.begin());
}

ModuleLayout::Coord ModuleLayout::coord(int64_t i) const {
  TORCH_INTERNAL_ASSERT(i >= 0 && i < size());
  return Coord{i % tp, (i / tp) % sp, i / (tp * sp)};
}

std::vector<int64_t> ModuleLayout::tp_group(int64_t i) const {
  const auto c = coord(i);
  std::vector<int64_t> g;
  for (int64_t t = 0; t < tp; ++t) g.push_back(ranks[static_cast<size_t>(c.dp * tp * sp + c.sp * tp + t)]);
  return g;
}

std::vector<int64_t> ModuleLayout::sp_group(int64_t i) const {
  const auto c = coord(i);
  std::vector<int64_t> g;
  for (int64_t s = 0; s < sp; ++s) g.push_back(ranks[static_cast<size_t>(c.dp * tp * sp + s * tp + c.tp)]);
  return g;
}

std::vector<int64_t> ModuleLayout::dp_group(int64_t i) const {
  const auto c = coord(i);
  std::vector<int64_t> g;
  for (int64_t d = 0; d < dp; ++d) g.push_back(ranks[static_cast<size_t>(d * tp * sp + c.sp * tp + c.tp)]);
  return g;
}

std::vector<int64_t> ModuleLayout::data_group(int64_t i) const {
  const auto c = coord(i);
  std::vector<int64_t> g;
  for (int64_t d = 0; d < dp; ++d)
    for (int64_t s = 0; s < sp; ++s) g.push_back(ranks[static_cast<size_t>(d * tp * sp + s * tp + c.tp)]);
  return g;
}

}  // namespace dhp::dist
