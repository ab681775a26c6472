#include "dhp/train/parallel_model.h"

#include <torch/torch.h>

#include <cmath>

#include "dhp/core/error.h"
#include "dhp/parallel/data_parallel.h"
#include "dhp/parallel/mappings.h"
#include "dhp/parallel/parallelize.h"
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

// Fills the strategy and degrees of one module from the named combination and overrides.
dist::ModuleLayout resolve_module(const ModuleParallelOptions& o, const std::string& named, dist::ModuleKind kind,
                                  int64_t world) {
  dist::ModuleLayout l;
  l.kind = kind;
  const bool vision = kind == dist::ModuleKind::kVision;
  const std::string key = std::string("parallel.") + (vision ? "vision" : "text");
  if (!o.strategy.empty()) l.strategy = o.strategy;
  else if (named == "dhp") l.strategy = vision ? "sp" : "tp";
  else l.strategy = named;  // none, tp, zero3, dp (custom requires both modules' strategies)
  l.ranks = dist::iota_ranks(world);
  for (const auto& [name, v] : {std::pair<const char*, int64_t>{"sp", o.sp}, {"tp", o.tp}, {"dp", o.dp}}) {
    DHP_CHECK(v >= 0, key, ".", name, "=", v, " must be >= 1 (or 0 = derived)");
    DHP_CHECK(v == 0 || world % v == 0, key, ".", name, "=", v, " does not divide the ", world, " ranks");
  }
  l.sp = o.sp ? o.sp : 1;
  l.tp = o.tp ? o.tp : 1;
  l.dp = o.dp ? o.dp : 1;
  // The strategy's own degree takes what the others leave; dp takes the rest otherwise.
  if (l.strategy == "sp" && !o.sp) l.sp = world / (l.tp * l.dp);
  if (l.strategy == "tp" && !o.tp) l.tp = world / (l.sp * l.dp);
  if (!o.dp && l.strategy != "none") l.dp = std::max<int64_t>(1, world / (l.sp * l.tp));
  l.zero = o.zero >= 0 ? o.zero : (l.strategy == "sp" ? 1 : l.strategy == "zero3" ? 3 : 0);
  DHP_CHECK(l.strategy != "none" || world == 1, key, ".strategy=none runs on one process, but the job has ", world,
            " ranks (use dp for replicas, or a parallel strategy)");
  return l;
}

int64_t image_rows(const data::Sample& s, int64_t image_token_id) {
  int64_t n = 0;
  for (auto id : s.ids) n += id == image_token_id;
  return n;
}

// forward: identity; backward: the gradient (zero unless `contribute`) summed over `group`.
torch::Tensor sum_grad_over(const torch::Tensor& x, const dist::Group& group, bool contribute) {
  auto y = parallel::copy_to_group(x, group);  // backward: all-reduce of what reaches it
  return contribute ? y : y * 0.0 + y.detach();  // backward: zero before the all-reduce
}

}  // namespace

std::vector<NamedParam> named_params(qwen::Qwen2_5_VLImpl& model) {
  std::vector<NamedParam> out;
  for (auto& kv : model.named_parameters(true)) {
    out.push_back({kv.key(), kv.value(), qwen::decays(kv.key(), kv.value())});
  }
  return out;
}

qwen::Qwen2_5_VL build_model(const Config& cfg) {
  qwen::Qwen2_5_VL m(cfg.model.config);
  qwen::init_parameters(*m, static_cast<uint64_t>(cfg.training.seed), cfg.model.config.initializer_range);
  if (cfg.training.precision == "bf16") m->to(torch::kBFloat16);
  m->set_activation_checkpointing(cfg.training.activation_checkpointing);
  set_attention_block(*m, cfg.training.attention_block);
  return m;
}

