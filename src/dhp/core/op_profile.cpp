#include "dhp/core/op_profile.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <vector>

#include "dhp/core/error.h"

namespace dhp {
namespace {

enum Kind { kElementwise = 0, kGemm = 1, kAttention = 2 };

bool contains(const std::string& lower, const char* s) { return lower.find(s) != std::string::npos; }

Kind kind_of(const char* name) {
  std::string n(name ? name : "");
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (contains(n, "attention")) return kAttention;
  // aten::mm, addmm, bmm, baddbmm, matmul, linear, convolution (and their autograd nodes).
  for (const char* g : {"::mm", "addmm", "bmm", "matmul", "linear", "conv", "mmbackward", "addmv", "::mv", "::dot"}) {
    if (contains(n, g)) return kGemm;
  }
  return kElementwise;
}

using Clock = std::chrono::steady_clock;

struct Frame {
  Clock::time_point start;
  double children = 0;  // seconds in operators called from this one
  Kind kind;
};

struct ThreadState {
  bool active = false;
  std::vector<Frame> stack;
  OpTimes times;
};
thread_local ThreadState tls;

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  if (!tls.active) return nullptr;
  Kind k = kind_of(fn.name());
  // Inside attention, everything is attention.
  if (!tls.stack.empty() && tls.stack.back().kind == kAttention) k = kAttention;
  tls.stack.push_back({Clock::now(), 0.0, k});
  return nullptr;
}

void on_end(const at::RecordFunction& /*fn*/, at::ObserverContext* /*ctx*/) {
  if (!tls.active || tls.stack.empty()) return;
  const Frame f = tls.stack.back();
  tls.stack.pop_back();
  const double d = std::chrono::duration<double>(Clock::now() - f.start).count();
  const double self = std::max(0.0, d - f.children);
  if (!tls.stack.empty()) tls.stack.back().children += d;
  ++tls.times.ops;
  switch (f.kind) {
    case kGemm: tls.times.gemm_s += self; break;
    case kAttention: tls.times.attention_s += self; break;
    case kElementwise: tls.times.elementwise_s += self; break;
  }
}

}  // namespace

std::string op_kind(const std::string& name) {
  switch (kind_of(name.c_str())) {
    case kGemm: return "gemm";
    case kAttention: return "attention";
    case kElementwise: break;
  }
  return "elementwise";
}

OpProfile::OpProfile() {
  DHP_CHECK(!tls.active, "an OpProfile is already timing this thread");
  tls = ThreadState{};
  tls.active = true;
  handle_ = at::addThreadLocalCallback(at::RecordFunctionCallback(on_start, on_end));
}

OpProfile::~OpProfile() {
  at::removeCallback(handle_);
  tls.active = false;
  tls.stack.clear();
}

OpTimes OpProfile::times() const { return tls.times; }

}  // namespace dhp
