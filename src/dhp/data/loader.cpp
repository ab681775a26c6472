#include "dhp/data/loader.h"

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <random>

#include "dhp/core/error.h"
#include "dhp/core/log.h"
#include "dhp/io/json.h"
#include "dhp/io/safetensors.h"

namespace dhp::data {
namespace {

namespace fs = std::filesystem;

// A permutation of 0..n-1 from a seed (Fisher-Yates on mt19937_64: the same on every platform).
std::vector<int64_t> permutation(int64_t n, uint64_t seed) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = i;
  std::mt19937_64 rng(seed);
  for (int64_t i = n - 1; i > 0; --i) std::swap(v[static_cast<size_t>(i)], v[rng() % static_cast<uint64_t>(i + 1)]);
  return v;
}

uint64_t mix(uint64_t a, uint64_t b) { return (a ^ (b + 0x9E3779B97F4A7C15ULL + (a << 6) + (a >> 2))) * 0xBF58476D1CE4E5B9ULL; }

}  // namespace

LlavaDataset::LlavaDataset(const LoaderOptions& o, std::shared_ptr<const Tokenizer> tokenizer)
    : o_(o), tok_(std::move(tokenizer)) {
  DHP_CHECK(!o_.datasets.empty(), "no dataset given");
  for (size_t k = 0; k < o_.datasets.size(); ++k) {
    const auto& d = o_.datasets[k];
    DHP_CHECK(d.fraction >= 0, "dataset ", d.annotations, ": fraction ", d.fraction, " must be >= 0");
    const std::string root = d.root.empty() ? fs::path(d.annotations).parent_path().string() : d.root;
    std::vector<BadRecord> bad;
    auto recs = read_llava(d.annotations, root.empty() ? "." : root, bad);
    if (!bad.empty() && o_.strict) DHP_FAIL(bad.front().where, ": ", bad.front().reason);
    bad_.insert(bad_.end(), bad.begin(), bad.end());
    const auto first = static_cast<int64_t>(records_.size());
    for (auto& r : recs) {
      records_.push_back(std::move(r));
      roots_.push_back(root.empty() ? "." : root);
    }
    std::vector<int64_t> idx;
    for (int64_t i = first; i < static_cast<int64_t>(records_.size()); ++i) idx.push_back(i);
    picks_.push_back(idx);
    const auto n = static_cast<int64_t>(idx.size());
    epoch_size_ += static_cast<int64_t>(std::llround(d.fraction * static_cast<double>(n)));
    if (!bad.empty()) {
      log_warn(d.annotations + ": " + std::to_string(bad.size()) + " bad record(s) skipped; first: " +
               bad.front().where + ": " + bad.front().reason);
    }
  }
  DHP_CHECK(epoch_size_ > 0, "no usable record in the dataset(s)",
            bad_.empty() ? std::string() : "; first bad one: " + bad_.front().where + ": " + bad_.front().reason);
}

const LlavaRecord& LlavaDataset::record(int64_t p) const {
  DHP_CHECK(p >= 0, "stream position ", p);
  const int64_t epoch = p / epoch_size_, i = p % epoch_size_;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = orders_.find(epoch);
  if (it == orders_.end()) {
    if (orders_.size() > 4) orders_.erase(orders_.begin());
    std::vector<int64_t> all;
    for (size_t k = 0; k < picks_.size(); ++k) {
      const auto& idx = picks_[k];
      const auto n = static_cast<int64_t>(idx.size());
      if (n == 0) continue;
      const int64_t count = std::llround(o_.datasets[k].fraction * static_cast<double>(n));
      for (int64_t c = 0; c < count / n; ++c) all.insert(all.end(), idx.begin(), idx.end());
      const auto perm = permutation(n, mix(mix(o_.seed, static_cast<uint64_t>(epoch)), k + 1));
      for (int64_t c = 0; c < count % n; ++c) all.push_back(idx[static_cast<size_t>(perm[static_cast<size_t>(c)])]);
    }
    const auto perm = permutation(static_cast<int64_t>(all.size()), mix(o_.seed, static_cast<uint64_t>(epoch)));
    std::vector<int64_t> order(all.size());
    for (size_t j = 0; j < all.size(); ++j) order[j] = all[static_cast<size_t>(perm[j])];
    it = orders_.emplace(epoch, std::move(order)).first;
  }
  return records_[static_cast<size_t>(it->second[static_cast<size_t>(i)])];
}

const std::string& LlavaDataset::where(int64_t p) const { return record(p).where; }

VideoOptions LlavaDataset::video_options(const VideoSettings& v) const {
  VideoOptions o = o_.video;
  if (v.fps > 0) {
    o.fps = v.fps;
    o.nframes = 0;
  }
  if (v.nframes > 0) o.nframes = v.nframes;
  if (v.start >= 0) o.start = v.start;
  if (v.end >= 0) o.end = v.end;
  if (v.min_pixels > 0) o.min_pixels = v.min_pixels;
  if (v.max_pixels > 0) o.requested_max_pixels = v.max_pixels;
  if (v.total_pixels > 0) o.total_pixels = v.total_pixels;
  return o;
}