Layouts resolve_layouts(const Config& cfg, int64_t world) {
  DHP_CHECK(world >= 1, "the job needs at least one rank, got ", world);
  const auto& p = cfg.parallel;
  DHP_CHECK(p.strategy != "none" || world == 1 || !p.vision.strategy.empty() || !p.text.strategy.empty(),
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
  // Every replica of both modules needs at least one sample of the smallest micro-batch.
  const int64_t smallest = cfg.data.batch_size / cfg.training.micro_batches;
  for (auto* m : {&l.vision, &l.text}) {
    DHP_CHECK(smallest >= m->dp, "parallel.", m->name(), ".dp=", m->dp, " replicas need at least ", m->dp,
              " samples per micro-batch, but data.batch_size=", cfg.data.batch_size, " / training.micro_batches=",
              cfg.training.micro_batches, " gives ", smallest);
  }
  // Sequence parallelism needs a window per rank: guaranteed with one image per rank.
  if (l.vision.sp > 1) {
    const int64_t images = smallest / l.vision.dp;
    DHP_CHECK(images >= l.vision.sp, "parallel.vision.sp=", l.vision.sp, " needs at least one attention window per ",
              "rank, guaranteed by one image per rank, but a vision replica gets as few as ", images,
              " images per micro-batch (data.batch_size=", cfg.data.batch_size, ", training.micro_batches=",
              cfg.training.micro_batches, ", vision dp=", l.vision.dp, ")");
  }
  return l;
}

std::string describe(const Layouts& l) {
  auto one = [](const dist::ModuleLayout& m) {
    std::string s = std::string(m.name()) + " " + m.strategy;
    if (m.sp > 1) s += " sp=" + std::to_string(m.sp);
    if (m.tp > 1) s += " tp=" + std::to_string(m.tp);
    if (m.dp > 1) s += " dp=" + std::to_string(m.dp);
    if (m.zero > 0) s += " zero=" + std::to_string(m.zero);
    return s;
  };
  return one(l.vision) + " | " + one(l.text);
}

struct ParallelModel::Module {
  dist::ModuleLayout layout;
  dist::ProcessGroups pg;
  dist::ModuleLayout::Coord coord;
  parallel::TpShardMap tp_map;
  std::unique_ptr<parallel::Zero3> zero3;
  std::vector<NamedParam> params;  // what the optimizer updates on this rank
  std::vector<bool> in_norm;       // counted once in the global gradient norm
  std::unique_ptr<AdamW> adam;
  std::unique_ptr<parallel::Zero1AdamW> zero1;
};

ParallelModel::~ParallelModel() = default;

ParallelModel::ParallelModel(const Config& cfg, const Layouts& layouts, const Runtime& rt)
    : cfg_(cfg), layouts_(layouts), rt_(rt) {
  DHP_CHECK(rt_.world == 1 || rt_.store, "a job of ", rt_.world, " ranks needs a store");
  if (rt_.world > 1) job_ = dist::Group(*rt_.store, "job", dist::iota_ranks(rt_.world), rt_.rank, rt_.timeout);
  model_ = build_model(cfg_);
  auto make = [&](const dist::ModuleLayout& l) {
    auto m = std::make_unique<Module>();
    m->layout = l;
    if (rt_.world > 1) m->pg = dist::make_process_groups(*rt_.store, l, rt_.rank, rt_.timeout);
    m->coord = l.coord(l.module_rank(rt_.rank));
    return m;
  };
  vision_ = make(layouts_.vision);
  text_ = make(layouts_.text);
  auto& m = *model_;
  const auto& vs = vision_->layout.strategy;
  if (vs == "sp") parallel::parallelize_vision_sp(m, vision_->pg.sp, cfg_.training.attention_block);
  else if (vs == "tp") vision_->tp_map = parallel::parallelize_vision_tp(m, vision_->pg.tp);
  else if (vs == "zero3") vision_->zero3 = parallel::parallelize_zero3(m, "visual", vision_->pg.dp);
  const auto& ts = text_->layout.strategy;
  if (ts == "tp") text_->tp_map = parallel::parallelize_text_tp(m, text_->pg.tp);
  else if (ts == "zero3") text_->zero3 = parallel::parallelize_zero3(m, "text", text_->pg.dp);

  AdamWOptions o;
  o.beta1 = cfg_.training.beta1;
  o.beta2 = cfg_.training.beta2;
  o.eps = cfg_.training.eps;
  o.weight_decay = cfg_.training.weight_decay;
  const auto all = named_params(m);
  for (Module* mod : {vision_.get(), text_.get()}) {
    const bool vis = mod == vision_.get();
    if (mod->zero3) {
      mod->params = mod->zero3->shards();
      mod->in_norm.assign(mod->params.size(), true);
    } else {
      for (const auto& p : all) {
        if (is_vision(p.name) != vis) continue;
        mod->params.push_back(p);
        mod->in_norm.push_back(mod->pg.data.rank() == 0 && (mod->tp_map.count(p.name) || mod->coord.tp == 0));
      }
    }
    if (mod->layout.zero == 1) mod->zero1 = std::make_unique<parallel::Zero1AdamW>(mod->params, o, mod->pg.data);
    else mod->adam = std::make_unique<AdamW>(mod->params, o);
  }
  // The text replica of a rank is its vision replica when both split the ranks into the
  // same consecutive blocks.
  same_replicas_ = layouts_.vision.dp == layouts_.text.dp;
}

std::vector<int64_t> ParallelModel::chunk(int64_t n, int64_t replicas, int64_t r) const {
  const int64_t base = n / replicas, rem = n % replicas;
  const int64_t begin = r * base + std::min(r, rem);
  return {begin, begin + base + (r < rem ? 1 : 0)};
}

torch::Tensor ParallelModel::bridge(const torch::Tensor& vision_rows, const std::vector<data::Sample>& mb) {
  const int64_t n = static_cast<int64_t>(mb.size());
  const int64_t img = cfg_.model.config.image_token_id;
  std::vector<int64_t> rows_of(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) rows_of[i] = image_rows(mb[i], img);
  auto rows_in = [&](const std::vector<int64_t>& c) {
    int64_t r = 0;
    for (int64_t i = c[0]; i < c[1]; ++i) r += rows_of[i];
    return r;
  };
  std::vector<int64_t> per_replica;
  for (int64_t v = 0; v < vision_->layout.dp; ++v) per_replica.push_back(rows_in(chunk(n, vision_->layout.dp, v)));
  auto all = parallel::gather_rows(vision_rows, vision_->pg.dp, per_replica);  // the micro-batch's rows
  all = sum_grad_over(all, job_, text_->coord.tp == 0);
  const auto tc = chunk(n, text_->layout.dp, text_->coord.dp);
  return all.narrow(0, rows_in({0, tc[0]}), rows_in(tc));
}

double ParallelModel::forward_backward(const std::vector<data::Sample>& mb, double global_targets) {
  const int64_t n = static_cast<int64_t>(mb.size());
  const auto& mc = cfg_.model.config;
  auto slice = [&](const std::vector<int64_t>& c) {
    return std::vector<data::Sample>(mb.begin() + c[0], mb.begin() + c[1]);
  };
  const auto vc = chunk(n, vision_->layout.dp, vision_->coord.dp);
  const auto tc = chunk(n, text_->layout.dp, text_->coord.dp);
  auto text_batch = data::collate(slice(tc), mc);
  // Vision replicas that share collectives across replicas (ZeRO-3 gathers) must all run.
  if (vision_->zero3) {
    for (int64_t v = 0; v < vision_->layout.dp; ++v) {
      const auto c = chunk(n, vision_->layout.dp, v);
      bool any = false;
      for (int64_t i = c[0]; i < c[1]; ++i) any = any || !mb[i].grids.empty();
      DHP_CHECK(any, "vision zero3: replica ", v, " has no image in its samples ", c[0], "..", c[1] - 1,
                " of the micro-batch; every replica needs one");
    }
  }
  torch::Tensor vis;
  if (same_replicas_) {
    vis = model_->encode_images(text_batch);
  } else {
    auto vb = data::collate(slice(vc), mc);
    auto rows = model_->encode_images(vb);
    if (!rows.defined()) {
      rows = torch::zeros({0, mc.text.hidden_size}, model_->model->embed_tokens->weight.options());
    }
    vis = bridge(rows, mb);
  }
  auto out = model_->forward(text_batch, vis);
  auto loss = out.loss_sum / global_targets;
  loss.backward();
  return text_->coord.tp == 0 ? out.loss_sum.item<double>() : 0.0;
}

void ParallelModel::zero_grad() {
  for (Module* m : {vision_.get(), text_.get()}) {
    if (m->zero1) m->zero1->zero_grad();
    else m->adam->zero_grad();
  }
}

double ParallelModel::finish_step(double lr, double max_norm) {
  torch::NoGradGuard no_grad;
  double sq = 0;
  for (Module* m : {vision_.get(), text_.get()}) {
    if (!m->zero3 && m->pg.data.size() > 1) {
      // Every member must reduce the same tensors: a parameter unused here is a zero gradient.
      std::vector<torch::Tensor> ps;
      for (auto& p : m->params) {
        if (!p.param.grad().defined()) p.param.mutable_grad() = torch::zeros_like(p.param);
        ps.push_back(p.param);
      }
      parallel::all_reduce_grads(ps, m->pg.data);
    }
    for (size_t i = 0; i < m->params.size(); ++i) {
      const auto& g = m->params[i].param.grad();
      if (m->in_norm[i] && g.defined()) sq += g.to(torch::kFloat32).pow(2).sum().item<double>();
    }
  }
  const double norm = std::sqrt(sum_over_job(sq));
  if (max_norm > 0 && norm > max_norm) {
    const double scale = max_norm / (norm + 1e-6);
    for (Module* m : {vision_.get(), text_.get()})
      for (auto& p : m->params)
        if (p.param.grad().defined()) p.param.grad().mul_(scale);
  }
  for (Module* m : {vision_.get(), text_.get()}) {
    if (m->zero1) m->zero1->step(lr);
    else m->adam->step(lr);
  }
  return norm;
}

std::map<std::string, torch::Tensor> ParallelModel::full_parameters() {
  torch::NoGradGuard no_grad;
  std::map<std::string, torch::Tensor> out;
  for (Module* m : {vision_.get(), text_.get()}) {
    if (m->zero3) {
      for (auto& [k, v] : m->zero3->full_parameters()) out[k] = v;
      continue;
    }
    for (const auto& p : m->params) {
      auto it = m->tp_map.find(p.name);
      out[p.name] = it == m->tp_map.end() ? p.param.detach().clone()
                                          : parallel::unshard(p.param.detach(), it->second, m->pg.tp);
    }
  }
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

void ParallelModel::barrier() const { job_.barrier(); }

bool ParallelModel::plain() const { return rt_.world == 1 && !vision_->zero3 && !text_->zero3; }

}  // namespace dhp::train
