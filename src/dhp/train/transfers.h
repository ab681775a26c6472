// How the point-to-point messages of a step's schedule are posted, so that they cannot
// deadlock under NCCL's rules (which Gloo's are a relaxation of):
//   - tags are ignored: the k-th send from A to B on a group matches the k-th receive of B
//     from A on that group;
//   - a rank's messages on one group run in the order it posted them, and a send does not
//     finish before its receive is posted (no buffering of large messages);
//   - messages posted together as one batch (ncclGroupStart/End) progress together.
// Two rules follow, and train/schedule.h's orders satisfy them (tests/test_transfers.cpp
// replays every layout under a simulator of the rules above):
//   1. Activations and gradients travel on separate groups (Channel), so that an encoder
//      rank that sends activations i+1 before it receives gradients i (pipelined) never
//      queues a send in front of the receive its peer is blocked on.
//   2. A rank that both sends and receives in one transfer (an encoder rank that hosts the
//      decoder too, overlapping placements) posts its sends with its receives, as one batch
//      at the receiving action (RA / RG); the sending action (SA / SG) then posts nothing.
#pragma once

#include <cstdint>
#include <vector>

#include "dhp/parallel/redistribute.h"
#include "dhp/train/schedule.h"

namespace dhp::train {

enum class Channel { kActivations, kGradients };

struct Message {
  bool send = false;
  int64_t peer = 0;  // global rank
  int64_t tag = 0;   // the transfer's tag (train::transfer_tag); informative under NCCL
  const parallel::RowPiece* piece = nullptr;
};

// What a rank posts at one transfer action (SA / RA / SG / RG), as one batch on `channel`;
// `wait`: the action needs the received rows before it returns (RA / RG).
struct Posting {
  Channel channel = Channel::kActivations;
  std::vector<Message> messages;  // sends first, then receives, each in plan order
  bool wait = false;
};

// The posting of action `a` on `rank`, given the transfer's plan (`a.op` must be a transfer).
Posting posting(const Action& a, const parallel::RedistributePlan& plan, int64_t rank, int64_t encoders);
// Does `rank` post sends at action `a` (posting(a, ...) has a send)?
bool posts_sends(const Action& a, const parallel::RedistributePlan& plan, int64_t rank);

}  // namespace dhp::train
