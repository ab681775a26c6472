// `dhp params`: parameter counts of a config or of every preset.
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

#include "dhp/models/qwen2_5_vl/hf.h"
#include "dhp/models/qwen2_5_vl/model.h"
#include "dhp/train/auto_plan.h"
#include "dhp/train/config.h"
#include "cli.h"

namespace dhp::cli {
namespace {

void print_line(const std::string& name, const dhp::qwen::ParamCount& p) {
  auto human = [](int64_t n) {
    char buf[32];
    if (n >= 1000000000) std::snprintf(buf, sizeof(buf), "%.3fB", n / 1e9);
    else std::snprintf(buf, sizeof(buf), "%.2fM", n / 1e6);
    return std::string(buf);
  };
  std::printf("%-16s vision %9s  text %9s  total %9s  (%lld parameters)\n", name.c_str(), human(p.vision).c_str(),
              human(p.text).c_str(), human(p.total()).c_str(), static_cast<long long>(p.total()));
}

void print_count(const std::string& name, const dhp::qwen::ModelConfig& c) {
  print_line(name, dhp::qwen::count_parameters(c));
}

// The configured model (with its LoRA adapters), with what trains and what is frozen
// (model.*.freeze, ..., and LoRA's base weights).
void print_trainable(const std::string& name, const dhp::Config& cfg) {
  const auto& c = cfg.model.config;
  const auto adapters = dhp::qwen::count_adapter_parameters(c, cfg.lora.spec());
  auto all = dhp::qwen::count_parameters(c), trains = dhp::qwen::count_trainable(c, cfg.model.freezing);
  all.vision += adapters.vision, all.text += adapters.text;
  trains.vision += adapters.vision, trains.text += adapters.text;
  print_line(name, all);
  print_line("  trainable", trains);
  print_line("  frozen", {all.vision - trains.vision, all.text - trains.text});
  if (adapters.total() > 0) print_line("  LoRA adapters", adapters);
}

}  // namespace

int cmd_params(int argc, char** argv, int first) {
  auto a = parse(argc, argv, first, {"--config", "--set", "--all"});
  if (a.help) {
    std::printf("usage: dhp params [--config FILE] [--set KEY=VALUE]... | --all\n\n"
                "Prints the exact parameter count (vision tower with merger, text decoder with\n"
                "embeddings and lm_head) of the configured model and its LoRA adapters, with how many\n"
                "of them train and how many are frozen (model.vision.freeze,\n"
                "model.text.trainable_layers, ..., LoRA's base weights), or of\n"
                "every preset with --all.\n\noptions:\n%s"
                "  --all             every preset\n", kConfigFlags);
    return 0;
  }
  if (a.all) {
    for (const auto& n : dhp::qwen::preset_names()) print_count(n, dhp::qwen::preset(n));
    return 0;
  }
  auto cfg = dhp::load_config(a.config, a.sets);
  print_trainable(cfg.model.from.empty() ? cfg.model.preset : cfg.model.from, cfg);
  return 0;
}

}  // namespace dhp::cli
