// Qwen2.5-VL vision tower: patch embedding, 2-D rotary, window attention blocks with full
// attention in fullatt_block_indexes, and the 2x2 PatchMerger. Architecture only; parallel
// strategies come in from outside, three ways: they replace linears by name (tensor
// parallelism), run each named stage through `runner` (ZeRO-3), and split the sequence
// through `split` (sequence parallelism), which the one forward below consults.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <array>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dhp/models/qwen2_5_vl/config.h"
#include "dhp/models/qwen2_5_vl/windows.h"
#include "dhp/nn/attention.h"
#include "dhp/nn/layers.h"

namespace dhp::qwen {

// Host-side geometry of one packed batch of images, computed once per batch. All indices
// refer to the packed patch sequence in the processor's order (merge-window order: each
// consecutive group of merge^2 patches is one LLM token).
struct VisionPlan {
  int64_t num_patches = 0;
  // window_index[i] = merged unit placed at position i after the window reorder.
  std::vector<int64_t> window_index;
  // Offsets (in patches, window order) of the attention windows; duplicates removed.
  std::vector<int64_t> cu_window_seqlens;
  // Offsets (in patches) of the full-attention segments: one per image and frame.
  std::vector<int64_t> cu_seqlens;
  // (h, w) patch coordinates per patch, processor order, (N, 2) int64.
  torch::Tensor pos_ids;
};

// (h, w) coordinates of every patch in processor (merge-window) order, (N, 2) int64.
torch::Tensor vision_pos_ids(const std::vector<GridTHW>& grids, int64_t merge);
VisionPlan make_vision_plan(const std::vector<GridTHW>& grids, const VisionConfig& cfg);
// argsort of a permutation.
std::vector<int64_t> inverse_permutation(const std::vector<int64_t>& perm);

// Attention core: (S, H, D) q, k, v over the segments cu -> (S, H, D).
using AttentionCore = std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&,
                                                  const torch::Tensor&,
                                                  const std::vector<int64_t>& cu, bool causal)>;
// dhp's varlen attention kernel on this process's rows (nn/attention.h).
AttentionCore local_attention_core(const dhp::nn::VarlenAttentionOptions& options);

// What one attention call needs besides the activations: the rotary angles, the segments
// and the attention core (chosen per call by the tower: local, or sequence-parallel).
struct VisionAttnInputs {
  torch::Tensor cos, sin;             // (S, head_dim), window order
  std::vector<int64_t> cu;            // segments for this block (windows or images)
  AttentionCore core;
};

// How the tower's window-ordered sequence is split over ranks (sequence parallelism,
// models/qwen2_5_vl/parallelize.h); absent, one process computes all of it. rows() is
// called first in every forward and the others refer to that forward's plan.
class VisionSequenceSplit {
 public:
  virtual ~VisionSequenceSplit() = default;
  // This rank's rows [lo, hi) of the window-ordered patch sequence, on window boundaries.
  virtual std::pair<int64_t, int64_t> rows(const VisionPlan& plan) = 0;
  // Attention over whole images (full-attention blocks) from every rank's rows.
  virtual AttentionCore full_attention() = 0;
  // This rank's merged rows (window order) -> every rank's, in window order.
  virtual torch::Tensor gather(const torch::Tensor& merged) = 0;
};

class VisionAttentionImpl : public torch::nn::Module {
 public:
  explicit VisionAttentionImpl(const VisionConfig& cfg);
  torch::Tensor forward(const torch::Tensor& x, const VisionAttnInputs& in);  // (S, C) -> (S, C)
  dhp::nn::Linear qkv{nullptr}, proj{nullptr};
  int64_t num_heads;
};
TORCH_MODULE(VisionAttention);

class VisionBlockImpl : public torch::nn::Module {
 public:
  explicit VisionBlockImpl(const VisionConfig& cfg);
  torch::Tensor forward(const torch::Tensor& x, const VisionAttnInputs& in);
  dhp::nn::RMSNorm norm1{nullptr}, norm2{nullptr};
  VisionAttention attn{nullptr};
  dhp::nn::SwiGLU mlp{nullptr};
};
TORCH_MODULE(VisionBlock);

// RMSNorm, then merge^2 consecutive patches into one row, Linear(4h, 4h), GELU, Linear(4h, out).
class PatchMergerImpl : public torch::nn::Module {
 public:
  explicit PatchMergerImpl(const VisionConfig& cfg);
  torch::Tensor forward(const torch::Tensor& x);  // (S, h) -> (S/merge^2, out)
  dhp::nn::RMSNorm ln_q{nullptr};
  // "mlp" holds fc1 as child "0" and fc2 as child "2" (Hugging Face's Sequential indices;
  // the GELU at index 1 has no parameters), so strategies can swap either linear.
  std::shared_ptr<torch::nn::Module> mlp;
  dhp::nn::Linear fc1{nullptr}, fc2{nullptr};
  int64_t merged_dim;
};
TORCH_MODULE(PatchMerger);

// Conv3d with stride = kernel over pre-flattened patches, stored with Conv3d's weight shape
// (hidden, C, T, P, P) so Hugging Face weights load unchanged; computed as one GEMM.
class PatchEmbedImpl : public torch::nn::Module {
 public:
  explicit PatchEmbedImpl(const VisionConfig& cfg);
  torch::Tensor forward(const torch::Tensor& patches);  // (N, C*T*P*P) -> (N, hidden)
  struct ProjHolder : torch::nn::Module {
    torch::Tensor weight;
  };
  std::shared_ptr<ProjHolder> proj;
};
TORCH_MODULE(PatchEmbed);

class VisionTransformerImpl : public torch::nn::Module {
 public:
  explicit VisionTransformerImpl(const VisionConfig& cfg);
  // patches (N, C*T*P*P), processor order -> (N / merge^2, out_hidden), processor order.
  // With a split, this rank embeds and runs the blocks and the merger on its rows only
  // [sharded], and the merged rows of every rank are gathered at the end.
  torch::Tensor forward(const torch::Tensor& patches, const VisionPlan& plan);
  // (cos, sin) of rows [lo, hi) of the window order, (hi - lo, head_dim) fp32 on `device`.
  std::pair<torch::Tensor, torch::Tensor> rotary(const VisionPlan& plan, const torch::Device& device, int64_t lo,
                                                 int64_t hi) const;

  PatchEmbed patch_embed{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  PatchMerger merger{nullptr};
  VisionConfig cfg;
  bool activation_checkpointing = false;
  dhp::nn::VarlenAttentionOptions attention;  // block and kernel (training.attention_block, training.attention)
  // Runs each stage ("visual.patch_embed", "visual.blocks.<i>", "visual.merger") when set
  // (ZeRO-3 gathers the stage's parameters around it); null: plain calls, blocks under
  // activation checkpointing when that is on.
  dhp::nn::StageRunner runner;
  // Sequence parallelism's split of the rows; null: all rows here.
  std::shared_ptr<VisionSequenceSplit> split;

 private:
  // fn(x) through the runner when there is one.
  torch::Tensor stage(const std::string& name, const dhp::nn::StageFn& fn, const torch::Tensor& x);
  // Window-ordered hidden states (S, hidden) of rows [lo, hi) of the sequence: embedded here.
  torch::Tensor embed(const torch::Tensor& patches, const VisionPlan& plan, int64_t lo, int64_t hi);
};
TORCH_MODULE(VisionTransformer);

// Reorders (N, ...) rows grouped by merge units of `unit` rows along dim 0 by `index`.
torch::Tensor reorder_units(const torch::Tensor& x, const std::vector<int64_t>& index,
                            int64_t unit);

}  // namespace dhp::qwen
