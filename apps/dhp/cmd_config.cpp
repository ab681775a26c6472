// `dhp config`: the resolved config, every key explained.
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

#include "dhp/train/auto_plan.h"
#include "dhp/train/config.h"
#include "cli.h"

namespace dhp::cli {

int cmd_config(int argc, char** argv, int first) {
  auto a = parse(argc, argv, first, {"--config", "--set"});
  if (a.help) {
    std::printf("usage: dhp config [--config FILE] [--set KEY=VALUE]...\n\n"
                "Prints the resolved config as YAML, every key with a comment saying what it is.\n\noptions:\n%s",
                kConfigFlags);
    return 0;
  }
  auto cfg = dhp::load_config(a.config, a.sets);
  std::cout << dhp::to_yaml(cfg, /*with_help=*/true);
  return 0;
}

}  // namespace dhp::cli
