#include "dhp/parallel/mappings.h"

#include <torch/torch.h>

#include "dhp/core/error.h"

namespace dhp::parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

c10::IValue hold(const dist::Group& g) { return group_capsule(g); }
const dist::Group& held(AutogradContext* ctx) { return group_of(ctx->saved_data["group"]); }

torch::Tensor all_reduced(const torch::Tensor& x, const dist::Group& g) {
  auto y = x.contiguous().clone();
  g.all_reduce_sum_(y);
  return y;
}

torch::Tensor own_slice(const torch::Tensor& x, const dist::Group& g, int64_t dim) {
  DHP_CHECK(x.size(dim) % g.size() == 0, "scatter over group '", g.name(), "': dim ", dim, " of size ",
            x.size(dim), " is not divisible by the group size ", g.size());
  const int64_t n = x.size(dim) / g.size();
  return x.narrow(dim, g.rank() * n, n).contiguous();
}

struct CopyTo : torch::autograd::Function<CopyTo> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const dist::Group& g) {
    ctx->saved_data["group"] = hold(g);
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_reduced(grads[0], held(ctx)), torch::Tensor()};
  }
};

struct ReduceFrom : torch::autograd::Function<ReduceFrom> {
  static torch::Tensor forward(AutogradContext*, const torch::Tensor& x, const dist::Group& g) {
    return all_reduced(x, g);
  }
  static variable_list backward(AutogradContext*, variable_list grads) { return {grads[0], torch::Tensor()}; }
};

struct GatherFrom : torch::autograd::Function<GatherFrom> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const dist::Group& g, int64_t dim) {
    ctx->saved_data["group"] = hold(g);
    ctx->saved_data["dim"] = dim;
    return g.all_gather(x, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {own_slice(grads[0], held(ctx), ctx->saved_data["dim"].toInt()), torch::Tensor(), torch::Tensor()};
  }
};

struct ScatterTo : torch::autograd::Function<ScatterTo> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const dist::Group& g, int64_t dim) {
    ctx->saved_data["group"] = hold(g);
    ctx->saved_data["dim"] = dim;
    return own_slice(x, g, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {held(ctx).all_gather(grads[0], ctx->saved_data["dim"].toInt()), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

struct GroupHolder : torch::CustomClassHolder {
  explicit GroupHolder(dist::Group g) : group(std::move(g)) {}
  dist::Group group;
};

c10::IValue group_capsule(const dist::Group& g) { return c10::IValue::make_capsule(c10::make_intrusive<GroupHolder>(g)); }
const dist::Group& group_of(const c10::IValue& capsule) {
  return c10::static_intrusive_pointer_cast<GroupHolder>(capsule.toCapsule())->group;
}

torch::Tensor copy_to_group(const torch::Tensor& x, const dist::Group& g) {
  return g.size() == 1 ? x : CopyTo::apply(x, g);
}
torch::Tensor reduce_from_group(const torch::Tensor& x, const dist::Group& g) {
  return g.size() == 1 ? x : ReduceFrom::apply(x, g);
}
torch::Tensor gather_from_group(const torch::Tensor& x, const dist::Group& g, int64_t dim) {
  return g.size() == 1 ? x : GatherFrom::apply(x, g, dim);
}
torch::Tensor scatter_to_group(const torch::Tensor& x, const dist::Group& g, int64_t dim) {
  return g.size() == 1 ? x : ScatterTo::apply(x, g, dim);
}

}  // namespace dhp::parallel
