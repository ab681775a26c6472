#include "dhp/train/transfers.h"

#include "dhp/core/error.h"

namespace dhp::train {

Posting posting(const Action& a, const parallel::RedistributePlan& plan, int64_t rank, int64_t encoders) {
  const bool forward = a.op == Op::kSendActivations || a.op == Op::kRecvActivations;
  const bool receiving = a.op == Op::kRecvActivations || a.op == Op::kRecvGrads;
  DHP_CHECK(forward || a.op == Op::kSendGrads || a.op == Op::kRecvGrads, "posting: action ", static_cast<int>(a.op),
            " moves no rows");
  const auto& pieces = forward ? plan.forward : plan.backward;
  const int64_t tag = transfer_tag(a, encoders);
  bool receives = false;
  for (const auto& p : pieces) receives = receives || (p.dst == rank && p.src != rank);
  Posting out;
  out.channel = forward ? Channel::kActivations : Channel::kGradients;
  out.wait = receiving;
  // Rule 2: a rank that receives in this transfer posts its sends with its receives (at RA /
  // RG), one that does not posts them at the sending action (SA / SG).
  if (receiving == receives) {
    for (const auto& p : pieces)
      if (p.src == rank && p.dst != rank) out.messages.push_back({true, p.dst, tag, &p});
  }
  if (receiving) {
    for (const auto& p : pieces)
      if (p.dst == rank && p.src != rank) out.messages.push_back({false, p.src, tag, &p});
  }
  return out;
}

}  // namespace dhp::train
