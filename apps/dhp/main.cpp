// dhp: the one command-line entry point. Subcommands parse their own flags; every error
// becomes one readable line on stderr and a non-zero exit code here, and only here.
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
#include "dhp/core/memory.h"
#include "dhp/data/image.h"
#include "dhp/data/loader.h"
#include "dhp/data/tokenizer.h"
#include "dhp/io/json.h"
#include "dhp/train/config.h"
#include "dhp/train/trainer.h"
#include "dhp/bench/bench.h"
#include "dhp/io/checkpoint_store.h"
#include "dhp/io/safetensors.h"
#include "dhp/train/checkpoint.h"
#include "dhp/models/qwen2_5_vl/hf.h"
#include "dhp/models/qwen2_5_vl/model.h"
#include "dhp/plan/calibrate.h"
#include "dhp/train/auto_plan.h"
#include "dhp/plan/report.h"
#include "launch.h"

namespace {

const char* kUsage = R"(dhp: disaggregated hybrid parallel training of vision-language models

usage: dhp <command> [options]

commands:
  train     train a model (default: the demo model on the built-in shapes task)
  params    print the parameter count of a config or of every preset
  config    print the resolved config with every key, its default and its meaning
  bench     measure strategies / placements side by side (step time, memory, comm, idle)
  plan      predict every strategy's step time and memory on a cluster and find the best plan
  forward   logits of a Hugging Face model directory for one sample (safetensors in and out)
  convert   export a training checkpoint (any layout) as a Hugging Face model directory
  tokenize  token ids of text with a Hugging Face tokenizer.json (Qwen's), or --decode them
  data      'dhp data preprocess': one image as Qwen2-VL's processor makes it (safetensors out);
            'dhp data synth': the shapes task written as a LLaVA dataset (JSONL + PNG)
  help      this text; 'dhp <command> --help' for a command's options

With no command, 'dhp' runs 'dhp train'.
)";

const char* kConfigFlags = R"(  --config FILE     YAML config (sections model, data, training, parallel, output)
  --set KEY=VALUE   override one key, VALUE parsed as YAML (repeatable), e.g.
                    --set training.steps=100 --set model.text.num_layers=2
)";

struct Args {
  std::string config;
  std::vector<std::string> sets;
  std::string out;
  bool help = false;
  bool all = false;
  bool print_schedule = false;
  bool resume = false;
  int64_t nproc = 1;
  int64_t max_restarts = 0;
};

// Walks the flags of argv from `first`: "--flag VALUE" or "--flag=VALUE" (split at the
// first '=', so "--set=a.b=1" works too).
class Flags {
 public:
  Flags(int argc, char** argv, int first) : argc_(argc), argv_(argv), i_(first - 1) {}
  // Advances to the next flag; false at the end.
  bool next() {
    if (++i_ >= argc_) return false;
    flag_ = argv_[i_];
    has_value_ = false;
    const auto eq = flag_.find('=');
    if (flag_.rfind("--", 0) == 0 && eq != std::string::npos) {
      value_ = flag_.substr(eq + 1);
      flag_ = flag_.substr(0, eq);
      has_value_ = true;
    }
    return true;
  }
  const std::string& flag() const { return flag_; }
  const char* raw() const { return argv_[i_]; }
  // The flag's value; throws naming the flag when there is none.
  std::string value() {
    if (has_value_) return value_;
    DHP_CHECK(i_ + 1 < argc_, flag_, " needs a value");
    return argv_[++i_];
  }

 private:
  int argc_;
  char** argv_;
  int i_;
  std::string flag_, value_;
  bool has_value_ = false;
};

