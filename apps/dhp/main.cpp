// dhp: the one command-line entry point. Each command lives in its own file (cmd_<name>.cpp)
// behind the table below; every error becomes one readable line on stderr and a non-zero
// exit code here, and only here.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "cli.h"
#include "dhp/core/memory.h"
#include "launch.h"

namespace {

struct Command {
  const char* name;
  int (*run)(int argc, char** argv, int first);
  const char* summary;  // the line of `dhp help`
};

const Command kCommands[] = {
    {"train", dhp::cli::cmd_train, "train a model (default: the demo model on the built-in shapes task)"},
    {"params", dhp::cli::cmd_params, "print the parameter count of a config or of every preset"},
    {"config", dhp::cli::cmd_config, "print the resolved config with every key, its default and its meaning"},
    {"bench", dhp::cli::cmd_bench, "measure strategies / placements side by side (step time, memory, comm, idle)"},
    {"plan", dhp::cli::cmd_plan, "predict every strategy's step time and memory on a cluster and find the best plan"},
    {"forward", dhp::cli::cmd_forward, "logits of a Hugging Face model directory for one sample (safetensors in and out)"},
    {"convert", dhp::cli::cmd_convert, "export a training checkpoint (any layout) as a Hugging Face model directory"},
    {"tokenize", dhp::cli::cmd_tokenize, "token ids of text with a Hugging Face tokenizer.json (Qwen's), or --decode them"},
    {"data", dhp::cli::cmd_data,
     "'dhp data preprocess': one image as Qwen2-VL's processor makes it (safetensors out);\n"
     "            'dhp data synth': the shapes task written as a LLaVA dataset (JSONL + PNG)"},
};

void print_usage(FILE* to) {
  std::fprintf(to, "dhp: disaggregated hybrid parallel training of vision-language models\n\n"
                   "usage: dhp <command> [options]\n\ncommands:\n");
  for (const auto& c : kCommands) std::fprintf(to, "  %-9s %s\n", c.name, c.summary);
  std::fprintf(to, "  %-9s %s\n\nWith no command, 'dhp' runs 'dhp train'.\n", "help",
               "this text; 'dhp <command> --help' for a command's options");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    dhp::install_memory_accounting();
    std::string cmd = argc > 1 ? argv[1] : "train";
    int first = 2;
    if (cmd.rfind("-", 0) == 0 && cmd != "-h" && cmd != "--help") {
      cmd = "train";
      first = 1;
    }
    if (cmd == "help" || cmd == "-h" || cmd == "--help") {
      print_usage(stdout);
      return 0;
    }
    for (const auto& c : kCommands) {
      if (cmd == c.name) return c.run(argc, argv, first);
    }
    std::fprintf(stderr, "dhp: unknown command '%s'\n\n", cmd.c_str());
    print_usage(stderr);
    return 2;
  } catch (const std::exception& e) {
    const char* rank = std::getenv("RANK");
    if (rank) std::fprintf(stderr, "dhp: error on rank %s: %s\n", rank, e.what());
    else std::fprintf(stderr, "dhp: error: %s\n", e.what());
    dhp::launch::report_worker_error(e);
    return 1;
  }
}
