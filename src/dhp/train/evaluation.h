// Held-out evaluation of a whole (single-process) model on the stream's held-out samples:
// mean cross-entropy over the answer tokens, exact match (every answer token the argmax,
// equal to greedy decoding), and token accuracy per answer position. Local.
#pragma once

#include <cstdint>

#include "dhp/models/qwen2_5_vl/model.h"
#include "dhp/train/data_stream.h"
#include "dhp/train/metrics.h"

namespace dhp::train {

// The first `num_samples` held-out samples of `data`, `chunk` samples per forward, on the
// model's device (the counting stays on the host).
EvalResult evaluate_model(qwen::Qwen2_5_VLImpl& model, DataStream& stream, int64_t num_samples, int64_t chunk,
                          const qwen::ModelConfig& cfg);

}  // namespace dhp::train
