// The `local` cluster's file: this machine's figures as measured by the calibration
// microbenchmarks (bench/calibrate.h: GEMM FLOP/s, memory bandwidth, Gloo collectives over
// loopback), saved to a JSON file and reused by the planner. Pure file reading and writing.
#pragma once

#include <string>

#include "dhp/plan/cost_model.h"

namespace dhp::plan {

// Where the calibration for `ranks` ranks lives: $DHP_CALIBRATION_DIR (default runs/plan)
// /local-x<ranks>.json.
std::string default_calibration_path(int64_t ranks);

// Reads a calibration file. Throws naming the file and what to run when it is missing or
// malformed.
Cluster load_local_cluster(const std::string& path);
void save_cluster(const Cluster& c, const std::string& path);

// Reads the eager host times per layer into c.eager_layer_host_s from the JSON that
// bench/device/reference_layers.py writes: its host-only rows (patches 0, tiny inputs) of
// vision tp dtensor -> vision/tp, vision sp plain -> vision/plain, text tp dtensor -> text/tp,
// text tp plain -> text/plain. Throws naming the file when it has none of them.
void load_eager_host_times(Cluster& c, const std::string& path);

}  // namespace dhp::plan
