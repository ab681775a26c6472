#include "dhp/train/data_stream.h"

#include <torch/torch.h>

#include <tuple>

#include "dhp/core/error.h"
#include "dhp/data/tokenizer.h"

namespace dhp::train {
namespace {

data::ShapesOptions shapes_options(const Config& cfg, uint64_t stream) {
  data::ShapesOptions o;
  o.min_side = cfg.data.min_side;
  o.max_side = cfg.data.max_side;
  o.seed = static_cast<uint64_t>(cfg.data.seed) * 2 + stream;
  o.frames = cfg.data.frames;
  return o;
}

}  // namespace

data::VideoOptions video_options(const DataOptions& d) {
  data::VideoOptions v;
  v.fps = d.video_fps;
  v.nframes = d.video_nframes;
  v.min_frames = d.video_min_frames;
  v.max_frames = d.video_max_frames;
  v.min_pixels = static_cast<double>(d.video_min_pixels);
  v.max_pixels = static_cast<double>(d.video_max_pixels);
  v.total_pixels = static_cast<double>(d.video_total_pixels);
  v.max_side = d.video_max_side;
  v.max_duration_s = d.video_max_duration_s;
  v.timeout_s = d.video_timeout_s;
  return v;
}

DataStream::DataStream(const Config& cfg) : cfg_(cfg) {
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
    o.video = video_options(d);
    auto tok = std::make_shared<const data::Tokenizer>(data::Tokenizer::from_file(d.tokenizer));
    const auto& mc = cfg_.model.config;
    for (const auto& [key, token, id] : {std::tuple<const char*, const char*, int64_t>{"model.image_token_id",
                                                                                      "<|image_pad|>", mc.image_token_id},
                                         {"model.video_token_id", "<|video_pad|>", mc.video_token_id},
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
    train_data_ = std::make_unique<data::ShapesDataset>(cfg_.model.config, shapes_options(cfg, 0));
    eval_data_ = std::make_unique<data::ShapesDataset>(cfg_.model.config, shapes_options(cfg, 1));
  }
}

int64_t DataStream::position() const {
  if (pending_) return pending_position_;
  if (llava_) return loader_ ? loader_->position() : sample_base_;
  return next_sample_;
}

void DataStream::restart_at(int64_t position) {
  sample_base_ = position;
  next_sample_ = position;
  pending_.reset();
  loader_.reset();  // restarts at sample_base_ on the next step
}

double DataStream::wait_seconds() const { return loader_ ? loader_->wait_seconds() : 0; }
int64_t DataStream::skipped() const { return loader_ ? loader_->skipped() : 0; }

data::Sample DataStream::take_sample() {
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

std::vector<std::vector<data::Sample>> DataStream::next_step(const Encodes& encodes, int64_t min_samples) {
  const int64_t B = cfg_.data.batch_size, M = cfg_.training.micro_batches, budget = cfg_.data.pack_tokens;
  std::vector<std::vector<data::Sample>> out;
  for (int64_t mb = 0; mb < M; ++mb) {
    std::vector<data::Sample> samples;
    if (budget > 0) {
      int64_t tokens = 0;
      while (true) {
        const int64_t at = position();
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
      const int64_t first = next_sample_;
      for (int64_t i = 0; i < n; ++i) {
        // Generated: first without pixels, drawn below only where this rank encodes them.
        samples.push_back(llava_ ? take_sample() : train_data_->get(next_sample_++, false));
      }
      if (!llava_) {
        const auto mine = encodes(samples);
        for (int64_t i = 0; i < n; ++i) {
          if (mine[static_cast<size_t>(i)]) samples[static_cast<size_t>(i)] = train_data_->get(first + i, true);
        }
        out.push_back(std::move(samples));
        continue;
      }
    }
    const auto mine = encodes(samples);
    for (size_t i = 0; i < samples.size(); ++i) {
      if (!mine[i]) samples[i].pixel_values = torch::Tensor();  // another replica encodes it
    }
    out.push_back(std::move(samples));
  }
  return out;
}

int64_t DataStream::eval_size(int64_t wanted) const {
  return llava_eval_ ? std::min(wanted, llava_eval_->epoch_size()) : wanted;
}

std::vector<data::Sample> DataStream::eval_samples(int64_t start, int64_t count) {
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

}  // namespace dhp::train
