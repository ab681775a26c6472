// `dhp bench`: strategies side by side (src/dhp/bench/bench.h, docs/bench.md).
#include <torch/torch.h>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dhp/bench/bench.h"
#include "dhp/core/memory.h"
#include "dhp/train/auto_plan.h"
#include "dhp/train/config.h"
#include "cli.h"

namespace dhp::cli {

int cmd_bench(int argc, char** argv, int first) {
  dhp::bench::Options o;
  std::string strategies = "dhp,tp,zero3";
  std::vector<std::string> points;
  std::vector<int64_t> sides;
  bool strategies_given = false;
  Flags flags(argc, argv, first);
  while (flags.next()) {
    const std::string& f = flags.flag();
    auto next = [&] { return flags.value(); };
    if (f == "-h" || f == "--help") {
      std::printf(
          "usage: dhp bench [--config FILE] [--set KEY=VALUE]... [--strategies LIST] [--point NAME:K=V;K=V]...\n"
          "                 [--vision-tokens LIST | --image-sides LIST] [--batch-sizes LIST]\n"
          "                 [--memory-limit SIZE] [--nproc N] [--steps N] [--warmup N] [--repeats N]\n"
          "                 [--out DIR] [--no-plot]\n\n"
          "For each point and vision length, runs 'dhp train --nproc N' jobs (own worker processes), trying\n"
          "the batch sizes from the largest down and keeping the largest that fits the per-rank memory\n"
          "limit; a length where none fits is recorded as OOM and the sweep goes on. Prints, in one run,\n"
          "throughput (vision patches per image x batch / mean step time after the warm-up), step time,\n"
          "text tokens/s, peak memory and communication time per rank, model FLOP/s per rank against\n"
          "the GEMM peak measured in the same run, and the idle fraction of the vision and text ranks.\n"
          "Writes DIR/results.json, DIR/table.md, DIR/throughput.png (gnuplot) and DIR/runs/*.\n\n"
          "options:\n%s"
          "  --strategies LIST    named strategies, each a point parallel.strategy=NAME\n"
          "                       (default dhp,tp,zero3; '' for none)\n"
          "  --point NAME:SETS    a custom point: config keys separated by ';', e.g.\n"
          "                       'seq:parallel.vision.ranks=[0,1];parallel.pipeline=false'\n"
          "  --vision-tokens LIST patches per image (before the 2x2 merge), each the square of an even\n"
          "                       number: images are that square (default 64,256 = 112 and 224 px)\n"
          "  --image-sides LIST   the same given as square image sides in pixels (multiples of 28)\n"
          "  --batch-sizes LIST   global batch sizes to try, largest first (default: data.batch_size)\n"
          "  --memory-limit SIZE  per-rank tensor memory budget, e.g. 2GiB (training.memory_limit)\n"
          "  --nproc N            worker processes per job (default 2)\n"
          "  --steps N            training steps per job (default 6)\n"
          "  --warmup N           first steps left out of the averages (default 2)\n"
          "  --repeats N          rounds (default 1): after the first, which finds each point's batch,\n"
          "                       every point runs again at that batch, point after point, N-1 times;\n"
          "                       each row is the round of median step time, with the range shown\n"
          "                       (a shared machine's slow stretch then falls on every point alike)\n"
          "  --out DIR            output directory (default runs/bench)\n"
          "  --no-plot            skip throughput.png\n",
          kConfigFlags);
      return 0;
    } else if (f == "--config") {
      o.config = next();
    } else if (f == "--set") {
      o.sets.push_back(next());
    } else if (f == "--strategies") {
      strategies = next();
      strategies_given = true;
    } else if (f == "--point") {
      points.push_back(next());
    } else if (f == "--vision-tokens") {
      o.vision_tokens = parse_int_list(f, next());
    } else if (f == "--image-sides") {
      sides = parse_int_list(f, next());
    } else if (f == "--batch-sizes") {
      o.batch_sizes = parse_int_list(f, next());
    } else if (f == "--memory-limit") {
      o.memory_limit = next();
      dhp::parse_bytes(o.memory_limit, "--memory-limit");
    } else if (f == "--nproc") {
      o.nproc = parse_int(f, next());
    } else if (f == "--steps") {
      o.steps = parse_int(f, next());
    } else if (f == "--warmup") {
      o.warmup = parse_int(f, next());
    } else if (f == "--repeats") {
      o.repeats = parse_int(f, next());
    } else if (f == "--out") {
      o.out = next();
    } else if (f == "--no-plot") {
      o.plot = false;
    } else {
      DHP_FAIL("unknown option '", flags.raw(), "' (see dhp bench --help)");
    }
  }
  if (!sides.empty()) {
    const auto cfg = dhp::load_config(o.config, o.sets);
    const int64_t patch = cfg.model.config.vision.patch_size;
    o.vision_tokens.clear();
    for (auto s : sides) {
      DHP_CHECK(s > 0 && s % (2 * patch) == 0, "--image-sides ", s, " is not a positive multiple of ", 2 * patch);
      o.vision_tokens.push_back((s / patch) * (s / patch));
    }
  }
  if (!points.empty() && !strategies_given) strategies.clear();
  o.points = dhp::bench::parse_points(strategies, points);
  const auto results = dhp::bench::run(o);
  for (const auto& r : results)
    if (!r.ok() && !r.oom) return 1;  // a point failed for another reason than memory
  return 0;
}

}  // namespace dhp::cli
