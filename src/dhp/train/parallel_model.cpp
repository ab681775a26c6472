#include "dhp/train/parallel_model.h"

#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>

#include "dhp/core/device_memory.h"
#include "dhp/core/error.h"
#include "dhp/core/log.h"
#include "dhp/core/memory.h"
#include "dhp/models/qwen2_5_vl/hf.h"
#include "dhp/models/qwen2_5_vl/parallelize.h"
#include "dhp/models/qwen2_5_vl/peft.h"
#include "dhp/parallel/redistribute.h"
#include "dhp/parallel/tensor_parallel.h"
#include "dhp/train/flops.h"
#include "dhp/train/transfers.h"

namespace dhp::train {

Placement place_rank(const std::string& d, const std::string& backend, int64_t world, int64_t local_rank,
                     int64_t count, bool nccl) {
  Placement p;
  if (d == "cpu") {
    DHP_CHECK(backend != "nccl", "parallel.backend=nccl with training.device=cpu: NCCL moves CUDA tensors; use ",
              "training.device=cuda, or parallel.backend=auto or gloo");
    return p;
  }
  DHP_CHECK(count > 0, "training.device=", d, " but no CUDA device is usable here (torch::cuda::device_count() = 0: ",
            "this libtorch is built without CUDA, or no GPU is visible); use training.device=cpu");
  DHP_CHECK(backend != "nccl" || nccl, "parallel.backend=nccl but this dhp was built against a libtorch without NCCL; ",
            "use parallel.backend=gloo, or rebuild against a CUDA libtorch (README, Building for GPUs)");
  p.backend = backend == "gloo" || !nccl ? dist::Backend::kGloo : dist::Backend::kNccl;
  const bool shared_ok = p.backend == dist::Backend::kGloo || world == 1;
  int64_t index = 0;
  if (d != "cuda") {
    index = std::stoll(d.substr(5));
    DHP_CHECK(shared_ok, "training.device=", d, " puts all ", world, " ranks on one GPU, which NCCL refuses; use ",
              "training.device=cuda (rank r on cuda:LOCAL_RANK) or parallel.backend=gloo");
  } else if (world > 1) {
    DHP_CHECK(shared_ok || local_rank < count, "training.device=cuda with NCCL: local rank ", local_rank,
              " needs cuda:", local_rank, " but this machine has ", count, " CUDA device(s); run at most ", count,
              " ranks per machine, or parallel.backend=gloo to share GPUs");
    index = local_rank % count;
  }
  DHP_CHECK(index < count, "training.device=", d, " but this machine has ", count, " CUDA device(s) (0..", count - 1, ")");
  p.device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
  return p;
}

Placement resolve_placement(const Config& cfg, const Runtime& rt) {
  const auto count = cfg.training.device == "cpu" ? 0 : static_cast<int64_t>(torch::cuda::device_count());
  return place_rank(cfg.training.device, cfg.parallel.backend, rt.world, rt.local_rank, count, dist::nccl_available());
}

torch::Device resolve_device(const Config& cfg, const Runtime& rt) { return resolve_placement(cfg, rt).device; }

optim::AdamWOptions optimizer_options(const Config& cfg) {
  const auto& t = cfg.training;
  optim::AdamWOptions o;
  o.beta1 = t.beta1;
  o.beta2 = t.beta2;
  o.eps = t.eps;
  o.weight_decay = t.weight_decay;
  const std::map<std::string, std::pair<double, double>> part = {{"vision", {t.lr_vision, t.weight_decay_vision}},
                                                                 {"merger", {t.lr_merger, t.weight_decay_merger}},
                                                                 {"text", {t.lr_text, t.weight_decay_text}}};
  bool any = false;
  for (const auto& [name, settings] : part) any = any || settings.first >= 0 || settings.second >= 0;
  if (!any) return o;  // every parameter on the defaults
  // Every part gets its group, the unset ones on the defaults: a part left out would fall
  // under a shorter prefix (the merger under the tower's).
  for (const auto& [name, prefix] : qwen::part_prefixes()) {
    const auto [lr, wd] = part.at(name);
    o.groups.push_back({prefix, lr < 0 ? 1.0 : lr / t.lr, wd});
  }
  return o;
}

parallel::CommOptions comm_options(const Config& cfg) {
  parallel::CommOptions o;
  o.overlap = cfg.parallel.overlap;
  o.bucket_bytes = std::max<int64_t>(1, static_cast<int64_t>(cfg.parallel.bucket_mb * (1 << 20)));
  o.buckets_in_flight = cfg.parallel.buckets_in_flight;
  return o;
}

nn::VarlenAttentionOptions attention_options(const Config& cfg) {
  nn::VarlenAttentionOptions o;
  o.block_size = cfg.training.attention_block;
  o.kernel = nn::parse_attention_kernel(cfg.training.attention, "training.attention");
  return o;
}

void load_peft_adapters(const Config& cfg, qwen::Qwen2_5_VLImpl& model) {
  const qwen::PeftAdapter a(cfg.lora.from);
  a.check_matches(cfg.lora.spec(), cfg.model.config);
  torch::NoGradGuard no_grad;
  for (auto& kv : model.named_parameters(true)) {
    if (!qwen::is_lora_parameter(kv.key())) continue;
    kv.value().copy_(a.read_box(kv.key(), std::vector<int64_t>(static_cast<size_t>(kv.value().dim()), 0),
                                kv.value().sizes().vec()));
  }
}

std::vector<bool> forward_only_encoders(const Config& cfg) { return {cfg.model.freezing.encoder_frozen()}; }

qwen::Qwen2_5_VL build_model(const Config& cfg, bool load_from) {
  qwen::Qwen2_5_VL m(cfg.model.config);
  qwen::init_parameters(*m, static_cast<uint64_t>(cfg.training.seed), cfg.model.config.initializer_range);
  if (load_from && !cfg.model.from.empty()) qwen::load_hf_weights(cfg.model.from, *m);
  qwen::apply_lora(*m, cfg.lora.spec(), static_cast<uint64_t>(cfg.training.seed));
  if (load_from && !cfg.lora.from.empty()) load_peft_adapters(cfg, *m);
  if (cfg.training.precision == "bf16") m->to(torch::kBFloat16);
  qwen::apply_freezing(*m, cfg.model.freezing, cfg.model.config);
  m->set_activation_checkpointing(cfg.training.activation_checkpointing);
  m->set_attention(attention_options(cfg));
  return m;
}

struct ParallelModel::Stage {
  dist::ModuleLayout layout;
  bool member = false;  // does this rank host the module?
  dist::ProcessGroups pg;
  dist::ModuleLayout::Coord coord;
  std::unique_ptr<parallel::ModuleTarget> target;
  std::unique_ptr<parallel::ModuleStrategy> strategy;  // null where the module does not run
};

// What the schedule's actions of one micro-batch hand each other on this rank, per encoder.
struct ParallelModel::Transfer {
  parallel::RedistributePlan plan;
  torch::Tensor encoder_out;   // (rows of this encoder replica, C), with its graph
  torch::Tensor decoder_in;    // (rows of this decoder replica, C), a leaf that collects the gradient
  torch::Tensor encoder_grad;  // (rows of this encoder replica, C)
};
struct ParallelModel::MicroBatchState {
  std::vector<parallel::ReplicaSamples> replicas;  // each module's assignment (assign())
  std::vector<Transfer> of;                        // one per encoder, in module order
};

ParallelModel::~ParallelModel() = default;

ParallelModel::Stage& ParallelModel::decoder() { return stages_.back(); }
int64_t ParallelModel::encoders() const { return static_cast<int64_t>(stages_.size()) - 1; }

void ParallelModel::release_parameters(const parallel::ModuleTarget& target) {
  torch::NoGradGuard no_grad;
  for (auto& kv : model_->named_parameters(true)) {
    if (target.owns(kv.key())) kv.value().set_data(torch::empty({0}, kv.value().options()));
  }
}

ParallelModel::ParallelModel(const Config& cfg, const Layouts& layouts, const Runtime& rt)
    : cfg_(cfg), layouts_(layouts), rt_(rt) {
  DHP_CHECK(rt_.world == 1 || rt_.store, "a job of ", rt_.world, " ranks needs a store");
  const Placement place = resolve_placement(cfg_, rt_);
  forward_only_ = forward_only_encoders(cfg_);
  device_ = place.device;
  use_device(device_);  // before any group or tensor: NCCL and cuBLAS take the current device
  const auto everyone = dist::iota_ranks(rt_.world);
  if (rt_.world > 1) job_ = dist::Group(*rt_.store, "job", everyone, rt_.rank, rt_.timeout);
  // Under NCCL the transfers get groups of their own, activations and gradients apart (a
  // group's messages run in order: train/transfers.h rule 1), made only where some rows cross
  // ranks. Gloo's sends do not wait for their receives: the job group will do.
  acts_ = grads_ = job_;
  bool crossing = false;
  for (size_t e = 0; e + 1 < layouts_.modules.size(); ++e)
    crossing = crossing || parallel::moves_between_ranks(layouts_.modules[e], layouts_.decoder());
  if (rt_.world > 1 && place.backend == dist::Backend::kNccl && crossing) {
    acts_ = dist::Group(*rt_.store, "transfers/activations", everyone, rt_.rank, rt_.timeout, place.backend, device_);
    grads_ = dist::Group(*rt_.store, "transfers/gradients", everyone, rt_.rank, rt_.timeout, place.backend, device_);
  }
  model_ = build_model(cfg_, /*load_from=*/false);  // model.from: each rank reads its slices below
  if (!device_.is_cpu()) model_->to(device_);       // before the optimizers take the parameters
  for (auto& kv : model_->named_parameters(true)) full_shapes_[kv.key()] = kv.value().sizes().vec();
  dtype_ = model_->parameters().front().scalar_type();
  auto targets = qwen::module_targets(*model_, attention_options(cfg_));
  TORCH_INTERNAL_ASSERT(targets.size() == layouts_.modules.size());
  for (size_t i = 0; i < targets.size(); ++i) {
    Stage s;
    s.layout = layouts_.modules[i];
    TORCH_INTERNAL_ASSERT(s.layout.name == targets[i]->name());
    s.member = s.layout.module_rank(rt_.rank) >= 0;
    // Collective over the job: every rank builds every module's groups, in module order.
    if (rt_.world > 1) {
      s.pg = dist::make_process_groups(*rt_.store, s.layout, rt_.rank, rt_.timeout, place.backend, device_,
                                       cfg_.parallel.overlap);
    }
    s.pg.member = s.member;
    if (s.member) s.coord = s.layout.coord(s.layout.module_rank(rt_.rank));
    s.target = std::move(targets[i]);
    stages_.push_back(std::move(s));
  }
  for (auto& s : stages_) {
    if (!s.member) release_parameters(*s.target);
  }
  for (auto& s : stages_) {
    if (!s.member) continue;
    s.strategy = parallel::make_strategy(s.layout, s.pg, comm_options(cfg_));
    s.strategy->apply(*s.target);
  }
  const auto o = optimizer_options(cfg_);
  for (auto& s : stages_) {
    if (s.strategy && rt_.optimizer) s.strategy->make_optimizer(o);
  }
  if (!cfg_.model.from.empty() || !cfg_.lora.from.empty()) load_weights();
}

void ParallelModel::load_weights() {
  // Parameters and masters (the moments stay zero); LoRA adapters come from the seed or lora.from.
  std::vector<CheckpointPiece> weights, adapters;
  for (auto& p : pieces(/*frozen_too=*/true)) {
    if (p.name.rfind("param/", 0) != 0 && p.name.rfind("master/", 0) != 0) continue;
    (qwen::is_lora_parameter(p.name) ? adapters : weights).push_back(std::move(p));
  }
  if (!cfg_.model.from.empty()) {
    const qwen::HfWeights w(cfg_.model.from);
    load_pieces(hf_source(w), weights);
    if (rt_.rank == 0) qwen::unused_hf_tensors(w, [&](const std::string& n) { return full_shapes_.count(n) > 0; });
  }
  if (!cfg_.lora.from.empty()) {
    const qwen::PeftAdapter a(cfg_.lora.from);
    a.check_matches(cfg_.lora.spec(), cfg_.model.config);
    load_pieces(peft_source(a), adapters);
  }
}

parallel::HeldElements ParallelModel::held(const std::string& name) const {
  for (const auto& s : stages_) {
    if (s.layout.name == name) return s.strategy ? s.strategy->held() : parallel::HeldElements{};
  }
  DHP_FAIL("no module named '", name, "'");
}

parallel::ReductionCounts ParallelModel::reduction_counts() const {
  parallel::ReductionCounts sum;
  for (const auto& s : stages_) {
    if (!s.strategy) continue;
    const auto c = s.strategy->reduction_counts();
    sum.buckets += c.buckets;
    sum.early += c.early;
    sum.prefetched += c.prefetched;
  }
  return sum;
}

std::vector<Action> ParallelModel::schedule(int64_t micro_batches) const {
  return make_schedule(layouts_.modules, rt_.rank, micro_batches, cfg_.parallel.pipeline, forward_only_);
}

std::vector<parallel::ReplicaSamples> ParallelModel::assign(const std::vector<data::Sample>& mb) const {
  const auto n = static_cast<int64_t>(mb.size());
  const auto& mods = layouts_.modules;
  std::vector<parallel::ReplicaSamples> out(mods.size());
  if (cfg_.parallel.balance == "contiguous") {
    for (size_t m = 0; m < mods.size(); ++m) out[m] = parallel::contiguous_replicas(n, mods[m].dp);
    return out;
  }
  // Training FLOPs of each sample per module: 3x forward, a forward-only encoder 1x.
  const auto& mc = cfg_.model.config;
  const size_t dec = mods.size() - 1;
  std::vector<std::vector<double>> cost(mods.size(), std::vector<double>(mb.size(), 0.0));
  std::vector<std::vector<bool>> has_input(dec);
  for (size_t i = 0; i < mb.size(); ++i) cost[dec][i] = 3 * text_sample_flops(mc, mb[i]);
  std::vector<bool> aligned(dec), first(mb.size(), false);
  for (size_t e = 0; e < dec; ++e) {
    aligned[e] = !parallel::moves_between_ranks(mods[e], mods[dec]);
    has_input[e].resize(mb.size());
    for (size_t i = 0; i < mb.size(); ++i) {
      cost[e][i] = (forward_only_.at(e) ? 1 : 3) * vision_sample_flops(mc, mb[i]);
      has_input[e][i] = qwen::encoder_rows(mc, static_cast<int64_t>(e), mb[i].ids) > 0;
      // An encoder on the decoder's ranks and replicas shares its assignment (no rows move).
      if (aligned[e]) {
        cost[dec][i] += cost[e][i];
        first[i] = first[i] || has_input[e][i];
      }
    }
  }
  out[dec] = parallel::balanced_replicas(cost[dec], mods[dec].dp, first);
  for (size_t e = 0; e < dec; ++e) {
    out[e] = aligned[e] ? out[dec] : parallel::balanced_replicas(cost[e], mods[e].dp, has_input[e]);
  }
  return out;
}

std::vector<bool> ParallelModel::encodes(const std::vector<data::Sample>& mb) const {
  std::vector<bool> out(mb.size(), false);
  const auto a = assign(mb);
  for (int64_t e = 0; e < encoders(); ++e) {
    const auto& s = stages_[static_cast<size_t>(e)];
    if (!s.member) continue;
    for (auto i : a[static_cast<size_t>(e)][static_cast<size_t>(s.coord.dp)]) out[static_cast<size_t>(i)] = true;
  }
  return out;
}

namespace {

std::vector<data::Sample> samples_of(const std::vector<data::Sample>& mb, const std::vector<int64_t>& which) {
  std::vector<data::Sample> out;
  out.reserve(which.size());
  for (auto i : which) out.push_back(mb[static_cast<size_t>(i)]);
  return out;
}

}  // namespace

ParallelModel::StepResult ParallelModel::forward_backward(std::vector<std::vector<data::Sample>> micro,
                                                          double global_targets) {
  std::vector<MicroBatchState> state(micro.size());
  for (size_t i = 0; i < micro.size(); ++i) {
    state[i].replicas = assign(micro[i]);
    const auto& dec = state[i].replicas.back();
    for (int64_t e = 0; e < encoders(); ++e) {
      std::vector<int64_t> rows;
      for (const auto& s : micro[i]) rows.push_back(qwen::encoder_rows(cfg_.model.config, e, s.ids));
      state[i].of.push_back({parallel::plan_redistribute(layouts_.modules[static_cast<size_t>(e)],
                                                         state[i].replicas[static_cast<size_t>(e)], layouts_.decoder(),
                                                         dec, rows)});
    }
  }
  StepResult result;
  torch::Tensor loss_sum;  // on the device, read once at the end of the step
  const auto actions = schedule(static_cast<int64_t>(micro.size()));
  // Each module's last backward on this rank: its gradient reductions may start during it.
  std::vector<size_t> last_backward(stages_.size(), actions.size());
  for (size_t i = 0; i < actions.size(); ++i) {
    if (actions[i].op == Op::kDecode) last_backward.back() = i;
    if (actions[i].op == Op::kEncodeBackward) last_backward[static_cast<size_t>(actions[i].module)] = i;
  }
  for (size_t i = 0; i < actions.size(); ++i) {
    for (size_t m = 0; m < stages_.size(); ++m)
      if (last_backward[m] == i && stages_[m].strategy) stages_[m].strategy->arm_reduction();
    run_action(actions[i], micro, global_targets, state, result, loss_sum);
  }
  const auto t0 = std::chrono::steady_clock::now();
  acts_.wait_sends();
  grads_.wait_sends();
  result.wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (loss_sum.defined()) result.loss_sum = loss_sum.item<double>();
  return result;
}

torch::Tensor ParallelModel::encode_chunk(int64_t encoder, std::vector<data::Sample>& mb, const MicroBatchState& st,
                                          int64_t micro_batch) {
  const auto& es = stages_[static_cast<size_t>(encoder)];
  const auto& replicas = st.replicas[static_cast<size_t>(encoder)];
  const auto& mine = replicas[static_cast<size_t>(es.coord.dp)];
  // Encoder replicas that share collectives across replicas (ZeRO-3 gathers) must all run.
  const auto& mc = cfg_.model.config;
  if (es.strategy->replicas_run_together()) {
    for (size_t v = 0; v < replicas.size(); ++v) {
      bool any = false;
      for (auto i : replicas[v]) any = any || qwen::encoder_rows(mc, encoder, mb[static_cast<size_t>(i)].ids) > 0;
      DHP_CHECK(any, es.layout.name, " ", dist::strategy_name(es.layout.strategy), ": replica ", v,
                " has no input for the module among its ", replicas[v].size(), " of the ", mb.size(),
                " samples of micro-batch ", micro_batch, "; every replica needs one (more samples with images per ",
                "micro-batch, or fewer replicas)");
    }
  }
  auto batch = qwen::to_device(data::collate(samples_of(mb, mine), mc), device_);
  // Packed now: the samples' own copies of the pixels are no longer needed.
  for (auto i : mine) mb[static_cast<size_t>(i)].pixel_values = torch::Tensor();
  auto out = encode(encoder, batch);
  batch = qwen::Batch();
  return out;
}

torch::Tensor ParallelModel::encode(int64_t encoder, const qwen::Batch& batch) {
  // A frozen encoder keeps no activations for a backward that never comes.
  std::optional<torch::NoGradGuard> no_grad;
  if (forward_only_.at(static_cast<size_t>(encoder))) no_grad.emplace();
  auto out = qwen::encode(*model_, encoder, batch);
  if (out.defined()) return out;
  return torch::zeros({0, cfg_.model.config.text.hidden_size}, torch::TensorOptions().dtype(dtype_).device(device_));
}

torch::Tensor ParallelModel::transfer(const Action& a, const parallel::RedistributePlan& plan,
                                      const torch::Tensor& local) {
  const auto& pieces = a.op == Op::kSendActivations || a.op == Op::kRecvActivations ? plan.forward : plan.backward;
  const int64_t tag = transfer_tag(a, encoders());
  const bool send = posts_sends(a, plan, rt_.rank);
  if (a.op == Op::kSendActivations || a.op == Op::kSendGrads) {
    if (send) parallel::send_pieces(pieces, local, channel(a), rt_.rank, tag);
    return torch::Tensor();
  }
  const auto& rows = a.op == Op::kRecvActivations ? plan.decoder_rows : plan.encoder_rows;
  const auto options = torch::TensorOptions().dtype(dtype_).device(device_);
  return parallel::exchange_pieces(pieces, send, local, rows.at(rt_.rank), cfg_.model.config.text.hidden_size,
                                   options, channel(a), rt_.rank, tag);
}

void ParallelModel::run_action(const Action& a, std::vector<std::vector<data::Sample>>& micro,
                               double global_targets, std::vector<MicroBatchState>& state, StepResult& result,
                               torch::Tensor& loss_sum) {
  auto& mb = micro[static_cast<size_t>(a.micro_batch)];
  auto& st = state[static_cast<size_t>(a.micro_batch)];
  const auto t0 = std::chrono::steady_clock::now();
  auto waited = [&] { result.wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  auto& tr = st.of[static_cast<size_t>(a.op == Op::kDecode ? 0 : a.module)];
  switch (a.op) {
    case Op::kEncode:
      tr.encoder_out = encode_chunk(a.module, mb, st, a.micro_batch);
      break;
    case Op::kSendActivations:
      transfer(a, tr.plan, tr.encoder_out);
      break;
    case Op::kRecvActivations:
      // A leaf collecting the rows' gradient, unless the encoder takes none.
      tr.decoder_in = transfer(a, tr.plan, tr.encoder_out).detach().requires_grad_(!forward_only_.at(a.module));
      waited();
      break;
    case Op::kDecode: {
      auto l = decode_chunk(mb, st, global_targets);
      if (l.defined()) loss_sum = loss_sum.defined() ? loss_sum + l : l;
      break;
    }
    case Op::kSendGrads: {
      auto g = tr.decoder_in.grad();
      if (!g.defined()) g = torch::zeros_like(tr.decoder_in);
      tr.decoder_in = g;  // the activations are no longer needed; keep what is sent
      transfer(a, tr.plan, g);
      break;
    }
    case Op::kRecvGrads:
      tr.encoder_grad = transfer(a, tr.plan, tr.decoder_in);
      waited();
      break;
    case Op::kEncodeBackward:
      if (tr.encoder_out.requires_grad() && tr.encoder_out.size(0) > 0) tr.encoder_out.backward(tr.encoder_grad);
      tr.encoder_out = torch::Tensor();
      tr.encoder_grad = torch::Tensor();
      break;
  }
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (a.op == Op::kEncode || a.op == Op::kEncodeBackward) result.vision_s += dt;
  if (a.op == Op::kDecode) result.text_s += dt;
  memory_mark(action_name(a, layouts_.modules).c_str());
}

const dist::Group& ParallelModel::channel(const Action& a) const {
  const bool activations = a.op == Op::kSendActivations || a.op == Op::kRecvActivations;
  return activations ? acts_ : grads_;
}

torch::Tensor ParallelModel::decode_chunk(std::vector<data::Sample>& mb, MicroBatchState& st, double global_targets) {
  const auto& ds = decoder();
  std::vector<torch::Tensor> rows;
  for (const auto& tr : st.of) rows.push_back(tr.decoder_in);
  const auto& mine = st.replicas.back()[static_cast<size_t>(ds.coord.dp)];
  const auto batch = qwen::to_device(data::collate(samples_of(mb, mine), cfg_.model.config), device_);
  auto out = qwen::decode(*model_, batch, rows);
  (out.loss_sum / global_targets).backward();
  return ds.coord.tp == 0 ? out.loss_sum.detach().to(torch::kFloat64) : torch::Tensor();
}

void ParallelModel::zero_grad() {
  for (auto& s : stages_)
    if (s.strategy) s.strategy->zero_grad();
}

double ParallelModel::finish_step(double lr, double max_norm) {
  torch::NoGradGuard no_grad;
  // Summed on the device and read once (one host sync for the step's norm).
  auto sq = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat64).device(device_));
  for (auto& s : stages_)
    if (s.strategy) sq += s.strategy->reduce_gradients().to(device_);
  const double norm = std::sqrt(sum_over_job(sq.item<double>()));
  // The same on every rank (summed over the job): all stop together, before any update, so
  // the parameters and the last checkpoint stay as they were.
  if (!std::isfinite(norm)) {
    throw NonFiniteGradient(detail::str_cat("the gradient norm is ", std::isnan(norm) ? "NaN" : "infinite", ": a gradient is not finite; no parameter ",
                                            "was updated (the last checkpoint holds the state before it)"));
  }
  if (max_norm > 0 && norm > max_norm) {
    const double scale = max_norm / (norm + 1e-6);
    for (auto& s : stages_)
      if (s.strategy) s.strategy->scale_gradients(scale);
  }
  for (auto& s : stages_) {
    if (!s.strategy) continue;
    s.strategy->step(lr);
    memory_mark("optimizer step");
  }
  return norm;
}

