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

int cmd_forward(int argc, char** argv, int first) {
  const char* usage =
      "usage: dhp forward --model DIR --inputs FILE.safetensors --out FILE.safetensors [--nproc N]\n"
      "                   [--set parallel.KEY=VALUE]...\n\n"
      "Loads a Hugging Face Qwen2.5-VL directory (config.json + model.safetensors or a sharded index),\n"
      "reads one sample from the inputs file as Hugging Face's processor gives it (input_ids [1, L]\n"
      "int64; pixel_values [N, 1176] and image_grid_thw [I, 3] int64 when the sample has images) and\n"
      "writes the logits of every position, [1, L, vocab] fp32, under the name 'logits', computed by\n"
      "the training model code (fp32).\n\n"
      "  --nproc N   run as N local worker processes under the layout parallel.* chooses (e.g.\n"
      "              --set parallel.strategy=dhp: vision sequence-parallel, text tensor-parallel);\n"
      "              each rank reads only its slices of the weights; each module must be one\n"
      "              replica (dp = 1). Also runs as one rank of a torchrun/srun/mpirun job.\n";
  std::string model, inputs, out;
  std::vector<std::string> sets;
  int64_t nproc = 1;
  Flags flags(argc, argv, first);
  while (flags.next()) {
    const auto& f = flags.flag();
    if (f == "-h" || f == "--help") {
      std::printf("%s", usage);
      return 0;
    }
    if (f == "--model") model = flags.value();
    else if (f == "--inputs") inputs = flags.value();
    else if (f == "--out") out = flags.value();
    else if (f == "--set") sets.push_back(flags.value());
    else if (f == "--nproc") nproc = parse_int(f, flags.value());
    else DHP_FAIL("unknown option '", flags.raw(), "' (see dhp forward --help)");
  }
  DHP_CHECK(!model.empty() && !inputs.empty() && !out.empty(), "dhp forward needs --model, --inputs and --out\n\n",
            usage);
  DHP_CHECK(nproc >= 1, "--nproc must be >= 1, got ", nproc);
  const auto env = dhp::launch::worker_env();
  // The sample from the inputs file, checked; errors name the file.
  auto read_batch = [&](const dhp::qwen::ModelConfig& c) {
    dhp::io::SafetensorsReader in(inputs);
    auto get = [&](const char* name) { return in.find(name) ? in.read(name) : torch::Tensor(); };
    DHP_CHECK(in.find("input_ids") != nullptr, inputs, " has no tensor 'input_ids'");
    try {
      return dhp::qwen::forward_batch(c, get("input_ids"), get("pixel_values"), get("image_grid_thw"));
    } catch (const dhp::Error& e) {
      DHP_FAIL(inputs, ": ", e.what());
    }
  };
  auto write = [&](const torch::Tensor& logits, const std::string& how) {
    dhp::io::write_safetensors(out, {{"logits", logits}});
    dhp::log_info("wrote logits " + std::to_string(logits.size(1)) + " x " + std::to_string(logits.size(2)) + " to " +
                  out + how);
  };
  if (!env && nproc == 1 && sets.empty()) {  // one process, the plain model
    const auto cfg = dhp::qwen::read_hf_config(model);
    dhp::qwen::Qwen2_5_VL m(cfg);
    dhp::qwen::load_hf_weights(model, *m);
    const auto batch = read_batch(cfg);
    torch::NoGradGuard no_grad;
    write(m->target_logits(batch).unsqueeze(0), "");
    return 0;
  }
  sets.push_back("model.from=" + model);
  const auto cfg = dhp::load_config("", sets);
  const int64_t world = env ? env->world : nproc;
  const auto layouts = dhp::train::resolve_layouts(cfg, world);  // refused before any worker starts
  if (!env && nproc > 1) return dhp::launch::run_workers(nproc, std::vector<std::string>(argv, argv + argc));
  auto rt = worker_runtime(env, cfg.parallel.timeout_s);
  rt.optimizer = false;
  try {
    const auto batch = read_batch(cfg.model.config);
    dhp::train::ParallelModel pm(cfg, layouts, rt);
    const auto logits = pm.forward_logits(batch);
    if (rt.rank == 0) write(logits, " (" + std::to_string(world) + " rank(s): " + dhp::train::describe(layouts) + ")");
    pm.barrier();
  } catch (const std::exception& e) {
    dhp::launch::report_worker_error(e.what());
    throw;
  }
  return 0;
}

}  // namespace dhp::cli
