#include "dhp/nn/layers.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <atomic>
#include <mutex>

namespace {
std::atomic<int64_t> g_random_layers{0};  // layers that draw random numbers in forward (LoRA dropout)
}  // namespace

namespace dhp::nn {

EmbeddingImpl::EmbeddingImpl(int64_t num, int64_t dim) {
  weight = register_parameter("weight", torch::empty({num, dim}));
  torch::nn::init::normal_(weight);
}

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& ids) { return torch::embedding(weight, ids); }

torch::Tensor CrossEntropyHeadImpl::forward(const torch::Tensor& h, const torch::Tensor& targets,
                                            const torch::Tensor& weight) {
  auto logits = torch::matmul(h, weight.t()).to(torch::kFloat32);
  return torch::nn::functional::cross_entropy(
      logits, targets, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// RMSNorm as one autograd node that saves only its input (in its own dtype) and the fp32
// reciprocal RMS per row; plain autograd would keep three fp32 copies of the activations
// (x, x * rstd, and the cast). Same math: the backward recomputes x * rstd.
struct RMSNormFn : public torch::autograd::Function<RMSNormFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& weight,
                               double eps) {
    auto xf = x.to(torch::kFloat32);
    auto rstd = torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
    ctx->save_for_backward({x, weight, rstd});
    return weight * (xf * rstd).to(x.scalar_type());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &weight = saved[1], &rstd = saved[2];
    const auto& gy = grads[0];
    auto xf = x.to(torch::kFloat32);  // a copy for a 16-bit x, a view of it in fp32 (read only)
    torch::Tensor gw;
    if (weight.requires_grad()) {
      gw = (gy * (xf * rstd).to(x.scalar_type())).reshape({-1, weight.size(0)}).sum(0).to(weight.scalar_type());
    }
    torch::Tensor gx;
    if (x.requires_grad()) {
      // d/dx [x * rstd] with rstd = (mean(x^2) + eps)^-1/2:
      //   dn * rstd - x * rstd^3 * sum(dn * x) / D, with dn the gradient of x * rstd (fp32).
      // In place where possible: the activations are the largest tensors of the step.
      auto dn = (gy * weight).to(torch::kFloat32);
      auto coef = (dn * xf).sum(-1, /*keepdim=*/true).mul_(rstd.pow(3)).div_(static_cast<double>(x.size(-1)));
      gx = dn.mul_(rstd).sub_(xf * coef).to(x.scalar_type());
    }
    return {gx, gw, torch::Tensor()};
  }
};

// Rotary embedding as one autograd node that saves nothing but the cos/sin tables.
struct RotaryFn : public torch::autograd::Function<RotaryFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& cos,
                               const torch::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["dtype"] = static_cast<int64_t>(x.scalar_type());
    auto xf = x.to(torch::kFloat32);
    auto c = cos.to(torch::kFloat32).unsqueeze(1), s = sin.to(torch::kFloat32).unsqueeze(1);
    return (xf * c + rotate_half(xf) * s).to(x.scalar_type());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto dtype = static_cast<torch::ScalarType>(ctx->saved_data["dtype"].toInt());
    auto c = saved[0].to(torch::kFloat32).unsqueeze(1), s = saved[1].to(torch::kFloat32).unsqueeze(1);
    auto g = grads[0].to(torch::kFloat32);
    // rotate_half is linear: y = (-x2, x1); its transpose maps (g1, g2) to (g2, -g1).
    auto gs = g * s;
    const int64_t half = gs.size(-1) / 2;
    auto back = torch::cat({gs.narrow(-1, half, half), -gs.narrow(-1, 0, half)}, -1);
    return {(g * c + back).to(dtype), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  return RMSNormFn::apply(x, weight, eps_);
}

LinearImpl::LinearImpl(int64_t in, int64_t out, bool with_bias) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  weight = register_parameter("weight", torch::empty({out, in}).uniform_(-bound, bound));
  if (with_bias) bias = register_parameter("bias", torch::empty({out}).uniform_(-bound, bound));
}

