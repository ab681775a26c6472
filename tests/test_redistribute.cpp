// Redistribute (vision rows -> text replicas and gradients back) and the step schedule.
// The plan is checked by simulating it on tensors whose values are the global row index,
// for layouts where replicas get different numbers of images (a text-only sample too);
// then the same moves run for real over Gloo point-to-point between ranks as threads.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <set>
#include <mutex>

#include "dhp/core/error.h"
#include "dhp/parallel/redistribute.h"
#include "dhp/train/schedule.h"
#include "ranks.h"

namespace {

using dhp::dist::ModuleLayout;
using dhp::parallel::plan_redistribute;
using dhp::parallel::replica_chunk;

ModuleLayout layout(std::string k, std::string strategy, std::vector<int64_t> ranks, int64_t dp, int64_t sp,
                    int64_t tp) {
  return dhp::testing::module_layout(k, std::move(strategy), std::move(ranks), dp, sp, tp);
}

// Image rows per sample: replicas get 4+0, 16, 9+1 rows...; sample 1 is text-only.
const std::vector<int64_t> kRows = {4, 0, 16, 9, 1};
constexpr int64_t kCols = 3;

// (rows of samples [c.first, c.second), kCols) whose values are global row index * scale.
torch::Tensor rows_of(std::pair<int64_t, int64_t> c, double scale) {
  int64_t lo = 0, hi = 0;
  for (int64_t i = 0; i < c.second; ++i) (i < c.first ? lo : hi) += kRows[i];
  auto idx = torch::arange(lo, lo + hi, torch::kFloat32).mul(scale);
  return idx.unsqueeze(1).repeat({1, kCols});
}

std::pair<int64_t, int64_t> chunk_of(const ModuleLayout& l, int64_t rank) {
  return replica_chunk(static_cast<int64_t>(kRows.size()), l.dp, l.coord(l.module_rank(rank)).dp);
}

struct Placement {
  const char* name;
  int64_t world;
  ModuleLayout vision, text;
};
void PrintTo(const Placement& p, std::ostream* os) { *os << p.name; }

const std::vector<Placement> kPlacements = {
    // vision dp=2 on ranks 0,1 -> text tp=2 on ranks 2,3 (disjoint)
    {"dp2_to_tp2_disjoint", 4, layout("vision", "dp", {0, 1}, 2, 1, 1),
     layout("text", "tp", {2, 3}, 1, 1, 2)},
    // vision on one rank -> text dp=3 on three others
    {"one_to_dp3", 4, layout("vision", "none", {0}, 1, 1, 1),
     layout("text", "dp", {1, 2, 3}, 3, 1, 1)},
    // vision sp=4 (one replica) -> text tp=2 x dp=2, colocated
    {"sp4_to_tp2dp2", 4, layout("vision", "sp", {0, 1, 2, 3}, 1, 4, 1),
     layout("text", "tp", {0, 1, 2, 3}, 2, 1, 2)},
    // vision dp=3 -> text dp=2, overlapping ranks
    {"dp3_to_dp2_overlap", 4, layout("vision", "dp", {0, 1, 2}, 3, 1, 1),
     layout("text", "dp", {2, 3}, 2, 1, 1)},
};

// Runs a piece list on plain tensors: `held` maps each source rank to its tensor.
std::map<int64_t, torch::Tensor> simulate(const std::vector<dhp::parallel::RowPiece>& pieces,
                                          const std::map<int64_t, torch::Tensor>& held,
                                          const std::map<int64_t, int64_t>& want_rows) {
  std::map<int64_t, torch::Tensor> out;
  for (const auto& [r, n] : want_rows) out[r] = torch::full({n, kCols}, -1.0f);
  for (const auto& p : pieces) {
    EXPECT_GT(p.rows, 0);
    auto src = held.at(p.src);
    out.at(p.dst).narrow(0, p.dst_row, p.rows).copy_(src.narrow(0, p.src_row, p.rows));
  }
  return out;
}

class Redistribute : public ::testing::TestWithParam<Placement> {};

TEST_P(Redistribute, EverySampleReachesEveryRankOfItsReplicaAndGradientsComeBack) {
  const auto& pl = GetParam();
  const auto plan = plan_redistribute(pl.vision, pl.text, kRows);
  std::map<int64_t, torch::Tensor> vision_held, text_grads;
  for (auto r : pl.vision.ranks) vision_held[r] = rows_of(chunk_of(pl.vision, r), 1.0);
  for (auto r : pl.text.ranks) text_grads[r] = rows_of(chunk_of(pl.text, r), 10.0);
  ASSERT_EQ(plan.decoder_rows.size(), pl.text.ranks.size());
  const auto got = simulate(plan.forward, vision_held, plan.decoder_rows);
  for (auto r : pl.text.ranks) {
    EXPECT_TRUE(torch::equal(got.at(r), rows_of(chunk_of(pl.text, r), 1.0))) << "text rank " << r;
  }
  const auto back = simulate(plan.backward, text_grads, plan.encoder_rows);
  for (auto r : pl.vision.ranks) {
    EXPECT_TRUE(torch::equal(back.at(r), rows_of(chunk_of(pl.vision, r), 10.0))) << "vision rank " << r;
  }
  // Nothing travels to a rank that holds the rows itself.
  for (const auto& p : plan.forward) {
    if (pl.vision.module_rank(p.dst) >= 0 && chunk_of(pl.vision, p.dst) == chunk_of(pl.vision, p.src)) {
      EXPECT_EQ(p.src, p.dst) << "rank " << p.dst << " already holds rows from rank " << p.src;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Placements, Redistribute, ::testing::ValuesIn(kPlacements),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(Redistribute, TextOnlySampleAndEmptyReplicaGetNoRows) {
  // Two text replicas; the second holds only the text-only sample.
  const std::vector<int64_t> rows = {5, 0};
  const auto v = layout("vision", "none", {0}, 1, 1, 1);
  const auto t = layout("text", "dp", {1, 2}, 2, 1, 1);
  const auto plan = plan_redistribute(v, t, rows);
  EXPECT_EQ(plan.decoder_rows.at(1), 5);
  EXPECT_EQ(plan.decoder_rows.at(2), 0);
  ASSERT_EQ(plan.forward.size(), 1u);
  EXPECT_EQ(plan.forward[0].dst, 1);
  for (const auto& p : plan.backward) EXPECT_NE(p.src, 2);
}

TEST(BalancedReplicas, LargestFirstToTheLeastLoadedReplica) {
  using dhp::parallel::balanced_replicas;
  using Assign = dhp::parallel::ReplicaSamples;
  // Order 5, 4, 3, 3, 2, 1: r0 5, r1 4, r1 7, r0 8, r1 9, r0 9 (contiguous: 10 against 8).
  EXPECT_EQ(balanced_replicas({5, 1, 4, 3, 3, 2}, 2), (Assign{{0, 1, 4}, {2, 3, 5}}));
  // Flagged samples first, one per replica; the rest after them by cost.
  EXPECT_EQ(balanced_replicas({10, 1, 9, 1}, 2, {false, true, false, true}), (Assign{{0, 1}, {2, 3}}));
  // 10 -> r0, 9 -> r1, 1 -> r1 (10 each), then the tie goes to the replica with fewer samples.
  EXPECT_EQ(balanced_replicas({10, 9, 1, 1}, 2), (Assign{{0, 3}, {1, 2}}));
  // Equal costs: ties go to the replica with fewer samples, then the lower one: round robin.
  EXPECT_EQ(balanced_replicas({0, 0, 0, 0, 0}, 3), (Assign{{0, 3}, {1, 4}, {2}}));
  // One replica takes everything in order; more replicas than samples leave some empty.
  EXPECT_EQ(balanced_replicas({3, 1, 2}, 1), (Assign{{0, 1, 2}}));
  EXPECT_EQ(balanced_replicas({3}, 2), (Assign{{0}, {}}));
  EXPECT_EQ(dhp::parallel::contiguous_replicas(5, 2), (Assign{{0, 1, 2}, {3, 4}}));
  EXPECT_THROW(balanced_replicas({1, -1}, 2), dhp::Error);
  EXPECT_THROW(balanced_replicas({1, 2}, 0), dhp::Error);
  EXPECT_THROW(balanced_replicas({1, 2}, 2, {true}), dhp::Error);
}

// Rows of the listed samples, in list order, valued global row index * scale.
torch::Tensor rows_of_samples(const std::vector<int64_t>& samples, double scale) {
  std::vector<torch::Tensor> parts;
  for (auto i : samples) parts.push_back(rows_of({i, i + 1}, scale));
  return parts.empty() ? torch::zeros({0, kCols}) : torch::cat(parts);
}

// Any assignment of the samples to either module's replicas: each text rank gets the rows of
// its samples in its order, each vision rank their gradients, and runs of samples that stay
// together travel as one piece.
TEST_P(Redistribute, AnyAssignmentOfSamplesToReplicas) {
  const auto& pl = GetParam();
  using Assign = dhp::parallel::ReplicaSamples;
  // Samples dealt to replicas in reverse order of rows (4, 0, 16, 9, 1), round robin.
  auto deal = [](int64_t replicas) {
    Assign a(static_cast<size_t>(replicas));
    const std::vector<int64_t> order = {2, 3, 0, 4, 1};
    for (size_t k = 0; k < order.size(); ++k) a[k % a.size()].push_back(order[k]);
    for (auto& r : a) std::sort(r.begin(), r.end());
    return a;
  };
  const Assign va = deal(pl.vision.dp), ta = dhp::parallel::balanced_replicas({1, 1, 5, 3, 1}, pl.text.dp);
  const auto plan = plan_redistribute(pl.vision, va, pl.text, ta, kRows);
  auto replica_of = [](const ModuleLayout& l, int64_t rank) { return l.coord(l.module_rank(rank)).dp; };
  std::map<int64_t, torch::Tensor> vision_held, text_grads;
  for (auto r : pl.vision.ranks) vision_held[r] = rows_of_samples(va[replica_of(pl.vision, r)], 1.0);
  for (auto r : pl.text.ranks) text_grads[r] = rows_of_samples(ta[replica_of(pl.text, r)], 10.0);
  const auto got = simulate(plan.forward, vision_held, plan.decoder_rows);
  for (auto r : pl.text.ranks) {
    EXPECT_TRUE(torch::equal(got.at(r), rows_of_samples(ta[replica_of(pl.text, r)], 1.0))) << "text rank " << r;
  }
  const auto back = simulate(plan.backward, text_grads, plan.encoder_rows);
  for (auto r : pl.vision.ranks) {
    EXPECT_TRUE(torch::equal(back.at(r), rows_of_samples(va[replica_of(pl.vision, r)], 10.0))) << "vision rank " << r;
  }
  for (size_t k = 1; k < plan.forward.size(); ++k) {
    const auto& a = plan.forward[k - 1];
    const auto& b = plan.forward[k];
    EXPECT_FALSE(a.src == b.src && a.dst == b.dst && a.src_row + a.rows == b.src_row && a.dst_row + a.rows == b.dst_row)
        << "pieces " << k - 1 << " and " << k << " could be one";
  }
  // The same assignment on both sides of an aligned pair moves nothing between ranks.
  if (!dhp::parallel::moves_between_ranks(pl.vision, pl.text)) {
    const auto same = plan_redistribute(pl.vision, ta, pl.text, ta, kRows);
    for (const auto& p : same.forward) EXPECT_EQ(p.src, p.dst);
  }
}

TEST(Redistribute, RefusesAnAssignmentThatLosesOrRepeatsASample) {
  const auto v = layout("vision", "dp", {0, 1}, 2, 1, 1);
  const auto t = layout("text", "dp", {0, 1}, 2, 1, 1);
  using Assign = dhp::parallel::ReplicaSamples;
  const std::vector<int64_t> rows = {1, 2, 3};
  EXPECT_NO_THROW(plan_redistribute(v, Assign{{0, 2}, {1}}, t, Assign{{1}, {0, 2}}, rows));
  EXPECT_THROW(plan_redistribute(v, Assign{{0, 2}, {1, 2}}, t, Assign{{1}, {0, 2}}, rows), dhp::Error);
  EXPECT_THROW(plan_redistribute(v, Assign{{0}, {1}}, t, Assign{{1}, {0, 2}}, rows), dhp::Error);
  EXPECT_THROW(plan_redistribute(v, Assign{{0, 1, 2}}, t, Assign{{1}, {0, 2}}, rows), dhp::Error);
}

// The same moves for real: Gloo point-to-point between ranks as threads.
TEST(Redistribute, PointToPointMovesRowsAndGradients) {
  for (const auto& pl : kPlacements) {
    const auto plan = plan_redistribute(pl.vision, pl.text, kRows);
    std::mutex mu;
    std::map<int64_t, torch::Tensor> got, back;
    std::map<int64_t, int64_t> calls;  // communication calls of the forward move
    dhp::testing::run_ranks(pl.world, [&](int64_t rank, const dhp::dist::Store& store) {
      dhp::dist::Group job(store, "job", dhp::testing::first_ranks(pl.world), rank, dhp::testing::kTestTimeout);
      const bool v = pl.vision.module_rank(rank) >= 0, t = pl.text.module_rank(rank) >= 0;
      const auto before = dhp::dist::comm_stats();
      torch::Tensor held = v ? rows_of(chunk_of(pl.vision, rank), 1.0) : torch::Tensor();
      if (v) dhp::parallel::send_pieces(plan.forward, held, job, rank, 0);
      torch::Tensor in, grad;
      if (t) {
        in = dhp::parallel::recv_pieces(plan.forward, held, plan.decoder_rows.at(rank), kCols, torch::kFloat32, job,
                                        rank, 0);
      }
      const auto forward_calls = dhp::dist::comm_stats().calls - before.calls;
      if (t) {
        grad = rows_of(chunk_of(pl.text, rank), 10.0);
        dhp::parallel::send_pieces(plan.backward, grad, job, rank, 1);
      }
      torch::Tensor vg;
      if (v) vg = dhp::parallel::recv_pieces(plan.backward, grad, plan.encoder_rows.at(rank), kCols, torch::kFloat32,
                                             job, rank, 1);
      job.wait_sends();
      std::lock_guard<std::mutex> lock(mu);
      if (t) got[rank] = in;
      if (v) back[rank] = vg;
      calls[rank] = forward_calls;
    });
    for (auto r : pl.text.ranks) {
      EXPECT_TRUE(torch::equal(got.at(r), rows_of(chunk_of(pl.text, r), 1.0))) << pl.name << " text rank " << r;
    }
    for (auto r : pl.vision.ranks) {
      EXPECT_TRUE(torch::equal(back.at(r), rows_of(chunk_of(pl.vision, r), 10.0))) << pl.name << " vision rank " << r;
    }
    if (std::string(pl.name) == "sp4_to_tp2dp2") {
      // Colocated, every text rank holds its rows already: the forward sends no message.
      // (Backward must: each vision rank needs the gradients of the other text replica.)
      for (const auto& [r, c] : calls) EXPECT_EQ(c, 0) << "rank " << r;
    }
  }
}

TEST(Redistribute, RowsAlreadyInPlaceAreNotCopied) {
  const std::vector<int64_t> rows = {4, 6};
  const auto l = layout("vision", "sp", {0, 1}, 1, 2, 1);
  const auto t = layout("text", "tp", {0, 1}, 1, 1, 2);
  const auto plan = plan_redistribute(l, t, rows);
  auto held = torch::randn({10, kCols});
  dhp::dist::Group self;
  auto in = dhp::parallel::recv_pieces(plan.forward, held, 10, kCols, torch::kFloat32, self, 0, 0);
  EXPECT_EQ(in.data_ptr(), held.data_ptr());
}

// The schedule as data.
TEST(Schedule, DisjointPipelinedRunsVisionOneMicroBatchAhead) {
  const auto v = layout("vision", "sp", {0, 1}, 1, 2, 1);
  const auto t = layout("text", "tp", {2, 3}, 1, 1, 2);
  const std::vector<ModuleLayout> m{v, t};
  EXPECT_TRUE(dhp::train::disjoint(m));
  auto sched = [&](int64_t rank, int64_t n, bool pipelined) {
    return dhp::train::to_string(dhp::train::make_schedule(m, rank, n, pipelined), m);
  };
  EXPECT_EQ(sched(0, 3, true), "VF0 SA0 VF1 SA1 RG0 VB0 VF2 SA2 RG1 VB1 RG2 VB2");
  EXPECT_EQ(sched(3, 3, true), "RA0 TFB0 SG0 RA1 TFB1 SG1 RA2 TFB2 SG2");
  EXPECT_EQ(sched(1, 3, false), "VF0 SA0 RG0 VB0 VF1 SA1 RG1 VB1 VF2 SA2 RG2 VB2");
  EXPECT_EQ(sched(0, 1, true), "VF0 SA0 RG0 VB0");
  // Every vision forward is sent, every gradient received, each exactly once, in order.
  for (int64_t n = 1; n <= 5; ++n) {
    const auto s = dhp::train::make_schedule(m, 0, n, true);
    int64_t vf = 0, vb = 0, in_flight_max = 0;
    for (const auto& a : s) {
      EXPECT_EQ(a.module, 0);
      if (a.op == dhp::train::Op::kEncode) EXPECT_EQ(a.micro_batch, vf++);
      if (a.op == dhp::train::Op::kEncodeBackward) EXPECT_EQ(a.micro_batch, vb++);
      in_flight_max = std::max(in_flight_max, vf - vb);
    }
    EXPECT_EQ(vf, n);
    EXPECT_EQ(vb, n);
    EXPECT_LE(in_flight_max, 2) << "activations of at most two micro-batches held";
  }
}

// A frozen encoder (fine-tuning) gets no gradients: its ranks stream forwards, the decoder
// sends nothing back; a rank hosting both runs forward, then the decoder.
TEST(Schedule, AFrozenEncoderIsAForwardOnlyStage) {
  const auto v = layout("vision", "sp", {0, 1}, 1, 2, 1);
  const auto t = layout("text", "tp", {2, 3}, 1, 1, 2);
  const std::vector<ModuleLayout> m{v, t};
  auto sched = [&](const std::vector<ModuleLayout>& mods, int64_t rank, int64_t n, bool pipelined) {
    return dhp::train::to_string(dhp::train::make_schedule(mods, rank, n, pipelined, {true}), mods);
  };
  EXPECT_EQ(sched(m, 0, 3, true), "VF0 SA0 VF1 SA1 VF2 SA2");
  EXPECT_EQ(sched(m, 2, 3, true), "RA0 TFB0 RA1 TFB1 RA2 TFB2");
  EXPECT_EQ(sched(m, 1, 2, false), "VF0 SA0 VF1 SA1");
  const std::vector<ModuleLayout> both{layout("vision", "sp", {0, 1, 2, 3}, 1, 4, 1), t};
  EXPECT_EQ(sched(both, 3, 2, true), "VF0 SA0 RA0 TFB0 VF1 SA1 RA1 TFB1");
  // Not frozen: the usual gradients (an empty list = every encoder trains).
  EXPECT_EQ(dhp::train::to_string(dhp::train::make_schedule(m, 0, 1, true, {false}), m), "VF0 SA0 RG0 VB0");
}

TEST(Schedule, ARankHostingBothModulesRunsSequentially) {
  const auto v = layout("vision", "sp", {0, 1, 2, 3}, 1, 4, 1);
  const auto t = layout("text", "tp", {2, 3}, 1, 1, 2);
  const std::vector<ModuleLayout> m{v, t};
  EXPECT_FALSE(dhp::train::disjoint(m));
  EXPECT_EQ(dhp::train::to_string(dhp::train::make_schedule(m, 2, 2, true), m),
            "VF0 SA0 RA0 TFB0 SG0 RG0 VB0 VF1 SA1 RA1 TFB1 SG1 RG1 VB1");
  EXPECT_EQ(dhp::train::to_string(dhp::train::make_schedule(m, 0, 2, true), m), "VF0 SA0 RG0 VB0 VF1 SA1 RG1 VB1");
}

// A second encoder is one more entry in the module list: the decoder receives from both
// before its forward and answers both after its backward; a rank hosting both encoders runs
// them in module order; every transfer has its own tag.
TEST(Schedule, ASecondEncoderIsAnotherEntry) {
  const auto v = layout("vision", "sp", {0, 1}, 1, 2, 1);
  const auto a = layout("audio", "none", {1}, 1, 1, 1);
  const auto t = layout("text", "tp", {2, 3}, 1, 1, 2);
  const std::vector<ModuleLayout> m{v, a, t};
  EXPECT_TRUE(dhp::train::disjoint(m));
  auto sched = [&](int64_t rank, int64_t n, bool pipelined) {
    return dhp::train::to_string(dhp::train::make_schedule(m, rank, n, pipelined), m);
  };
  EXPECT_EQ(sched(0, 2, true), "VF0 SA0:vision VF1 SA1:vision RG0:vision VB0 RG1:vision VB1");
  EXPECT_EQ(sched(1, 2, true),
            "VF0 SA0:vision AF0 SA0:audio VF1 SA1:vision AF1 SA1:audio RG0:vision VB0 RG0:audio AB0 "
            "RG1:vision VB1 RG1:audio AB1");
  EXPECT_EQ(sched(2, 1, true), "RA0:vision RA0:audio TFB0 SG0:vision SG0:audio");
  // Colocated on rank 2: sequential.
  const std::vector<ModuleLayout> c{v, layout("audio", "none", {2}, 1, 1, 1), t};
  EXPECT_FALSE(dhp::train::disjoint(c));
  EXPECT_EQ(dhp::train::to_string(dhp::train::make_schedule(c, 2, 1, true), c),
            "AF0 SA0:audio RA0:vision RA0:audio TFB0 SG0:vision SG0:audio RG0:audio AB0");
  std::set<int64_t> tags;
  for (int64_t mb = 0; mb < 3; ++mb)
    for (int64_t e = 0; e < 2; ++e)
      for (auto op : {dhp::train::Op::kSendActivations, dhp::train::Op::kSendGrads})
        EXPECT_TRUE(tags.insert(dhp::train::transfer_tag({op, mb, e}, 2)).second);
  // One encoder: the tags of before (2i forward, 2i+1 backward).
  EXPECT_EQ(dhp::train::transfer_tag({dhp::train::Op::kRecvActivations, 3, 0}, 1), 6);
  EXPECT_EQ(dhp::train::transfer_tag({dhp::train::Op::kRecvGrads, 3, 0}, 1), 7);
}

}  // namespace
