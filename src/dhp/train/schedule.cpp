#include "dhp/train/schedule.h"

namespace dhp::train {

bool disjoint(const dist::ModuleLayout& vision, const dist::ModuleLayout& text) {
  for (auto r : vision.ranks)
    if (text.module_rank(r) >= 0) return false;
  return true;
}

const char* op_name(Op op) {
  switch (op) {
    case Op::kVisionForward: return "VF";
    case Op::kSendActivations: return "SA";
    case Op::kRecvActivations: return "RA";
    case Op::kTextForwardBackward: return "TFB";
    case Op::kSendGrads: return "SG";
    case Op::kRecvGrads: return "RG";
    case Op::kVisionBackward: return "VB";
  }
  return "?";
}

std::vector<Action> make_schedule(const dist::ModuleLayout& vision, const dist::ModuleLayout& text, int64_t rank,
                                  int64_t micro_batches, bool pipelined) {
  const bool v = vision.module_rank(rank) >= 0, t = text.module_rank(rank) >= 0;
  std::vector<Action> a;
  auto vision_forward = [&](int64_t i) {
    a.push_back({Op::kVisionForward, i});
    a.push_back({Op::kSendActivations, i});
  };
  auto vision_backward = [&](int64_t i) {
    a.push_back({Op::kRecvGrads, i});
    a.push_back({Op::kVisionBackward, i});
  };
  auto text_step = [&](int64_t i) {
    a.push_back({Op::kRecvActivations, i});
    a.push_back({Op::kTextForwardBackward, i});
    a.push_back({Op::kSendGrads, i});
  };
  if (pipelined && disjoint(vision, text)) {
    if (v && micro_batches > 0) vision_forward(0);
    for (int64_t i = 0; i < micro_batches; ++i) {
      if (v) {
        if (i + 1 < micro_batches) vision_forward(i + 1);
        vision_backward(i);
      }
      if (t) text_step(i);
    }
    return a;
  }
  for (int64_t i = 0; i < micro_batches; ++i) {
    if (v) vision_forward(i);
    if (t) text_step(i);
    if (v) vision_backward(i);
  }
  return a;
}

std::string to_string(const std::vector<Action>& actions) {
  std::string s;
  for (const auto& x : actions) {
    if (!s.empty()) s += ' ';
    s += op_name(x.op) + std::to_string(x.micro_batch);
  }
  return s;
}

}  // namespace dhp::train