torch::Tensor ParallelModel::forward_logits(const qwen::Batch& host_batch) {
  torch::NoGradGuard no_grad;
  const nn::EvalScope eval_mode(*model_);  // no dropout
  DHP_CHECK(layouts_.max_dp() == 1, "a forward of one sample runs each module as one ",
            "replica, but the layout (", describe(layouts_), ") has data-parallel replicas; set parallel.vision.dp=1 ",
            "and parallel.text.dp=1 (the strategy's own degree takes the ranks)");
  const auto& mc = cfg_.model.config;
  const auto b = qwen::to_device(host_batch, device_);
  const auto& text = decoder();
  const auto ids_tensor = host_batch.input_ids.cpu().contiguous();
  const std::vector<int64_t> ids(ids_tensor.data_ptr<int64_t>(), ids_tensor.data_ptr<int64_t>() + ids_tensor.numel());
  // The step's transfer actions for micro-batch 0, posted by the same rules (train/transfers.h).
  std::vector<torch::Tensor> in(static_cast<size_t>(encoders()));
  for (int64_t e = 0; e < encoders(); ++e) {
    const auto& es = stages_[static_cast<size_t>(e)];
    const auto plan = parallel::plan_redistribute(es.layout, text.layout, {qwen::encoder_rows(mc, e, ids)});
    const auto out = es.member ? encode(e, b) : torch::Tensor();
    if (es.member) transfer({Op::kSendActivations, 0, e}, plan, out);
    if (text.member) in[static_cast<size_t>(e)] = transfer({Op::kRecvActivations, 0, e}, plan, out);
  }
  torch::Tensor logits;
  if (text.member) {
    auto h = qwen::decode_hidden(*model_, b, in).first;
    auto head = [this](const torch::Tensor& x) {
      return torch::matmul(x, model_->lm_head_weight().t()).to(torch::kFloat32);
    };
    logits = text.strategy->run_unit(model_->lm_head ? "lm_head" : "model.embed_tokens", head, h);
    logits = parallel::unshard(logits.contiguous(), parallel::TpShard{1, 1}, text.pg.tp);  // vocabulary shards
  }
  // Rank 0 gets them from the text module's first rank when it is not a text rank.
  const int64_t owner = text.layout.ranks.front();
  if (!text.member && rt_.rank == 0) {
    logits = torch::empty({b.input_ids.size(0), mc.text.vocab_size}, torch::kFloat32);
    job_.recv(logits, owner, /*tag=*/1);
  } else if (rt_.rank == owner && text.layout.module_rank(0) < 0) {
    job_.send(logits.cpu(), 0, /*tag=*/1);  // the job group is the host's (Gloo, CPU tensors)
  }
  job_.wait_sends();
  acts_.wait_sends();
  return rt_.rank == 0 ? logits.unsqueeze(0).cpu() : torch::Tensor();
}

