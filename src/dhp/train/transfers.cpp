#include "dhp/train/transfers.h"

#include "dhp/core/error.h"

namespace dhp::train {
namespace {

struct Direction {
  bool forward = false;    // activations (SA / RA), else gradients (SG / RG)
  bool receiving = false;  // RA / RG
};

Direction direction(const Action& a) {
  const bool forward = a.op == Op::kSendActivations || a.op == Op::kRecvActivations;
  DHP_CHECK(forward || a.op == Op::kSendGrads || a.op == Op::kRecvGrads, "posting: action ", static_cast<int>(a.op),
            " moves no rows");
  return {forward, a.op == Op::kRecvActivations || a.op == Op::kRecvGrads};
}

// Rule 2: a rank that receives in this transfer posts its sends with its receives (at RA /
// RG), one that does not posts them at the sending action (SA / SG).
bool sends_at(const Direction& d, const std::vector<parallel::RowPiece>& pieces, int64_t rank) {
  bool receives = false;
  for (const auto& p : pieces) receives = receives || (p.dst == rank && p.src != rank);
  return d.receiving == receives;
}

}  // namespace

Posting posting(const Action& a, const parallel::RedistributePlan& plan, int64_t rank, int64_t encoders) {
  const auto d = direction(a);
  const auto& pieces = d.forward ? plan.forward : plan.backward;
  const int64_t tag = transfer_tag(a, encoders);
  Posting out;
  out.channel = d.forward ? Channel::kActivations : Channel::kGradients;
  out.wait = d.receiving;
  if (sends_at(d, pieces, rank)) {
    for (const auto& p : pieces)
      if (p.src == rank && p.dst != rank) out.messages.push_back({true, p.dst, tag, &p});
  }
  if (d.receiving) {
    for (const auto& p : pieces)
      if (p.dst == rank && p.src != rank) out.messages.push_back({false, p.src, tag, &p});
  }
  return out;
}

bool posts_sends(const Action& a, const parallel::RedistributePlan& plan, int64_t rank) {
  const auto d = direction(a);
  const auto& pieces = d.forward ? plan.forward : plan.backward;
  if (!sends_at(d, pieces, rank)) return false;
  for (const auto& p : pieces)
    if (p.src == rank && p.dst != rank) return true;
  return false;
}

}  // namespace dhp::train
