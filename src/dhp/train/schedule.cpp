#include "dhp/train/schedule.h"

#include <cctype>

namespace dhp::train {
namespace {

bool hosts(const dist::ModuleLayout& m, int64_t rank) { return m.module_rank(rank) >= 0; }

std::string initial(const dist::ModuleLayout& m) {
  return std::string(1, static_cast<char>(std::toupper(static_cast<unsigned char>(m.name.empty() ? '?' : m.name[0]))));
}

}  // namespace

bool disjoint(const std::vector<dist::ModuleLayout>& modules) {
  const auto& decoder = modules.back();
  for (size_t e = 0; e + 1 < modules.size(); ++e)
    for (auto r : modules[e].ranks)
      if (hosts(decoder, r)) return false;
  return true;
}

std::vector<Action> make_schedule(const std::vector<dist::ModuleLayout>& modules, int64_t rank,
                                  int64_t micro_batches, bool pipelined, const std::vector<bool>& forward_only) {
  const int64_t decoder = static_cast<int64_t>(modules.size()) - 1;
  auto trains = [&](int64_t e) { return static_cast<size_t>(e) >= forward_only.size() || !forward_only[e]; };
  std::vector<int64_t> mine;  // the encoders this rank hosts, in module order
  for (int64_t e = 0; e < decoder; ++e)
    if (hosts(modules[e], rank)) mine.push_back(e);
  const bool decodes = hosts(modules.back(), rank);
  std::vector<Action> a;
  auto encode = [&](int64_t i) {
    for (auto e : mine) {
      a.push_back({Op::kEncode, i, e});
      a.push_back({Op::kSendActivations, i, e});
    }
  };
  auto encode_backward = [&](int64_t i) {
    for (auto e : mine) {
      if (!trains(e)) continue;
      a.push_back({Op::kRecvGrads, i, e});
      a.push_back({Op::kEncodeBackward, i, e});
    }
  };
  auto decode = [&](int64_t i) {
    if (!decodes) return;
    for (int64_t e = 0; e < decoder; ++e) a.push_back({Op::kRecvActivations, i, e});
    a.push_back({Op::kDecode, i, decoder});
    for (int64_t e = 0; e < decoder; ++e)
      if (trains(e)) a.push_back({Op::kSendGrads, i, e});
  };
  if (pipelined && disjoint(modules)) {
    if (micro_batches > 0) encode(0);
    for (int64_t i = 0; i < micro_batches; ++i) {
      if (i + 1 < micro_batches) encode(i + 1);
      encode_backward(i);
      decode(i);
    }
    return a;
  }
  for (int64_t i = 0; i < micro_batches; ++i) {
    encode(i);
    decode(i);
    encode_backward(i);
  }
  return a;
}

int64_t transfer_tag(const Action& a, int64_t encoders) {
  const bool backward = a.op == Op::kSendGrads || a.op == Op::kRecvGrads;
  return 2 * (a.micro_batch * encoders + a.module) + (backward ? 1 : 0);
}

std::string action_name(const Action& a, const std::vector<dist::ModuleLayout>& modules) {
  const auto& m = modules.at(static_cast<size_t>(a.module));
  const std::string mb = std::to_string(a.micro_batch);
  const std::string of = modules.size() > 2 ? ":" + m.name : "";
  switch (a.op) {
    case Op::kEncode: return initial(m) + "F" + mb;
    case Op::kSendActivations: return "SA" + mb + of;
    case Op::kRecvActivations: return "RA" + mb + of;
    case Op::kDecode: return initial(m) + "FB" + mb;
    case Op::kSendGrads: return "SG" + mb + of;
    case Op::kRecvGrads: return "RG" + mb + of;
    case Op::kEncodeBackward: return initial(m) + "B" + mb;
  }
  return "?";
}

std::string to_string(const std::vector<Action>& actions, const std::vector<dist::ModuleLayout>& modules) {
  std::string s;
  for (const auto& x : actions) {
    if (!s.empty()) s += ' ';
    s += action_name(x, modules);
  }
  return s;
}

}  // namespace dhp::train
