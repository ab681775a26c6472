// `dhp train`: one training job, as its launcher (--nproc N starts the workers) or as one of
// its ranks; parallel.strategy=auto is chosen here, once per job.
#include <torch/torch.h>
#include <cstdio>
#include <cstring>
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
#include "dhp/core/log.h"
#include "dhp/core/memory.h"
#include "dhp/train/auto_plan.h"
#include "dhp/train/checkpoint.h"
#include "dhp/train/config.h"
#include "dhp/train/trainer.h"
#include "cli.h"
#include "launch.h"

namespace dhp::cli {
namespace {

// --inject-fault values: fail:RANK:STEP, kill:RANK:STEP, kill-in-save:STEP.
train::FaultInjection parse_faults(const std::vector<std::string>& specs) {
  train::FaultInjection f;
  for (const auto& spec : specs) {
    long long r = -1, s = -1;
    if (std::sscanf(spec.c_str(), "fail:%lld:%lld", &r, &s) == 2 && r >= 0 && s >= 1) {
      f.fail_rank = r;
      f.fail_step = s;
    } else if (std::sscanf(spec.c_str(), "kill:%lld:%lld", &r, &s) == 2 && r >= 0 && s >= 1) {
      f.kill_rank = r;
      f.kill_step = s;
    } else if (std::sscanf(spec.c_str(), "kill-in-save:%lld", &s) == 1 && s >= 1) {
      f.kill_in_save_step = s;
    } else {
      DHP_FAIL("--inject-fault '", spec, "' is not fail:RANK:STEP, kill:RANK:STEP or kill-in-save:STEP");
    }
  }
  return f;
}

// parallel.strategy=auto, chosen here once per job: the launcher pins its choice for the
// workers it starts by appending --set overrides to `worker_argv` (ranks started by
// torchrun, srun or mpirun each choose, deterministically). `calibrate`: measure this
// machine first when it has no calibration for `world` ranks.
Config choose_auto(const Config& cfg, int64_t world, const std::optional<dist::WorkerEnv>& env, bool calibrate,
                   std::vector<std::string>& worker_argv) {
  if (calibrate) bench::calibrate_if_missing(world, cfg.training.precision);
  std::string why;
  auto out = train::resolve_auto(cfg, world, &why);
  if (!env || env->rank == 0) log_info(why);
  for (const auto& kv : train::pinned_parallel_sets(out)) {
    worker_argv.push_back("--set");
    worker_argv.push_back(kv);
  }
  return out;
}

// --print-schedule: each rank's modules and the actions of one step.
void print_schedule(const Config& cfg, const train::Layouts& layouts, int64_t world) {
  const auto forward_only = train::forward_only_encoders(cfg);
  std::string frozen;
  for (size_t e = 0; e < forward_only.size(); ++e)
    if (forward_only[e]) frozen += "; " + layouts.modules[e].name + " frozen: forward only";
  std::printf("%lld rank(s): %s; %lld micro-batch(es) per step, %s%s\n", static_cast<long long>(world),
              train::describe(layouts).c_str(), static_cast<long long>(cfg.training.micro_batches),
              cfg.parallel.pipeline && train::disjoint(layouts.modules) ? "pipelined" : "sequential", frozen.c_str());
  for (int64_t r = 0; r < world; ++r) {
    std::string hosts;
    for (const auto& m : layouts.modules) {
      if (m.module_rank(r) >= 0) hosts += (hosts.empty() ? "" : "+") + m.name;
    }
    const auto actions =
        train::make_schedule(layouts.modules, r, cfg.training.micro_batches, cfg.parallel.pipeline, forward_only);
    std::printf("rank %lld [%s]: %s\n", static_cast<long long>(r), hosts.c_str(), train::to_string(actions, layouts.modules).c_str());
  }
}

}  // namespace

int cmd_train(int argc, char** argv, int first) {
  auto a = parse(argc, argv, first,
                 {"--config", "--set", "--out", "--nproc", "--print-schedule", "--resume", "--max-restarts",
                  "--inject-fault", "--nnodes", "--node-rank", "--master-addr", "--master-port"});
  if (a.help) {
    std::printf(
        "usage: dhp train [--config FILE] [--set KEY=VALUE]... [--out DIR] [--nproc N] [--resume]\n"
        "                 [--max-restarts K] [--print-schedule]\n"
        "                 [--nnodes M --node-rank R --master-addr HOST [--master-port P]]\n\n"
        "Trains the configured model (default: the demo preset on the built-in shapes task),\n"
        "showing step, loss, tokens/s, ETA and peak memory, then evaluates held-out answers.\n"
        "Writes DIR/metrics.jsonl (one JSON object per step: step, loss, lr, grad_norm,\n"
        "tokens_per_s, peak_bytes, ...), DIR/config.yaml (the resolved config) and\n"
        "DIR/summary.json (first/final loss, held-out exact-match accuracy), and checkpoints\n"
        "(checkpoint.*: every K steps and at the end, into DIR/checkpoints/step-N; the newest 3 kept).\n\n"
        "options:\n%s  --out DIR         run directory (default: output.dir = runs/demo)\n"
        "  --nproc N         start N local worker processes (ranks 0..N-1, meeting through a store\n"
        "                    file; on one host nothing listens beyond 127.0.0.1) and supervise\n"
        "                    them; one failing stops all\n"
        "  --nnodes M        a job over M hosts: run the same command on each host with its own\n"
        "  --node-rank R     --node-rank (0 .. M-1); each starts --nproc workers (ranks R*N .. R*N+N-1)\n"
        "  --master-addr A   node 0's address, which every host reaches; node 0's launcher hosts the\n"
        "  --master-port P   job's store there on port P (default 29500). The hosts must see one\n"
        "                    checkpoint.dir; see docs/multinode.md\n"
        "  --resume          continue from the newest complete checkpoint (checkpoint.resume=auto;\n"
        "                    a damaged one is reported and the previous one used; none: from step 0).\n"
        "                    Any layout or number of ranks loads any checkpoint\n"
        "  --max-restarts K  when a worker dies, stop the others and restart the whole job from the\n"
        "                    newest complete checkpoint, up to K times (default 0)\n"
        "  --print-schedule  print each rank's layout and the actions of one step (VF vision\n"
        "                    forward, SA/RA send/receive embeddings, TFB text forward+backward,\n"
        "                    SG/RG send/receive their gradients, VB vision backward) and exit\n"
        "  --inject-fault F  for tests of failure handling (repeatable): fail:RANK:STEP (that rank\n"
        "                    throws before that step), kill:RANK:STEP (it SIGKILLs itself, first\n"
        "                    attempt only), kill-in-save:STEP (rank 0 SIGKILLs itself while saving\n"
        "                    that step's checkpoint, before the commit; first attempt only)\n\n"
        "Started by torchrun (--no-python), srun or mpirun, dhp reads RANK/WORLD_SIZE (or\n"
        "SLURM_PROCID/SLURM_NTASKS, OMPI_COMM_WORLD_RANK/SIZE) and MASTER_ADDR/MASTER_PORT\n"
        "(under srun: from SLURM_JOB_NODELIST and the job id when unset) and runs as one rank of\n"
        "that job. Every rank checks that all run the same dhp and config. parallel.strategy chooses the layout (dhp, tp,\n"
        "zero3, dp, custom); 'dhp config' lists every key with its default.\n",
        kConfigFlags);
    return 0;
  }
  if (!a.out.empty()) a.sets.push_back("output.dir=" + a.out);
  if (a.resume) a.sets.push_back("checkpoint.resume=auto");
  auto cfg = dhp::load_config(a.config, a.sets);
  const auto env = dhp::dist::worker_env();
  const int64_t world = env ? env->world : a.nproc * a.nodes.count;
  if (!env) DHP_CHECK(a.nproc >= 1, "--nproc must be >= 1, got ", a.nproc);
  std::vector<std::string> worker_argv(argv, argv + argc);
  if (dhp::parse_combination(cfg.parallel.strategy) == dhp::Combination::kAuto) {
    DHP_CHECK(a.nodes.count == 1 && (!env || env->single_host()),
              "parallel.strategy=auto plans from this host's calibration and cannot plan a job spanning hosts yet: name "
              "the layout (parallel.strategy=dhp, tp, zero3, dp or custom)");
    cfg = choose_auto(cfg, world, env, /*calibrate=*/!env && !a.print_schedule, worker_argv);
  }
  const auto layouts = dhp::train::resolve_layouts(cfg, world);  // refuse an impossible layout before any worker starts
  if (a.print_schedule) {
    print_schedule(cfg, layouts, world);
    return 0;
  }
  if (!env) {
    if (a.nproc > 1 || a.max_restarts > 0 || a.nodes.count > 1) {
      return dhp::launch::run_workers(a.nproc, worker_argv, a.max_restarts, a.nodes, cfg.parallel.timeout());
    }
  } else {
    DHP_CHECK(a.nproc == 1 || a.nproc * a.nodes.count == env->world, "--nproc ", a.nproc, " but the ", env->launcher,
              " environment says WORLD_SIZE=", env->world);
  }
  auto rt = worker_runtime(env, cfg);
  rt.faults = parse_faults(a.faults);
  // The trainer (and its connections) outlives the handler, so a failing rank records its
  // error before the others see their connections close and fail in turn.
  std::unique_ptr<dhp::train::Trainer> trainer;
  try {
    trainer = std::make_unique<dhp::train::Trainer>(cfg, rt);
    trainer->run();
  } catch (const std::exception& e) {
    dhp::launch::report_worker_error(e);
    throw;
  }
  return 0;
}

}  // namespace dhp::cli
