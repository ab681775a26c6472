// Where a thread's compute time goes, from ATen's operator callbacks (at::RecordFunction):
// while an OpProfile lives, every operator this thread runs (forward and, on the CPU, the
// backward that autograd runs on the calling thread) adds its own time (its duration minus
// that of the operators it called) to one kind:
//   attention    anything inside an operator or scope whose name says attention (dhp's
//                kernel, its autograd node, libtorch's flash kernels)
//   gemm         matrix products and convolutions (mm, addmm, bmm, baddbmm, matmul, linear, conv)
//   elementwise  every other operator (norms, activations, copies, softmax, optimizer math)
// The time between operators (dhp's own code, waiting on collectives) is in none of them.
// The callbacks cost a few microseconds per operator: profile a sampled step, not every one.
// CUDA work is timed as launched on the host, not as run on the device.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace dhp {

struct OpTimes {
  double gemm_s = 0, attention_s = 0, elementwise_s = 0;
  int64_t ops = 0;  // operators timed
};

// The kind of an operator or scope by its name (for tests): "attention", "gemm" or "elementwise".
std::string op_kind(const std::string& name);

class OpProfile {
 public:
  OpProfile();  // starts timing this thread's operators
  ~OpProfile();
  OpProfile(const OpProfile&) = delete;
  OpProfile& operator=(const OpProfile&) = delete;
  OpTimes times() const;  // so far

 private:
  uint64_t handle_ = 0;
};

}  // namespace dhp
