// What `dhp bench` writes: results.json (the schema `dhp plan` writes too, so a prediction
// and a measurement compare line by line) and throughput.png through gnuplot.
#pragma once

#include <string>
#include <vector>

#include "dhp/bench/bench.h"
#include "dhp/train/config.h"

namespace dhp::bench {

// {"machine": {...}, "model": {...}, "settings": {...}, "points": [{"strategy", "vision_tokens",
//  "batch_size", "oom", "throughput", "step_time_s", "peak_bytes_per_rank", "comm_fraction",
//  ..., "attempts": [...]}]}. Throws when the file cannot be written.
void write_json(const std::vector<PointResult>& results, const Options& o, double gemm_peak_gflops,
                const Config& base, const std::string& path);

// Grouped bars per vision length, one colour per point, OOM marked. Returns false (and says
// why on stderr) when gnuplot is not installed or fails; the sweep's other outputs stand.
bool plot_throughput(const std::vector<PointResult>& results, const Options& o, const std::string& png);

}  // namespace dhp::bench