Sample LlavaDataset::load(int64_t p, bool pixels) const {
  const auto& r = record(p);
  const auto& root = roots_[static_cast<size_t>(&r - records_.data())];
  try {
    Sample s;
    std::vector<int64_t> image_tokens, video_tokens;
    std::vector<torch::Tensor> pv;
    const int64_t unit = o_.merge_size * o_.merge_size;
    const VideoOptions video = video_options(r.video);
    size_t image = 0, clip = 0;
    for (char kind : r.order) {  // images and videos in the order of their tags
      if (kind == 'i') {
        const auto pp = preprocess(load_image(resolve_image(root, r.images[image++])), o_.image);
        s.grids.push_back({pp.grid[0], pp.grid[1], pp.grid[2]});
        s.second_per_grid_t.push_back(0);
        image_tokens.push_back(pp.grid[0] * pp.grid[1] * pp.grid[2] / unit);
        if (pixels) pv.push_back(pp.pixel_values);
        continue;
      }
      const std::string path = resolve_image(root, r.videos[clip++]);
      std::array<int64_t, 3> grid{};
      float seconds = 0;
      if (pixels) {
        auto vp = preprocess_video(path, video, o_.image);
        grid = vp.grid;
        seconds = vp.second_per_grid_t;
        pv.push_back(std::move(vp.pixel_values));
      } else {
        const auto plan = plan_video(probe_video(path, video), video, o_.image.patch_size * o_.image.merge_size);
        grid = video_grid(plan, o_.image);
        seconds = second_per_grid_t(plan, o_.image);
      }
      s.grids.push_back({grid[0], grid[1], grid[2]});
      s.second_per_grid_t.push_back(seconds);
      video_tokens.push_back(grid[0] * grid[1] * grid[2] / unit);
    }
    if (r.videos.empty()) s.second_per_grid_t.clear();
    if (!pv.empty()) s.pixel_values = torch::cat(pv, 0);
    auto e = encode_chat(*tok_, r, image_tokens, o_.chat, video_tokens);
    s.ids = std::move(e.ids);
    s.labels = std::move(e.labels);
    s.answer = r.turns.back().text;
    return s;
  } catch (const Error& e) {
    DHP_FAIL(r.where, ": ", e.what());
  }
}

Loader::Loader(std::shared_ptr<const LlavaDataset> data, int64_t start, int64_t replica, int64_t replicas,
               int64_t workers, int64_t prefetch)
    : data_(std::move(data)), replica_(replica), replicas_(replicas), prefetch_(std::max<int64_t>(1, prefetch)) {
  DHP_CHECK(replicas >= 1 && replica >= 0 && replica < replicas, "replica ", replica, " of ", replicas);
  DHP_CHECK(start >= 0 && workers >= 1, "loader start ", start, ", workers ", workers);
  // The first position of this replica at or after `start`.
  next_ = start + ((replica_ - start % replicas_) % replicas_ + replicas_) % replicas_;
  claim_ = next_;
  for (int64_t w = 0; w < workers; ++w) threads_.emplace_back([this] { work(); });
}

Loader::~Loader() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void Loader::work() {
  while (true) {
    int64_t p = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || claim_ < next_ + prefetch_ * replicas_; });
      if (stop_) return;
      p = claim_;
      claim_ += replicas_;
    }
    Slot s;
    try {
      s.sample = data_->load(p);
      s.ok = true;
    } catch (const std::exception& e) {
      s.error = e.what();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      ready_[p] = std::move(s);
    }
    cv_.notify_all();
  }
}

Sample Loader::next() {
  int64_t bad_run = 0;
  const int64_t limit = std::max<int64_t>(1, data_->epoch_size() / replicas_);
  while (true) {
    Slot s;
    {
      std::unique_lock<std::mutex> lock(mu_);
      const auto t0 = std::chrono::steady_clock::now();
      cv_.wait(lock, [&] { return ready_.count(next_) > 0; });
      wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      s = std::move(ready_[next_]);
      ready_.erase(next_);
      next_ += replicas_;
    }
    cv_.notify_all();
    if (s.ok) return std::move(s.sample);
    DHP_CHECK(!data_->strict(), s.error);
    ++skipped_;
    if (reasons_.size() < 10) {
      reasons_.push_back(s.error);
      log_warn("skipped a bad sample: " + s.error);
    }
    DHP_CHECK(++bad_run < limit, "every one of ", bad_run, " samples in a row failed (a whole epoch's share of ",
              "replica ", replica_, "); the last: ", s.error);
  }
}

void write_synthetic(const std::string& dir, int64_t num, const qwen::ModelConfig& model, const ShapesOptions& options) {
  DHP_CHECK(num > 0, "--num must be > 0, got ", num);
  ShapesDataset shapes(model, options);
  const bool video = shapes.video();
  fs::create_directories(fs::path(dir) / (video ? "videos" : "images"));
  const std::string codec = video_encoder_available("libx264") ? "libx264" : "mpeg4";
  std::string jsonl;
  for (int64_t i = 0; i < num; ++i) {
    char name[32];
    Sample s;
    if (video) {
      std::vector<Image> frames;
      s = shapes.render_frames(i, frames);
      std::snprintf(name, sizeof(name), "videos/%06lld.mp4", static_cast<long long>(i));
      write_video((fs::path(dir) / name).string(), frames, options.fps, codec);
    } else {
      Image img;
      s = shapes.render(i, img.rgb, img.width, img.height);
      std::snprintf(name, sizeof(name), "images/%06lld.png", static_cast<long long>(i));
      save_png(img, (fs::path(dir) / name).string());
    }
    io::Json conv = io::Json::array();
    io::Json q = io::Json::object(), a = io::Json::object();
    q.set("from", io::Json("human"));
    q.set("value", io::Json(video ? "<video>\nWhat is in the video?" : "<image>\nWhat is in the image?"));
    a.set("from", io::Json("gpt"));
    a.set("value", io::Json(s.answer));
    conv.push(std::move(q));
    conv.push(std::move(a));
    io::Json rec = io::Json::object();
    rec.set(video ? "video" : "image", io::Json(std::string(name)));
    rec.set("conversations", std::move(conv));
    jsonl += rec.dump() + "\n";
  }
  io::write_file_atomic((fs::path(dir) / "train.jsonl").string(), jsonl);
}

}  // namespace dhp::data
