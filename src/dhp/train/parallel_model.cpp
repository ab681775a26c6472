#include "dhp/train/parallel_model.h"

#include <torch/cuda.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstring>

#include "dhp/core/error.h"
#include "dhp/core/log.h"
#include "dhp/core/memory.h"
#include "dhp/models/qwen2_5_vl/hf.h"
#include "dhp/models/qwen2_5_vl/parallelize.h"
#include "dhp/parallel/redistribute.h"
#include "dhp/parallel/tensor_parallel.h"

namespace dhp::train {
namespace {

int64_t image_rows(const data::Sample& s, int64_t image_token_id) {
  int64_t n = 0;
  for (auto id : s.ids) n += id == image_token_id;
  return n;
}

}  // namespace

torch::Device resolve_device(const Config& cfg, const Runtime& rt) {
  const std::string& d = cfg.training.device;
  if (d == "cpu") return torch::Device(torch::kCPU);
  DHP_CHECK(rt.world == 1, "training.device=", d, " in a job of ", rt.world, " ranks: dhp's process groups run on ",
            "Gloo, which takes CPU tensors, so CUDA training runs as one process; use --nproc 1 or training.device=cpu");
  const int64_t count = static_cast<int64_t>(torch::cuda::device_count());
  DHP_CHECK(count > 0, "training.device=", d, " but no CUDA device is usable here (torch::cuda::device_count() = 0: ",
            "this libtorch is built without CUDA, or no GPU is visible); use training.device=cpu");
  const int64_t index = d == "cuda" ? 0 : std::stoll(d.substr(5));
  DHP_CHECK(index < count, "training.device=", d, " but this machine has ", count, " CUDA device(s) (0..", count - 1, ")");
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
}

qwen::Qwen2_5_VL build_model(const Config& cfg, bool load_from) {
  qwen::Qwen2_5_VL m(cfg.model.config);
  qwen::init_parameters(*m, static_cast<uint64_t>(cfg.training.seed), cfg.model.config.initializer_range);
  if (load_from && !cfg.model.from.empty()) qwen::load_hf_weights(cfg.model.from, *m);
  if (cfg.training.precision == "bf16") m->to(torch::kBFloat16);
  m->set_activation_checkpointing(cfg.training.activation_checkpointing);
  m->set_attention_block(cfg.training.attention_block);
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

// What the schedule's actions of one micro-batch hand each other on this rank.
struct ParallelModel::MicroBatchState {
  parallel::RedistributePlan plan;
  torch::Tensor vision_out;  // (rows of this vision replica, C), with its graph
  torch::Tensor text_in;     // (rows of this text replica, C), a leaf that collects the gradient
  torch::Tensor vision_grad; // (rows of this vision replica, C)
};

ParallelModel::~ParallelModel() = default;

ParallelModel::Stage& ParallelModel::encoder() { return stages_.front(); }
ParallelModel::Stage& ParallelModel::decoder() { return stages_.back(); }
const ParallelModel::Stage& ParallelModel::encoder() const { return stages_.front(); }
const ParallelModel::Stage& ParallelModel::decoder() const { return stages_.back(); }

void ParallelModel::release_parameters(const parallel::ModuleTarget& target) {
  torch::NoGradGuard no_grad;
  for (auto& kv : model_->named_parameters(true)) {
    if (target.owns(kv.key())) kv.value().set_data(torch::empty({0}, kv.value().options()));
  }
}

ParallelModel::ParallelModel(const Config& cfg, const Layouts& layouts, const Runtime& rt)
    : cfg_(cfg), layouts_(layouts), rt_(rt) {
  DHP_CHECK(rt_.world == 1 || rt_.store, "a job of ", rt_.world, " ranks needs a store");
  if (rt_.world > 1) job_ = dist::Group(*rt_.store, "job", dist::iota_ranks(rt_.world), rt_.rank, rt_.timeout);
  device_ = resolve_device(cfg_, rt_);
  model_ = build_model(cfg_, /*load_from=*/false);  // model.from: each rank reads its slices below
  if (!device_.is_cpu()) model_->to(device_);       // before the optimizers take the parameters
  for (auto& kv : model_->named_parameters(true)) full_shapes_[kv.key()] = kv.value().sizes().vec();
  dtype_ = model_->parameters().front().scalar_type();
  auto targets = qwen::module_targets(*model_, cfg_.training.attention_block);
  TORCH_INTERNAL_ASSERT(targets.size() == layouts_.modules.size());
  for (size_t i = 0; i < targets.size(); ++i) {
    Stage s;
    s.layout = layouts_.modules[i];
    TORCH_INTERNAL_ASSERT(s.layout.name == targets[i]->name());
    s.member = s.layout.module_rank(rt_.rank) >= 0;
    // Collective over the job: every rank builds every module's groups, in module order.
    if (rt_.world > 1) s.pg = dist::make_process_groups(*rt_.store, s.layout, rt_.rank, rt_.timeout);
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
    s.strategy = parallel::make_strategy(s.layout, s.pg);
    s.strategy->apply(*s.target);
  }
  optim::AdamWOptions o;
  o.beta1 = cfg_.training.beta1;
  o.beta2 = cfg_.training.beta2;
  o.eps = cfg_.training.eps;
  o.weight_decay = cfg_.training.weight_decay;
  for (auto& s : stages_) {
    if (s.strategy && rt_.optimizer) s.strategy->make_optimizer(o);
  }
  if (!cfg_.model.from.empty()) load_from(cfg_.model.from);
}

void ParallelModel::load_from(const std::string& dir) {
  qwen::HfWeights w(dir);
  std::vector<CheckpointPiece> weights;  // parameters and masters: the moments stay zero
  for (auto& p : checkpoint_pieces()) {
    if (p.name.rfind("param/", 0) == 0 || p.name.rfind("master/", 0) == 0) weights.push_back(std::move(p));
  }
  load_pieces(hf_source(w), weights);
  if (rt_.rank == 0) qwen::unused_hf_tensors(w, [&](const std::string& n) { return full_shapes_.count(n) > 0; });
}

parallel::HeldElements ParallelModel::held(const std::string& name) const {
  for (const auto& s : stages_) {
    if (s.layout.name == name) return s.strategy ? s.strategy->held() : parallel::HeldElements{};
  }
  DHP_FAIL("no module named '", name, "'");
}

std::vector<Action> ParallelModel::schedule(int64_t micro_batches) const {
  return make_schedule(layouts_.encoder(), layouts_.decoder(), rt_.rank, micro_batches, cfg_.parallel.pipeline);
}

bool ParallelModel::encodes(int64_t i, int64_t n) const {
  const auto& v = encoder();
  if (!v.member) return false;
  const auto c = parallel::replica_chunk(n, v.layout.dp, v.coord.dp);
  return i >= c.first && i < c.second;
}

ParallelModel::StepResult ParallelModel::forward_backward(std::vector<std::vector<data::Sample>> micro,
                                                          double global_targets) {
  const int64_t img = cfg_.model.config.image_token_id;
  std::vector<MicroBatchState> state(micro.size());
  for (size_t i = 0; i < micro.size(); ++i) {
    std::vector<int64_t> rows;
    for (const auto& s : micro[i]) rows.push_back(image_rows(s, img));
    state[i].plan = parallel::plan_redistribute(layouts_.encoder(), layouts_.decoder(), rows);
  }
  StepResult result;
  for (const auto& a : schedule(static_cast<int64_t>(micro.size()))) {
    run_action(a, micro, global_targets, state, result);
  }
  const auto t0 = std::chrono::steady_clock::now();
  job_.wait_sends();
  result.wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

torch::Tensor ParallelModel::encode_vision_chunk(std::vector<data::Sample>& mb, int64_t micro_batch) {
  const int64_t n = static_cast<int64_t>(mb.size());
  const auto& vs = encoder();
  const auto vc = parallel::replica_chunk(n, vs.layout.dp, vs.coord.dp);
  // Vision replicas that share collectives across replicas (ZeRO-3 gathers) must all run.
  if (vs.strategy->replicas_run_together()) {
    for (int64_t v = 0; v < vs.layout.dp; ++v) {
      const auto c = parallel::replica_chunk(n, vs.layout.dp, v);
      bool any = false;
      for (int64_t i = c.first; i < c.second; ++i) any = any || !mb[i].grids.empty();
      DHP_CHECK(any, "vision ", dist::strategy_name(vs.layout.strategy), ": replica ", v, " has no image in its samples ", c.first, "..", c.second - 1,
                " of micro-batch ", micro_batch, "; every replica needs one");
    }
  }
  const auto& mc = cfg_.model.config;
  auto batch = qwen::to_device(
      data::collate(std::vector<data::Sample>(mb.begin() + vc.first, mb.begin() + vc.second), mc), device_);
  // Packed now: the samples' own copies of the pixels are no longer needed.
  for (int64_t i = vc.first; i < vc.second; ++i) mb[static_cast<size_t>(i)].pixel_values = torch::Tensor();
  auto out = model_->encode_images(batch);
  batch = qwen::Batch();
  if (!out.defined()) {
    out = torch::zeros({0, mc.text.hidden_size}, torch::TensorOptions().dtype(dtype_).device(device_));
  }
  return out;
}

void ParallelModel::run_action(const Action& a, std::vector<std::vector<data::Sample>>& micro,
                               double global_targets, std::vector<MicroBatchState>& state, StepResult& result) {
  auto& mb = micro[static_cast<size_t>(a.micro_batch)];
  auto& st = state[static_cast<size_t>(a.micro_batch)];
  const auto& mc = cfg_.model.config;
  const int64_t n = static_cast<int64_t>(mb.size());
  const int64_t hidden = mc.text.hidden_size;
  const int64_t fwd_tag = 2 * a.micro_batch, bwd_tag = 2 * a.micro_batch + 1;
  auto slice = [&](std::pair<int64_t, int64_t> c) {
    return std::vector<data::Sample>(mb.begin() + c.first, mb.begin() + c.second);
  };
  auto options = torch::TensorOptions().dtype(dtype_).device(device_);
  const auto t0 = std::chrono::steady_clock::now();
  switch (a.op) {
    case Op::kVisionForward:
      st.vision_out = encode_vision_chunk(mb, a.micro_batch);
      break;
    case Op::kSendActivations:
      parallel::send_pieces(st.plan.forward, st.vision_out, job_, rt_.rank, fwd_tag);
      break;
    case Op::kRecvActivations: {
      const int64_t rows = st.plan.text_rows.at(rt_.rank);
      auto in = parallel::recv_pieces(st.plan.forward, st.vision_out, rows, hidden, options, job_, rt_.rank, fwd_tag);
      st.text_in = in.detach().requires_grad_(true);
      result.wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      break;
    }
    case Op::kTextForwardBackward: {
      const auto& ts = decoder();
      const auto tc = parallel::replica_chunk(n, ts.layout.dp, ts.coord.dp);
      auto out = model_->forward(qwen::to_device(data::collate(slice(tc), mc), device_), st.text_in);
      (out.loss_sum / global_targets).backward();
      if (ts.coord.tp == 0) result.loss_sum += out.loss_sum.item<double>();
      break;
    }
    case Op::kSendGrads: {
      auto g = st.text_in.grad();
      if (!g.defined()) g = torch::zeros_like(st.text_in);
      st.text_in = g;  // the activations are no longer needed; keep what is sent
      parallel::send_pieces(st.plan.backward, g, job_, rt_.rank, bwd_tag);
      break;
    }
    case Op::kRecvGrads: {
      const int64_t rows = st.plan.vision_rows.at(rt_.rank);
      st.vision_grad = parallel::recv_pieces(st.plan.backward, st.text_in, rows, hidden, options, job_, rt_.rank,
                                             bwd_tag);
      result.wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      break;
    }
    case Op::kVisionBackward:
      if (st.vision_out.requires_grad() && st.vision_out.size(0) > 0) st.vision_out.backward(st.vision_grad);
      st.vision_out = torch::Tensor();
      st.vision_grad = torch::Tensor();
      break;
  }
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (a.op == Op::kVisionForward || a.op == Op::kVisionBackward) result.vision_s += dt;
  if (a.op == Op::kTextForwardBackward) result.text_s += dt;
  memory_mark(to_string({a}).c_str());
}

void ParallelModel::zero_grad() {
  for (auto& s : stages_)
    if (s.strategy) s.strategy->zero_grad();
}

double ParallelModel::finish_step(double lr, double max_norm) {
  torch::NoGradGuard no_grad;
  double sq = 0;
  for (auto& s : stages_)
    if (s.strategy) sq += s.strategy->reduce_gradients();
  const double norm = std::sqrt(sum_over_job(sq));
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
  DHP_CHECK(layouts_.max_dp() == 1, "a forward of one sample runs each module as one ",
            "replica, but the layout (", describe(layouts_), ") has data-parallel replicas; set parallel.vision.dp=1 ",
            "and parallel.text.dp=1 (the strategy's own degree takes the ranks)");
  const auto& mc = cfg_.model.config;
  const int64_t hidden = mc.text.hidden_size;
  const auto options = torch::TensorOptions().dtype(dtype_).device(device_);
  const auto b = qwen::to_device(host_batch, device_);
  const int64_t rows = b.input_ids.eq(mc.image_token_id).sum().item<int64_t>();
  const auto plan = parallel::plan_redistribute(layouts_.encoder(), layouts_.decoder(), {rows});
  const auto& text = decoder();
  torch::Tensor vis;
  if (encoder().member) {
    vis = model_->encode_images(b);
    if (!vis.defined()) vis = torch::zeros({0, hidden}, options);
    parallel::send_pieces(plan.forward, vis, job_, rt_.rank, /*tag=*/0);
  }
  torch::Tensor logits;
  if (text.member) {
    auto in = parallel::recv_pieces(plan.forward, vis, plan.text_rows.at(rt_.rank), hidden, options, job_, rt_.rank, 0);
    auto h = model_->hidden_at_targets(b, in).first;
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
    job_.send(logits, 0, /*tag=*/1);
  }
  job_.wait_sends();
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
    job_.send(torch::cat(parts).to(dtype_), 0, /*tag=*/1 << 20);
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

std::vector<CheckpointPiece> ParallelModel::checkpoint_pieces() {
  std::vector<CheckpointPiece> out;
  for (auto& s : stages_) {
    if (!s.strategy) continue;
    auto pieces = s.strategy->checkpoint_pieces(full_shapes_);
    std::move(pieces.begin(), pieces.end(), std::back_inserter(out));
  }
  return out;
}

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
