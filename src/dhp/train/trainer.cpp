#include "dhp/train/trainer.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <sstream>
#include <limits>
#include <mutex>
#include <thread>
#include <tuple>

#include "dhp/core/log.h"
#include "dhp/core/machine.h"
#include "dhp/core/memory.h"
#include "dhp/io/checkpoint_store.h"
#include "dhp/io/json.h"
#include "dhp/models/qwen2_5_vl/hf.h"
#include "dhp/train/auto_plan.h"
#include "dhp/train/flops.h"

namespace dhp::train {
namespace {

data::ShapesOptions shapes_options(const Config& cfg, uint64_t stream) {
  data::ShapesOptions o;
  o.min_side = cfg.data.min_side;
  o.max_side = cfg.data.max_side;
  o.seed = static_cast<uint64_t>(cfg.data.seed) * 2 + stream;
  return o;
}

std::string fmt_duration(double s) {
  char buf[32];
  const int t = static_cast<int>(s + 0.5);
  if (t >= 3600) std::snprintf(buf, sizeof(buf), "%dh%02dm", t / 3600, (t / 60) % 60);
  else std::snprintf(buf, sizeof(buf), "%dm%02ds", t / 60, t % 60);
  return buf;
}

std::string metrics_json(const StepMetrics& m) {
  std::ostringstream os;
  os << std::setprecision(8) << "{\"step\": " << m.step << ", \"loss\": " << m.loss << ", \"lr\": " << m.lr
     << ", \"grad_norm\": " << m.grad_norm << ", \"tokens_per_s\": " << m.tokens_per_s
     << ", \"patches_per_s\": " << m.patches_per_s << ", \"step_time_s\": " << m.step_time_s
     << ", \"tokens\": " << m.tokens << ", \"target_tokens\": " << m.target_tokens
     << ", \"patches\": " << m.patches << ", \"peak_bytes\": " << m.peak_bytes
     << ", \"model_flops\": " << m.model_flops << ", \"comm_s\": " << m.comm_s
     << ", \"comm_calls\": " << m.comm_calls << ", \"comm_bytes\": " << m.comm_bytes
     << ", \"wait_s\": " << m.wait_s << ", \"data_wait_s\": " << m.data_wait_s
     << ", \"skipped_samples\": " << m.skipped_samples << ", \"samples\": " << m.samples
     << ", \"samples_s\": " << m.samples_s << ", \"update_s\": " << m.update_s;
  auto list = [&](const char* key, const std::vector<double>& v) {
    os << ", \"" << key << "\": [";
    for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
    os << "]";
  };
  list("peak_bytes_per_rank", m.peak_bytes_per_rank);
  list("comm_s_per_rank", m.comm_s_per_rank);
  list("busy_s_per_rank", m.busy_s_per_rank);
  list("idle_s_per_rank", m.idle_s_per_rank);
  list("vision_s_per_rank", m.vision_s_per_rank);
  list("text_s_per_rank", m.text_s_per_rank);
  list("update_s_per_rank", m.update_s_per_rank);
  os << "}";
  return os.str();
}

}  // namespace

Trainer::Trainer(const Config& cfg, const Runtime& rt)
    : cfg_(cfg), rt_(rt) {
  if (cfg_.parallel.strategy == "auto") {
    std::string why;
    cfg_ = resolve_auto(cfg_, rt_.world, &why);
    if (rt_.rank == 0) log_info(why);
  }
  if (cfg_.data.dataset == "llava") {
    const auto& d = cfg_.data;
    data::LoaderOptions o;
    for (size_t i = 0; i < d.files.size(); ++i) {
      o.datasets.push_back({d.files[i], d.root, d.fractions.empty() ? 1.0 : d.fractions[i]});
    }
    o.seed = static_cast<uint64_t>(d.seed);
    o.image.min_pixels = d.min_pixels;
    o.image.max_pixels = d.max_pixels;
    o.image.patch_size = cfg_.model.config.vision.patch_size;
    o.image.merge_size = cfg_.model.config.vision.spatial_merge_size;
    o.image.temporal_patch_size = cfg_.model.config.vision.temporal_patch_size;
    o.merge_size = cfg_.model.config.vision.spatial_merge_size;
    o.chat.max_length = d.max_length;
    o.strict = d.strict;
    auto tok = std::make_shared<const data::Tokenizer>(data::Tokenizer::from_file(d.tokenizer));
    const auto& mc = cfg_.model.config;
    for (const auto& [key, token, id] : {std::tuple<const char*, const char*, int64_t>{"model.image_token_id",
                                                                                      "<|image_pad|>", mc.image_token_id},
                                         {"model.vision_start_token_id", "<|vision_start|>", mc.vision_start_token_id},
                                         {"model.vision_end_token_id", "<|vision_end|>", mc.vision_end_token_id}}) {
      DHP_CHECK(tok->token_id(token) == id, key, "=", id, " but ", d.tokenizer, " has ", token, " at id ",
                tok->token_id(token), "; set ", key, "=", tok->token_id(token));
    }
    DHP_CHECK(tok->vocab_size() <= mc.text.vocab_size, "model.text.vocab_size=", mc.text.vocab_size, " is smaller than ",
              d.tokenizer, "'s ", tok->vocab_size(), " tokens");
    llava_ = std::make_shared<data::LlavaDataset>(o, tok);
    if (!d.eval_files.empty()) {
      data::LoaderOptions e = o;
      e.datasets.clear();
      for (const auto& f : d.eval_files) e.datasets.push_back({f, d.root, 1.0});
      llava_eval_ = std::make_shared<data::LlavaDataset>(e, tok);
    }
  } else {
    train_data_ = std::make_unique<data::ShapesDataset>(cfg.model.config, shapes_options(cfg, 0));
    eval_data_ = std::make_unique<data::ShapesDataset>(cfg.model.config, shapes_options(cfg, 1));
  }
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  // Ranks on one machine share its cores.
  const int64_t local = rt_.local_world > 0 ? rt_.local_world : rt_.world;
  const int64_t share = std::max<int64_t>(1, static_cast<int64_t>(hw) / std::max<int64_t>(1, local));
  torch::set_num_threads(static_cast<int>(cfg_.training.threads > 0 ? cfg_.training.threads : share));
  set_memory_limit(parse_bytes(cfg_.training.memory_limit, "training.memory_limit"));
  parallel_ = std::make_unique<ParallelModel>(cfg_, resolve_layouts(cfg_, rt_.world), rt_);
  // Test hook: DHP_TEST_FAIL_AT=RANK:STEP makes that rank throw before that step (1-based).
  if (const char* f = std::getenv("DHP_TEST_FAIL_AT"); f && *f) {
    long long r = -1, s = -1;
    DHP_CHECK(std::sscanf(f, "%lld:%lld", &r, &s) == 2, "DHP_TEST_FAIL_AT='", f, "' must be RANK:STEP");
    if (r == rt_.rank) fail_at_step_ = s;
  }
  // Test hook: DHP_TEST_KILL_AT=RANK:STEP makes that rank SIGKILL itself before that step,
  // in the first attempt of a job only (the launcher counts restarts in DHP_RESTART).
  const char* restart = std::getenv("DHP_RESTART");
  if (const char* f = std::getenv("DHP_TEST_KILL_AT"); f && *f && (!restart || std::string(restart) == "0")) {
    long long r = -1, s = -1;
    DHP_CHECK(std::sscanf(f, "%lld:%lld", &r, &s) == 2, "DHP_TEST_KILL_AT='", f, "' must be RANK:STEP");
    if (r == rt_.rank) kill_at_step_ = s;
  }
  // Test hook: DHP_TEST_KILL_IN_SAVE=STEP makes rank 0 SIGKILL itself while saving that
  // step's checkpoint, after the rank files are written and before the commit.
  if (const char* f = std::getenv("DHP_TEST_KILL_IN_SAVE"); f && *f && (!restart || std::string(restart) == "0")) {
    kill_in_save_ = std::atoll(f);
  }
  resume();
}

std::string Trainer::save_checkpoint() {
  namespace fs = std::filesystem;
  Timer timer;
  const fs::path root(checkpoint_root(cfg_));
  const std::string name = "step-" + std::to_string(step_);
  const fs::path tmp = root / ("." + name + ".tmp"), final_dir = root / name;
  std::string error;
  if (is_main()) {
    try {
      fs::remove_all(tmp);
      fs::create_directories(tmp);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  error = parallel_->all_gather_strings(error)[0];
  DHP_CHECK(error.empty(), "checkpoint ", final_dir.string(), " not written: ", error);
  // Every rank writes its pieces; the records (or the error) travel to rank 0.
  std::string record;
  int64_t bytes = 0;
  try {
    char file[32];
    std::snprintf(file, sizeof(file), "rank-%05lld.safetensors", static_cast<long long>(rt_.rank));
    io::SliceWriter w(file);
    const auto pieces = parallel_->checkpoint_pieces();
    add_pieces(w, pieces);
    for (const auto& p : pieces)
      if (p.write) bytes += p.data.numel() * p.data.element_size();
    if (is_main()) {
      auto gen = at::detail::getDefaultCPUGenerator();
      torch::Tensor rng;
      {
        std::lock_guard<std::mutex> lock(gen.mutex());
        rng = gen.get_state();
      }
      w.add("rng/cpu", {rng.numel()}, {0}, rng);
    }
    record = "+" + w.write(tmp.string());
  } catch (const std::exception& e) {
    record = "!rank " + std::to_string(rt_.rank) + ": " + e.what();
  }
  const auto records = parallel_->all_gather_strings(record);
  if (is_main() && step_ == kill_in_save_) ::raise(SIGKILL);
  bytes = static_cast<int64_t>(parallel_->sum_over_job(static_cast<double>(bytes)));
  if (is_main()) {
    std::vector<std::string> ok;
    for (const auto& r : records) {
      if (r[0] == '!' && error.empty()) error = r.substr(1);
      ok.push_back(r.substr(1));
    }
    try {
      if (!error.empty()) DHP_FAIL(error);
      io::Json meta = io::Json::object();
      meta.set("samples_seen", io::Json(data_position()));  // the data stream's next position
      meta.set("batch_size", io::Json(cfg_.data.batch_size));
      meta.set("world", io::Json(rt_.world));
      meta.set("layout", io::Json(describe(parallel_->layouts())));
      meta.set("precision", io::Json(cfg_.training.precision));
      meta.set("dhp_version", io::Json(std::string(DHP_VERSION)));
      meta.set("config", io::Json(to_yaml(cfg_)));
      io::commit_checkpoint(tmp.string(), final_dir.string(), step_, meta, ok);
      io::prune_checkpoints(root.string(), cfg_.checkpoint.keep);
    } catch (const std::exception& e) {
      error = e.what();
      std::error_code ec;
      fs::remove_all(tmp, ec);
    }
  }
  error = parallel_->all_gather_strings(error)[0];  // rank 0's verdict
  DHP_CHECK(error.empty(), "checkpoint ", final_dir.string(), " not written (earlier ones are kept): ", error);
  if (is_main()) {
    const double s = timer.seconds();
    char line[160];
    std::snprintf(line, sizeof(line), " (%.1f MB in %.2f s, %.0f MB/s)", static_cast<double>(bytes) / 1e6, s,
                  static_cast<double>(bytes) / 1e6 / std::max(s, 1e-9));
    log_info("saved checkpoint " + final_dir.string() + line);
  }
  return final_dir.string();
}

void Trainer::load_checkpoint(const std::string& dir) {
  io::CheckpointReader r(dir);
  load_pieces(checkpoint_source(r), parallel_->checkpoint_pieces());
  const auto& meta = r.manifest().meta;
  const std::string what = dir + "/manifest.json meta";
  step_ = r.manifest().step;
  sample_base_ = meta.at("samples_seen", what).integer(what + " samples_seen");
  next_sample_ = sample_base_;
  pending_.reset();
  loader_.reset();  // restarts at sample_base_ on the next step
  parallel_->set_optimizer_steps(step_);
  if (r.has("rng/cpu")) {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(r.read_full("rng/cpu"));
  }
}

void Trainer::resume() {
  namespace fs = std::filesystem;
  const auto& how = cfg_.checkpoint.resume;
  if (how.empty()) return;
  const std::string root = checkpoint_root(cfg_);
  std::vector<std::string> dirs;
  if (how == "auto") {
    // Rank 0's listing decides, so every rank tries the same checkpoints.
    std::string list;
    if (is_main())
      for (const auto& c : io::list_checkpoints(root)) list += c.second + "\n";
    list = parallel_->all_gather_strings(list)[0];
    for (size_t a = 0, b; (b = list.find('\n', a)) != std::string::npos; a = b + 1) dirs.push_back(list.substr(a, b - a));
    if (dirs.empty()) {
      if (is_main()) log_info("checkpoint.resume=auto: no checkpoint under " + root + "; starting from step 0");
      return;
    }
  } else {
    dirs.push_back(how);
  }
  for (size_t i = 0; i < dirs.size(); ++i) {
    std::string error;
    try {
      load_checkpoint(dirs[i]);
    } catch (const std::exception& e) {
      error = "rank " + std::to_string(rt_.rank) + ": " + e.what();
    }
    std::string first;
    for (const auto& e : parallel_->all_gather_strings(error))
      if (first.empty()) first = e;
    if (first.empty()) {
      if (is_main()) log_info("resumed from " + dirs[i] + " at step " + std::to_string(step_));
      return;
    }
    DHP_CHECK(how == "auto", "cannot resume from checkpoint.resume=", how, ": ", first);
    if (i + 1 == dirs.size()) {
      DHP_FAIL("checkpoint.resume=auto: no usable checkpoint under ", root, "; the oldest, ", dirs[i], ", failed with: ",
               first);
    }
    if (is_main()) log_warn("checkpoint " + dirs[i] + " is unusable (" + first + "); falling back to " + dirs[i + 1]);
  }
}

const data::ShapesDataset& Trainer::dataset() const {
  DHP_CHECK(train_data_ != nullptr, "Trainer::dataset(): data.dataset is ", cfg_.data.dataset, ", not shapes");
  return *train_data_;
}

int64_t Trainer::data_position() const {
  if (pending_) return pending_position_;
  if (llava_) return loader_ ? loader_->position() : sample_base_;
  return next_sample_;
}

data::Sample Trainer::take_sample() {
  if (pending_) {
    auto s = std::move(*pending_);
    pending_.reset();
    return s;
  }
  if (!llava_) return train_data_->get(next_sample_++, true);
  if (!loader_) {
    // Every rank reads the whole global batch (the parallel model splits it), in stream order.
    loader_ = std::make_unique<data::Loader>(llava_, sample_base_, 0, 1, cfg_.data.workers, cfg_.data.prefetch);
  }
  return loader_->next();
}

std::vector<std::vector<data::Sample>> Trainer::next_step_samples() {
  const int64_t B = cfg_.data.batch_size, M = cfg_.training.micro_batches, budget = cfg_.data.pack_tokens;
  const auto& l = parallel_->layouts();
  const int64_t min_samples = std::max(l.vision.dp, l.text.dp);  // one per replica of either module
  std::vector<std::vector<data::Sample>> out;
  for (int64_t mb = 0; mb < M; ++mb) {
    std::vector<data::Sample> samples;
    if (budget > 0) {
      int64_t tokens = 0;
      while (true) {
        const int64_t at = data_position();
        auto s = take_sample();
        const auto len = static_cast<int64_t>(s.ids.size());
        if (static_cast<int64_t>(samples.size()) >= min_samples && tokens + len > budget) {
          pending_ = std::move(s);  // opens the next micro-batch
          pending_position_ = at;
          break;
        }
        tokens += len;
        samples.push_back(std::move(s));
      }
    } else {
      const int64_t n = B / M + (mb < B % M ? 1 : 0);
      for (int64_t i = 0; i < n; ++i) {
        if (!llava_) {  // generated: pixels only where this rank encodes them
          samples.push_back(train_data_->get(next_sample_++, parallel_->encodes(i, n)));
        } else {
          samples.push_back(take_sample());
        }
      }
    }
    const auto n = static_cast<int64_t>(samples.size());
    for (int64_t i = 0; i < n; ++i) {
      if (!parallel_->encodes(i, n)) samples[i].pixel_values = torch::Tensor();  // another replica encodes it
    }
    out.push_back(std::move(samples));
  }
  return out;
}

StepMetrics Trainer::train_step() {
  DHP_CHECK(step_ + 1 != fail_at_step_, "injected failure on rank ", rt_.rank, " at step ", step_ + 1,
            " (DHP_TEST_FAIL_AT)");
  if (step_ + 1 == kill_at_step_) ::raise(SIGKILL);
  Timer timer;
  reset_memory_peak();
  const auto comm0 = dist::comm_stats();
  parallel_->zero_grad();  // the last step's gradients go before this step's pixels arrive
  memory_mark("step start");
  const double data_wait0 = loader_ ? loader_->wait_seconds() : 0;
  Timer samples_timer;
  auto micro = next_step_samples();
  memory_mark("samples");
  StepMetrics m;
  m.samples_s = samples_timer.seconds();
  if (loader_) {
    m.data_wait_s = loader_->wait_seconds() - data_wait0;
    m.skipped_samples = loader_->skipped();
  }
  for (const auto& mb : micro) {
    m.samples += static_cast<int64_t>(mb.size());
    for (const auto& s : mb) {
      m.target_tokens += data::num_targets(s);
      m.tokens += static_cast<int64_t>(s.ids.size());
      for (const auto& g : s.grids) m.patches += g[0] * g[1] * g[2];  // pixels may live on other ranks
    }
    m.model_flops += training_flops(cfg_.model.config, mb);
  }
  DHP_CHECK(m.target_tokens > 0, "step ", step_, ": the global batch has no answer tokens");
  const auto fb = parallel_->forward_backward(std::move(micro), static_cast<double>(m.target_tokens));
  double loss_sum = fb.loss_sum;
  m.wait_s = fb.wait_s;
  m.lr = lr_at(step_, cfg_.training.steps, cfg_.training.warmup_steps, cfg_.training.lr, cfg_.training.min_lr);
  Timer update_timer;
  m.grad_norm = parallel_->finish_step(m.lr, cfg_.training.grad_clip);
  m.update_s = update_timer.seconds();
  loss_sum = parallel_->sum_over_job(loss_sum);
  ++step_;
  m.step = step_;
  m.loss = loss_sum / static_cast<double>(m.target_tokens);
  m.peak_bytes = static_cast<int64_t>(parallel_->max_over_job(static_cast<double>(memory_peak_bytes())));
  m.step_time_s = timer.seconds();
  m.tokens_per_s = static_cast<double>(m.tokens) / m.step_time_s;
  m.patches_per_s = static_cast<double>(m.patches) / m.step_time_s;
  const auto comm1 = dist::comm_stats();
  m.comm_s = comm1.seconds - comm0.seconds;
  m.comm_calls = comm1.calls - comm0.calls;
  m.comm_bytes = comm1.bytes - comm0.bytes;
  // Busy = the step minus the time blocked on the other module (idle).
  constexpr size_t kFigures = 7;
  const auto per_rank = parallel_->gather_over_job({static_cast<double>(memory_peak_bytes()), m.comm_s,
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
  return m;
}

int64_t Trainer::eval_size(int64_t wanted) const {
  return llava_eval_ ? std::min(wanted, llava_eval_->epoch_size()) : wanted;
}

std::vector<data::Sample> Trainer::eval_samples(int64_t start, int64_t count) {
  std::vector<data::Sample> out;
  if (eval_data_) {
    for (int64_t i = start; i < start + count; ++i) out.push_back(eval_data_->get(i));
    return out;
  }
  if (!eval_loader_) eval_loader_ = std::make_unique<data::Loader>(llava_eval_, 0, 0, 1, cfg_.data.workers, cfg_.data.prefetch);
  // One epoch at most: bad held-out samples are skipped (counted by the loader), never repeated.
  while (static_cast<int64_t>(eval_cache_.size()) < start + count &&
         eval_loader_->position() < llava_eval_->epoch_size()) {
    auto s = eval_loader_->next();
    if (eval_loader_->position() > llava_eval_->epoch_size()) break;  // wrapped into the next epoch
    eval_cache_.push_back(std::move(s));
  }
  for (int64_t i = start; i < std::min<int64_t>(start + count, static_cast<int64_t>(eval_cache_.size())); ++i) {
    out.push_back(eval_cache_[static_cast<size_t>(i)]);
  }
  return out;
}

EvalResult Trainer::evaluate(int64_t num_samples) {
  if (!eval_data_ && !llava_eval_) {
    if (is_main()) log_info("no held-out evaluation for data.dataset=" + cfg_.data.dataset + " without data.eval_files");
    return {};
  }
  num_samples = eval_size(num_samples);
  if (parallel_->plain()) return evaluate_model(model(), num_samples);
  // Sharded: rank 0 evaluates a single-process copy of the full parameters.
  auto full = parallel_->full_parameters();
  EvalResult r;
  if (is_main()) {
    auto m = build_model(cfg_);
    torch::NoGradGuard no_grad;
    for (auto& kv : m->named_parameters()) kv.value().copy_(full.at(kv.key()));
    full.clear();
    r = evaluate_model(*m, num_samples);
  }
  parallel_->barrier();
  return r;
}

EvalResult Trainer::evaluate_model(qwen::Qwen2_5_VLImpl& model, int64_t num_samples) {
  torch::NoGradGuard no_grad;
  EvalResult r;
  double loss_sum = 0;
  int64_t tokens = 0;
  std::vector<int64_t> slot_hits, slot_total;
  const int64_t chunk = std::max<int64_t>(1, cfg_.data.batch_size);
  const auto device = model.parameters().front().device();  // batches go there; the counting stays on the host
  for (int64_t start = 0; start < num_samples; start += chunk) {
    auto samples = eval_samples(start, std::min(num_samples, start + chunk) - start);
    if (samples.empty()) break;  // the held-out files had fewer good samples
    auto b = data::collate(samples, cfg_.model.config);
    auto logits = model.target_logits(qwen::to_device(b, device)).cpu();  // (n, vocab), target positions in order
    auto sel = b.targets.ne(-100).nonzero().squeeze(-1);
    auto tgt = b.targets.index_select(0, sel);
    loss_sum += torch::nn::functional::cross_entropy(
                    logits, tgt, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                    .item<double>();
    tokens += tgt.numel();
    auto correct = logits.argmax(-1).eq(tgt);
    // Sample of each target position: count of cu_seqlens offsets <= position, minus one.
    auto cu = torch::tensor(b.cu_seqlens, torch::kInt64);
    auto sample = torch::searchsorted(cu, sel, /*out_int32=*/false, /*right=*/true) - 1;
    auto wrong = torch::zeros({b.num_samples()}, torch::kInt64).index_add_(0, sample, correct.logical_not().to(torch::kInt64));
    r.exact += wrong.eq(0).sum().item<int64_t>();
    // Answer slot of each target position: its rank among the sample's target positions.
    auto first = torch::zeros({b.num_samples()}, torch::kInt64).fill_(std::numeric_limits<int64_t>::max());
    first.scatter_reduce_(0, sample, sel, "amin");
    auto slot = sel - first.index_select(0, sample);
    const int64_t nslots = slot.max().item<int64_t>() + 1;
    if (static_cast<int64_t>(slot_hits.size()) < nslots) {
      slot_hits.resize(nslots, 0);
      slot_total.resize(nslots, 0);
    }
    auto hits = torch::zeros({nslots}, torch::kInt64).index_add_(0, slot, correct.to(torch::kInt64));
    auto tot = torch::bincount(slot, {}, nslots);
    for (int64_t i = 0; i < nslots; ++i) {
      slot_hits[i] += hits[i].item<int64_t>();
      slot_total[i] += tot[i].item<int64_t>();
    }
    r.samples += b.num_samples();
  }
  r.accuracy = r.samples ? static_cast<double>(r.exact) / static_cast<double>(r.samples) : 0;
  r.loss = tokens ? loss_sum / static_cast<double>(tokens) : 0;
  for (size_t i = 0; i < slot_hits.size(); ++i) {
    r.slot_accuracy.push_back(static_cast<double>(slot_hits[i]) / static_cast<double>(std::max<int64_t>(1, slot_total[i])));
  }
  return r;
}

EvalResult Trainer::run() {
  namespace fs = std::filesystem;
  const fs::path dir(cfg_.output.dir);
  const bool main = is_main();  // rank 0 alone reports and writes
  std::ofstream metrics;
  double first_loss = 0, last_loss = 0;
  if (main) {
    fs::create_directories(dir);
    std::ofstream c(dir / "config.yaml");
    c << "# resolved dhp config (dhp " << DHP_VERSION << ")\n" << to_yaml(cfg_);
    // Resumed: the lines of the steps up to the checkpoint stay, later ones (from an
    // interrupted attempt) are written again.
    std::string kept;
    if (step_ > 0) {
      std::ifstream old(dir / "metrics.jsonl");
      std::string line;
      while (std::getline(old, line)) {
        const auto p = line.find("\"step\": ");
        if (p != std::string::npos && std::atoll(line.c_str() + p + 8) <= step_) kept += line + "\n";
      }
    }
    metrics.open(dir / "metrics.jsonl");
    DHP_CHECK(metrics.good(), "cannot write ", (dir / "metrics.jsonl").string());
    metrics << kept;
    if (!kept.empty()) {
      first_loss = std::atof(kept.c_str() + kept.find("\"loss\": ") + 8);
      last_loss = std::atof(kept.c_str() + kept.rfind("\"loss\": ") + 8);
    }
  }
  const auto pc = qwen::count_parameters(cfg_.model.config);
  if (main) {
    log_info("model " + cfg_.model.preset + ": " + std::to_string(pc.vision) + " vision + " +
           std::to_string(pc.text) + " text parameters; " + std::to_string(cfg_.training.steps) +
           " steps of " +
           (cfg_.data.pack_tokens > 0 ? std::to_string(cfg_.training.micro_batches) + " micro-batch(es) packed to " +
                                            std::to_string(cfg_.data.pack_tokens) + " tokens"
                                      : std::to_string(cfg_.data.batch_size) + " samples") +
           "; threads " +
           std::to_string(torch::get_num_threads()) + "; run dir " + dir.string());
    log_info("parallel: " + std::to_string(rt_.world) + " rank(s), " + describe(parallel_->layouts()));
    if (!parallel_->device().is_cpu()) {
      log_info("device: " + parallel_->device().str() + " (model, activations and optimizer state; the samples are " +
               "made on the CPU; peak memory figures count CPU tensors only)");
    }
    log_info("fp32 GEMMs: " + blas_description());
    if (!blas_hint().empty()) log_warn(blas_hint());
  }
  const bool tty = isatty(2);
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
    if (!main) continue;
    metrics << metrics_json(m) << "\n";
    metrics.flush();
    if (s == 0) first_loss = m.loss;
    last_loss = m.loss;
    const double eta =
        total.seconds() / static_cast<double>(s + 1 - start) * static_cast<double>(cfg_.training.steps - s - 1);
    char line[256];
    std::snprintf(line, sizeof(line), "step %lld/%lld loss %.4f lr %.2e tok/s %.0f ETA %s peak %s",
                  static_cast<long long>(m.step), static_cast<long long>(cfg_.training.steps), m.loss, m.lr,
                  m.tokens_per_s, fmt_duration(eta).c_str(), format_bytes(m.peak_bytes).c_str());
    if (tty) {
      const int width = 24, done = static_cast<int>(width * m.step / cfg_.training.steps);
      std::fprintf(stderr, "\r[%s%s] %s   ", std::string(done, '#').c_str(), std::string(width - done, '.').c_str(), line);
      if (m.step == cfg_.training.steps) std::fprintf(stderr, "\n");
    } else if (m.step % cfg_.training.log_every == 0 || m.step == 1 || m.step == cfg_.training.steps) {
      std::fprintf(stderr, "%s\n", line);
    }
    std::fflush(stderr);
  }
  const double train_s = total.seconds();
  if (main && llava_) {
    char line[200];
    std::snprintf(line, sizeof(line), "data: waited %.2f s for samples in %.1f s of training (%.1f%%); %lld bad sample(s) skipped",
                  data_wait, train_s, 100 * data_wait / std::max(train_s, 1e-9), static_cast<long long>(skipped));
    log_info(line);
  }
  if (cfg_.output.hf_export) {
    auto full = parallel_->full_parameters();  // collective; complete on rank 0
    if (main) {
      const auto hf = (dir / "hf").string();
      qwen::save_hf(hf, full, cfg_.model.config);
      log_info("wrote the trained model as a Hugging Face directory: " + hf);
    }
    parallel_->barrier();
  }
  EvalResult ev;
  if (cfg_.data.eval_samples > 0) ev = evaluate(cfg_.data.eval_samples);
  if (!main) return ev;
  std::ofstream summary(dir / "summary.json");
  summary << std::setprecision(8) << "{\"steps\": " << cfg_.training.steps << ", \"first_loss\": " << first_loss
          << ", \"final_loss\": " << last_loss << ", \"train_seconds\": " << train_s
          << ", \"eval_samples\": " << ev.samples << ", \"eval_exact_match\": " << ev.accuracy
          << ", \"eval_loss\": " << ev.loss << ", \"data_wait_fraction\": " << data_wait / std::max(train_s, 1e-9)
          << ", \"skipped_samples\": " << skipped << ", \"chance\": " << (train_data_ ? 1.0 / static_cast<double>(train_data_->num_answers()) : 0.0)
          << "}\n";
  char line[256];
  if (ev.samples > 0) {
    char chance[48] = "";
    if (train_data_) {
      std::snprintf(chance, sizeof(chance), " (chance %.1f%%)", 100.0 / static_cast<double>(train_data_->num_answers()));
    }
    std::snprintf(line, sizeof(line),
                  "done in %s: loss %.4f -> %.4f; held-out loss %.4f, exact match %lld/%lld = %.1f%%%s",
                  fmt_duration(train_s).c_str(), first_loss, last_loss, ev.loss, static_cast<long long>(ev.exact),
                  static_cast<long long>(ev.samples), 100 * ev.accuracy, chance);
  } else {
    std::snprintf(line, sizeof(line), "done in %s: loss %.4f -> %.4f (no held-out evaluation: %s)",
                  fmt_duration(train_s).c_str(), first_loss, last_loss,
                  llava_ && !llava_eval_ ? "no data.eval_files" : "data.eval_samples=0");
  }
  log_info(line);
  std::string slots = "held-out token accuracy per answer position:";
  for (double a : ev.slot_accuracy) {
    char buf[16];
    std::snprintf(buf, sizeof(buf), " %.2f", a);
    slots += buf;
  }
  if (!ev.slot_accuracy.empty()) log_info(slots);
  return ev;
}

}  // namespace dhp::train