// Parses the flags shared by the subcommands; throws dhp::Error on an unknown flag.
Args parse(int argc, char** argv, int first, const std::vector<std::string>& allowed) {
  Args a;
  auto ok = [&](const std::string& f) {
    for (const auto& x : allowed) if (x == f) return true;
    return false;
  };
  Flags flags(argc, argv, first);
  while (flags.next()) {
    const std::string& f = flags.flag();
    auto next = [&] { return flags.value(); };
    if (f == "-h" || f == "--help") {
      a.help = true;
    } else if (!ok(f)) {
      DHP_FAIL("unknown option '", flags.raw(), "' (see --help)");
    } else if (f == "--config") {
      a.config = next();
    } else if (f == "--set") {
      a.sets.push_back(next());
    } else if (f == "--out") {
      a.out = next();
    } else if (f == "--all") {
      a.all = true;
    } else if (f == "--print-schedule") {
      a.print_schedule = true;
    } else if (f == "--resume") {
      a.resume = true;
    } else if (f == "--nproc" || f == "--max-restarts") {
      const std::string v = next();
      int64_t x = -1;
      try {
        size_t used = 0;
        x = std::stoll(v, &used);
        if (used != v.size()) x = -1;
      } catch (const std::exception&) {
      }
      DHP_CHECK(x >= (f == "--nproc" ? 1 : 0), f, " expects a ", f == "--nproc" ? "positive" : "non-negative",
                " integer, got '", v, "'");
      (f == "--nproc" ? a.nproc : a.max_restarts) = x;
    }
  }
  return a;
}

// The job's rank, world and store from a launcher's environment (one process without one).
dhp::train::Runtime worker_runtime(const std::optional<dhp::launch::WorkerEnv>& env, double timeout_s) {
  dhp::train::Runtime rt;
  rt.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  if (env) {
    rt.rank = env->rank;
    rt.world = env->world;
    rt.local_world = env->local_world;
    if (rt.world > 1) {
      rt.store = std::make_shared<dhp::dist::Store>(
          dhp::dist::make_tcp_store(env->master_addr, env->master_port, rt.world, rt.rank == 0, rt.timeout));
    }
  }
  return rt;
}