torch::Tensor LinearImpl::forward(const torch::Tensor& x) {
  auto y = torch::nn::functional::linear(x, weight, bias);
  return has_lora() ? y + lora_delta(x) : y;
}

namespace {
// Holds one adapter matrix as its parameter "weight" (PEFT's lora_A.weight / lora_B.weight).
struct LoraHolder : torch::nn::Module {};
}  // namespace

void LinearImpl::register_lora(torch::Tensor a, torch::Tensor b, double scale, double dropout, bool requires_grad) {
  TORCH_CHECK(!has_lora(), "Linear: an adapter is there already");
  auto ha = register_module("lora_A", std::make_shared<LoraHolder>());
  auto hb = register_module("lora_B", std::make_shared<LoraHolder>());
  lora_a = ha->register_parameter("weight", std::move(a), requires_grad);
  lora_b = hb->register_parameter("weight", std::move(b), requires_grad);
  lora_scale = scale;
  lora_dropout = dropout;
  if (dropout > 0) ++g_random_layers;  // recomputations replay the random state from now on
}

void LinearImpl::add_lora(const LoraOptions& o) {
  TORCH_CHECK(o.rank > 0, "Linear::add_lora: rank must be > 0, got ", o.rank);
  torch::NoGradGuard no_grad;
  const int64_t in = weight.size(1), out = weight.size(0);
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  const auto opts = weight.options().requires_grad(false);
  register_lora(torch::empty({o.rank, in}, opts).uniform_(-bound, bound), torch::zeros({out, o.rank}, opts),
                o.alpha / static_cast<double>(o.rank), o.dropout, true);
}

torch::Tensor LinearImpl::lora_delta(const torch::Tensor& x) const {
  auto in = lora_dropout > 0 && is_training() ? torch::dropout(x, lora_dropout, /*train=*/true) : x;
  return torch::nn::functional::linear(torch::nn::functional::linear(in, lora_a), lora_b) * lora_scale;
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
  if (cos.requires_grad() || sin.requires_grad()) {  // tables are constants; stay general anyway
    auto xf = x.to(torch::kFloat32);
    auto c = cos.to(torch::kFloat32).unsqueeze(1), s = sin.to(torch::kFloat32).unsqueeze(1);
    return (xf * c + rotate_half(xf) * s).to(x.scalar_type());
  }
  return RotaryFn::apply(x, cos, sin);
}

torch::Tensor rope_inv_freq(int64_t dim, double theta) {
  auto i = torch::arange(0, dim, 2, torch::kFloat32);
  return 1.0 / torch::pow(theta, i / static_cast<double>(dim));
}

namespace {

struct FnHolder : torch::CustomClassHolder {
  std::function<torch::Tensor(const torch::Tensor&)> fn;
  RngState rng;  // empty unless random ops are in use
};

struct CheckpointFn : public torch::autograd::Function<CheckpointFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               c10::intrusive_ptr<FnHolder> holder) {
    ctx->save_for_backward({x});
    ctx->saved_data["fn"] = c10::IValue::make_capsule(holder);
    if (random_ops_in_use()) holder->rng = RngState::save(x.device());
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
      if (holder->rng.empty()) {
        y = holder->fn(x);
      } else {  // the first run's random numbers, then the generators as they were
        const auto now = RngState::save(x.device());
        holder->rng.restore();
        y = holder->fn(x);
        now.restore();
      }
    }
    torch::autograd::backward({y}, {grads[0]});
    return {x.grad(), torch::Tensor()};
  }
};

}  // namespace

bool random_ops_in_use() { return g_random_layers.load() > 0; }

RngState RngState::save(const c10::Device& device) {
  RngState s;
  s.device = device;
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    s.cpu = gen.get_state();
  }
  if (device.is_cuda()) {
    auto gen = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    s.cuda = gen.get_state();
  }
  return s;
}

void RngState::restore() const {
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(cpu);
  }
  if (cuda.defined()) {
    auto gen = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(cuda);
  }
}

bool has_trainable_parameters(const torch::nn::Module& m) {
  for (const auto& p : m.parameters(/*recurse=*/true))
    if (p.requires_grad()) return true;
  return false;
}

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
