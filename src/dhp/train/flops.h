// Model FLOPs of a batch, counted from the shapes: GEMMs (2*m*n*k) and attention
// (QK^T and PV over each segment; causal counts the visible pairs only). Training FLOPs
// are 3x forward (backward = 2x forward); activation recomputation is not counted, as in
// the usual model-FLOPs-utilisation convention.
#pragma once

#include "dhp/data/sample.h"
#include "dhp/models/qwen2_5_vl/model.h"

namespace dhp::train {

double vision_forward_flops(const qwen::VisionConfig& cfg, const qwen::VisionPlan& plan);
double text_forward_flops(const qwen::TextConfig& cfg, const std::vector<int64_t>& cu_seqlens,
                          int64_t target_tokens);
// `vision_forward_only`: the vision encoder is frozen whole (fine-tuning) and runs its forward
// alone, counted once instead of three times.
double training_flops(const qwen::ModelConfig& cfg, const qwen::Batch& batch, bool vision_forward_only = false);
// The same for the samples of one packed micro-batch, without packing them.
double training_flops(const qwen::ModelConfig& cfg, const std::vector<data::Sample>& samples,
                      bool vision_forward_only = false);

// The forward FLOPs of one sample alone in the vision tower (its images and clips; 0 without
// any) and in the decoder (its tokens, its causal attention, the loss head over its answer
// tokens): the costs a module's data-parallel replicas are balanced by (parallel.balance).
double vision_sample_flops(const qwen::ModelConfig& cfg, const data::Sample& sample);
double text_sample_flops(const qwen::ModelConfig& cfg, const data::Sample& sample);

}  // namespace dhp::train
