// Plain layers with no communication: Linear, Embedding, the cross-entropy head, RMSNorm,
// SwiGLU MLP, rotary helpers. Linear, Embedding and CrossEntropyHead have virtual forwards:
// the parallel strategies replace them by name with subclasses holding shards.
// Submodule names follow Hugging Face (gate_proj, up_proj, down_proj, weight) so that
// parameter names are checkpoint keys.
#pragma once

#include <torch/nn/module.h>

#include <functional>
#include <string>

namespace dhp::nn {

// y = x W^T + b with parameters "weight" (out, in) and "bias" (out, absent when off), as
// torch::nn::Linear, but with a virtual forward so parallel strategies can swap in a
// subclass (tensor-parallel shards) without changing the model code. Initialised like
// torch::nn::Linear (uniform +-1/sqrt(in) from the global RNG); models re-initialise.
//
// LoRA (Hu et al., 2021; add_lora): a low-rank adapter beside the weight,
//   y = x W^T + b + scale * dropout(x) A^T B^T,   scale = alpha / rank,
// with A (rank, in) and B (out, rank) as the parameters "lora_A.weight" and "lora_B.weight"
// (PEFT's names, one submodule each). B starts at zero, so an adapter changes nothing until
// it trains.
struct LoraOptions {
  int64_t rank = 0;      // 0: no adapter
  double alpha = 16;     // scale = alpha / rank
  double dropout = 0;    // on the adapter's input, in training mode (Module::train; eval() turns it off)
};

class LinearImpl : public torch::nn::Module {
 public:
  LinearImpl(int64_t in, int64_t out, bool bias);
  virtual ~LinearImpl() = default;
  virtual torch::Tensor forward(const torch::Tensor& x);  // (..., in) -> (..., out)
  torch::Tensor weight, bias;

  // Adds the adapter: A uniform in +-1/sqrt(in) from the global RNG (models re-initialise),
  // B zero. Once.
  void add_lora(const LoraOptions& options);
  bool has_lora() const { return lora_a.defined(); }
  torch::Tensor lora_a, lora_b;  // undefined without an adapter
  double lora_scale = 0, lora_dropout = 0;

 protected:
  LinearImpl() = default;  // for subclasses that register their own shards
  // scale * dropout(x) A^T B^T with this object's A and B (shards, in subclasses).
  torch::Tensor lora_delta(const torch::Tensor& x) const;
  // Registers A and B (subclasses: their shards) as lora_A.weight / lora_B.weight.
  void register_lora(torch::Tensor a, torch::Tensor b, double scale, double dropout, bool requires_grad);
};
TORCH_MODULE(Linear);

Linear make_linear(int64_t in, int64_t out, bool bias);

// Token embedding: ids (...) int64 -> (..., dim), parameter "weight" (num, dim), as
// torch::nn::Embedding (initialised like it, N(0, 1) from the global RNG; models
// re-initialise), with a virtual forward (vocabulary-parallel shards replace it).
class EmbeddingImpl : public torch::nn::Module {
 public:
  EmbeddingImpl(int64_t num, int64_t dim);
  virtual ~EmbeddingImpl() = default;
  virtual torch::Tensor forward(const torch::Tensor& ids);
  torch::Tensor weight;

 protected:
  EmbeddingImpl() = default;  // for subclasses that register their own shard
};
TORCH_MODULE(Embedding);

// The language-model loss: hidden states h (n, C) at the target positions, targets (n) and
// the output projection's weight (vocab, C) -> the summed cross-entropy () in fp32 over the
// full logits (h W^T). No parameters of its own (the weight is lm_head's, or the tied
// embedding's); a vocabulary-parallel subclass replaces it.
class CrossEntropyHeadImpl : public torch::nn::Module {
 public:
  virtual ~CrossEntropyHeadImpl() = default;
  virtual torch::Tensor forward(const torch::Tensor& h, const torch::Tensor& targets, const torch::Tensor& weight);
};
TORCH_MODULE(CrossEntropyHead);

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
  Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(SwiGLU);


// (..., D) -> (..., D): cat(-x2, x1) with x1, x2 the two halves.
torch::Tensor rotate_half(const torch::Tensor& x);
// x (S, H, D) rotated by cos, sin (S, D); math in fp32, result in x's dtype.
torch::Tensor apply_rotary(const torch::Tensor& x, const torch::Tensor& cos,
                           const torch::Tensor& sin);
// 1 / theta^(2i/dim) for i < dim/2, fp32 (dim/2).
torch::Tensor rope_inv_freq(int64_t dim, double theta);

// Random state for recomputation: a forward that draws random numbers (LoRA dropout) must
// draw the same ones when checkpointing or ZeRO-3 reruns it in backward. random_ops_in_use()
// is true once any layer with dropout exists; RngState then holds the default CPU generator's
// state and, for a CUDA `device`, that device's generator's.
bool random_ops_in_use();
struct RngState {
  torch::Tensor cpu, cuda;
  c10::Device device{c10::kCPU};
  static RngState save(const c10::Device& device);
  void restore() const;
  bool empty() const { return !cpu.defined(); }
};

// Evaluation mode for a scope (dropout off), then the module's mode as it was.
class EvalScope {
 public:
  explicit EvalScope(torch::nn::Module& m) : m_(m), was_(m.is_training()) { m_.eval(); }
  ~EvalScope() { m_.train(was_); }
  EvalScope(const EvalScope&) = delete;
  EvalScope& operator=(const EvalScope&) = delete;

 private:
  torch::nn::Module& m_;
  bool was_;
};

// Does any parameter of `m` (recursively) require gradients? A layer with none whose input
// needs none (frozen, before the first trainable layer) records nothing for backward, so it
// needs no checkpointing either.
bool has_trainable_parameters(const torch::nn::Module& m);

// Re-entrant activation checkpointing: runs fn(x) without saving activations and reruns it
// in the backward pass (with the random state of the first run when random_ops_in_use()).
// Parameter gradients accumulate into .grad as without checkpointing.
// fn must be deterministic. Only for use under torch::autograd::backward (not autograd::grad).
torch::Tensor checkpoint(std::function<torch::Tensor(const torch::Tensor&)> fn,
                         const torch::Tensor& x);

// How a model runs one named stage (a layer, an embedding, a norm): runner(name, fn, x)
// must return fn(x) (parallel strategies wrap it, e.g. ZeRO-3 gathers the stage's
// parameters around the call).
using StageFn = std::function<torch::Tensor(const torch::Tensor&)>;
using StageRunner = std::function<torch::Tensor(const std::string& name, const StageFn& fn, const torch::Tensor& x)>;

}  // namespace dhp::nn