void ParallelModel::gather_full(Stage& s, std::map<std::string, torch::Tensor>& out) {
  std::map<std::string, torch::Tensor> full;
  if (s.member) full = s.strategy->full_parameters();
  // Rank 0 gets a module it does not host from the module's first rank, in one message.
  const int64_t owner = s.layout.ranks.front();
  if (!s.member && rt_.rank == 0) {
    int64_t numel = 0;
    for (const auto& [name, shape] : full_shapes_)
      if (s.target->owns(name)) numel += c10::multiply_integers(shape);
    auto flat = torch::empty({numel}, torch::TensorOptions().dtype(dtype_));
    job_.recv(flat, owner, /*tag=*/1 << 20);
    int64_t at = 0;
    for (const auto& [name, shape] : full_shapes_) {
      if (!s.target->owns(name)) continue;
      auto t = flat.narrow(0, at, c10::multiply_integers(shape)).view(shape).clone();
      at += t.numel();
      full[name] = t;
    }
  } else if (rt_.rank == owner && s.layout.module_rank(0) < 0) {
    std::vector<torch::Tensor> parts;
    for (const auto& [name, t] : full) parts.push_back(t.reshape({-1}));  // map order = name order
    job_.send(torch::cat(parts).to(dtype_).cpu(), 0, /*tag=*/1 << 20);
  }
  for (auto& [k, v] : full) out[k] = v.cpu();  // the tensor itself when it is there
}

