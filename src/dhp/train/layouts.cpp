#include "dhp/train/layouts.h"

#include <algorithm>

#include "dhp/core/error.h"
#include "dhp/models/qwen2_5_vl/parallelize.h"

namespace dhp::train {
namespace {

// The config's per-module options of module `name`.
const ModuleParallelOptions& module_options(const ParallelOptions& p, const std::string& name) {
  if (name == "vision") return p.vision;
  DHP_CHECK(name == "text", "the config has no parallel.", name, " section (modules: vision, text)");
  return p.text;
}

// A module's strategy in a named combination: dhp is sp for the modules that support it
// (the vision encoder) and tp for the others; none, tp, zero3 and dp name one strategy for
// every module. custom leaves each module to its own parallel.<module>.strategy.
dist::Strategy strategy_of(Combination named, const dist::ModuleDims& dims) {
  using S = dist::Strategy;
  const auto supports = [&](S s) { return std::find(dims.strategies.begin(), dims.strategies.end(), s) != dims.strategies.end(); };
  switch (named) {
    case Combination::kDhp: return supports(S::kSequenceParallel) ? S::kSequenceParallel : S::kTensorParallel;
    case Combination::kNone: return S::kNone;
    case Combination::kTp: return S::kTensorParallel;
    case Combination::kZero3: return S::kZero3;
    case Combination::kDp: return S::kDataParallel;
    case Combination::kCustom:
    case Combination::kAuto: break;
  }
  DHP_FAIL("parallel.strategy=", combination_name(named), " needs parallel.", dims.name, ".strategy");
}

// Fills the ranks, strategy and degrees of one module from the named combination and
// overrides.
dist::ModuleLayout resolve_module(const ModuleParallelOptions& o, Combination named, const dist::ModuleDims& dims,
                                  int64_t world) {
  dist::ModuleLayout l;
  l.name = dims.name;
  const std::string key = "parallel." + dims.name;
  l.strategy = o.strategy.empty() ? strategy_of(named, dims)
                                  : dist::parse_strategy(o.strategy, key + ".strategy", dims.strategies);
  l.ranks = o.ranks.empty() ? dist::iota_ranks(world) : o.ranks;
  const int64_t n = l.size();
  const std::string where = o.ranks.empty() ? "the " + std::to_string(n) + " ranks"
                                            : "the " + std::to_string(n) + " ranks of " + key + ".ranks";
  for (const auto& [name, v] : {std::pair<const char*, int64_t>{"sp", o.sp}, {"tp", o.tp}, {"dp", o.dp}}) {
    DHP_CHECK(v >= 0, key, ".", name, "=", v, " must be >= 1 (or 0 = derived)");
    DHP_CHECK(v == 0 || n % v == 0, key, ".", name, "=", v, " does not divide ", where);
  }
  l.sp = o.sp ? o.sp : 1;
  l.tp = o.tp ? o.tp : 1;
  l.dp = o.dp ? o.dp : 1;
  // The strategy's own degree takes what the others leave; dp takes the rest otherwise.
  using S = dist::Strategy;
  if (l.strategy == S::kSequenceParallel && !o.sp) l.sp = n / (l.tp * l.dp);
  if (l.strategy == S::kTensorParallel && !o.tp) l.tp = n / (l.sp * l.dp);
  if (!o.dp && l.strategy != S::kNone) l.dp = std::max<int64_t>(1, n / (l.sp * l.tp));
  l.zero = o.zero >= 0 ? o.zero : (l.strategy == S::kSequenceParallel ? 1 : l.strategy == S::kZero3 ? 3 : 0);
  DHP_CHECK(l.strategy != S::kNone || n == 1, key, ".strategy=none runs on one process, but the module has ", where,
            " (use dp for replicas, or a parallel strategy)");
  return l;
}

}  // namespace

const dist::ModuleLayout& Layouts::at(const std::string& name) const {
  std::string names;
  for (const auto& m : modules) {
    if (m.name == name) return m;
    names += (names.empty() ? "" : ", ") + m.name;
  }
  DHP_FAIL("no module named '", name, "' (modules: ", names, ")");
}

int64_t Layouts::max_dp() const {
  int64_t most = 1;
  for (const auto& m : modules) most = std::max(most, m.dp);
  return most;
}

Layouts resolve_layouts(const Config& cfg, int64_t world) {
  DHP_CHECK(world >= 1, "the job needs at least one rank, got ", world);
  const auto& p = cfg.parallel;
  const Combination named = parse_combination(p.strategy);
  DHP_CHECK(named != Combination::kAuto, "parallel.strategy=auto must be resolved to a layout first (resolve_auto)");
  DHP_CHECK(named != Combination::kNone || world == 1 || !p.vision.strategy.empty() || !p.text.strategy.empty() ||
                !p.vision.ranks.empty() || !p.text.ranks.empty(),
            "parallel.strategy=none runs on one process, but the job has ", world,
            " ranks; choose parallel.strategy = dhp, tp, zero3 or dp");
  Layouts l;
  const auto dims = qwen::module_dims(cfg.model.config);
  for (const auto& d : dims) {
    l.modules.push_back(resolve_module(module_options(p, d.name), named, d, world));
    try {
      l.modules.back().validate(d, world);
    } catch (const Error& e) {
      DHP_FAIL("parallel.", d.name, ": ", e.what());
    }
  }
  for (int64_t r = 0; r < world; ++r) {
    bool runs = false;
    std::string lists;
    for (const auto& m : l.modules) {
      runs = runs || m.module_rank(r) >= 0;
      lists += (lists.empty() ? "parallel." : " and parallel.") + m.name + ".ranks=" + detail::to_yaml_text(m.ranks);
    }
    DHP_CHECK(runs, "rank ", r, " of the ", world, " runs no module: ", lists, " leave it idle");
  }
  // Every replica of every module needs at least one sample of the smallest micro-batch
  // (packed micro-batches always hold one per replica).
  const int64_t smallest = cfg.data.pack_tokens > 0 ? l.max_dp() : cfg.data.batch_size / cfg.training.micro_batches;
  for (const auto& m : l.modules) {
    DHP_CHECK(smallest >= m.dp, "parallel.", m.name, ".dp=", m.dp, " replicas need at least ", m.dp,
              " samples per micro-batch, but data.batch_size=", cfg.data.batch_size, " / training.micro_batches=",
              cfg.training.micro_batches, " gives ", smallest);
  }
  // Sequence parallelism needs a window per rank: count the windows of the smallest images.
  const auto& vision = l.at("vision");
  if (vision.sp > 1) {
    const auto& v = cfg.model.config.vision;
    const int64_t unit = v.patch_size * v.spatial_merge_size;
    const int64_t side = unit * ((cfg.data.min_side + unit - 1) / unit);  // smallest image side
    const int64_t per_side = (side + v.window_size - 1) / v.window_size;
    const int64_t images = smallest / vision.dp;
    const int64_t windows = images * per_side * per_side;
    DHP_CHECK(windows >= vision.sp, "parallel.vision.sp=", vision.sp, " needs at least one attention window per ",
              "rank, but a vision replica may get only ", windows, " window(s) per micro-batch: ", images,
              " image(s) (data.batch_size=", cfg.data.batch_size, ", training.micro_batches=",
              cfg.training.micro_batches, ", vision dp=", vision.dp, ") of at least ", side, "x", side, " px (",
              per_side * per_side, " window(s) of ", v.window_size, " px each); use larger images, more samples or a "
              "smaller sp");
  }
  return l;
}

std::string describe(const Layouts& l) {
  bool same_ranks = true;
  for (const auto& m : l.modules) same_ranks = same_ranks && m.ranks == l.modules.front().ranks;
  auto one = [&](const dist::ModuleLayout& m) {
    std::string s = m.name + " " + dist::strategy_name(m.strategy);
    if (m.sp > 1) s += " sp=" + std::to_string(m.sp);
    if (m.tp > 1) s += " tp=" + std::to_string(m.tp);
    if (m.dp > 1) s += " dp=" + std::to_string(m.dp);
    if (m.zero > 0) s += " zero=" + std::to_string(m.zero);
    if (!same_ranks) s += " on ranks " + detail::to_yaml_text(m.ranks);
    return s;
  };
  std::string out;
  for (const auto& m : l.modules) out += (out.empty() ? "" : " | ") + one(m);
  return out;
}

}  // namespace dhp::train
