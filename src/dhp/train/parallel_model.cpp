#include "dhp/train/parallel_model.h"

#include "dhp/train/auto_plan.h"

#include <torch/cuda.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstring>

#include "dhp/core/error.h"
#include "dhp/core/log.h"
#include "dhp/core/memory.h"
#include "dhp/models/qwen2_5_vl/hf.h"
#include "dhp/parallel/data_parallel.h"
#include "dhp/parallel/mappings.h"
#include "dhp/parallel/parallelize.h"
#include "dhp/parallel/redistribute.h"
#include "dhp/parallel/tensor_parallel.h"
#include "dhp/parallel/vision_sp.h"
#include "dhp/parallel/zero.h"
#include "dhp/parallel/zero3.h"

namespace dhp::train {
namespace {

void set_attention_block(qwen::Qwen2_5_VLImpl& m, int64_t block) {
  for (auto& b : *m.visual->blocks) b->as<qwen::VisionBlockImpl>()->attn->core = qwen::local_attention_core(block);
  for (auto& l : *m.model->layers) l->as<qwen::DecoderLayerImpl>()->self_attn->core = qwen::local_attention_core(block);
}

bool is_vision(const std::string& name) { return name.rfind("visual.", 0) == 0; }

// Fills the ranks, strategy and degrees of one module from the named combination and
// overrides.
dist::ModuleLayout resolve_module(const ModuleParallelOptions& o, const std::string& named, dist::ModuleKind kind,
                                  int64_t world) {
  dist::ModuleLayout l;
  l.kind = kind;
  const bool vision = kind == dist::ModuleKind::kVision;
  const std::string key = std::string("parallel.") + (vision ? "vision" : "text");
  if (!o.strategy.empty()) l.strategy = o.strategy;
  else if (named == "dhp") l.strategy = vision ? "sp" : "tp";
  else l.strategy = named;  // none, tp, zero3, dp (custom requires both modules' strategies)
  l.ranks = o.ranks.empty() ? dist::iota_ranks(world) : o.ranks;
  const int64_t n = l.size();
  const std::string where = o.ranks.empty() ? "the " + std::to_string(n) + " ranks"
                                            : "the " + std::to_string(n) + " ranks of " + key + ".ranks";
  for (const auto& [name, v] : {std::pair<const char*, int64_t>{"sp", o.sp}, {"tp", o.tp}, {"dp", o.dp}}) {
    DHP_CHECK(v >= 0, key, ".", name, "=", v, " must be >= 1 (or 0 = derived)");
    DHP_CHECK(v == 0 || n % v == 0, key, ".", name, "=", v, " does not divide ", where);
  }
  l.sp = o.sp ? o.sp : 1;
  l.tp = o.tp ? o.tp : 1;
  l.dp = o.dp ? o.dp : 1;
  // The strategy's own degree takes what the others leave; dp takes the rest otherwise.
  if (l.strategy == "sp" && !o.sp) l.sp = n / (l.tp * l.dp);
  if (l.strategy == "tp" && !o.tp) l.tp = n / (l.sp * l.dp);
  if (!o.dp && l.strategy != "none") l.dp = std::max<int64_t>(1, n / (l.sp * l.tp));
  l.zero = o.zero >= 0 ? o.zero : (l.strategy == "sp" ? 1 : l.strategy == "zero3" ? 3 : 0);
  DHP_CHECK(l.strategy != "none" || n == 1, key, ".strategy=none runs on one process, but the module has ", where,
            " (use dp for replicas, or a parallel strategy)");
  return l;
}

int64_t image_rows(const data::Sample& s, int64_t image_token_id) {
  int64_t n = 0;
  for (auto id : s.ids) n += id == image_token_id;
  return n;
}

}  // namespace

std::vector<NamedParam> named_params(qwen::Qwen2_5_VLImpl& model) {
  std::vector<NamedParam> out;
  for (auto& kv : model.named_parameters(true)) {
    out.push_back({kv.key(), kv.value(), qwen::decays(kv.key(), kv.value())});
  }
  return out;
}

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
  set_attention_block(*m, cfg.training.attention_block);
  return m;
}