std::map<std::string, torch::Tensor> ParallelModel::full_parameters() {
  torch::NoGradGuard no_grad;
  std::map<std::string, torch::Tensor> out;
  for (auto& s : stages_) gather_full(s, out);
  job_.wait_sends();
  return out;
}

double ParallelModel::sum_over_job(double x) const {
  if (rt_.world == 1) return x;
  auto t = torch::tensor({x}, torch::kFloat64);
  job_.all_reduce_sum_(t);
  return t.item<double>();
}

double ParallelModel::max_over_job(double x) const {
  if (rt_.world == 1) return x;
  auto t = torch::tensor({x}, torch::kFloat64);
  job_.all_reduce_max_(t);
  return t.item<double>();
}

std::vector<double> ParallelModel::gather_over_job(const std::vector<double>& x) const {
  auto t = torch::tensor(x, torch::kFloat64);
  auto all = job_.all_gather(t, 0).contiguous();
  return std::vector<double>(all.data_ptr<double>(), all.data_ptr<double>() + all.numel());
}

void ParallelModel::barrier() const { job_.barrier(); }

std::vector<std::string> ParallelModel::all_gather_strings(const std::string& s) const {
  if (rt_.world == 1) return {s};
  // Bytes padded to whole int64 words (the collectives take int64).
  const int64_t n = static_cast<int64_t>(s.size());
  auto len = torch::tensor({n}, torch::kInt64);
  len = job_.all_gather(len, 0);
  const int64_t most = len.max().item<int64_t>();
  const int64_t words = (most + 7) / 8;
  auto buf = torch::zeros({std::max<int64_t>(1, words)}, torch::kInt64);
  std::memcpy(buf.data_ptr(), s.data(), s.size());
  auto all = job_.all_gather(buf, 0).contiguous();
  std::vector<std::string> out;
  const auto* bytes = static_cast<const char*>(all.data_ptr());
  for (int64_t r = 0; r < rt_.world; ++r) {
    out.emplace_back(bytes + r * buf.numel() * 8, static_cast<size_t>(len[r].item<int64_t>()));
  }
  return out;
}

std::vector<CheckpointPiece> ParallelModel::pieces(bool frozen_too) {
  std::vector<CheckpointPiece> out;
  for (auto& s : stages_) {
    if (!s.strategy) continue;
    for (auto& p : s.strategy->checkpoint_pieces(full_shapes_))
      if (frozen_too || !p.frozen) out.push_back(std::move(p));
  }
  return out;
}

std::vector<CheckpointPiece> ParallelModel::checkpoint_pieces() { return pieces(/*frozen_too=*/false); }

void ParallelModel::set_optimizer_steps(int64_t n) {
  if (!rt_.optimizer) return;
  for (auto& s : stages_)
    if (s.strategy) s.strategy->set_step_count(n);
}

bool ParallelModel::plain() const {
  if (rt_.world > 1) return false;
  for (const auto& s : stages_)
    if (s.strategy && !s.strategy->whole_parameters()) return false;
  return true;
}

}  // namespace dhp::train
