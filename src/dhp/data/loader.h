// Training data from LLaVA-format datasets: several annotation files mixed by fraction, a
// seeded shuffle per epoch, data-parallel shards, and background loading.
//
// The stream: epoch e is a permutation (seed, e) of the epoch's records, where dataset k
// contributes round(fraction_k * size_k) of its records (a seeded choice; fractions above 1
// repeat records). Stream position p is record p % epoch_size of epoch p / epoch_size.
// Replica r of n reads positions r, r + n, r + 2n, ...: disjoint, together covering the
// stream. A position whose sample is bad (missing or corrupt image, too long, ...) is
// skipped and counted; positions only advance, so a loader restarted at position() reads
// exactly what the interrupted one would have read next.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dhp/data/image.h"
#include "dhp/data/llava.h"
#include "dhp/data/shapes.h"
#include "dhp/data/tokenizer.h"
#include "dhp/data/video.h"

namespace dhp::data {

struct DatasetSpec {
  std::string annotations;  // JSON or JSONL file
  std::string root;         // images are relative to it (default: the annotation file's directory)
  double fraction = 1.0;    // records per epoch = round(fraction * records)
};

struct LoaderOptions {
  std::vector<DatasetSpec> datasets;
  uint64_t seed = 0;
  ImageOptions image;
  VideoOptions video;  // a record's own settings (llava.h VideoSettings) win
  ChatOptions chat;
  int64_t merge_size = 2;  // vision tokens per image = patches / merge_size^2
  bool strict = false;     // a bad record or sample stops with its error instead of being skipped
};

class LlavaDataset {
 public:
  // Reads and checks every annotation file (bad records reported, or thrown when strict).
  // Throws when no record is usable.
  LlavaDataset(const LoaderOptions& o, std::shared_ptr<const Tokenizer> tokenizer);
  int64_t epoch_size() const { return epoch_size_; }
  // The sample at stream position p (pixels=false: grids, ids and labels only; the image
  // files are still opened for their sizes, the videos' containers read without decoding).
  // Throws dhp::Error naming the record on a bad sample.
  Sample load(int64_t p, bool pixels = true) const;
  // Where stream position p comes from ("file:line").
  const std::string& where(int64_t p) const;
  const std::vector<BadRecord>& bad_records() const { return bad_; }
  bool strict() const { return o_.strict; }

 private:
  const LlavaRecord& record(int64_t p) const;
  // The dataset's video options with a record's own settings applied.
  VideoOptions video_options(const VideoSettings& v) const;
  LoaderOptions o_;
  std::shared_ptr<const Tokenizer> tok_;
  std::vector<LlavaRecord> records_;
  std::vector<BadRecord> bad_;
  std::vector<std::string> roots_;     // per record
  std::vector<std::vector<int64_t>> picks_;  // per dataset: records drawn per epoch (indices into records_)
  int64_t epoch_size_ = 0;
  mutable std::mutex mu_;
  mutable std::map<int64_t, std::vector<int64_t>> orders_;  // epoch -> permutation (cached)
};

// Reads replica `replica`'s positions in order with `workers` threads, at most `prefetch`
// samples ahead; bad samples are skipped and counted. Not thread-safe (one consumer).
class Loader {
 public:
  Loader(std::shared_ptr<const LlavaDataset> data, int64_t start, int64_t replica, int64_t replicas,
         int64_t workers, int64_t prefetch);
  ~Loader();
  // The next good sample. Throws (naming the last reason) after a whole epoch of bad samples
  // in a row, or at once when the dataset is strict.
  Sample next();
  int64_t position() const { return next_; }  // the next stream position this replica will read
  int64_t skipped() const { return skipped_; }
  const std::vector<std::string>& first_reasons() const { return reasons_; }  // up to 10
  double wait_seconds() const { return wait_s_; }  // time next() blocked on the workers

 private:
  void work();
  std::shared_ptr<const LlavaDataset> data_;
  int64_t replica_, replicas_, prefetch_;
  int64_t next_ = 0;     // consumer: next position
  int64_t claim_ = 0;    // workers: next position to load
  struct Slot {
    bool ok = false;
    Sample sample;
    std::string error;
  };
  std::map<int64_t, Slot> ready_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
  int64_t skipped_ = 0;
  std::vector<std::string> reasons_;
  double wait_s_ = 0;
};

// The shapes task as files: DIR/images/000000.png ... and DIR/train.jsonl with one
// conversation per image ("<image>\nWhat is in the image?" -> "a red triangle top left"),
// the same images and answers as ShapesDataset(model, options).get(i). The moving task
// (options.frames > 0) writes DIR/videos/000000.mp4 ... (H.264, or MPEG-4 part 2 where
// FFmpeg has no libx264) at options.fps with "<video>\nWhat is in the video?" records.
void write_synthetic(const std::string& dir, int64_t num, const qwen::ModelConfig& model, const ShapesOptions& options);

}  // namespace dhp::data