Layouts resolve_layouts(const Config& cfg, int64_t world) {
  DHP_CHECK(world >= 1, "the job needs at least one rank, got ", world);
  if (cfg.parallel.strategy == "auto") return resolve_layouts(resolve_auto(cfg, world), world);
  const auto& p = cfg.parallel;
  DHP_CHECK(p.strategy != "none" || world == 1 || !p.vision.strategy.empty() || !p.text.strategy.empty() ||
                !p.vision.ranks.empty() || !p.text.ranks.empty(),
            "parallel.strategy=none runs on one process, but the job has ", world,
            " ranks; choose parallel.strategy = dhp, tp, zero3 or dp");
  Layouts l;
  l.vision = resolve_module(p.vision, p.strategy, dist::ModuleKind::kVision, world);
  l.text = resolve_module(p.text, p.strategy, dist::ModuleKind::kText, world);
  for (auto* m : {&l.vision, &l.text}) {
    try {
      m->validate(cfg.model.config, world);
    } catch (const Error& e) {
      DHP_FAIL("parallel.", m->name(), ": ", e.what());
    }
  }
  for (int64_t r = 0; r < world; ++r) {
    DHP_CHECK(l.vision.module_rank(r) >= 0 || l.text.module_rank(r) >= 0, "rank ", r, " of the ", world,
              " runs no module: parallel.vision.ranks=", detail::to_yaml_text(l.vision.ranks),
              " and parallel.text.ranks=", detail::to_yaml_text(l.text.ranks), " leave it idle");
  }
  // Every replica of both modules needs at least one sample of the smallest micro-batch
  // (packed micro-batches always hold one per replica).
  const int64_t smallest = cfg.data.pack_tokens > 0 ? std::max(l.vision.dp, l.text.dp)
                                                    : cfg.data.batch_size / cfg.training.micro_batches;
  for (auto* m : {&l.vision, &l.text}) {
    DHP_CHECK(smallest >= m->dp, "parallel.", m->name(), ".dp=", m->dp, " replicas need at least ", m->dp,
              " samples per micro-batch, but data.batch_size=", cfg.data.batch_size, " / training.micro_batches=",
              cfg.training.micro_batches, " gives ", smallest);
  }
  // Sequence parallelism needs a window per rank: count the windows of the smallest images.
  if (l.vision.sp > 1) {
    const auto& v = cfg.model.config.vision;
    const int64_t unit = v.patch_size * v.spatial_merge_size;
    const int64_t side = unit * ((cfg.data.min_side + unit - 1) / unit);  // smallest image side
    const int64_t per_side = (side + v.window_size - 1) / v.window_size;
    const int64_t images = smallest / l.vision.dp;
    const int64_t windows = images * per_side * per_side;
    DHP_CHECK(windows >= l.vision.sp, "parallel.vision.sp=", l.vision.sp, " needs at least one attention window per ",
              "rank, but a vision replica may get only ", windows, " window(s) per micro-batch: ", images,
              " image(s) (data.batch_size=", cfg.data.batch_size, ", training.micro_batches=",
              cfg.training.micro_batches, ", vision dp=", l.vision.dp, ") of at least ", side, "x", side, " px (",
              per_side * per_side, " window(s) of ", v.window_size, " px each); use larger images, more samples or a "
              "smaller sp");
  }
  return l;
}

std::string describe(const Layouts& l) {
  const bool same_ranks = l.vision.ranks == l.text.ranks;
  auto one = [&](const dist::ModuleLayout& m) {
    std::string s = std::string(m.name()) + " " + m.strategy;
    if (m.sp > 1) s += " sp=" + std::to_string(m.sp);
    if (m.tp > 1) s += " tp=" + std::to_string(m.tp);
    if (m.dp > 1) s += " dp=" + std::to_string(m.dp);
    if (m.zero > 0) s += " zero=" + std::to_string(m.zero);
    if (!same_ranks) s += " on ranks " + detail::to_yaml_text(m.ranks);
    return s;
  };
  return one(l.vision) + " | " + one(l.text);
}

