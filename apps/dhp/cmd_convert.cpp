// `dhp convert`: a training checkpoint (any layout) as a Hugging Face directory.
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
#include "dhp/io/checkpoint_store.h"
#include "dhp/io/safetensors.h"
#include "dhp/models/qwen2_5_vl/hf.h"
#include "dhp/models/qwen2_5_vl/model.h"
#include "dhp/train/auto_plan.h"
#include "dhp/train/checkpoint.h"
#include "dhp/train/config.h"
#include "dhp/train/trainer.h"
#include "cli.h"

namespace dhp::cli {

int cmd_convert(int argc, char** argv, int first) {
  const char* usage =
      "usage: dhp convert --checkpoint DIR --out HFDIR [--dtype same|bf16|fp32]\n\n"
      "Exports the model of a training checkpoint (DIR: a step-N directory, or a checkpoint root\n"
      "whose newest complete step-N is used), saved under any layout, as a Hugging Face\n"
      "Qwen2.5-VL directory: config.json and model.safetensors (shards of at most 5 GiB with\n"
      "model.safetensors.index.json when larger) with transformers' parameter names.\n\n"
      "  --dtype same   the parameters as trained (default)\n"
      "  --dtype fp32   fp32; a bf16 run's fp32 master weights when the checkpoint has them\n"
      "  --dtype bf16   bf16 (rounded from the masters when the checkpoint has them)\n";
  std::string checkpoint, out, dtype = "same";
  Flags flags(argc, argv, first);
  while (flags.next()) {
    const auto& f = flags.flag();
    if (f == "-h" || f == "--help") {
      std::printf("%s", usage);
      return 0;
    }
    if (f == "--checkpoint") checkpoint = flags.value();
    else if (f == "--out") out = flags.value();
    else if (f == "--dtype") dtype = flags.value();
    else DHP_FAIL("unknown option '", flags.raw(), "' (see dhp convert --help)");
  }
  DHP_CHECK(!checkpoint.empty() && !out.empty(), "dhp convert needs --checkpoint and --out\n\n", usage);
  DHP_CHECK(dtype == "same" || dtype == "bf16" || dtype == "fp32", "--dtype must be same, bf16 or fp32, got '", dtype,
            "'");
  const auto dir = dhp::train::find_checkpoint(checkpoint);
  dhp::io::CheckpointReader r(dir);
  const auto cfg = dhp::train::checkpoint_config(r);
  auto params = dhp::train::checkpoint_parameters(r, /*masters=*/dtype != "same");
  if (dtype != "same") {
    for (auto& [name, t] : params) t = t.to(dtype == "bf16" ? torch::kBFloat16 : torch::kFloat32);
  }
  dhp::qwen::save_hf(out, params, cfg.model.config);
  dhp::log_info("wrote " + std::to_string(params.size()) + " tensors of " + dir + " (step " +
                std::to_string(r.manifest().step) + ") as a Hugging Face directory: " + out);
  return 0;
}

}  // namespace dhp::cli
