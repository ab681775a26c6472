#include "dhp/train/config.h"

#include <c10/util/Exception.h>  // TORCH_INTERNAL_ASSERT

#include <map>

#include "dhp/core/memory.h"
#include "dhp/dist/layout.h"
#include "dhp/models/qwen2_5_vl/hf.h"
#include "dhp/nn/attention.h"
#include "dhp/train/data_stream.h"

namespace dhp {

Config load_config(const ConfigTree& tree) {
  Config c;
  const YAML::Node& root = tree.root();
  // The model preset decides the defaults the rest of the model section overrides.
  YAML::Node model = root["model"];
  if (model && model.IsMap()) {
    Binder b(tree, model, "model.");
    if (model["preset"]) b.field("preset", c.model.preset, "");
    if (model["from"]) b.field("from", c.model.from, "");
  }
  const std::string key = c.model.from.empty() ? "model.preset" : "model.from";
  try {
    c.model.config = c.model.from.empty() ? qwen::preset(c.model.preset) : qwen::read_hf_config(c.model.from);
  } catch (const Error& e) {
    const std::string o = tree.origin(key);
    DHP_FAIL(key, o.empty() ? "" : " (from " + o + ")", ": ", e.what());
  }
  Binder::bind(tree, root, "", c);
  if (c.lora.rank > 0) c.model.freezing.adapted = c.lora.modules;  // LoRA freezes the base there
  c.validate();
  return c;
}

Config load_config(const std::string& file, const std::vector<std::string>& sets) {
  ConfigTree tree;
  if (!file.empty()) tree.merge_file(file);
  for (const auto& s : sets) tree.merge_set(s);
  return load_config(tree);
}

void Config::validate() const {
  model.config.validate();
  DHP_CHECK(lora.rank >= 0, "lora.rank must be >= 0 (0 = no LoRA), got ", lora.rank);
  if (lora.rank > 0) {
    DHP_CHECK(lora.alpha > 0, "lora.alpha must be > 0, got ", lora.alpha);
    DHP_CHECK(lora.dropout >= 0 && lora.dropout < 1, "lora.dropout must be in [0, 1), got ", lora.dropout);
    DHP_CHECK(!lora.modules.empty(), "lora.modules is empty; name some of vision, merger, text");
    DHP_CHECK(!lora.targets.empty(), "lora.targets is empty; name the linears to adapt, e.g. [q_proj, v_proj]");
    const std::map<std::string, std::pair<const char*, bool>> whole = {
        {"vision", {"model.vision.freeze", model.freezing.vision.freeze || !model.freezing.vision.trainable_blocks.empty()}},
        {"merger", {"model.merger.freeze", model.freezing.merger.freeze}},
        {"text", {"model.text.freeze", model.freezing.text.freeze || !model.freezing.text.trainable_layers.empty() ||
                                           model.freezing.text.freeze_embeddings || model.freezing.text.freeze_lm_head}}};
    for (const auto& m : lora.modules) {
      const auto it = whole.find(m);
      DHP_CHECK(it != whole.end(), "lora.modules has '", m, "'; the modules are vision, merger, text");
      DHP_CHECK(!it->second.second, "lora.modules has ", m, " and ", it->second.first,
                " (or a block list) freezes it too: with LoRA its base weights are frozen anyway and only the ",
                "adapters train; drop the freeze settings of ", m, ", or ", m, " from lora.modules");
    }
    qwen::adapted_linears(model.config, lora.spec());  // every target names something
  } else {
    DHP_CHECK(!output.peft_export, "output.peft_export=true needs LoRA adapters (lora.rank > 0)");
    DHP_CHECK(lora.from.empty(), "lora.from=", lora.from, " needs lora.rank > 0 (and lora.* as the adapter was trained)");
  }
  model.freezing.validate(model.config);
  DHP_CHECK(data.dataset == "shapes" || data.dataset == "llava", "data.dataset='", data.dataset,
            "' is not supported; available: shapes, llava");
  if (data.dataset == "llava") {
    DHP_CHECK(!data.files.empty(), "data.dataset=llava needs data.files (annotation files)");
  } else {
    DHP_CHECK(data.eval_files.empty(), "data.eval_files is for data.dataset=llava (the shapes task makes its own ",
              "held-out set)");
  }
  if (data.dataset == "llava") {
    DHP_CHECK(data.fractions.empty() || data.fractions.size() == data.files.size(), "data.fractions has ",
              data.fractions.size(), " entries for ", data.files.size(), " data.files");
    for (double f : data.fractions) DHP_CHECK(f >= 0, "data.fractions must be >= 0, got ", f);
    DHP_CHECK(data.max_length > 0, "data.max_length must be > 0, got ", data.max_length);
    DHP_CHECK(data.min_pixels > 0 && data.max_pixels >= data.min_pixels, "data.min_pixels=", data.min_pixels,
              " and data.max_pixels=", data.max_pixels, " must satisfy 0 < min <= max");
    DHP_CHECK(data.workers >= 1 && data.prefetch >= 1, "data.workers and data.prefetch must be >= 1");
    train::video_options(data).validate("data.video_");
  }
  DHP_CHECK(data.batch_size > 0, "data.batch_size must be > 0, got ", data.batch_size);
  DHP_CHECK(data.eval_samples >= 0, "data.eval_samples must be >= 0, got ", data.eval_samples);
  DHP_CHECK(training.steps > 0, "training.steps must be > 0, got ", training.steps);
  DHP_CHECK(data.pack_tokens >= 0, "data.pack_tokens must be >= 0, got ", data.pack_tokens);
  if (data.dataset == "llava" && data.pack_tokens > 0) {
    DHP_CHECK(data.pack_tokens >= data.max_length, "data.pack_tokens=", data.pack_tokens,
              " is smaller than data.max_length=", data.max_length, ": the longest sample would not fit");
  }
  DHP_CHECK(training.micro_batches > 0 && (data.pack_tokens > 0 || training.micro_batches <= data.batch_size),
            "training.micro_batches=", training.micro_batches, " must be in [1, data.batch_size=",
            data.batch_size, "]");
  DHP_CHECK(training.precision == "fp32" || training.precision == "bf16",
            "training.precision must be fp32 or bf16, got '", training.precision, "'");
  DHP_CHECK(training.lr > 0 && training.min_lr >= 0 && training.min_lr <= training.lr,
            "training.lr=", training.lr, " and training.min_lr=", training.min_lr,
            " must satisfy 0 <= min_lr <= lr, lr > 0");
  DHP_CHECK(training.warmup_steps >= 0, "training.warmup_steps must be >= 0");
  DHP_CHECK(training.weight_decay >= 0, "training.weight_decay must be >= 0");
  for (const auto& [key, value] : {std::pair<const char*, double>{"lr_vision", training.lr_vision},
                                   {"lr_merger", training.lr_merger},
                                   {"lr_text", training.lr_text},
                                   {"weight_decay_vision", training.weight_decay_vision},
                                   {"weight_decay_merger", training.weight_decay_merger},
                                   {"weight_decay_text", training.weight_decay_text}}) {
    DHP_CHECK(value >= 0 || value == -1, "training.", key, "=", value, " must be >= 0, or -1 for the default (training.",
              std::string(key).rfind("lr", 0) == 0 ? "lr" : "weight_decay", ")");
  }
  DHP_CHECK(training.beta1 >= 0 && training.beta1 < 1 && training.beta2 >= 0 && training.beta2 < 1,
            "training.beta1 and training.beta2 must be in [0, 1)");
  DHP_CHECK(training.eps > 0, "training.eps must be > 0");
  DHP_CHECK(training.grad_clip >= 0, "training.grad_clip must be >= 0");
  {
    const auto& d = training.device;
    bool ok = d == "cpu" || d == "cuda";
    if (!ok && d.rfind("cuda:", 0) == 0 && d.size() > 5 && d.size() < 9) {
      ok = d.find_first_not_of("0123456789", 5) == std::string::npos;
    }
    DHP_CHECK(ok, "training.device='", d, "' is not cpu, cuda or cuda:N (N a GPU index)");
  }
  DHP_CHECK(training.threads >= 0, "training.threads must be >= 0");
  DHP_CHECK(training.attention_block > 0, "training.attention_block must be > 0");
  nn::parse_attention_kernel(training.attention, "training.attention");
  DHP_CHECK(training.log_every > 0, "training.log_every must be > 0");
  DHP_CHECK(training.profile_every >= 0, "training.profile_every must be >= 0 (0 = never), got ", training.profile_every);
  parse_bytes(training.memory_limit, "training.memory_limit");
  {
    const Combination named = parse_combination(parallel.strategy);
    DHP_CHECK(parallel.timeout_s > 0, "parallel.timeout_s must be > 0, got ", parallel.timeout_s);
    DHP_CHECK(parallel.backend == "auto" || parallel.backend == "nccl" || parallel.backend == "gloo",
              "parallel.backend='", parallel.backend, "' is not auto, nccl or gloo");
    DHP_CHECK(parallel.balance == "cost" || parallel.balance == "contiguous", "parallel.balance='", parallel.balance,
              "' is not cost or contiguous");
    DHP_CHECK(parallel.bucket_mb > 0, "parallel.bucket_mb must be > 0, got ", parallel.bucket_mb);
    DHP_CHECK(parallel.buckets_in_flight >= 1, "parallel.buckets_in_flight must be >= 1, got ",
              parallel.buckets_in_flight);
    DHP_CHECK(named != Combination::kCustom || (!parallel.vision.strategy.empty() && !parallel.text.strategy.empty()),
              "parallel.strategy=custom needs parallel.vision.strategy and parallel.text.strategy");
    for (const auto& [key, m] : {std::pair<const char*, const ModuleParallelOptions*>{"parallel.vision.strategy", &parallel.vision},
                                 {"parallel.text.strategy", &parallel.text}}) {
      if (!m->strategy.empty()) dist::parse_strategy(m->strategy, key, dist::all_strategies());
    }
  }
  DHP_CHECK(!output.dir.empty(), "output.dir must not be empty");
  DHP_CHECK(checkpoint.every >= 0, "checkpoint.every must be >= 0 (0 = only at the end), got ", checkpoint.every);
  DHP_CHECK(checkpoint.keep >= 0, "checkpoint.keep must be >= 0 (0 = keep all), got ", checkpoint.keep);
}

namespace {
const std::pair<Combination, const char*> kCombinations[] = {
    {Combination::kNone, "none"}, {Combination::kDhp, "dhp"},       {Combination::kTp, "tp"},
    {Combination::kZero3, "zero3"}, {Combination::kDp, "dp"},       {Combination::kCustom, "custom"},
    {Combination::kAuto, "auto"}};
}  // namespace

Combination parse_combination(const std::string& value) {
  std::string names;
  for (const auto& [c, name] : kCombinations) {
    if (value == name) return c;
    names += (names.empty() ? "" : ", ") + std::string(name);
  }
  DHP_FAIL("parallel.strategy='", value, "' is not one of ", names);
}

const char* combination_name(Combination c) {
  for (const auto& [k, name] : kCombinations)
    if (k == c) return name;
  TORCH_INTERNAL_ASSERT(false, "unknown combination ", static_cast<int>(c));
}

std::string checkpoint_root(const Config& cfg) {
  return cfg.checkpoint.dir.empty() ? cfg.output.dir + "/checkpoints" : cfg.checkpoint.dir;
}

}  // namespace dhp
