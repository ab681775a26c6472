// The schedule of one optimizer step on one rank: the ordered actions it runs over the
// step's micro-batches. Data, not code: it is printed (`dhp train --print-schedule`),
// tested, and executed by ParallelModel::run_step.
//
// The job's modules are a list (Layouts::modules): encoders first, the decoder last. Each
// encoder's output rows go to the decoder, and their gradients come back. An action names
// the module it belongs to by its index in that list. With today's Qwen2.5-VL (one encoder,
// "vision", then "text"), per micro-batch i:
//   Sequential (a rank that hosts an encoder and the decoder, or pipelining off):
//     vision ranks: VF(i) SA(i) ........................ RG(i) VB(i)
//     text ranks:              RA(i) TFB(i) SG(i)
//   Pipelined (no rank hosts both an encoder and the decoder): the encoder ranks run one
//   micro-batch ahead, so they encode i+1 while the decoder ranks work on i, and run the
//   backward of i when its gradients arrive (1F1B with one micro-batch in flight: at most two
//   micro-batches' encoder activations are held):
//     vision: VF(0) SA(0) | VF(1) SA(1) RG(0) VB(0) | VF(2) SA(2) RG(1) VB(1) | ... RG(n-1) VB(n-1)
//     text:   RA(0) TFB(0) SG(0) | RA(1) TFB(1) SG(1) | ...
// An encoder that does not train (fine-tuning: frozen whole; `forward_only`) gets no
// gradients: no SG, RG or <E>B for it, so a disjoint encoder group only streams forwards
// (VF0 SA0 VF1 SA1 ...), ahead of the decoder by as much as its sends allow.
// With several encoders a rank runs the actions of each encoder it hosts in module order, and
// the decoder receives from every encoder before its forward and sends to every encoder after
// its backward. Both orders compute the same thing: the same micro-batches, each module's
// collectives in the same order on all its ranks; only the overlap differs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dhp/dist/layout.h"

namespace dhp::train {

enum class Op {
  kEncode,            // <E>F (VF): encoder forward over this rank's replica's samples
  kSendActivations,   // SA: send the encoder's output rows to the decoder ranks that need them
  kRecvActivations,   // RA: receive this decoder replica's rows of one encoder (blocks)
  kDecode,            // <D>FB (TFB): decoder forward, loss, backward
  kSendGrads,         // SG: send the rows' gradients back to the encoder's ranks
  kRecvGrads,         // RG: receive the gradients of this encoder replica's rows (blocks)
  kEncodeBackward,    // <E>B (VB): backward through the encoder
};

struct Action {
  Op op;
  int64_t micro_batch;
  int64_t module = 0;  // index in the module list: the encoder (kDecode: the decoder)
};

// True when no rank hosts both an encoder and the decoder (modules.back()).
bool disjoint(const std::vector<dist::ModuleLayout>& modules);

// The actions of global rank `rank` for one step of `micro_batches` micro-batches.
// `pipelined` takes effect only when the modules are disjoint. `forward_only[e]`: encoder e
// gets no gradients (empty = every encoder trains).
std::vector<Action> make_schedule(const std::vector<dist::ModuleLayout>& modules, int64_t rank,
                                  int64_t micro_batches, bool pipelined, const std::vector<bool>& forward_only = {});

// Tag of the point-to-point messages of one action's transfer: forward (SA/RA) and backward
// (SG/RG) of each encoder of each micro-batch get their own.
int64_t transfer_tag(const Action& a, int64_t encoders);

// "VF0 SA0 VF1 SA1 RG0 VB0 ...": the op (F/B and FB after the initial of the module's name),
// the micro-batch index appended; with several encoders a transfer names its encoder
// ("SA0:audio").
std::string to_string(const std::vector<Action>& actions, const std::vector<dist::ModuleLayout>& modules);
std::string action_name(const Action& a, const std::vector<dist::ModuleLayout>& modules);

}  // namespace dhp::train
