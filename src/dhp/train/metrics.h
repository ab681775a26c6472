// What a training step and a held-out evaluation measure (metrics.jsonl, summary.json;
// the README lists every field).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dhp::train {

struct StepMetrics {
  int64_t step = 0;            // 1-based after the step
  double loss = 0;             // mean CE over the global batch's target tokens
  double lr = 0;
  double grad_norm = 0;        // before clipping
  double step_time_s = 0;
  double tokens_per_s = 0;     // text tokens (input ids) per second
  double patches_per_s = 0;    // vision patches per second
  int64_t tokens = 0, target_tokens = 0, patches = 0;
  int64_t peak_bytes = 0;      // peak CPU tensor bytes during the step
  double model_flops = 0;      // forward+backward FLOPs of the step (6*N*T style, see flops.h)
  double comm_s = 0;           // this rank's time inside collectives during the step
  int64_t comm_calls = 0;
  int64_t comm_bytes = 0;
  double samples_s = 0;        // making (or taking from the loader) this step's samples
  double update_s = 0;         // this rank's finish_step: gradient reductions, norm, clipping, optimizer
  double wait_s = 0;           // this rank's time blocked on the other module (schedule receives)
  double data_wait_s = 0;      // rank 0's time waiting for the data loader's samples
  int64_t skipped_samples = 0; // bad samples skipped so far (llava; see the log for the reasons)
  int64_t samples = 0;         // samples in the step (varies when packing to a token budget)
  // Per rank of the job, rank-major (rank 0 has them all; other ranks their own only).
  std::vector<double> peak_bytes_per_rank, comm_s_per_rank, busy_s_per_rank, idle_s_per_rank;
  std::vector<double> vision_s_per_rank, text_s_per_rank;  // time in each module's forward/backward
  std::vector<double> update_s_per_rank;                    // time in finish_step (update_s)
  // A profiled step (training.profile_every) only: per part of the step, its seconds on each
  // rank (kBreakdownParts, in that order); empty on other steps.
  std::vector<std::vector<double>> breakdown_per_rank;
};

// The parts of a profiled step: operators' own time by kind during the forward and backward
// (core/op_profile.h), time in collectives (the whole step), finish_step without its
// collectives, making the step's samples, and the rest (dhp's own code between operators).
inline constexpr const char* kBreakdownParts[] = {"gemm_s",   "attention_s", "elementwise_s", "comm_s",
                                                  "update_s", "data_s",      "other_s"};
inline constexpr size_t kBreakdownCount = sizeof(kBreakdownParts) / sizeof(kBreakdownParts[0]);

struct EvalResult {
  int64_t samples = 0;
  int64_t exact = 0;           // samples whose whole answer is predicted (greedy == teacher-forced argmax)
  double accuracy = 0;
  double loss = 0;             // mean CE on the held-out answers
  std::vector<double> slot_accuracy;  // token accuracy at each answer position (a, colour, shape, ...)
};

// One line of metrics.jsonl.
std::string metrics_json(const StepMetrics& m);

}  // namespace dhp::train
