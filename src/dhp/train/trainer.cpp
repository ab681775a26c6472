#include "dhp/train/trainer.h"

#include <torch/torch.h>
#include <signal.h>

#include <algorithm>
#include <optional>
#include <thread>

#include "dhp/core/device_memory.h"
#include "dhp/core/op_profile.h"
#include "dhp/core/log.h"
#include "dhp/core/machine.h"
#include "dhp/core/memory.h"
#include "dhp/models/qwen2_5_vl/hf.h"
#include "dhp/models/qwen2_5_vl/peft.h"
#include "dhp/train/checkpointing.h"
#include "dhp/train/evaluation.h"
#include "dhp/train/flops.h"
#include "dhp/train/run_report.h"

namespace dhp::train {

Trainer::Trainer(const Config& cfg, const Runtime& rt) : cfg_(cfg), rt_(rt), data_(cfg) {
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  // Ranks on one machine share its cores.
  const int64_t local = rt_.local_world > 0 ? rt_.local_world : rt_.world;
  const int64_t share = std::max<int64_t>(1, static_cast<int64_t>(hw) / std::max<int64_t>(1, local));
  torch::set_num_threads(static_cast<int>(cfg_.training.threads > 0 ? cfg_.training.threads : share));
  set_device_memory_limit(resolve_device(cfg_, rt_), parse_bytes(cfg_.training.memory_limit, "training.memory_limit"));
  check_shared_checkpoint_dir(cfg_, rt_);
  parallel_ = std::make_unique<ParallelModel>(cfg_, resolve_layouts(cfg_, rt_.world), rt_);
  if (const auto r = train::resume(*parallel_, cfg_)) {
    step_ = r->step;
    data_.restart_at(r->samples_seen);
  }
}

std::string Trainer::save_checkpoint() { return train::save_checkpoint(*parallel_, cfg_, step_, data_.position()); }

void Trainer::load_checkpoint(const std::string& dir) {
  const auto r = train::load_checkpoint(*parallel_, dir);
  step_ = r.step;
  data_.restart_at(r.samples_seen);
}

const data::ShapesDataset& Trainer::dataset() const {
  DHP_CHECK(data_.shapes() != nullptr, "Trainer::dataset(): data.dataset is ", cfg_.data.dataset, ", not shapes");
  return *data_.shapes();
}

std::vector<std::vector<data::Sample>> Trainer::next_step_samples() {
  return data_.next_step([this](const std::vector<data::Sample>& mb) { return parallel_->encodes(mb); },
                         parallel_->layouts().max_dp());
}

StepMetrics Trainer::train_step() {
  const auto& f = rt_.faults;
  DHP_CHECK(f.fail_rank != rt_.rank || step_ + 1 != f.fail_step, "injected failure on rank ", rt_.rank, " at step ",
            step_ + 1, " (--inject-fault fail:", f.fail_rank, ":", f.fail_step, ")");
  if (rt_.restart == 0 && f.kill_rank == rt_.rank && step_ + 1 == f.kill_step) ::raise(SIGKILL);
  Timer timer;
  reset_device_peak(parallel_->device());
  const auto comm0 = dist::comm_stats();
  parallel_->zero_grad();  // the last step's gradients go before this step's pixels arrive
  memory_mark("step start");
  const double data_wait0 = data_.wait_seconds();
  Timer samples_timer;
  auto micro = next_step_samples();
  memory_mark("samples");
  StepMetrics m;
  m.samples_s = samples_timer.seconds();
  m.data_wait_s = data_.wait_seconds() - data_wait0;
  m.skipped_samples = data_.skipped();
  for (const auto& mb : micro) {
    m.samples += static_cast<int64_t>(mb.size());
    for (const auto& s : mb) {
      m.target_tokens += data::num_targets(s);
      m.tokens += static_cast<int64_t>(s.ids.size());
      for (const auto& g : s.grids) m.patches += g[0] * g[1] * g[2];  // pixels may live on other ranks
    }
    m.model_flops += training_flops(cfg_.model.config, mb, cfg_.model.freezing.encoder_frozen());
  }
  DHP_CHECK(m.target_tokens > 0, "step ", step_, ": the global batch has no answer tokens");
  const int64_t every = cfg_.training.profile_every;
  std::optional<OpProfile> profile;
  const bool profile_step = every > 0 && (step_ + 1) % every == 0;  // the same on every rank
  if (profile_step) profile.emplace();
  const auto fb = parallel_->forward_backward(std::move(micro), static_cast<double>(m.target_tokens));
  OpTimes ops;
  if (profile) {
    ops = profile->times();
    profile.reset();
  }
  // Only a profiled step reads the collectives' time around the update: on CUDA a read
  // synchronizes the host with the events of the collectives so far.
  const double comm_before_update = profile_step ? dist::comm_stats().seconds : 0;
  double loss_sum = fb.loss_sum;
  m.wait_s = fb.wait_s;
  m.lr = optim::lr_at(step_, cfg_.training.steps, cfg_.training.warmup_steps, cfg_.training.lr, cfg_.training.min_lr);
  Timer update_timer;
  try {
    m.grad_norm = parallel_->finish_step(m.lr, cfg_.training.grad_clip);
  } catch (const NonFiniteGradient& e) {
    DHP_FAIL("step ", step_ + 1, ": ", e.what());
  }
  m.update_s = update_timer.seconds();
  const double update_comm_s = profile_step ? dist::comm_stats().seconds - comm_before_update : 0;
  loss_sum = parallel_->sum_over_job(loss_sum);
  ++step_;
  m.step = step_;
  m.loss = loss_sum / static_cast<double>(m.target_tokens);
  m.peak_bytes = static_cast<int64_t>(parallel_->max_over_job(static_cast<double>(device_peak_bytes(parallel_->device()))));
  m.step_time_s = timer.seconds();
  m.tokens_per_s = static_cast<double>(m.tokens) / m.step_time_s;
  m.patches_per_s = static_cast<double>(m.patches) / m.step_time_s;
  const auto comm1 = dist::comm_stats();
  m.comm_s = comm1.seconds - comm0.seconds;
  m.comm_calls = comm1.calls - comm0.calls;
  m.comm_bytes = comm1.bytes - comm0.bytes;
  // Busy = the step minus the time blocked on the other module (idle).
  constexpr size_t kFigures = 7;
  const auto per_rank = parallel_->gather_over_job({static_cast<double>(device_peak_bytes(parallel_->device())), m.comm_s,
                                                    m.step_time_s - m.wait_s, m.wait_s, fb.vision_s, fb.text_s,
                                                    m.update_s});
  for (size_t r = 0; r < per_rank.size() / kFigures; ++r) {
    m.peak_bytes_per_rank.push_back(per_rank[kFigures * r]);
    m.comm_s_per_rank.push_back(per_rank[kFigures * r + 1]);
    m.busy_s_per_rank.push_back(per_rank[kFigures * r + 2]);
    m.idle_s_per_rank.push_back(per_rank[kFigures * r + 3]);
    m.vision_s_per_rank.push_back(per_rank[kFigures * r + 4]);
    m.text_s_per_rank.push_back(per_rank[kFigures * r + 5]);
    m.update_s_per_rank.push_back(per_rank[kFigures * r + 6]);
  }
  if (profile_step) {  // a collective
    std::vector<double> parts = {ops.gemm_s, ops.attention_s, ops.elementwise_s, m.comm_s,
                                 std::max(0.0, m.update_s - update_comm_s), m.samples_s};
    double known = 0;
    for (auto x : parts) known += x;
    parts.push_back(std::max(0.0, m.step_time_s - known));
    const auto all = parallel_->gather_over_job(parts);
    m.breakdown_per_rank.assign(kBreakdownCount, {});
    for (size_t r = 0; r < all.size() / kBreakdownCount; ++r)
      for (size_t k = 0; k < kBreakdownCount; ++k) m.breakdown_per_rank[k].push_back(all[kBreakdownCount * r + k]);
  }
  return m;
}

EvalResult Trainer::evaluate(int64_t num_samples) {
  if (!data_.has_eval()) {
    if (is_main()) log_info("no held-out evaluation for data.dataset=" + cfg_.data.dataset + " without data.eval_files");
    return {};
  }
  num_samples = data_.eval_size(num_samples);
  const int64_t chunk = cfg_.data.batch_size;
  if (parallel_->plain()) return evaluate_model(model(), data_, num_samples, chunk, cfg_.model.config);
  // Sharded: rank 0 evaluates a single-process copy of the full parameters.
  auto full = parallel_->full_parameters();
  EvalResult r;
  if (is_main()) {
    auto m = build_model(cfg_);
    torch::NoGradGuard no_grad;
    for (auto& kv : m->named_parameters()) kv.value().copy_(full.at(kv.key()));
    full.clear();
    r = evaluate_model(*m, data_, num_samples, chunk, cfg_.model.config);
  }
  parallel_->barrier();
  return r;
}

EvalResult Trainer::run() {
  const bool main = is_main();  // rank 0 alone reports and writes
  RunReport report(cfg_, main, step_);
  std::vector<std::string> lines = {"parallel: " + std::to_string(rt_.world) + " rank(s), " +
                                    describe(parallel_->layouts())};
  if (!parallel_->device().is_cpu()) {
    lines.push_back("device: " + parallel_->device().str() + " (model, activations and optimizer state; the samples " +
                    "are made on the CPU; peak memory figures count CPU tensors only)");
  }
  report.start(lines);
  Timer total;
  const int64_t start = step_;
  const auto& ck = cfg_.checkpoint;
  double data_wait = 0;
  int64_t skipped = 0;
  for (int64_t s = step_; s < cfg_.training.steps; ++s) {
    StepMetrics m;
    {
      StepProfiler profile(s + 1, rt_.rank);
      m = train_step();
    }
    data_wait += m.data_wait_s;
    skipped = m.skipped_samples;
    const bool last = step_ == cfg_.training.steps;
    if ((ck.every > 0 && step_ % ck.every == 0) || (last && ck.at_end)) save_checkpoint();
    const double eta =
        total.seconds() / static_cast<double>(s + 1 - start) * static_cast<double>(cfg_.training.steps - s - 1);
    report.step(m, eta);
  }
  const double train_s = total.seconds();
  if (data_.llava()) report.data_wait(data_wait, train_s, skipped);
  if (cfg_.output.hf_export || cfg_.output.peft_export) {
    auto full = parallel_->full_parameters();  // collective; complete on rank 0
    if (main && cfg_.output.peft_export) {
      const auto dir = cfg_.output.dir + "/peft";
      qwen::save_peft(dir, full, cfg_.lora.spec(), cfg_.model.config, cfg_.model.from);
      log_info("wrote the LoRA adapters as a PEFT directory: " + dir);
    }
    if (main && cfg_.output.hf_export) {
      const auto hf = cfg_.output.dir + "/hf";
      const auto merged = qwen::merge_lora(full, cfg_.lora.rank > 0 ? cfg_.lora.spec().scale() : 0.0);
      qwen::save_hf(hf, full, cfg_.model.config);
      log_info("wrote the trained model as a Hugging Face directory: " + hf +
               (merged > 0 ? " (" + std::to_string(merged) + " LoRA adapters merged into their weights)" : ""));
    }
    parallel_->barrier();
  }
  EvalResult ev;
  if (cfg_.data.eval_samples > 0) ev = evaluate(cfg_.data.eval_samples);
  const auto* shapes = data_.shapes();
  report.finish(ev, train_s, data_wait, skipped, shapes ? 1.0 / static_cast<double>(shapes->num_answers()) : 0.0,
                data_.llava() && !data_.llava_eval() ? "no data.eval_files" : "data.eval_samples=0");
  return ev;
}

}  // namespace dhp::train
