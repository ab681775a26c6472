// The training data as every rank of a job sees it: one sample stream (data.dataset=shapes:
// generated from the seed; llava: the loader's workers over the files), cut into a step's
// micro-batches (data.batch_size samples, or packed to data.pack_tokens each), its position
// for checkpoints, and the held-out samples for evaluation. Every rank draws the same global
// batch; pixels are kept only where the rank encodes them. Not thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "dhp/data/llava.h"
#include "dhp/data/loader.h"
#include "dhp/data/sample.h"
#include "dhp/data/shapes.h"
#include "dhp/train/config.h"

namespace dhp::train {

// The dataset's video options (data.video_*).
data::VideoOptions video_options(const DataOptions& d);

class DataStream {
 public:
  // Opens the datasets of cfg.data (llava: checks the tokenizer's special ids against the
  // model's; throws naming the key). The stream starts at position 0.
  explicit DataStream(const Config& cfg);

  // Which samples of a micro-batch does this rank encode (needs their pixels)? Given the
  // samples' ids and grids; their pixels may be absent.
  using Encodes = std::function<std::vector<bool>(const std::vector<data::Sample>& micro_batch)>;
  // The next step's samples, split into training.micro_batches micro-batches, each of at
  // least `min_samples` samples (one per data-parallel replica) when packing.
  std::vector<std::vector<data::Sample>> next_step(const Encodes& encodes, int64_t min_samples);

  // The stream position of the next sample a step will use (a packed micro-batch's
  // look-ahead that did not fit counts as unused): what a checkpoint records.
  int64_t position() const;
  // Continues the stream at `position` (resuming from a checkpoint).
  void restart_at(int64_t position);
  // Seconds rank 0 waited for the loader's samples so far, and bad samples it skipped (0
  // without a loader).
  double wait_seconds() const;
  int64_t skipped() const;

  // Held-out samples: whether there are any, how many exist (up to `wanted`), and samples
  // [start, start + count) (shapes: generated from a second seed; llava: the eval files'
  // good samples in their seeded order, at most one epoch).
  bool has_eval() const { return eval_data_ || llava_eval_; }
  int64_t eval_size(int64_t wanted) const;
  std::vector<data::Sample> eval_samples(int64_t start, int64_t count);

  const data::ShapesDataset* shapes() const { return train_data_.get(); }  // null for llava
  bool llava() const { return llava_ != nullptr; }
  bool llava_eval() const { return llava_eval_ != nullptr; }

 private:
  data::Sample take_sample();  // the next sample with its pixels (the look-ahead first)
  Config cfg_;
  std::unique_ptr<data::ShapesDataset> train_data_, eval_data_;  // data.dataset=shapes
  std::shared_ptr<const data::LlavaDataset> llava_;               // data.dataset=llava
  std::shared_ptr<const data::LlavaDataset> llava_eval_;          // data.eval_files
  std::unique_ptr<data::Loader> loader_;                          // created at the first step
  std::unique_ptr<data::Loader> eval_loader_;                     // reads llava_eval_ from its start
  std::vector<data::Sample> eval_cache_;                          // the held-out samples read so far
  int64_t sample_base_ = 0;  // the stream position training (re)started at
  int64_t next_sample_ = 0;  // shapes: the next stream position to generate
  std::optional<data::Sample> pending_;  // packing look-ahead, at stream position pending_position_
  int64_t pending_position_ = 0;
};

}  // namespace dhp::train
