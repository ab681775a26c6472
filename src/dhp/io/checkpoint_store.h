// The on-disk side of training checkpoints, independent of any model or layout: every
// saved tensor is a global tensor (name, dtype, global shape) stored as slices
// (a box: offset + shape in the global index space) spread over per-rank safetensors
// files, described by one manifest. A reader asks for any box of any tensor and gets it
// assembled from whichever slices overlap it, so a checkpoint written under one layout
// loads under any other. See docs/checkpoint_format.md.
//
// Crash safety: ranks write into DIR/.step-N.tmp/, rank 0 writes manifest.json last, and
// the directory is renamed to DIR/step-N only then; a directory without a valid manifest,
// a missing or truncated file, or a slice whose CRC-32 differs is refused with a message
// naming the file.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dhp/io/json.h"

namespace dhp::io {

class SafetensorsReader;

// CRC-32 (IEEE 802.3, as zlib's crc32), continuing from `crc`.
uint32_t crc32(const void* data, size_t n, uint32_t crc = 0);

struct SliceRecord {
  std::string file;                       // file name inside the checkpoint directory
  std::string key;                        // tensor name inside that file
  std::vector<int64_t> offset, shape;     // the box in the global tensor
  uint32_t crc = 0;                       // CRC-32 of the slice's bytes
};

struct TensorRecord {
  std::string dtype;                      // safetensors dtype name
  std::vector<int64_t> shape;             // global shape
  std::vector<SliceRecord> slices;
};

// Collects the slices one rank holds and writes them as one safetensors file.
class SliceWriter {
 public:
  // `file`: the file name this rank writes inside the checkpoint's temporary directory.
  explicit SliceWriter(std::string file) : file_(std::move(file)) {}
  // Adds the box of global tensor `name` (global shape `shape`) at `offset` that `t` holds.
  void add(const std::string& name, const std::vector<int64_t>& shape, const std::vector<int64_t>& offset,
           const torch::Tensor& t);
  // Writes DIR/file (atomically) and returns the records for the manifest, as JSON text
  // (so that it can travel to rank 0 as bytes).
  std::string write(const std::string& dir) const;

 private:
  std::string file_;
  std::vector<std::pair<std::string, torch::Tensor>> tensors_;
  std::map<std::string, TensorRecord> records_;
};

struct Manifest {
  int64_t step = 0;
  Json meta = Json::object();  // trainer state, layout, config, version: opaque here
  std::map<std::string, TensorRecord> tensors;
};

// Rank 0: merges the ranks' records (SliceWriter::write results), checks that every
// tensor's slices tile its global shape exactly once, writes manifest.json into `tmp_dir`
// and renames `tmp_dir` to `final_dir`. Throws (leaving final_dir absent) otherwise.
void commit_checkpoint(const std::string& tmp_dir, const std::string& final_dir, int64_t step, const Json& meta,
                       const std::vector<std::string>& rank_records);

// A committed checkpoint, opened for reading. The constructor checks the manifest and
// that every file exists and is a valid safetensors file holding the slices it names;
// CRCs are verified on first read of each slice (verify_all() reads everything).
class CheckpointReader {
 public:
  explicit CheckpointReader(const std::string& dir);
  ~CheckpointReader();
  const Manifest& manifest() const { return manifest_; }
  const std::string& dir() const { return dir_; }
  bool has(const std::string& name) const { return manifest_.tensors.count(name) > 0; }
  // The box [offset, offset + shape) of tensor `name`, assembled from the slices.
  torch::Tensor read(const std::string& name, const std::vector<int64_t>& offset,
                     const std::vector<int64_t>& shape) const;
  torch::Tensor read_full(const std::string& name) const;
  void verify_all() const;

 private:
  const SafetensorsReader& file(const std::string& name) const;
  void check_crc(const SliceRecord& s) const;
  std::string dir_;
  Manifest manifest_;
  mutable std::map<std::string, std::unique_ptr<SafetensorsReader>> files_;
  mutable std::map<std::string, bool> verified_;
};

// Committed checkpoints under `root` (directories step-N with a manifest), newest first.
std::vector<std::pair<int64_t, std::string>> list_checkpoints(const std::string& root);
// Keeps the newest `keep` checkpoints under `root`, removes older ones and stale
// temporary directories. keep <= 0 keeps all.
void prune_checkpoints(const std::string& root, int64_t keep);

}  // namespace dhp::io
