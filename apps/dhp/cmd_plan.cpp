// `dhp plan`: the cost model's predictions, the calibration of this machine, and their
// validation against a measured sweep (docs/cost_model.md).
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
#include "dhp/bench/calibrate.h"
#include "dhp/core/memory.h"
#include "dhp/models/qwen2_5_vl/hf.h"
#include "dhp/models/qwen2_5_vl/model.h"
#include "dhp/plan/report.h"
#include "dhp/train/auto_plan.h"
#include "dhp/train/checkpoint.h"
#include "dhp/train/config.h"
#include "dhp/train/trainer.h"
#include "cli.h"

namespace dhp::cli {

namespace {

const char* const kPlanUsage =
    "usage: dhp plan [--model PRESET | --config FILE [--set KEY=VALUE]...] [--cluster SPEC]\n"
    "                [--vision-tokens LIST] [--batch-sizes LIST] [--images N] [--frames N]\n"
    "                [--text-tokens N] [--targets N] [--precision bf16|fp32] [--no-checkpointing] [--conventions dhp|reference]\n"
    "                [--strategies LIST] [--memory-per-device SIZE] [--top K] [--json FILE]\n"
    "                [--host-times FILE]\n"
    "       dhp plan --calibrate [--ranks N] [--threads N] [--out FILE]\n"
    "       dhp plan --config FILE --cluster localxN --against RESULTS.json\n\n"
    "Predicts, from the cost model in docs/cost_model.md (no measurement), each named strategy's\n"
    "throughput (vision patches per image x batch / step time, the reference's metric), step time,\n"
    "memory per device and largest batch for each vision length, and searches every plan (vision\n"
    "none/sp/tp/zero3/dp and text none/tp/zero3/dp at every degree, data-parallel replicas, on the\n"
    "same or on disjoint devices, micro-batches) for the fastest that fits.\n\n"
    "options:\n"
    "  --model PRESET         model preset (default qwen2.5-vl-32b; see dhp params --all)\n"
    "  --config FILE, --set   take the model from a dhp config instead (and, unless given, the\n"
    "                         precision, checkpointing and text tokens of its shapes task)\n"
    "  --cluster SPEC         h100, h200, a100, each xN devices (default h100x8; 8 per node), or\n"
    "                         localxN: this machine as N ranks, from dhp plan --calibrate --ranks N\n"
    "  --vision-tokens LIST   patches per image (default 1024,4096)\n"
    "  --batch-sizes LIST     global batch sizes to try (default 1,2,4,8)\n"
    "  --images N             images per sample (default 1)\n"
    "  --frames N             every image a clip of N frames (even): --vision-tokens then count\n"
    "                         its patches over all its temporal patches, as dhp bench --frames does\n"
    "                         (default: the config's data.frames, else 0: images)\n"
    "  --text-tokens N        text tokens per sample besides the image's (default 64)\n"
    "  --targets N            answer tokens with a loss per sample (default 32)\n"
    "  --precision P          bf16 (default) or fp32\n"
    "  --no-checkpointing     without activation checkpointing\n"
    "  --conventions C        dhp (default): dhp's runtime; reference: the published systems'\n"
    "                         (dhp and tp as the Ray reference, zero3 as DeepSpeed under HF Trainer)\n"
    "  --strategies LIST      named strategies to report (default dhp,tp,zero3)\n"
    "  --memory-per-device S  usable memory per device instead of the cluster's (e.g. 700MiB)\n"
    "  --top K                best plans kept per length in the JSON (default 3)\n"
    "  --json FILE            also write every figure as JSON\n"
    "  --host-times FILE      with --conventions reference: eager PyTorch's host time per layer\n"
    "                         (DTensor TP and plain), the JSON of bench/device/reference_layers.py\n"
    "                         run on a GPU machine; each module then takes at least its layers'\n"
    "                         host time (default: not modeled)\n"
    "  --calibrate            measure this machine (Gloo collectives and their wait after compute,\n"
    "                         GEMM, element-wise bandwidth, op overhead, the optimizer update,\n"
    "                         synthetic samples, attention; ~30 s) and save it for --cluster localxN\n"
    "  --ranks N, --threads N ranks measured at once and intra-op threads each (default 2, 1)\n"
    "  --calibrate-precision P  dtype of the element-wise measurement: bf16 (default) or fp32\n"
    "  --out FILE             where --calibrate writes (default runs/plan/local-xN.json)\n"
    "  --against FILE         predict every point of a dhp bench results.json (its strategies,\n"
    "                         lengths, batches and memory limit) and print the error per point\n"
    "                         and whether the strategies rank as measured (pairs within 5%, or\n"
    "                         whose rounds overlap under dhp bench --repeats, count as ties)\n";

// dhp plan's flags.
struct PlanArgs {
  plan::StudyOptions study;
  std::string model = "qwen2.5-vl-32b", cluster = "h100x8", json, memory, config, against, host_times;
  std::vector<std::string> sets;
  int64_t frames = -1;  // -1: the config's data.frames (shapes), else images
  bool calibrate = false, help = false, text_given = false, precision_given = false, ckpt_given = false;
  bench::CalibrateOptions calibration;
};

PlanArgs parse_plan_args(int argc, char** argv, int first) {
  PlanArgs a;
  Flags flags(argc, argv, first);
  while (flags.next()) {
    const std::string& f = flags.flag();
    auto next = [&] { return flags.value(); };
    if (f == "-h" || f == "--help") {
      a.help = true;
      return a;  // as soon as asked, whatever follows
    }
    if (f == "--model") {
      a.model = next();
    } else if (f == "--config") {
      a.config = next();
    } else if (f == "--set") {
      a.sets.push_back(next());
    } else if (f == "--cluster") {
      a.cluster = next();
    } else if (f == "--vision-tokens") {
      a.study.vision_tokens = parse_int_list(f, next());
    } else if (f == "--batch-sizes") {
      a.study.batch_sizes = parse_int_list(f, next());
    } else if (f == "--images") {
      a.study.workload.images_per_sample = parse_int(f, next());
    } else if (f == "--frames") {
      a.frames = parse_int(f, next());
      DHP_CHECK(a.frames >= 0 && a.frames % 2 == 0, "--frames ", a.frames, " must be an even number >= 0 (0: images)");
    } else if (f == "--text-tokens") {
      a.study.workload.text_tokens = parse_int(f, next());
      a.text_given = true;
    } else if (f == "--targets") {
      a.study.workload.target_tokens = parse_int(f, next());
      a.text_given = true;
    } else if (f == "--precision") {
      a.precision_given = true;
      a.study.workload.precision = next();
      DHP_CHECK(a.study.workload.precision == "bf16" || a.study.workload.precision == "fp32", "--precision must be bf16 or fp32, got '",
                a.study.workload.precision, "'");
    } else if (f == "--no-checkpointing") {
      a.study.workload.checkpointing = false;
      a.ckpt_given = true;
    } else if (f == "--conventions") {
      a.study.conventions = next();
      DHP_CHECK(a.study.conventions == "dhp" || a.study.conventions == "reference", "--conventions must be dhp or reference, got '",
                a.study.conventions, "'");
    } else if (f == "--strategies") {
      a.study.strategies.clear();
      std::stringstream ss(next());
      for (std::string x; std::getline(ss, x, ',');)
        if (!x.empty()) a.study.strategies.push_back(x);
    } else if (f == "--memory-per-device") {
      a.memory = next();
    } else if (f == "--top") {
      a.study.top = parse_int(f, next());
    } else if (f == "--json") {
      a.json = next();
    } else if (f == "--calibrate") {
      a.calibrate = true;
    } else if (f == "--calibrate-precision") {
      a.calibration.precision = next();
    } else if (f == "--ranks") {
      a.calibration.ranks = parse_int(f, next());
    } else if (f == "--threads") {
      a.calibration.threads = parse_int(f, next());
    } else if (f == "--out") {
      a.calibration.out = next();
    } else if (f == "--against") {
      a.against = next();
    } else if (f == "--host-times") {
      a.host_times = next();
    } else {
      DHP_FAIL("unknown option '", flags.raw(), "' (see dhp plan --help)");
    }
  }
  return a;
}

}  // namespace

int cmd_plan(int argc, char** argv, int first) {
  auto a = parse_plan_args(argc, argv, first);
  if (a.help) {
    std::printf("%s", kPlanUsage);
    return 0;
  }
  auto& o = a.study;
  if (a.calibrate) {
    dhp::bench::calibrate_local(a.calibration);
    return 0;
  }
  DHP_CHECK(o.workload.images_per_sample >= 1 && o.workload.text_tokens >= 0 && o.workload.target_tokens >= 1 &&
                o.workload.target_tokens <= o.workload.text_tokens,
            "need --images >= 1 and 1 <= --targets <= --text-tokens");
  for (auto b : o.batch_sizes) DHP_CHECK(b >= 1, "--batch-sizes must be >= 1, got ", b);
  for (const auto& s : o.strategies) dhp::plan::named_plan(s, 1);  // names checked before the work
  dhp::qwen::ModelConfig m;
  std::string model_name = a.model;
  std::optional<dhp::Config> cfg;
  if (!a.config.empty() || !a.sets.empty()) {
    cfg = dhp::load_config(a.config, a.sets);
    m = cfg->model.config;
    model_name = cfg->model.preset;
    if (!a.precision_given) o.workload.precision = cfg->training.precision;
    if (!a.ckpt_given) o.workload.checkpointing = cfg->training.activation_checkpointing;
    o.workload.freezing = cfg->model.freezing;  // frozen parts: no gradients, optimizer state or backward
    o.workload.lora = cfg->lora.spec();
    if (!a.text_given && cfg->data.dataset == "shapes") {  // the task's mean text and answer tokens
      std::tie(o.workload.text_tokens, o.workload.target_tokens) = dhp::train::shapes_text_tokens(*cfg);
    }
  } else {
    m = dhp::qwen::preset(a.model);
  }
  const int64_t frames = a.frames >= 0 ? a.frames : cfg ? dhp::train::clip_frames(*cfg) : 0;
  o.workload.temporal_patches = dhp::plan::clip_temporal_patches(m.vision, frames);
  auto c = dhp::plan::cluster_preset(a.cluster);
  if (cfg) dhp::train::apply_runtime(*cfg, c, o.workload);
  if (!a.host_times.empty()) {
    DHP_CHECK(o.conventions == "reference", "--host-times ", a.host_times, " applies to the eager systems' runtimes: ",
              "add --conventions reference (dhp's own runtime is C++, its dispatch cost is in the calibration)");
    dhp::plan::load_eager_host_times(c, a.host_times);
  }
  if (!a.memory.empty()) {
    c.memory_bytes = static_cast<double>(dhp::parse_bytes(a.memory, "--memory-per-device"));
    c.reserved_bytes = 0;
  }
  if (!a.against.empty()) {
    std::printf("dhp plan --against %s: %s on %s, %s%s, %lld text tokens (%lld with a loss) per sample\n\n",
                a.against.c_str(), model_name.c_str(), c.name.c_str(), o.workload.precision.c_str(),
                o.workload.checkpointing ? ", activation checkpointing" : "",
                static_cast<long long>(o.workload.text_tokens), static_cast<long long>(o.workload.target_tokens));
    const auto v = dhp::plan::validate(m, c, o.workload, a.against, !a.memory.empty());
    std::printf("%s", v.table.c_str());
    return 0;
  }
  const auto points = dhp::plan::study(m, c, o);
  std::printf("%s", dhp::plan::study_table(model_name, c, o, points).c_str());
  if (!a.json.empty()) {
    std::ofstream f(a.json);
    DHP_CHECK(f.good(), "cannot write --json ", a.json);
    f << dhp::plan::study_json(model_name, c, o, points);
    DHP_CHECK(f.good(), "writing ", a.json, " failed");
    std::printf("\nwrote %s\n", a.json.c_str());
  }
  return 0;
}

}  // namespace dhp::cli
