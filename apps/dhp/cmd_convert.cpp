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
#include "dhp/models/qwen2_5_vl/peft.h"
#include "dhp/train/auto_plan.h"
#include "dhp/train/checkpoint.h"
#include "dhp/train/config.h"
#include "dhp/train/trainer.h"
#include "cli.h"

namespace dhp::cli {

int cmd_convert(int argc, char** argv, int first) {
  const char* usage =
      "usage: dhp convert --checkpoint DIR --out OUTDIR [--format hf|peft] [--dtype same|bf16|fp32]\n\n"
      "Exports the model of a training checkpoint (DIR: a step-N directory, or a checkpoint root\n"
      "whose newest complete step-N is used), saved under any layout, as a Hugging Face\n"
      "Qwen2.5-VL directory: config.json and model.safetensors (shards of at most 5 GiB with\n"
      "model.safetensors.index.json when larger) with transformers' parameter names. A\n"
      "fine-tuning checkpoint holds what trained: its frozen parameters are rebuilt as the run\n"
      "started (its model.from, or its seed's initialisation); LoRA adapters are merged into\n"
      "their weights (W + alpha/r * B A).\n\n"
      "  --format hf     the whole model (default)\n"
      "  --format peft   the LoRA adapters alone, as a PEFT adapter directory (adapter_config.json,\n"
      "                  adapter_model.safetensors) for Hugging Face PEFT on the base model\n"
      "  --dtype same   the parameters as trained (default)\n"
      "  --dtype fp32   fp32; a bf16 run's fp32 master weights when the checkpoint has them\n"
      "  --dtype bf16   bf16 (rounded from the masters when the checkpoint has them)\n";
  std::string checkpoint, out, dtype = "same", format = "hf";
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
    else if (f == "--format") format = flags.value();
    else DHP_FAIL("unknown option '", flags.raw(), "' (see dhp convert --help)");
  }
  DHP_CHECK(!checkpoint.empty() && !out.empty(), "dhp convert needs --checkpoint and --out\n\n", usage);
  DHP_CHECK(dtype == "same" || dtype == "bf16" || dtype == "fp32", "--dtype must be same, bf16 or fp32, got '", dtype,
            "'");
  DHP_CHECK(format == "hf" || format == "peft", "--format must be hf or peft, got '", format, "'");
  const auto dir = dhp::train::find_checkpoint(checkpoint);
  dhp::io::CheckpointReader r(dir);
  const auto cfg = dhp::train::checkpoint_config(r);
  auto params = dhp::train::checkpoint_parameters(r, /*masters=*/dtype != "same");
  if (dtype != "same") {
    for (auto& [name, t] : params) t = t.to(dtype == "bf16" ? torch::kBFloat16 : torch::kFloat32);
  }
  if (format == "peft") {
    DHP_CHECK(cfg.lora.rank > 0, dir, " was trained without LoRA (lora.rank=0): no adapters to export; use --format hf");
    dhp::qwen::save_peft(out, params, cfg.lora.spec(), cfg.model.config, dhp::train::checkpoint_base_model(r));
    dhp::log_info("wrote the LoRA adapters of " + dir + " (step " + std::to_string(r.manifest().step) +
                  ") as a PEFT adapter directory: " + out);
    return 0;
  }
  const auto merged = dhp::qwen::merge_lora(params, cfg.lora.rank > 0 ? cfg.lora.spec().scale() : 0.0);
  dhp::qwen::save_hf(out, params, cfg.model.config);
  dhp::log_info("wrote " + std::to_string(params.size()) + " tensors of " + dir + " (step " +
                std::to_string(r.manifest().step) + ") as a Hugging Face directory: " + out +
                (merged > 0 ? " (" + std::to_string(merged) + " LoRA adapters merged)" : ""));
  return 0;
}

}  // namespace dhp::cli
