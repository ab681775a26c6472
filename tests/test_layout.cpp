// ModuleLayout: validation messages with the numbers, and the rank arithmetic.
#include <gtest/gtest.h>

#include "dhp/core/error.h"
#include "dhp/dist/layout.h"
#include "ranks.h"

namespace {

using dhp::dist::ModuleLayout;
using dhp::testing::dims_of;

ModuleLayout layout(std::string k, std::string strategy, std::vector<int64_t> ranks, int64_t dp, int64_t sp,
                    int64_t tp) {
  return dhp::testing::module_layout(k, std::move(strategy), std::move(ranks), dp, sp, tp);
}

std::string error_of(const ModuleLayout& l, const dhp::qwen::ModelConfig& m, int64_t world) {
  try {
    l.validate(dhp::testing::dims_of(m, l.name), world);
  } catch (const dhp::Error& e) {
    return e.what();
  }
  return "<no error>";
}

TEST(Layout, ValidLayoutsOfTheIssues) {
  auto m = dhp::qwen::preset("qwen2.5-vl-7b");
  EXPECT_NO_THROW(layout("vision", "sp", dhp::dist::iota_ranks(8), 1, 8, 1).validate(dims_of(m, "vision"), 8));
  EXPECT_NO_THROW(layout("text", "tp", dhp::dist::iota_ranks(8), 2, 1, 4).validate(dims_of(m, "text"), 8));
  EXPECT_NO_THROW(layout("vision", "sp", {0, 1}, 1, 2, 1).validate(dims_of(m, "vision"), 8));
  EXPECT_NO_THROW(layout("text", "tp", {2, 3, 4, 5, 6, 7}, 3, 1, 2).validate(dims_of(m, "text"), 8));
}

TEST(Layout, RefusalsNameTheNumbers) {
  auto m = dhp::qwen::preset("qwen2.5-vl-7b");  // vision 16 heads; text 28 heads, 4 kv heads
  auto e1 = error_of(layout("vision", "sp", dhp::dist::iota_ranks(3), 1, 3, 1), m, 3);
  EXPECT_NE(e1.find("vision sp=3 does not divide vision num_heads=16"), std::string::npos) << e1;
  auto e2 = error_of(layout("text", "tp", dhp::dist::iota_ranks(4), 1, 1, 4),
                     dhp::qwen::preset("qwen2.5-vl-3b"), 4);  // 16 heads, 2 kv heads
  EXPECT_NE(e2.find("text tp=4 does not divide text num_kv_heads=2"), std::string::npos) << e2;
  auto e2b = error_of(layout("text", "tp", dhp::dist::iota_ranks(8), 1, 1, 8), m, 8);
  EXPECT_NE(e2b.find("text tp=8 does not divide text num_heads=28"), std::string::npos) << e2b;
  auto e3 = error_of(layout("text", "tp", dhp::dist::iota_ranks(6), 2, 1, 2), m, 6);
  EXPECT_NE(e3.find("dp=2 x sp=1 x tp=2 = 4 but the module has 6 ranks"), std::string::npos) << e3;
  auto e4 = error_of(layout("vision", "tp", dhp::dist::iota_ranks(8), 1, 1, 8), m, 8);
  EXPECT_NE(e4.find("vision intermediate_size=3420"), std::string::npos) << e4;
  auto e5 = error_of(layout("text", "tp", {0, 9}, 1, 1, 2), m, 4);
  EXPECT_NE(e5.find("rank 9 is outside the world of 4"), std::string::npos) << e5;
  auto e6 = error_of(layout("text", "sp", {0, 1}, 1, 2, 1), m, 2);
  EXPECT_NE(e6.find("strategy 'sp' is not one of"), std::string::npos) << e6;
  auto e7 = error_of(layout("text", "tp", {1, 1}, 1, 1, 2), m, 2);
  EXPECT_NE(e7.find("lists rank 1 twice"), std::string::npos) << e7;
}

TEST(Layout, RankArithmeticTpFastestThenSpThenDp) {
  // 12 ranks offset by 4: tp=2, sp=3, dp=2.
  std::vector<int64_t> ranks;
  for (int64_t i = 0; i < 12; ++i) ranks.push_back(4 + i);
  auto l = layout("vision", "sp", ranks, 2, 3, 2);
  EXPECT_EQ(l.module_rank(4 + 7), 7);
  EXPECT_EQ(l.module_rank(2), -1);
  auto c = l.coord(7);  // 7 = dp 1, sp 0, tp 1
  EXPECT_EQ(c.tp, 1);
  EXPECT_EQ(c.sp, 0);
  EXPECT_EQ(c.dp, 1);
  EXPECT_EQ(l.tp_group(7), (std::vector<int64_t>{10, 11}));
  EXPECT_EQ(l.sp_group(7), (std::vector<int64_t>{11, 13, 15}));
  EXPECT_EQ(l.dp_group(7), (std::vector<int64_t>{5, 11}));
  // Every module rank is in exactly one group of each kind.
  for (int64_t i = 0; i < l.size(); ++i) {
    for (const auto& g : {l.tp_group(i), l.sp_group(i), l.dp_group(i)}) {
      EXPECT_EQ(std::count(g.begin(), g.end(), ranks[i]), 1);
    }
  }
}

}  // namespace