int cmd_train(int argc, char** argv, int first) {
  auto a = parse(argc, argv, first,
                 {"--config", "--set", "--out", "--nproc", "--print-schedule", "--resume", "--max-restarts"});
  if (a.help) {
    std::printf(
        "usage: dhp train [--config FILE] [--set KEY=VALUE]... [--out DIR] [--nproc N] [--resume]\n"
        "                 [--max-restarts K] [--print-schedule]\n\n"
        "Trains the configured model (default: the demo preset on the built-in shapes task),\n"
        "showing step, loss, tokens/s, ETA and peak memory, then evaluates held-out answers.\n"
        "Writes DIR/metrics.jsonl (one JSON object per step: step, loss, lr, grad_norm,\n"
        "tokens_per_s, peak_bytes, ...), DIR/config.yaml (the resolved config) and\n"
        "DIR/summary.json (first/final loss, held-out exact-match accuracy), and checkpoints\n"
        "(checkpoint.*: every K steps and at the end, into DIR/checkpoints/step-N; the newest 3 kept).\n\n"
        "options:\n%s  --out DIR         run directory (default: output.dir = runs/demo)\n"
        "  --nproc N         start N local worker processes (ranks 0..N-1, rendezvous on a free\n"
        "                    port of 127.0.0.1) and supervise them; one failing stops all\n"
        "  --resume          continue from the newest complete checkpoint (checkpoint.resume=auto;\n"
        "                    a damaged one is reported and the previous one used; none: from step 0).\n"
        "                    Any layout or number of ranks loads any checkpoint\n"
        "  --max-restarts K  when a worker dies, stop the others and restart the whole job from the\n"
        "                    newest complete checkpoint, up to K times (default 0)\n"
        "  --print-schedule  print each rank's layout and the actions of one step (VF vision\n"
        "                    forward, SA/RA send/receive embeddings, TFB text forward+backward,\n"
        "                    SG/RG send/receive their gradients, VB vision backward) and exit\n\n"
        "Started by torchrun (--no-python), srun or mpirun, dhp reads RANK/WORLD_SIZE (or\n"
        "SLURM_PROCID/SLURM_NTASKS, OMPI_COMM_WORLD_RANK/SIZE) and MASTER_ADDR/MASTER_PORT\n"
        "and runs as one rank of that job. parallel.strategy chooses the layout (dhp, tp,\n"
        "zero3, dp, custom); 'dhp config' lists every key with its default.\n",
        kConfigFlags);
    return 0;
  }
  if (!a.out.empty()) a.sets.push_back("output.dir=" + a.out);
  if (a.resume) a.sets.push_back("checkpoint.resume=auto");
  auto cfg = dhp::load_config(a.config, a.sets);
  const auto env = dhp::launch::worker_env();
  if (a.print_schedule) {
    const int64_t world = env ? env->world : a.nproc;
    const auto layouts = dhp::train::resolve_layouts(cfg, world);
    std::printf("%lld rank(s): %s; %lld micro-batch(es) per step, %s\n", static_cast<long long>(world),
                dhp::train::describe(layouts).c_str(), static_cast<long long>(cfg.training.micro_batches),
                cfg.parallel.pipeline && dhp::train::disjoint(layouts.vision, layouts.text) ? "pipelined"
                                                                                           : "sequential");
    for (int64_t r = 0; r < world; ++r) {
      const bool v = layouts.vision.module_rank(r) >= 0, t = layouts.text.module_rank(r) >= 0;
      std::printf("rank %lld [%s]: %s\n", static_cast<long long>(r), v && t ? "vision+text" : v ? "vision" : "text",
                  dhp::train::to_string(dhp::train::make_schedule(layouts.vision, layouts.text, r,
                                                                  cfg.training.micro_batches, cfg.parallel.pipeline))
                      .c_str());
    }
    return 0;
  }
  if (!env) {
    DHP_CHECK(a.nproc >= 1, "--nproc must be >= 1, got ", a.nproc);
    if (cfg.parallel.strategy == "auto" && a.nproc > 1 &&
        !std::filesystem::exists(dhp::train::auto_calibration_path(a.nproc))) {
      dhp::log_info("parallel.strategy=auto: no calibration of this machine as " + std::to_string(a.nproc) +
                    " ranks yet; measuring it once (dhp plan --calibrate --ranks " + std::to_string(a.nproc) + ")");
      dhp::plan::CalibrateOptions co;
      co.ranks = a.nproc;
      dhp::plan::calibrate_local(co);
    }
    dhp::train::resolve_layouts(cfg, a.nproc);  // refuse an impossible layout before any worker starts
    if (a.nproc > 1 || a.max_restarts > 0) {
      return dhp::launch::run_workers(a.nproc, std::vector<std::string>(argv, argv + argc), a.max_restarts);
    }
  } else {
    DHP_CHECK(a.nproc == 1 || a.nproc == env->world, "--nproc ", a.nproc, " but the ", env->launcher,
              " environment says WORLD_SIZE=", env->world);
  }
  const auto rt = worker_runtime(env, cfg.parallel.timeout_s);
  // The trainer (and its connections) outlives the handler, so a failing rank records its
  // error before the others see their connections close and fail in turn.
  std::unique_ptr<dhp::train::Trainer> trainer;
  try {
    trainer = std::make_unique<dhp::train::Trainer>(cfg, rt);
    trainer->run();
  } catch (const std::exception& e) {
    dhp::launch::report_worker_error(e.what());
    throw;
  }
  return 0;
}

int64_t parse_int(const std::string& flag, const std::string& v) {
  try {
    size_t used = 0;
    const long long x = std::stoll(v, &used);
    if (used == v.size()) return x;
  } catch (const std::exception&) {
  }
  DHP_FAIL(flag, " expects an integer, got '", v, "'");
}

std::vector<int64_t> parse_int_list(const std::string& flag, const std::string& v) {
  std::vector<int64_t> out;
  std::string cur;
  for (char c : v + ",") {
    if (c == ',') {
      if (!cur.empty()) out.push_back(parse_int(flag, cur));
      cur.clear();
    } else if (c != ' ') {
      cur += c;
    }
  }
  DHP_CHECK(!out.empty(), flag, " needs a comma-separated list of integers, got '", v, "'");
  return out;
}

