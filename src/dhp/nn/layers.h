// Plain layers with no communication: RMSNorm, SwiGLU MLP, rotary helpers.
// Submodule names follow Hugging Face (gate_proj, up_proj, down_proj, weight) so that
// parameter names are checkpoint keys.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

namespace dhp::nn {

// y = weight * (x / sqrt(mean(x^2) + eps)); the normalisation runs in fp32 and is cast back
// to x's dtype before the weight multiply (as Hugging Face's Qwen2RMSNorm).
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  torch::Tensor forward(const torch::Tensor& x);  // (..., dim) -> (..., dim)
  torch::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

// down(silu(gate(x)) * up(x)).
class SwiGLUImpl : public torch::nn::Module {
 public:
  SwiGLUImpl(int64_t dim, int64_t hidden, bool bias);
  torch::Tensor forward(const torch::Tensor& x);  // (S, dim) -> (S, dim)
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(SwiGLU);

// torch::nn::Linear with bias on or off.
torch::nn::Linear make_linear(int64_t in, int64_t out, bool bias);

// (..., D) -> (..., D): cat(-x2, x1) with x1, x2 the two halves.
torch::Tensor rotate_half(const torch::Tensor& x);
// x (S, H, D) rotated by cos, sin (S, D); math in fp32, result in x's dtype.
torch::Tensor apply_rotary(const torch::Tensor& x, const torch::Tensor& cos,
                           const torch::Tensor& sin);
// 1 / theta^(2i/dim) for i < dim/2, fp32 (dim/2).
torch::Tensor rope_inv_freq(int64_t dim, double theta);

// Re-entrant activation checkpointing: runs fn(x) without saving activations and reruns it
// in the backward pass. Parameter gradients accumulate into .grad as without checkpointing.
// fn must be deterministic. Only for use under torch::autograd::backward (not autograd::grad).
torch::Tensor checkpoint(std::function<torch::Tensor(const torch::Tensor&)> fn,
                         const torch::Tensor& x);

}  // namespace dhp::nn
