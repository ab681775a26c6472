// Calibration of the `local` cluster: short microbenchmarks of this machine (GEMM FLOP/s,
// memory bandwidth, Gloo collectives over loopback, dhp's attention and ZeRO-3 units,
// the optimizer update), saved where the planner reads them (plan/calibration.h).
#pragma once

#include <cstdint>
#include <string>

#include "dhp/plan/calibration.h"

namespace dhp::bench {

struct CalibrateOptions {
  std::string out;        // file to write (empty: plan::default_calibration_path(ranks))
  int64_t ranks = 2;      // ranks for the collective measurements (threads, loopback)
  int64_t threads = 1;    // intra-op threads per rank (the trainer gives each rank cores / ranks)
  std::string precision = "bf16";  // dtype of the element-wise measurement (the training's)
  bool quiet = false;
};

// Runs the microbenchmarks (about a minute), writes the file, returns the cluster.
plan::Cluster calibrate_local(const CalibrateOptions& o);

// What parallel.strategy=auto needs (dhp train's launcher, dhp bench's auto points): this
// machine's calibration as `ranks` ranks, measured once (logged: "measuring it once") when
// the file is missing; the element-wise passes in `precision`. Nothing to do for one rank.
void calibrate_if_missing(int64_t ranks, const std::string& precision);

}  // namespace dhp::bench
