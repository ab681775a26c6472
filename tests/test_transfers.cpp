// The point-to-point transfers of a step under NCCL's rules (train/transfers.h), replayed by
// a simulator on the CPU: every rank's schedule (train/schedule.h) for every layout of the
// parity matrix and of the redistribution placements, with 1-8 micro-batches, runs to the
// end without a deadlock or a mismatched message; today's Gloo-style order (one group for
// both directions, every message posted alone, sends at once) deadlocks where NCCL would,
// so the simulator can fail.
//
// The simulator's rules, stricter than NCCL where they differ (so passing here is safe):
//  - each rank has one in-order stream per group (NCCL has one per communicator; c10d may
//    even split pairs onto their own streams, which only removes orderings);
//  - a posted batch occupies the head of its stream until every message in it has been
//    matched; the k-th send of A to B on a group matches the k-th receive of B from A on that
//    group (tags ignored; a matched pair with different tags is reported: the receiver got
//    the wrong rows);
//  - a send completes only when its receive is at the head of the peer's stream (no
//    buffering, as for large messages);
//  - a rank's module compute (VF / TFB / VB) is a blocking rendezvous of all the module's
//    ranks (a stand-in for its collectives), and a receiving action blocks the rank until
//    its batch is done.
#include <gtest/gtest.h>

#include <deque>
#include <map>
#include <set>
#include <sstream>

#include "dhp/parallel/redistribute.h"
#include "dhp/train/layouts.h"
#include "dhp/train/schedule.h"
#include "dhp/train/transfers.h"
#include "ranks.h"
#include "support/parity_matrix.h"

