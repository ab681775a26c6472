// The vision tower's window geometry, without torch (the planner counts windows with it).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "dhp/models/qwen2_5_vl/config.h"

namespace dhp::qwen {

using GridTHW = std::array<int64_t, 3>;  // (t, h, w) in patches

// Qwen's window index: windows of (window_size / merge / patch)^2 merged units, per image,
// row-major over windows, padding excluded. Throws dhp::Error on a grid not divisible by merge.
void window_index(const std::vector<GridTHW>& grids, const VisionConfig& cfg,
                  std::vector<int64_t>& index, std::vector<int64_t>& cu_window_seqlens);

}  // namespace dhp::qwen
