// `dhp forward`: logits of one sample from a Hugging Face directory, under any layout.
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

#include "dhp/core/log.h"
#include "dhp/io/safetensors.h"
#include "dhp/models/qwen2_5_vl/hf.h"
#include "dhp/models/qwen2_5_vl/model.h"
#include "dhp/train/auto_plan.h"
#include "dhp/train/config.h"
#include "dhp/train/trainer.h"
#include "cli.h"
#include "launch.h"

namespace dhp::cli {

namespace {

const char* const kUsage =
    "usage: dhp forward --model DIR --inputs FILE.safetensors --out FILE.safetensors [--nproc N]\n"
    "                   [--set parallel.KEY=VALUE]...\n\n"
    "Loads a Hugging Face Qwen2.5-VL directory (config.json + model.safetensors or a sharded index),\n"
    "reads one sample from the inputs file as Hugging Face's processor gives it (input_ids [1, L]\n"
    "int64; pixel_values [N, 1176] and image_grid_thw [I, 3] int64 when the sample has images;\n"
    "pixel_values_videos [M, 1176], video_grid_thw [V, 3] int64 and second_per_grid_ts [V] when it\n"
    "has videos, without which each temporal patch counts 1 s) and writes the logits of every\n"
    "position, [1, L, vocab] fp32, under the name 'logits', computed by the training model code\n"
    "(fp32).\n\n"
    "  --nproc N   run as N local worker processes under the layout parallel.* chooses (e.g.\n"
    "              --set parallel.strategy=dhp: vision sequence-parallel, text tensor-parallel);\n"
    "              each rank reads only its slices of the weights; each module must be one\n"
    "              replica (dp = 1). Also runs as one rank of a torchrun/srun/mpirun job.\n";

struct ForwardFlags {
  std::string model, inputs, out;
  std::vector<std::string> sets;
  int64_t nproc = 1;
  bool help = false;
};

ForwardFlags parse_flags(int argc, char** argv, int first) {
  ForwardFlags a;
  Flags flags(argc, argv, first);
  while (flags.next()) {
    const auto& f = flags.flag();
    if (f == "-h" || f == "--help") {
      a.help = true;
      return a;
    }
    if (f == "--model") a.model = flags.value();
    else if (f == "--inputs") a.inputs = flags.value();
    else if (f == "--out") a.out = flags.value();
    else if (f == "--set") a.sets.push_back(flags.value());
    else if (f == "--nproc") a.nproc = parse_int(f, flags.value());
    else DHP_FAIL("unknown option '", flags.raw(), "' (see dhp forward --help)");
  }
  DHP_CHECK(!a.model.empty() && !a.inputs.empty() && !a.out.empty(),
            "dhp forward needs --model, --inputs and --out\n\n", kUsage);
  DHP_CHECK(a.nproc >= 1, "--nproc must be >= 1, got ", a.nproc);
  return a;
}

// The sample from the inputs file, checked; errors name the file.
dhp::qwen::Batch read_batch(const std::string& inputs, const dhp::qwen::ModelConfig& c) {
  dhp::io::SafetensorsReader in(inputs);
  auto get = [&](const char* name) { return in.find(name) ? in.read(name) : torch::Tensor(); };
  DHP_CHECK(in.find("input_ids") != nullptr, inputs, " has no tensor 'input_ids'");
  try {
    return dhp::qwen::forward_batch(c, {get("input_ids"), get("pixel_values"), get("image_grid_thw"),
                                        get("pixel_values_videos"), get("video_grid_thw"), get("second_per_grid_ts")});
  } catch (const dhp::Error& e) {
    DHP_FAIL(inputs, ": ", e.what());
  }
}

void write_logits(const std::string& out, const torch::Tensor& logits, const std::string& how) {
  dhp::io::write_safetensors(out, {{"logits", logits}});
  dhp::log_info("wrote logits " + std::to_string(logits.size(1)) + " x " + std::to_string(logits.size(2)) + " to " +
                out + how);
}

}  // namespace

int cmd_forward(int argc, char** argv, int first) {
  auto a = parse_flags(argc, argv, first);
  if (a.help) {
    std::printf("%s", kUsage);
    return 0;
  }
  const auto env = dhp::dist::worker_env();
  if (!env && a.nproc == 1 && a.sets.empty()) {  // one process, the plain model
    const auto cfg = dhp::qwen::read_hf_config(a.model);
    dhp::qwen::Qwen2_5_VL m(cfg);
    dhp::qwen::load_hf_weights(a.model, *m);
    const auto batch = read_batch(a.inputs, cfg);
    torch::NoGradGuard no_grad;
    write_logits(a.out, m->target_logits(batch).unsqueeze(0), "");
    return 0;
  }
  a.sets.push_back("model.from=" + a.model);
  const auto cfg = dhp::load_config("", a.sets);
  const int64_t world = env ? env->world : a.nproc;
  const auto layouts = dhp::train::resolve_layouts(cfg, world);  // refused before any worker starts
  if (!env && a.nproc > 1) return dhp::launch::run_workers(a.nproc, std::vector<std::string>(argv, argv + argc));
  auto rt = worker_runtime(env, cfg);
  rt.optimizer = false;
  try {
    const auto batch = read_batch(a.inputs, cfg.model.config);
    dhp::train::ParallelModel pm(cfg, layouts, rt);
    const auto logits = pm.forward_logits(batch);
    if (rt.rank == 0) write_logits(a.out, logits, " (" + std::to_string(world) + " rank(s): " + dhp::train::describe(layouts) + ")");
    pm.barrier();
  } catch (const std::exception& e) {
    dhp::launch::report_worker_error(e);
    throw;
  }
  return 0;
}

}  // namespace dhp::cli
