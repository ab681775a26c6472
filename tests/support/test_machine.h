// A machine for the planner written by hand (tests/test_plan.cpp, tests/test_bench.cpp): the
// calibration file `parallel.strategy=auto` reads, without the minute of measurements.
#pragma once

#include <cstdint>
#include <string>

#include "dhp/plan/calibration.h"
#include "dhp/plan/cost_model.h"

namespace dhp::testing {

// DIR/local-xRANKS.json: `ranks` ranks on one node, each with 8 GB, collectives of the given
// latency per call at 2 GB/s.
inline void write_test_machine(const std::string& dir, double latency_s, int64_t ranks = 2) {
  plan::Cluster c;
  c.name = "local";
  c.device = "test machine";
  c.devices_per_node = ranks;
  c.memory_bytes = 8e9;
  c.flops_bf16 = 2e11;
  c.flops_fp32 = 5e10;
  c.gemm_efficiency = c.attention_efficiency = c.hbm_efficiency = 1;
  c.attention_flops = 5e10;
  c.attention_tile = 1;
  c.attention_block = 256;
  c.hbm_bandwidth = 5e9;
  c.launch_s = 1e-6;
  c.intra = c.inter = {2e9, latency_s};
  c.source = "test";
  plan::save_cluster(c, dir + "/local-x" + std::to_string(ranks) + ".json");
}

}  // namespace dhp::testing
