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

namespace {

const char* const kHelp =
    "usage: dhp bench [--config FILE] [--set KEY=VALUE]... [--strategies LIST] [--point NAME:K=V;K=V]...\n"
    "                 [--vision-tokens LIST | --image-sides LIST | --mixed-sides MIN-MAX] [--frames F]\n"
    "                 [--batch-sizes LIST]\n"
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
    "                       (default dhp,tp,zero3; '' for none); auto: at each point and batch\n"
    "                       the layout and micro-batch count the planner picks from this\n"
    "                       machine's calibration (measured once when missing), spelled out\n"
    "                       in the layout column\n"
    "  --point NAME:SETS    a custom point: config keys separated by ';', e.g.\n"
    "                       'seq:parallel.vision.ranks=[0,1];parallel.pipeline=false'\n"
    "  --vision-tokens LIST patches per image (before the 2x2 merge), each the square of an even\n"
    "                       number: images are that square (default 64,256 = 112 and 224 px)\n"
    "  --image-sides LIST   the same given as square image sides in pixels (multiples of 28)\n"
    "  --mixed-sides MIN-MAX one length of mixed resolution instead: every image's height and\n"
    "                       width drawn from MIN..MAX px (multiples of 28); throughput is the\n"
    "                       measured patches/s (what parallel.balance is for)\n"
    "  --frames F           video points: every sample a clip of F frames (even) of the moving\n"
    "                       shapes task, the lengths above per frame; patches per clip = per frame\n"
    "                       x F / 2 (temporal patches of 2 frames)\n"
    "  --batch-sizes LIST   global batch sizes to try, largest first (default: data.batch_size)\n"
    "  --memory-limit SIZE  per-rank tensor memory budget, e.g. 2GiB (training.memory_limit)\n"
    "  --nproc N            worker processes per job (default 2)\n"
    "  --steps N            training steps per job (default 6), then one more, profiled (the\n"
    "                       \"where the time goes\" table), left out of the averages\n"
    "  --warmup N           first steps left out of the averages (default 2)\n"
    "  --repeats N          rounds (default 1): after the first, which finds each point's batch,\n"
    "                       every point runs again at that batch, point after point, N-1 times;\n"
    "                       each row is the round of median step time, with the range shown\n"
    "                       (a shared machine's slow stretch then falls on every point alike)\n"
    "  --out DIR            output directory (default runs/bench)\n"
    "  --no-plot            skip throughput.png\n";

struct BenchFlags {
  dhp::bench::Options o;
  std::string strategies = "dhp,tp,zero3";
  bool strategies_given = false;
  std::vector<std::string> points;
  std::vector<int64_t> sides;
  bool help = false;
};

BenchFlags parse_flags(int argc, char** argv, int first) {
  BenchFlags b;
  auto& o = b.o;
  Flags flags(argc, argv, first);
  while (flags.next()) {
    const std::string& f = flags.flag();
    auto next = [&] { return flags.value(); };
    if (f == "-h" || f == "--help") {
      b.help = true;
      return b;
    } else if (f == "--config") {
      o.config = next();
    } else if (f == "--set") {
      o.sets.push_back(next());
    } else if (f == "--strategies") {
      b.strategies = next();
      b.strategies_given = true;
    } else if (f == "--point") {
      b.points.push_back(next());
    } else if (f == "--vision-tokens") {
      o.vision_tokens = parse_int_list(f, next());
    } else if (f == "--image-sides") {
      b.sides = parse_int_list(f, next());
    } else if (f == "--mixed-sides") {
      const std::string v = next();
      const auto dash = v.find('-');
      DHP_CHECK(dash != std::string::npos && dash > 0, "--mixed-sides '", v, "' must be MIN-MAX, e.g. 112-896");
      o.mixed_min_side = parse_int(f, v.substr(0, dash));
      o.mixed_max_side = parse_int(f, v.substr(dash + 1));
    } else if (f == "--frames") {
      o.frames = parse_int(f, next());
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
  return b;
}

// --image-sides: square images of that many pixels, as patches per image.
std::vector<int64_t> tokens_of_sides(const dhp::bench::Options& o, const std::vector<int64_t>& sides) {
  const auto cfg = dhp::load_config(o.config, o.sets);
  const int64_t patch = cfg.model.config.vision.patch_size;
  std::vector<int64_t> tokens;
  for (auto s : sides) {
    DHP_CHECK(s > 0 && s % (2 * patch) == 0, "--image-sides ", s, " is not a positive multiple of ", 2 * patch);
    tokens.push_back((s / patch) * (s / patch));
  }
  return tokens;
}

}  // namespace

int cmd_bench(int argc, char** argv, int first) {
  auto b = parse_flags(argc, argv, first);
  if (b.help) {
    std::printf(kHelp, kConfigFlags);
    return 0;
  }
  if (!b.sides.empty()) b.o.vision_tokens = tokens_of_sides(b.o, b.sides);
  if (!b.points.empty() && !b.strategies_given) b.strategies.clear();
  b.o.points = dhp::bench::parse_points(b.strategies, b.points);
  const auto results = dhp::bench::run(b.o);
  for (const auto& r : results)
    if (!r.ok() && !r.oom) return 1;  // a point failed for another reason than memory
  return 0;
}

}  // namespace dhp::cli