struct ParallelModel::Module {
  dist::ModuleLayout layout;
  bool member = false;  // does this rank host the module?
  dist::ProcessGroups pg;
  dist::ModuleLayout::Coord coord;
  parallel::TpShardMap tp_map;
  std::unique_ptr<parallel::Zero3> zero3;
  std::vector<NamedParam> params;  // what the optimizer updates on this rank
  std::vector<bool> in_norm;       // counted once in the global gradient norm
  std::unique_ptr<AdamW> adam;
  std::unique_ptr<parallel::Zero1AdamW> zero1;
};

// What the schedule's actions of one micro-batch hand each other on this rank.
struct ParallelModel::MicroBatchState {
  parallel::RedistributePlan plan;
  torch::Tensor vision_out;  // (rows of this vision replica, C), with its graph
  torch::Tensor text_in;     // (rows of this text replica, C), a leaf that collects the gradient
  torch::Tensor vision_grad; // (rows of this vision replica, C)
};

ParallelModel::~ParallelModel() = default;

void ParallelModel::release_parameters(bool vision) {
  torch::NoGradGuard no_grad;
  for (auto& kv : model_->named_parameters(true)) {
    if (is_vision(kv.key()) != vision) continue;
    kv.value().set_data(torch::empty({0}, kv.value().options()));
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
  auto make = [&](const dist::ModuleLayout& l) {
    auto m = std::make_unique<Module>();
    m->layout = l;
    m->member = l.module_rank(rt_.rank) >= 0;
    if (rt_.world > 1) m->pg = dist::make_process_groups(*rt_.store, l, rt_.rank, rt_.timeout);
    if (m->member) m->coord = l.coord(l.module_rank(rt_.rank));
    return m;
  };
  vision_ = make(layouts_.vision);
  text_ = make(layouts_.text);
  auto& m = *model_;
  if (!vision_->member) release_parameters(/*vision=*/true);
  if (!text_->member) release_parameters(/*vision=*/false);
  const auto& vs = vision_->layout.strategy;
  if (vision_->member) {
    if (vs == "sp") parallel::parallelize_vision_sp(m, vision_->pg.sp, cfg_.training.attention_block);
    else if (vs == "tp") vision_->tp_map = parallel::parallelize_vision_tp(m, vision_->pg.tp);
    else if (vs == "zero3") vision_->zero3 = parallel::parallelize_zero3(m, "visual", vision_->pg.dp);
  }
  const auto& ts = text_->layout.strategy;
  if (text_->member) {
    if (ts == "tp") text_->tp_map = parallel::parallelize_text_tp(m, text_->pg.tp);
    else if (ts == "zero3") text_->zero3 = parallel::parallelize_zero3(m, "text", text_->pg.dp);
  }

  AdamWOptions o;
  o.beta1 = cfg_.training.beta1;
  o.beta2 = cfg_.training.beta2;
  o.eps = cfg_.training.eps;
  o.weight_decay = cfg_.training.weight_decay;
  const auto all = named_params(m);
  for (Module* mod : {vision_.get(), text_.get()}) {
    if (!mod->member) continue;
    const bool vis = mod == vision_.get();
    std::vector<bool> once_over_tp;  // counted on one rank of its TP group (TP shards: on each)
    if (mod->zero3) {
      mod->params = mod->zero3->shards();
      mod->in_norm.assign(mod->params.size(), true);
    } else {
      for (const auto& p : all) {
        if (is_vision(p.name) != vis) continue;
        mod->params.push_back(p);
        once_over_tp.push_back(mod->tp_map.count(p.name) || mod->coord.tp == 0);
        mod->in_norm.push_back(mod->pg.data.rank() == 0 && once_over_tp.back());
      }
    }
    if (!rt_.optimizer) continue;
    // Elements of a ZeRO-1 slice are unique over the data group, so the slicing replaces
    // in_norm's data-rank condition.
    if (mod->layout.zero == 1) {
      mod->zero1 = std::make_unique<parallel::Zero1AdamW>(mod->params, o, mod->pg.data, once_over_tp);
    } else {
      mod->adam = std::make_unique<AdamW>(mod->params, o);
    }
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

bool ParallelModel::hosts_vision() const { return vision_->member; }
bool ParallelModel::hosts_text() const { return text_->member; }

std::vector<Action> ParallelModel::schedule(int64_t micro_batches) const {
  return make_schedule(layouts_.vision, layouts_.text, rt_.rank, micro_batches, cfg_.parallel.pipeline);
}

bool ParallelModel::encodes(int64_t i, int64_t n) const {
  if (!vision_->member) return false;
  const auto c = parallel::replica_chunk(n, vision_->layout.dp, vision_->coord.dp);
  return i >= c.first && i < c.second;
}

ParallelModel::StepResult ParallelModel::forward_backward(std::vector<std::vector<data::Sample>> micro,
                                                          double global_targets) {
  const int64_t img = cfg_.model.config.image_token_id;
  std::vector<MicroBatchState> state(micro.size());
  for (size_t i = 0; i < micro.size(); ++i) {
    std::vector<int64_t> rows;
    for (const auto& s : micro[i]) rows.push_back(image_rows(s, img));
    state[i].plan = parallel::plan_redistribute(layouts_.vision, layouts_.text, rows);
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
  const auto vc = parallel::replica_chunk(n, vision_->layout.dp, vision_->coord.dp);
  // Vision replicas that share collectives across replicas (ZeRO-3 gathers) must all run.
  if (vision_->zero3) {
    for (int64_t v = 0; v < vision_->layout.dp; ++v) {
      const auto c = parallel::replica_chunk(n, vision_->layout.dp, v);
      bool any = false;
      for (int64_t i = c.first; i < c.second; ++i) any = any || !mb[i].grids.empty();
      DHP_CHECK(any, "vision zero3: replica ", v, " has no image in its samples ", c.first, "..", c.second - 1,
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
      const auto tc = parallel::replica_chunk(n, text_->layout.dp, text_->coord.dp);
      auto out = model_->forward(qwen::to_device(data::collate(slice(tc), mc), device_), st.text_in);
      (out.loss_sum / global_targets).backward();
      if (text_->coord.tp == 0) result.loss_sum += out.loss_sum.item<double>();
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
  for (Module* m : {vision_.get(), text_.get()}) {
    if (!m->member) continue;
    if (m->zero1) m->zero1->zero_grad();
    else m->adam->zero_grad();
  }
}

double ParallelModel::finish_step(double lr, double max_norm) {
  torch::NoGradGuard no_grad;
  double sq = 0;
  for (Module* m : {vision_.get(), text_.get()}) {
    if (!m->member) continue;
    if (m->zero1) {  // reduce-scattered into the optimizer's slices: no full gradient is summed
      m->zero1->reduce_gradients();
      sq += m->zero1->grad_sq_norm();
      memory_mark("gradients reduced");
      continue;
    }
    if (!m->zero3 && m->pg.data.size() > 1) {
      // Every member must reduce the same tensors: a parameter unused here is a zero gradient.
      std::vector<torch::Tensor> ps;
      for (auto& p : m->params) {
        if (!p.param.grad().defined()) p.param.mutable_grad() = torch::zeros_like(p.param);
        ps.push_back(p.param);
      }
      parallel::all_reduce_grads(ps, m->pg.data);
      memory_mark("gradients reduced");
    }
    for (size_t i = 0; i < m->params.size(); ++i) {
      const auto& g = m->params[i].param.grad();
      if (m->in_norm[i] && g.defined()) sq += g.to(torch::kFloat32).pow(2).sum().item<double>();
    }
  }
  const double norm = std::sqrt(sum_over_job(sq));
  if (max_norm > 0 && norm > max_norm) {
    const double scale = max_norm / (norm + 1e-6);
    for (Module* m : {vision_.get(), text_.get()}) {
      if (m->zero1) {
        m->zero1->scale_gradients(scale);
        continue;
      }
      for (auto& p : m->params)
        if (p.param.grad().defined()) p.param.grad().mul_(scale);
    }
  }
  for (Module* m : {vision_.get(), text_.get()}) {
    if (!m->member) continue;
    if (m->zero1) m->zero1->step(lr);
    else m->adam->step(lr);
    memory_mark("optimizer step");
  }
  return norm;
}

torch::Tensor ParallelModel::forward_logits(const qwen::Batch& host_batch) {
  torch::NoGradGuard no_grad;
  DHP_CHECK(layouts_.vision.dp == 1 && layouts_.text.dp == 1, "a forward of one sample runs each module as one ",
            "replica, but the layout (", describe(layouts_), ") has data-parallel replicas; set parallel.vision.dp=1 ",
            "and parallel.text.dp=1 (the strategy's own degree takes the ranks)");
  const auto& mc = cfg_.model.config;
  const int64_t hidden = mc.text.hidden_size;
  const auto options = torch::TensorOptions().dtype(dtype_).device(device_);
  const auto b = qwen::to_device(host_batch, device_);
  const int64_t rows = b.input_ids.eq(mc.image_token_id).sum().item<int64_t>();
  const auto plan = parallel::plan_redistribute(layouts_.vision, layouts_.text, {rows});
  torch::Tensor vis;
  if (vision_->member) {
    vis = model_->encode_images(b);
    if (!vis.defined()) vis = torch::zeros({0, hidden}, options);
    parallel::send_pieces(plan.forward, vis, job_, rt_.rank, /*tag=*/0);
  }
  torch::Tensor logits;
  if (text_->member) {
    auto in = parallel::recv_pieces(plan.forward, vis, plan.text_rows.at(rt_.rank), hidden, options, job_, rt_.rank, 0);
    auto h = model_->hidden_at_targets(b, in).first;
    auto head = [this](const torch::Tensor& x) {
      return torch::matmul(x, model_->lm_head_weight().t()).to(torch::kFloat32);
    };
    logits = text_->zero3 ? text_->zero3->run(model_->lm_head ? "lm_head" : "model.embed_tokens", head, h) : head(h);
    logits = parallel::unshard(logits.contiguous(), parallel::TpShard{1, 1}, text_->pg.tp);  // vocabulary shards
  }
  // Rank 0 gets them from the text module's first rank when it is not a text rank.
  const int64_t owner = text_->layout.ranks.front();
  if (!text_->member && rt_.rank == 0) {
    logits = torch::empty({b.input_ids.size(0), mc.text.vocab_size}, torch::kFloat32);
    job_.recv(logits, owner, /*tag=*/1);
  } else if (rt_.rank == owner && text_->layout.module_rank(0) < 0) {
    job_.send(logits, 0, /*tag=*/1);
  }
  job_.wait_sends();
  return rt_.rank == 0 ? logits.unsqueeze(0).cpu() : torch::Tensor();
}

std::map<std::string, torch::Tensor> ParallelModel::full_parameters() {
  torch::NoGradGuard no_grad;
  std::map<std::string, torch::Tensor> out;
  for (Module* m : {vision_.get(), text_.get()}) {
    std::map<std::string, torch::Tensor> full;
    if (m->member) {
      if (m->zero3) {
        full = m->zero3->full_parameters();
      } else {
        for (const auto& p : m->params) {
          auto it = m->tp_map.find(p.name);
          full[p.name] = it == m->tp_map.end() ? p.param.detach().clone()
                                               : parallel::unshard(p.param.detach(), it->second, m->pg.tp);
        }
      }
    }
    // Rank 0 gets a module it does not host from the module's first rank, in one message.
    const int64_t owner = m->layout.ranks.front();
    const bool vis = m == vision_.get();
    if (!m->member && rt_.rank == 0) {
      int64_t numel = 0;
      for (const auto& [name, shape] : full_shapes_)
        if (is_vision(name) == vis) numel += c10::multiply_integers(shape);
      auto flat = torch::empty({numel}, torch::TensorOptions().dtype(dtype_));
      job_.recv(flat, owner, /*tag=*/1 << 20);
      int64_t at = 0;
      for (const auto& [name, shape] : full_shapes_) {
        if (is_vision(name) != vis) continue;
        auto t = flat.narrow(0, at, c10::multiply_integers(shape)).view(shape).clone();
        at += t.numel();
        full[name] = t;
      }
    } else if (rt_.rank == owner && m->layout.module_rank(0) < 0) {
      std::vector<torch::Tensor> parts;
      for (const auto& [name, t] : full) parts.push_back(t.reshape({-1}));  // map order = name order
      job_.send(torch::cat(parts).to(dtype_), 0, /*tag=*/1 << 20);
    }
    for (auto& [k, v] : full) out[k] = v.cpu();  // the tensor itself when it is there
  }
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
  for (Module* m : {vision_.get(), text_.get()}) {
    if (!m->member) continue;
    const int64_t tp_rank = m->pg.tp.rank(), tp_size = m->pg.tp.size();
    const bool data_first = m->pg.data.rank() == 0;
    int64_t flat_at = 0;  // ZeRO-1: where parameter i starts in the flat vector
    for (size_t i = 0; i < m->params.size(); ++i) {
      const auto& p = m->params[i];
      const auto& shape = full_shapes_.at(p.name);
      const auto it = m->tp_map.find(p.name);
      const parallel::TpShard how = it == m->tp_map.end() ? parallel::TpShard{} : it->second;
      const bool tp_unique = it != m->tp_map.end() || m->coord.tp == 0;  // one TP rank writes a replicated one
      const bool fp32 = p.param.scalar_type() == torch::kFloat32;
      auto add = [&](const char* kind, const torch::Tensor& data, int64_t begin, bool write) {
        CheckpointPiece c;
        c.name = std::string(kind) + "/" + p.name;
        c.shape = shape;
        c.tp = how;
        c.tp_rank = tp_rank;
        c.tp_size = tp_size;
        c.begin = begin;
        c.data = data;
        c.write = write;
        out.push_back(std::move(c));
      };
      if (m->zero3) {
        // The shard holds elements [rank * chunk, +chunk) of the flattened parameter, padded.
        const int64_t chunk = p.param.numel(), total = c10::multiply_integers(shape);
        const int64_t lo = std::min(total, m->pg.dp.rank() * chunk), n = std::min(total, lo + chunk) - lo;
        add("param", p.param.detach().narrow(0, 0, n), lo, true);
        if (!m->adam) continue;
        const auto& st = m->adam->state()[i];
        if (!fp32) add("master", st.master.narrow(0, 0, n), lo, true);
        add("exp_avg", st.exp_avg.narrow(0, 0, n), lo, true);
        add("exp_avg_sq", st.exp_avg_sq.narrow(0, 0, n), lo, true);
        continue;
      }
      add("param", p.param.detach().view({-1}), 0, data_first && tp_unique);
      if (!m->adam && !m->zero1) continue;  // forward only
      if (m->zero1) {
        const auto& z = *m->zero1;
        const int64_t numel = p.param.numel(), lo = z.slice_begin(), hi = lo + z.state_numel();
        const int64_t b = std::max(flat_at, lo), e = std::min(flat_at + numel, hi);
        flat_at += numel;
        if (b >= e) continue;
        // An fp32 model's masters equal its parameters: loaded, not saved.
        add("master", z.master().narrow(0, b - lo, e - b), b - (flat_at - numel), tp_unique && !fp32);
        add("exp_avg", z.exp_avg().narrow(0, b - lo, e - b), b - (flat_at - numel), tp_unique);
        add("exp_avg_sq", z.exp_avg_sq().narrow(0, b - lo, e - b), b - (flat_at - numel), tp_unique);
        continue;
      }
      const auto& st = m->adam->state()[i];
      if (!fp32) add("master", st.master.view({-1}), 0, data_first && tp_unique);
      add("exp_avg", st.exp_avg.view({-1}), 0, data_first && tp_unique);
      add("exp_avg_sq", st.exp_avg_sq.view({-1}), 0, data_first && tp_unique);
    }
  }
  return out;
}

void ParallelModel::set_optimizer_steps(int64_t n) {
  for (Module* m : {vision_.get(), text_.get()}) {
    if (!m->member || !rt_.optimizer) continue;
    if (m->zero1) m->zero1->set_step_count(n);
    else m->adam->set_step_count(n);
  }
}

bool ParallelModel::plain() const { return rt_.world == 1 && !vision_->zero3 && !text_->zero3; }

}  // namespace dhp::train
