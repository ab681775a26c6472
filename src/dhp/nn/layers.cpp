#include "dhp/nn/layers.h"

#include <torch/torch.h>

namespace dhp::nn {

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  auto xf = x.to(torch::kFloat32);
  auto normed = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps_);
  return weight * normed.to(x.scalar_type());
}

LinearImpl::LinearImpl(int64_t in, int64_t out, bool with_bias) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  weight = register_parameter("weight", torch::empty({out, in}).uniform_(-bound, bound));
  if (with_bias) bias = register_parameter("bias", torch::empty({out}).uniform_(-bound, bound));
}

torch::Tensor LinearImpl::forward(const torch::Tensor& x) {
  return torch::nn::functional::linear(x, weight, bias);
}

Linear make_linear(int64_t in, int64_t out, bool bias) { return Linear(in, out, bias); }

SwiGLUImpl::SwiGLUImpl(int64_t dim, int64_t hidden, bool bias) {
  gate_proj = register_module("gate_proj", make_linear(dim, hidden, bias));
  up_proj = register_module("up_proj", make_linear(dim, hidden, bias));
  down_proj = register_module("down_proj", make_linear(hidden, dim, bias));
}

torch::Tensor SwiGLUImpl::forward(const torch::Tensor& x) {
  return down_proj(torch::silu(gate_proj(x)) * up_proj(x));
}

torch::Tensor rotate_half(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

torch::Tensor apply_rotary(const torch::Tensor& x, const torch::Tensor& cos,
                           const torch::Tensor& sin) {
  auto xf = x.to(torch::kFloat32);
  auto c = cos.to(torch::kFloat32).unsqueeze(1), s = sin.to(torch::kFloat32).unsqueeze(1);
  return (xf * c + rotate_half(xf) * s).to(x.scalar_type());
}

torch::Tensor rope_inv_freq(int64_t dim, double theta) {
  auto i = torch::arange(0, dim, 2, torch::kFloat32);
  return 1.0 / torch::pow(theta, i / static_cast<double>(dim));
}

namespace {

struct FnHolder : torch::CustomClassHolder {
  std::function<torch::Tensor(const torch::Tensor&)> fn;
};

struct CheckpointFn : public torch::autograd::Function<CheckpointFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               c10::intrusive_ptr<FnHolder> holder) {
    ctx->save_for_backward({x});
    ctx->saved_data["fn"] = c10::IValue::make_capsule(holder);
    torch::NoGradGuard no_grad;
    return holder->fn(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    auto holder = c10::static_intrusive_pointer_cast<FnHolder>(ctx->saved_data["fn"].toCapsule());
    torch::Tensor y;
    {
      torch::AutoGradMode enable(true);
      y = holder->fn(x);
    }
    torch::autograd::backward({y}, {grads[0]});
    return {x.grad(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor checkpoint(std::function<torch::Tensor(const torch::Tensor&)> fn,
                         const torch::Tensor& x) {
  if (!torch::GradMode::is_enabled()) return fn(x);
  auto holder = c10::make_intrusive<FnHolder>();
  holder->fn = std::move(fn);
  // The input must require grad for the node to exist; parameters are reached inside.
  auto xin = x.requires_grad() ? x : x.detach().requires_grad_(true);
  return CheckpointFn::apply(xin, holder);
}

}  // namespace dhp::nn
