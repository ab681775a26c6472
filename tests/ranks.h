// Runs a function as N ranks, one thread each, over one in-process store. Exceptions in a
// rank are collected and reported; gtest assertions inside ranks are thread-safe.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dhp/dist/comm.h"

namespace dhp::testing {

inline void run_ranks(int64_t n, const std::function<void(int64_t rank, const dist::Store& store)>& fn) {
  auto store = dist::make_hash_store();
  std::mutex mu;
  std::vector<std::string> errors;
  std::vector<std::thread> threads;
  for (int64_t r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r, store);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mu);
        errors.push_back("rank " + std::to_string(r) + ": " + e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors) ADD_FAILURE() << e;
}

constexpr std::chrono::milliseconds kTestTimeout{20000};

}  // namespace dhp::testing

#include "dhp/data/shapes.h"
#include "dhp/models/qwen2_5_vl/parallelize.h"
#include "dhp/dist/layout.h"

namespace dhp::testing {

// The first `n` samples of the shapes task with image sides in [min_side, max_side].
inline std::vector<data::Sample> shapes_samples(const qwen::ModelConfig& cfg, int n, int64_t min_side,
                                                int64_t max_side) {
  data::ShapesOptions so;
  so.min_side = min_side;
  so.max_side = max_side;
  data::ShapesDataset ds(cfg, so);
  std::vector<data::Sample> out;
  for (int i = 0; i < n; ++i) out.push_back(ds.get(i));
  return out;
}

// A module layout from its fields (not validated); `strategy` by its config name.
inline dist::ModuleLayout module_layout(std::string name, const std::string& strategy, std::vector<int64_t> ranks,
                                        int64_t dp, int64_t sp, int64_t tp) {
  dist::ModuleLayout l;
  l.name = std::move(name);
  l.strategy = dist::parse_strategy(strategy, "test layout", dist::all_strategies());
  l.ranks = std::move(ranks);
  l.dp = dp;
  l.sp = sp;
  l.tp = tp;
  return l;
}

// The numbers module `name` of `model` must divide (qwen::module_dims).
inline dist::ModuleDims dims_of(const qwen::ModelConfig& model, const std::string& name) {
  for (const auto& d : qwen::module_dims(model))
    if (d.name == name) return d;
  throw std::runtime_error("no module " + name);
}

// members 0..n-1.
inline std::vector<int64_t> first_ranks(int64_t n) {
  std::vector<int64_t> r;
  for (int64_t i = 0; i < n; ++i) r.push_back(i);
  return r;
}

}  // namespace dhp::testing
