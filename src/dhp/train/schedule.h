// The schedule of one optimizer step on one rank: the ordered actions it runs over the
// step's micro-batches. Data, not code: it is printed (`dhp train --print-schedule`),
// tested, and executed by ParallelModel::run_step.
//
// Sequential (a rank that hosts both modules, or pipelining off), per micro-batch i:
//   vision ranks: VF(i) SA(i) ........................ RG(i) VB(i)
//   text ranks:              RA(i) TFB(i) SG(i)
// Pipelined (vision and text on disjoint ranks): the vision ranks run one micro-batch
// ahead, so they encode i+1 while the text ranks work on i, and run the backward of i when
// its gradients arrive (1F1B with one micro-batch in flight: at most two micro-batches'
// vision activations are held):
//   vision: VF(0) SA(0) | VF(1) SA(1) RG(0) VB(0) | VF(2) SA(2) RG(1) VB(1) | ... RG(n-1) VB(n-1)
//   text:   RA(0) TFB(0) SG(0) | RA(1) TFB(1) SG(1) | ...
// Both orders compute the same thing: the same micro-batches, each module's collectives in
// the same order on all its ranks; only the overlap differs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dhp/dist/layout.h"

namespace dhp::train {

enum class Op {
  kVisionForward,        // VF: encode the images of this rank's vision replica
  kSendActivations,      // SA: send embedding rows to the text ranks that need them
  kRecvActivations,      // RA: receive this text replica's embedding rows (blocks)
  kTextForwardBackward,  // TFB: decoder forward, loss, backward
  kSendGrads,            // SG: send the embedding rows' gradients to the vision ranks
  kRecvGrads,            // RG: receive the gradients of this vision replica's rows (blocks)
  kVisionBackward,       // VB: backward through the vision tower
};

struct Action {
  Op op;
  int64_t micro_batch;
};

// True when no rank hosts both modules.
bool disjoint(const dist::ModuleLayout& vision, const dist::ModuleLayout& text);

// The actions of global rank `rank` for one step of `micro_batches` micro-batches.
// `pipelined` takes effect only when the modules are disjoint.
std::vector<Action> make_schedule(const dist::ModuleLayout& vision, const dist::ModuleLayout& text, int64_t rank,
                                  int64_t micro_batches, bool pipelined);

// "VF0 SA0 VF1 SA1 RG0 VB0 ..." (the abbreviations above, micro-batch index appended).
std::string to_string(const std::vector<Action>& actions);
const char* op_name(Op op);

}  // namespace dhp::train