namespace {

using dhp::dist::ModuleLayout;
using dhp::parallel::RedistributePlan;
using dhp::train::Action;
using dhp::train::Op;

struct Msg {
  bool send;
  int64_t peer, tag;
};

struct Step {
  enum Kind { kPost, kWait, kRendezvous, kWaitSends } kind;
  int64_t stream = 0;      // kPost: the group the batch is posted on
  std::vector<Msg> batch;  // kPost
  int64_t id = -1;         // kPost / kWait: the batch
  std::string group;       // kRendezvous: the module
  std::string what;        // for reports: the schedule action
};

using Program = std::vector<Step>;

// How a rank posts its transfers: the design of train/transfers.h, or the order of before.
enum class Design { kTransfers, kSingleGroupEager };

// The plan of every (micro-batch, encoder): rows per sample vary, some samples have none.
std::vector<std::vector<RedistributePlan>> plans(const std::vector<ModuleLayout>& modules, int64_t micro_batches) {
  int64_t most_dp = 1;
  for (const auto& m : modules) most_dp = std::max(most_dp, m.dp);
  const int64_t samples = std::max<int64_t>(4, most_dp);
  std::vector<std::vector<RedistributePlan>> out(static_cast<size_t>(micro_batches));
  for (int64_t i = 0; i < micro_batches; ++i) {
    for (size_t e = 0; e + 1 < modules.size(); ++e) {
      std::vector<int64_t> rows;
      for (int64_t s = 0; s < samples; ++s) rows.push_back((s * 7 + i * 3 + static_cast<int64_t>(e) + 1) % 5);
      out[static_cast<size_t>(i)].push_back(dhp::parallel::plan_redistribute(modules[e], modules.back(), rows));
    }
  }
  return out;
}

Program program(const std::vector<ModuleLayout>& modules, int64_t rank, int64_t micro_batches, bool pipelined,
                const std::vector<std::vector<RedistributePlan>>& p, Design design) {
  const int64_t encoders = static_cast<int64_t>(modules.size()) - 1;
  Program out;
  int64_t next_id = 0;
  for (const auto& a : dhp::train::make_schedule(modules, rank, micro_batches, pipelined)) {
    const std::string what = dhp::train::action_name(a, modules);
    const auto& m = modules[static_cast<size_t>(a.module)];
    if (a.op == Op::kEncode || a.op == Op::kDecode || a.op == Op::kEncodeBackward) {
      if (m.ranks.size() > 1) out.push_back({Step::kRendezvous, 0, {}, -1, m.name, what});
      continue;
    }
    const auto& plan = p[static_cast<size_t>(a.micro_batch)][static_cast<size_t>(a.module)];
    if (design == Design::kTransfers) {
      const auto post = dhp::train::posting(a, plan, rank, encoders);
      if (post.messages.empty()) continue;
      Step s{Step::kPost, post.channel == dhp::train::Channel::kActivations ? 0 : 1, {}, next_id++, "", what};
      for (const auto& msg : post.messages) s.batch.push_back({msg.send, msg.peer, msg.tag});
      out.push_back(s);
      if (post.wait) out.push_back({Step::kWait, 0, {}, s.id, "", what});
      continue;
    }
    // Before: one group, each message alone, sends posted at SA / SG, receives waited at RA / RG.
    const bool forward = a.op == Op::kSendActivations || a.op == Op::kRecvActivations;
    const bool receiving = a.op == Op::kRecvActivations || a.op == Op::kRecvGrads;
    const int64_t tag = dhp::train::transfer_tag(a, encoders);
    std::vector<int64_t> ids;
    for (const auto& piece : forward ? plan.forward : plan.backward) {
      if (piece.src == piece.dst) continue;
      if (!receiving && piece.src == rank) out.push_back({Step::kPost, 0, {{true, piece.dst, tag}}, next_id++, "", what});
      if (receiving && piece.dst == rank) {
        out.push_back({Step::kPost, 0, {{false, piece.src, tag}}, next_id, "", what});
        ids.push_back(next_id++);
      }
    }
    for (auto id : ids) out.push_back({Step::kWait, 0, {}, id, "", what});
  }
  out.push_back({Step::kWaitSends, 0, {}, -1, "", "end of step"});
  return out;
}

struct Batch {
  int64_t id;
  std::vector<Msg> msgs;
  std::vector<int64_t> seq;  // per message: its index among this rank's messages of that kind and peer
  std::vector<bool> done;
  std::vector<std::string> what;
};

// Runs the programs; returns "" when every rank finishes, else what is stuck.
std::string simulate(const std::vector<Program>& progs, const std::vector<ModuleLayout>& modules) {
  const size_t R = progs.size();
  std::vector<size_t> pc(R, 0);
  std::vector<std::map<int64_t, std::deque<Batch>>> streams(R);
  std::vector<std::set<int64_t>> finished(R);
  std::vector<std::map<std::tuple<int64_t, bool, int64_t>, int64_t>> counts(R);  // (stream, send, peer) -> posted
  std::vector<int64_t> open_sends(R, 0);
  std::map<std::string, std::vector<int64_t>> group_ranks;
  for (const auto& m : modules) group_ranks[m.name] = m.ranks;
  std::string error;
  for (bool moved = true; moved && error.empty();) {
    moved = false;
    for (size_t r = 0; r < R; ++r) {  // each rank runs until it blocks
      while (pc[r] < progs[r].size()) {
        const auto& s = progs[r][pc[r]];
        if (s.kind == Step::kPost) {
          Batch b{s.id, s.batch, {}, std::vector<bool>(s.batch.size(), false), {}};
          for (const auto& m : s.batch) {
            b.seq.push_back(counts[r][{s.stream, m.send, m.peer}]++);
            b.what.push_back(s.what);
            open_sends[r] += m.send;
          }
          streams[r][s.stream].push_back(b);
        } else if (s.kind == Step::kWait) {
          if (!finished[r].count(s.id)) break;
        } else if (s.kind == Step::kWaitSends) {
          if (open_sends[r] > 0) break;
        } else {
          break;  // rendezvous: below
        }
        ++pc[r];
        moved = true;
      }
    }
    for (const auto& [name, ranks] : group_ranks) {  // rendezvous of a module's ranks
      bool all = ranks.size() > 1;
      for (auto r : ranks) {
        const auto& prog = progs[static_cast<size_t>(r)];
        all = all && pc[r] < prog.size() && prog[pc[r]].kind == Step::kRendezvous && prog[pc[r]].group == name;
      }
      if (!all) continue;
      const std::string& what = progs[static_cast<size_t>(ranks[0])][pc[ranks[0]]].what;
      for (auto r : ranks) {
        if (progs[static_cast<size_t>(r)][pc[r]].what != what)
          error = "module " + name + ": rank " + std::to_string(r) + " at " + progs[r][pc[r]].what + " while rank " +
                  std::to_string(ranks[0]) + " at " + what;
        ++pc[r];
      }
      moved = true;
    }
    for (size_t a = 0; a < R; ++a) {  // match the heads of the streams
      for (auto& [stream, q] : streams[a]) {
        if (q.empty()) continue;
        auto& b = q.front();
        for (size_t i = 0; i < b.msgs.size(); ++i) {
          if (b.done[i] || !b.msgs[i].send) continue;
          const auto peer = static_cast<size_t>(b.msgs[i].peer);
          auto it = streams[peer].find(stream);
          if (it == streams[peer].end() || it->second.empty()) continue;
          auto& pb = it->second.front();
          for (size_t j = 0; j < pb.msgs.size(); ++j) {
            if (pb.done[j] || pb.msgs[j].send || pb.msgs[j].peer != static_cast<int64_t>(a) || pb.seq[j] != b.seq[i])
              continue;
            if (pb.msgs[j].tag != b.msgs[i].tag)
              error = "rank " + std::to_string(peer) + " receives at " + pb.what[j] + " what rank " + std::to_string(a) +
                      " sent at " + b.what[i];
            b.done[i] = pb.done[j] = true;
            --open_sends[a];
            moved = true;
          }
        }
      }
    }
    for (size_t r = 0; r < R; ++r) {  // retire finished batches
      for (auto& [stream, q] : streams[r]) {
        while (!q.empty() && std::all_of(q.front().done.begin(), q.front().done.end(), [](bool d) { return d; })) {
          finished[r].insert(q.front().id);
          q.pop_front();
          moved = true;
        }
      }
    }
  }
  if (!error.empty()) return error;
  std::ostringstream stuck;
  for (size_t r = 0; r < R; ++r) {
    if (pc[r] < progs[r].size()) stuck << "rank " << r << " blocked at " << progs[r][pc[r]].what << "; ";
  }
  return stuck.str();
}

std::string replay(const std::vector<ModuleLayout>& modules, int64_t world, int64_t micro_batches, bool pipelined,
                   Design design) {
  const auto p = plans(modules, micro_batches);
  std::vector<Program> progs;
  for (int64_t r = 0; r < world; ++r) progs.push_back(program(modules, r, micro_batches, pipelined, p, design));
  return simulate(progs, modules);
}

using dhp::testing::module_layout;

// The redistribution tests' placements, and a second encoder.
std::vector<std::pair<std::string, std::vector<ModuleLayout>>> placements() {
  return {
      {"dp2_to_tp2_disjoint", {module_layout("vision", "dp", {0, 1}, 2, 1, 1), module_layout("text", "tp", {2, 3}, 1, 1, 2)}},
      {"one_to_dp3", {module_layout("vision", "none", {0}, 1, 1, 1), module_layout("text", "dp", {1, 2, 3}, 3, 1, 1)}},
      {"sp4_to_tp2dp2", {module_layout("vision", "sp", {0, 1, 2, 3}, 1, 4, 1), module_layout("text", "tp", {0, 1, 2, 3}, 2, 1, 2)}},
      {"dp3_to_dp2_overlap", {module_layout("vision", "dp", {0, 1, 2}, 3, 1, 1), module_layout("text", "dp", {1, 2}, 2, 1, 1)}},
      {"dp4_to_dp4_reversed", {module_layout("vision", "dp", {0, 1, 2, 3}, 4, 1, 1), module_layout("text", "dp", {3, 2, 1, 0}, 4, 1, 1)}},
      {"two_encoders", {module_layout("vision", "sp", {0, 1}, 1, 2, 1), module_layout("audio", "dp", {1, 2}, 2, 1, 1),
                        module_layout("text", "tp", {2, 3}, 1, 1, 2)}},
  };
}

TEST(NcclTransfers, EveryParityLayoutRunsWithoutDeadlock) {
  int64_t replays = 0;
  for (const auto& c : dhp::testing::parity_matrix()) {
    const auto cfg = dhp::testing::parity_config(c.sets);
    const auto layouts = dhp::train::resolve_layouts(cfg, c.world);
    for (int64_t n = 1; n <= 8; ++n) {
      EXPECT_EQ(replay(layouts.modules, c.world, n, cfg.parallel.pipeline, Design::kTransfers), "")
          << c.name << " with " << n << " micro-batch(es)";
      ++replays;
    }
  }
  EXPECT_EQ(replays, 8 * static_cast<int64_t>(dhp::testing::parity_matrix().size()));
}

TEST(NcclTransfers, EveryPlacementRunsWithoutDeadlock) {
  for (const auto& [name, modules] : placements()) {
    int64_t world = 0;
    for (const auto& m : modules)
      for (auto r : m.ranks) world = std::max(world, r + 1);
    for (bool pipelined : {true, false}) {
      for (int64_t n = 1; n <= 8; ++n) {
        EXPECT_EQ(replay(modules, world, n, pipelined, Design::kTransfers), "")
            << name << (pipelined ? " pipelined" : " sequential") << " with " << n << " micro-batch(es)";
      }
    }
  }
}

// moves_between_ranks (which decides whether the NCCL transfer groups are made) agrees with
// the plans themselves: false only where no micro-batch of 1-12 samples moves a row between
// ranks; true only where some does.
TEST(NcclTransfers, TransferGroupsAreNeededExactlyWhereRowsCrossRanks) {
  std::vector<std::pair<std::string, std::vector<ModuleLayout>>> cases = placements();
  for (const auto& c : dhp::testing::parity_matrix()) {
    cases.emplace_back(c.name, dhp::train::resolve_layouts(dhp::testing::parity_config(c.sets), c.world).modules);
  }
  // Same ranks and replicas, and the same ranks in other replicas: the two sides of the rule.
  cases.push_back({"dp2_both_same", {module_layout("vision", "dp", {0, 1}, 2, 1, 1), module_layout("text", "dp", {0, 1}, 2, 1, 1)}});
  cases.push_back({"dp2_both_swapped", {module_layout("vision", "dp", {0, 1}, 2, 1, 1), module_layout("text", "dp", {1, 0}, 2, 1, 1)}});
  int64_t local_only = 0;
  for (const auto& [name, modules] : cases) {
    for (size_t e = 0; e + 1 < modules.size(); ++e) {
      bool crossed = false;
      for (int64_t n = 1; n <= 12; ++n) {
        const auto plan = dhp::parallel::plan_redistribute(modules[e], modules.back(), std::vector<int64_t>(n, 3));
        for (const auto* pieces : {&plan.forward, &plan.backward})
          for (const auto& p : *pieces) crossed = crossed || p.src != p.dst;
      }
      EXPECT_EQ(dhp::parallel::moves_between_ranks(modules[e], modules.back()), crossed) << name << " encoder " << e;
      local_only += crossed ? 0 : 1;
    }
  }
  EXPECT_GE(local_only, 2) << "the cases include layouts that need no transfer group";
}

// The simulator finds the deadlocks of the order before train/transfers.h.
TEST(NcclTransfers, TheEagerSingleGroupOrderDeadlocks) {
  const auto disjoint = dhp::testing::parity_config(dhp::testing::kSp2TextTp2Disjoint);
  const auto d = dhp::train::resolve_layouts(disjoint, 4);
  EXPECT_EQ(replay(d.modules, 4, 1, true, Design::kSingleGroupEager), "") << "one micro-batch has nothing to overlap";
  const auto stuck = replay(d.modules, 4, 2, true, Design::kSingleGroupEager);
  EXPECT_NE(stuck.find("blocked at RG0"), std::string::npos) << stuck;
  EXPECT_NE(stuck.find("blocked at RA1"), std::string::npos) << stuck;
  EXPECT_EQ(replay(d.modules, 4, 2, false, Design::kSingleGroupEager), "") << "sequential: one direction at a time";
  // Overlapping: vision dp=4 on every rank, text tp=2 x dp=2: ranks 0 and 1 each send their
  // replica's rows to the other, then receive.
  const auto overlap = dhp::train::resolve_layouts(
      dhp::testing::parity_config({"parallel.strategy=custom", "parallel.vision.strategy=dp",
                                   "parallel.text.strategy=tp", "parallel.text.tp=2"}),
      4);
  const auto stuck2 = replay(overlap.modules, 4, 1, true, Design::kSingleGroupEager);
  EXPECT_NE(stuck2.find("blocked at RA0"), std::string::npos) << stuck2;
  EXPECT_EQ(replay(overlap.modules, 4, 1, true, Design::kTransfers), "");
}

// Rule 2 in isolation: a rank that receives in a transfer posts its sends with its receives.
TEST(NcclTransfers, ARankThatAlsoReceivesPostsItsSendsWithItsReceives) {
  // Vision dp=2 and text tp=2 on ranks 0 and 1: each vision replica holds one sample's rows,
  // and each text rank needs both.
  const auto v = module_layout("vision", "dp", {0, 1}, 2, 1, 1);
  const auto text = module_layout("text", "tp", {0, 1}, 1, 1, 2);
  const auto plan = dhp::parallel::plan_redistribute(v, text, {2, 3});
  const Action sa{Op::kSendActivations, 0, 0}, ra{Op::kRecvActivations, 0, 0};
  EXPECT_TRUE(dhp::train::posting(sa, plan, 0, 1).messages.empty());
  const auto post = dhp::train::posting(ra, plan, 0, 1);
  ASSERT_EQ(post.messages.size(), 2u);
  EXPECT_TRUE(post.messages[0].send);
  EXPECT_FALSE(post.messages[1].send);
  EXPECT_TRUE(post.wait);
  EXPECT_EQ(post.channel, dhp::train::Channel::kActivations);
  const Action sg{Op::kSendGrads, 0, 0};
  EXPECT_EQ(dhp::train::posting(sg, plan, 0, 1).channel, dhp::train::Channel::kGradients);
  // A rank that only sends (vision alone on rank 0; its own text rows stay local) posts at once.
  const auto only_send = dhp::parallel::plan_redistribute(module_layout("vision", "none", {0}, 1, 1, 1), text, {2, 3});
  const auto at_once = dhp::train::posting(sa, only_send, 0, 1);
  ASSERT_EQ(at_once.messages.size(), 1u);
  EXPECT_TRUE(at_once.messages[0].send);
  EXPECT_EQ(at_once.messages[0].peer, 1);
  EXPECT_TRUE(dhp::train::posting(ra, only_send, 0, 1).messages.empty());
  // posts_sends answers what posting's messages say, for every rank and transfer action.
  for (const auto* p : {&plan, &only_send}) {
    for (const Action& a : {sa, ra, sg, Action{Op::kRecvGrads, 0, 0}}) {
      for (int64_t rank : {0, 1}) {
        bool any = false;
        for (const auto& m : dhp::train::posting(a, *p, rank, 1).messages) any = any || m.send;
        EXPECT_EQ(dhp::train::posts_sends(a, *p, rank), any) << dhp::train::action_name(a, {v, text}) << " rank " << rank;
      }
    }
  }
  EXPECT_TRUE(dhp::train::posts_sends(ra, plan, 0));
  EXPECT_FALSE(dhp::train::posts_sends(sa, plan, 0));
  EXPECT_TRUE(dhp::train::posts_sends(sa, only_send, 0));
}

}  // namespace