int cmd_bench(int argc, char** argv, int first) {
  dhp::bench::Options o;
  std::string strategies = "dhp,tp,zero3";
  std::vector<std::string> points;
  std::vector<int64_t> sides;
  bool strategies_given = false;
  Flags flags(argc, argv, first);
  while (flags.next()) {
    const std::string& f = flags.flag();
    auto next = [&] { return flags.value(); };
    if (f == "-h" || f == "--help") {
      std::printf(
          "usage: dhp bench [--config FILE] [--set KEY=VALUE]... [--strategies LIST] [--point NAME:K=V;K=V]...\n"
          "                 [--vision-tokens LIST | --image-sides LIST] [--batch-sizes LIST]\n"
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
          "                       (default dhp,tp,zero3; '' for none)\n"
          "  --point NAME:SETS    a custom point: config keys separated by ';', e.g.\n"
          "                       'seq:parallel.vision.ranks=[0,1];parallel.pipeline=false'\n"
          "  --vision-tokens LIST patches per image (before the 2x2 merge), each the square of an even\n"
          "                       number: images are that square (default 64,256 = 112 and 224 px)\n"
          "  --image-sides LIST   the same given as square image sides in pixels (multiples of 28)\n"
          "  --batch-sizes LIST   global batch sizes to try, largest first (default: data.batch_size)\n"
          "  --memory-limit SIZE  per-rank tensor memory budget, e.g. 2GiB (training.memory_limit)\n"
          "  --nproc N            worker processes per job (default 2)\n"
          "  --steps N            training steps per job (default 6)\n"
          "  --warmup N           first steps left out of the averages (default 2)\n"
          "  --repeats N          rounds (default 1): after the first, which finds each point's batch,\n"
          "                       every point runs again at that batch, point after point, N-1 times;\n"
          "                       each row is the round of median step time, with the range shown\n"
          "                       (a shared machine's slow stretch then falls on every point alike)\n"
          "  --out DIR            output directory (default runs/bench)\n"
          "  --no-plot            skip throughput.png\n",
          kConfigFlags);
      return 0;
    } else if (f == "--config") {
      o.config = next();
    } else if (f == "--set") {
      o.sets.push_back(next());
    } else if (f == "--strategies") {
      strategies = next();
      strategies_given = true;
    } else if (f == "--point") {
      points.push_back(next());
    } else if (f == "--vision-tokens") {
      o.vision_tokens = parse_int_list(f, next());
    } else if (f == "--image-sides") {
      sides = parse_int_list(f, next());
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
  if (!sides.empty()) {
    const auto cfg = dhp::load_config(o.config, o.sets);
    const int64_t patch = cfg.model.config.vision.patch_size;
    o.vision_tokens.clear();
    for (auto s : sides) {
      DHP_CHECK(s > 0 && s % (2 * patch) == 0, "--image-sides ", s, " is not a positive multiple of ", 2 * patch);
      o.vision_tokens.push_back((s / patch) * (s / patch));
    }
  }
  if (!points.empty() && !strategies_given) strategies.clear();
  o.points = dhp::bench::parse_points(strategies, points);
  const auto results = dhp::bench::run(o);
  for (const auto& r : results)
    if (!r.ok() && !r.oom) return 1;  // a point failed for another reason than memory
  return 0;
}

int cmd_plan(int argc, char** argv, int first) {
  dhp::plan::StudyOptions o;
  std::string model = "qwen2.5-vl-32b", cluster = "h100x8", json, memory, config, against, host_times;
  std::vector<std::string> sets;
  bool calibrate = false, text_given = false, precision_given = false, ckpt_given = false;
  dhp::plan::CalibrateOptions co;
  Flags flags(argc, argv, first);
  while (flags.next()) {
    const std::string& f = flags.flag();
    auto next = [&] { return flags.value(); };
    if (f == "-h" || f == "--help") {
      std::printf(
          "usage: dhp plan [--model PRESET | --config FILE [--set KEY=VALUE]...] [--cluster SPEC]\n"
          "                [--vision-tokens LIST] [--batch-sizes LIST] [--images N] [--text-tokens N]\n"
          "                [--targets N] [--precision bf16|fp32] [--no-checkpointing] [--conventions dhp|reference]\n"
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
          "                         whose rounds overlap under dhp bench --repeats, count as ties)\n");
      return 0;
    } else if (f == "--model") {
      model = next();
    } else if (f == "--config") {
      config = next();
    } else if (f == "--set") {
      sets.push_back(next());
    } else if (f == "--cluster") {
      cluster = next();
    } else if (f == "--vision-tokens") {
      o.vision_tokens = parse_int_list(f, next());
    } else if (f == "--batch-sizes") {
      o.batch_sizes = parse_int_list(f, next());
    } else if (f == "--images") {
      o.workload.images_per_sample = parse_int(f, next());
    } else if (f == "--text-tokens") {
      o.workload.text_tokens = parse_int(f, next());
      text_given = true;
    } else if (f == "--targets") {
      o.workload.target_tokens = parse_int(f, next());
      text_given = true;
    } else if (f == "--precision") {
      precision_given = true;
      o.workload.precision = next();
      DHP_CHECK(o.workload.precision == "bf16" || o.workload.precision == "fp32", "--precision must be bf16 or fp32, got '",
                o.workload.precision, "'");
    } else if (f == "--no-checkpointing") {
      o.workload.checkpointing = false;
      ckpt_given = true;
    } else if (f == "--conventions") {
      o.conventions = next();
      DHP_CHECK(o.conventions == "dhp" || o.conventions == "reference", "--conventions must be dhp or reference, got '",
                o.conventions, "'");
    } else if (f == "--strategies") {
      o.strategies.clear();
      std::stringstream ss(next());
      for (std::string x; std::getline(ss, x, ',');)
        if (!x.empty()) o.strategies.push_back(x);
    } else if (f == "--memory-per-device") {
      memory = next();
    } else if (f == "--top") {
      o.top = parse_int(f, next());
    } else if (f == "--json") {
      json = next();
    } else if (f == "--calibrate") {
      calibrate = true;
    } else if (f == "--calibrate-precision") {
      co.precision = next();
    } else if (f == "--ranks") {
      co.ranks = parse_int(f, next());
    } else if (f == "--threads") {
      co.threads = parse_int(f, next());
    } else if (f == "--out") {
      co.out = next();
    } else if (f == "--against") {
      against = next();
    } else if (f == "--host-times") {
      host_times = next();
    } else {
      DHP_FAIL("unknown option '", flags.raw(), "' (see dhp plan --help)");
    }
  }
  if (calibrate) {
    dhp::plan::calibrate_local(co);
    return 0;
  }
  DHP_CHECK(o.workload.images_per_sample >= 1 && o.workload.text_tokens >= 0 && o.workload.target_tokens >= 1 &&
                o.workload.target_tokens <= o.workload.text_tokens,
            "need --images >= 1 and 1 <= --targets <= --text-tokens");
  for (auto b : o.batch_sizes) DHP_CHECK(b >= 1, "--batch-sizes must be >= 1, got ", b);
  for (const auto& s : o.strategies) dhp::plan::named_plan(s, 1);  // names checked before the work
  dhp::qwen::ModelConfig m;
  std::string model_name = model;
  std::optional<dhp::Config> cfg;
  if (!config.empty() || !sets.empty()) {
    cfg = dhp::load_config(config, sets);
    m = cfg->model.config;
    model_name = cfg->model.preset;
    if (!precision_given) o.workload.precision = cfg->training.precision;
    if (!ckpt_given) o.workload.checkpointing = cfg->training.activation_checkpointing;
    if (!text_given && cfg->data.dataset == "shapes") {  // the task's mean text and answer tokens
      std::tie(o.workload.text_tokens, o.workload.target_tokens) = dhp::train::shapes_text_tokens(*cfg);
    }
  } else {
    m = dhp::qwen::preset(model);
  }
  auto c = dhp::plan::cluster_preset(cluster);
  if (cfg) dhp::train::apply_runtime(*cfg, c, o.workload);
  if (!host_times.empty()) {
    DHP_CHECK(o.conventions == "reference", "--host-times ", host_times, " applies to the eager systems' runtimes: ",
              "add --conventions reference (dhp's own runtime is C++, its dispatch cost is in the calibration)");
    dhp::plan::load_eager_host_times(c, host_times);
  }
  if (!memory.empty()) {
    c.memory_bytes = static_cast<double>(dhp::parse_bytes(memory, "--memory-per-device"));
    c.reserved_bytes = 0;
  }
  if (!against.empty()) {
    std::printf("dhp plan --against %s: %s on %s, %s%s, %lld text tokens (%lld with a loss) per sample\n\n",
                against.c_str(), model_name.c_str(), c.name.c_str(), o.workload.precision.c_str(),
                o.workload.checkpointing ? ", activation checkpointing" : "",
                static_cast<long long>(o.workload.text_tokens), static_cast<long long>(o.workload.target_tokens));
    const auto v = dhp::plan::validate(m, c, o.workload, against, !memory.empty());
    std::printf("%s", v.table.c_str());
    return 0;
  }
  const auto points = dhp::plan::study(m, c, o);
  std::printf("%s", dhp::plan::study_table(model_name, c, o, points).c_str());
  if (!json.empty()) {
    std::ofstream f(json);
    DHP_CHECK(f.good(), "cannot write --json ", json);
    f << dhp::plan::study_json(model_name, c, o, points);
    DHP_CHECK(f.good(), "writing ", json, " failed");
    std::printf("\nwrote %s\n", json.c_str());
  }
  return 0;
}

void print_count(const std::string& name, const dhp::qwen::ModelConfig& c) {
  const auto p = dhp::qwen::count_parameters(c);
  auto human = [](int64_t n) {
    char buf[32];
    if (n >= 1000000000) std::snprintf(buf, sizeof(buf), "%.3fB", n / 1e9);
    else std::snprintf(buf, sizeof(buf), "%.2fM", n / 1e6);
    return std::string(buf);
  };
  std::printf("%-16s vision %9s  text %9s  total %9s  (%lld parameters)\n", name.c_str(), human(p.vision).c_str(),
              human(p.text).c_str(), human(p.total()).c_str(), static_cast<long long>(p.total()));
}

int cmd_params(int argc, char** argv, int first) {
  auto a = parse(argc, argv, first, {"--config", "--set", "--all"});
  if (a.help) {
    std::printf("usage: dhp params [--config FILE] [--set KEY=VALUE]... | --all\n\n"
                "Prints the exact parameter count (vision tower with merger, text decoder with\n"
                "embeddings and lm_head) of the configured model, or of every preset with --all.\n\noptions:\n%s"
                "  --all             every preset\n", kConfigFlags);
    return 0;
  }
  if (a.all) {
    for (const auto& n : dhp::qwen::preset_names()) print_count(n, dhp::qwen::preset(n));
    return 0;
  }
  auto cfg = dhp::load_config(a.config, a.sets);
  print_count(cfg.model.preset, cfg.model.config);
  return 0;
}

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

int cmd_tokenize(int argc, char** argv, int first) {
  const char* usage =
      "usage: dhp tokenize --tokenizer FILE (--text STR | --file F) [--decode]\n\n"
      "Tokenizes with a Hugging Face tokenizer.json (byte-level BPE of the Qwen2 family, e.g.\n"
      "third_party/qwen-tokenizer/tokenizer.json from scripts/fetch_tokenizer.sh) and prints the ids\n"
      "as a JSON array: of STR, or one array per line of F (without the line's newline).\n"
      "Special tokens written in the text (<|im_start|>, <|image_pad|>, ...) become their ids.\n\n"
      "  --decode   the reverse: STR, or each line of F, is a JSON array of ids; prints the text\n";
  std::string tokenizer, text, file;
  bool has_text = false, decode = false;
  Flags flags(argc, argv, first);
  while (flags.next()) {
    const auto& f = flags.flag();
    if (f == "-h" || f == "--help") {
      std::printf("%s", usage);
      return 0;
    }
    if (f == "--tokenizer") tokenizer = flags.value();
    else if (f == "--text") text = flags.value(), has_text = true;
    else if (f == "--file") file = flags.value();
    else if (f == "--decode") decode = true;
    else DHP_FAIL("unknown option '", flags.raw(), "' (see dhp tokenize --help)");
  }
  DHP_CHECK(!tokenizer.empty(), "dhp tokenize needs --tokenizer FILE\n\n", usage);
  DHP_CHECK(has_text != !file.empty(), "dhp tokenize needs exactly one of --text and --file\n\n", usage);
  const auto tok = dhp::data::Tokenizer::from_file(tokenizer);
  std::vector<std::string> inputs;
  if (has_text) {
    inputs.push_back(text);
  } else {
    std::ifstream in(file, std::ios::binary);
    DHP_CHECK(in.good(), "cannot read --file ", file);
    for (std::string line; std::getline(in, line);) inputs.push_back(line);
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    const std::string where = has_text ? std::string("--text") : file + " line " + std::to_string(i + 1);
    if (decode) {
      std::vector<int64_t> ids;
      const auto j = dhp::io::Json::parse(inputs[i], where);  // errors name `where`
      for (const auto& e : j.elements(where + " (a JSON array of ids)")) ids.push_back(e.integer(where + " id"));
      try {
        std::printf("%s\n", tok.decode(ids).c_str());
      } catch (const dhp::Error& e) {
        DHP_FAIL(where, ": ", e.what());
      }
      continue;
    }
    std::vector<int64_t> ids;
    try {
      ids = tok.encode(inputs[i]);
    } catch (const dhp::Error& e) {
      DHP_FAIL(where, ": ", e.what());
    }
    std::string out = "[";
    for (size_t k = 0; k < ids.size(); ++k) out += (k ? ", " : "") + std::to_string(ids[k]);
    std::printf("%s]\n", out.c_str());
  }
  return 0;
}

int cmd_data(int argc, char** argv, int first) {
  const char* usage =
      "usage: dhp data preprocess --image PATH [--min-pixels A] [--max-pixels B] --out F.safetensors\n"
      "       dhp data synth --out DIR --num N [--seed S] [--min-side A] [--max-side B]\n\n"
      "Preprocesses one image (JPEG or PNG) exactly as Qwen2-VL's Hugging Face processor does\n"
      "(EXIF orientation, transparency over white, smart_resize to multiples of 28 within\n"
      "[A, B] pixels, Pillow's bicubic resize, rescale, normalise, 2 frames, merge-window patch\n"
      "order) and writes pixel_values [N, 1176] fp32 and image_grid_thw [1, 3] int64, to compare\n"
      "with the processor tensor by tensor. Defaults: Qwen2.5-VL's min 3136, max 12845056.\n\n"
      "synth writes the built-in shapes task as a LLaVA dataset: DIR/train.jsonl (one conversation\n"
      "per image: \"<image>\\nWhat is in the image?\" -> \"a red circle top left\") and DIR/images/*.png\n"
      "(sides in [A, B] px, multiples of 28; default 112..224).\n";
  if (first >= argc || std::string(argv[first]) == "-h" || std::string(argv[first]) == "--help") {
    std::printf("%s", usage);
    return first >= argc ? 2 : 0;
  }
  if (std::string(argv[first]) == "synth") {
    std::string out;
    int64_t num = -1;
    dhp::data::ShapesOptions so;
    so.seed = 1234 * 2;  // data.seed's default training stream
    Flags flags(argc, argv, first + 1);
    while (flags.next()) {
      const auto& f = flags.flag();
      if (f == "-h" || f == "--help") {
        std::printf("%s", usage);
        return 0;
      }
      if (f == "--out") out = flags.value();
      else if (f == "--num") num = parse_int(f, flags.value());
      else if (f == "--seed") so.seed = static_cast<uint64_t>(parse_int(f, flags.value()));
      else if (f == "--min-side") so.min_side = parse_int(f, flags.value());
      else if (f == "--max-side") so.max_side = parse_int(f, flags.value());
      else DHP_FAIL("unknown option '", flags.raw(), "' (see dhp data --help)");
    }
    DHP_CHECK(!out.empty() && num > 0, "dhp data synth needs --out DIR and --num N > 0\n\n", usage);
    dhp::data::write_synthetic(out, num, dhp::qwen::preset("demo"), so);
    dhp::log_info("wrote " + std::to_string(num) + " samples of the shapes task to " + out +
                  " (train.jsonl + images/*.png)");
    return 0;
  }
  DHP_CHECK(std::string(argv[first]) == "preprocess", "unknown 'dhp data' command '", argv[first], "'\n\n", usage);
  std::string image, out;
  dhp::data::ImageOptions o;
  Flags flags(argc, argv, first + 1);
  while (flags.next()) {
    const auto& f = flags.flag();
    if (f == "-h" || f == "--help") {
      std::printf("%s", usage);
      return 0;
    }
    if (f == "--image") image = flags.value();
    else if (f == "--out") out = flags.value();
    else if (f == "--min-pixels") o.min_pixels = parse_int(f, flags.value());
    else if (f == "--max-pixels") o.max_pixels = parse_int(f, flags.value());
    else DHP_FAIL("unknown option '", flags.raw(), "' (see dhp data --help)");
  }
  DHP_CHECK(!image.empty() && !out.empty(), "dhp data preprocess needs --image and --out\n\n", usage);
  DHP_CHECK(o.min_pixels > 0 && o.max_pixels >= o.min_pixels, "--min-pixels ", o.min_pixels, " and --max-pixels ",
            o.max_pixels, " must satisfy 0 < min <= max");
  const auto p = dhp::data::preprocess(dhp::data::load_image(image), o);
  auto grid = torch::tensor({p.grid[0], p.grid[1], p.grid[2]}, torch::kInt64).view({1, 3});
  dhp::io::write_safetensors(out, {{"pixel_values", p.pixel_values}, {"image_grid_thw", grid}});
  dhp::log_info(image + ": resized to " + std::to_string(p.resized.width) + "x" + std::to_string(p.resized.height) +
                " px (width x height), image_grid_thw [" + std::to_string(p.grid[0]) + ", " + std::to_string(p.grid[1]) +
                ", " + std::to_string(p.grid[2]) + "] -> " + out);
  return 0;
}

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
      std::printf("%s", kUsage);
      return 0;
    }
    const std::map<std::string, std::function<int(int, char**, int)>> cmds = {
        {"train", cmd_train}, {"convert", cmd_convert}, {"tokenize", cmd_tokenize}, {"data", cmd_data}, {"params", cmd_params}, {"config", cmd_config}, {"bench", cmd_bench},
        {"plan", cmd_plan},
        {"forward", cmd_forward}};
    auto it = cmds.find(cmd);
    if (it == cmds.end()) {
      std::fprintf(stderr, "dhp: unknown command '%s'\n\n%s", cmd.c_str(), kUsage);
      return 2;
    }
    return it->second(argc, argv, first);
  } catch (const std::exception& e) {
    const char* rank = std::getenv("RANK");
    if (rank) std::fprintf(stderr, "dhp: error on rank %s: %s\n", rank, e.what());
    else std::fprintf(stderr, "dhp: error: %s\n", e.what());
    dhp::launch::report_worker_error(e.what());
    return 1;
  }
}
