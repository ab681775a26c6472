// safetensors files (the format of Hugging Face model weights), read and written by dhp's
// own code.
//
// Layout: 8 bytes little-endian u64 N, then N bytes of a JSON object (UTF-8, may end in
// spaces): {"NAME": {"dtype": "BF16", "shape": [..], "data_offsets": [BEGIN, END]}, ...,
// "__metadata__": {"k": "v"}}, then the data buffer; offsets are relative to the buffer,
// tensors are row-major little-endian and together cover the buffer exactly.
//
// Reading maps the file (mmap, read only) and checks the whole header before anything is
// returned: N against the file size, the JSON, every dtype, shape (non-negative, no
// overflow), and offsets (inside the buffer, END - BEGIN = elements x dtype size, no
// overlap, no gap). A malformed file is a dhp::Error naming the file and what is wrong,
// never a crash. Tensors are copied out (all of one, or a range of rows), so a reader
// touches only the pages it needs and results never alias the mapping.
#pragma once

#include "dhp/io/files.h"  // read_file, write_file_atomic

#include <torch/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace dhp::io {

struct TensorInfo {
  std::string name;
  std::string dtype_name;  // "F32", "BF16", ...
  torch::ScalarType dtype;
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;  // byte offsets in the data buffer
  int64_t numel() const;
};

// "F32" <-> torch::kFloat32 and the others safetensors names (F64 F32 F16 BF16 I64 I32 I16
// I8 U8 BOOL); throws dhp::Error naming the dtype otherwise.
torch::ScalarType safetensors_dtype(const std::string& name);
std::string safetensors_dtype_name(torch::ScalarType t);

class SafetensorsReader {
 public:
  explicit SafetensorsReader(const std::string& path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::string& path() const { return path_; }
  // In file order (by offset).
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const;  // throws naming the file
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // The whole tensor (a copy, contiguous, CPU).
  torch::Tensor read(const std::string& name) const;
  // Rows [start, start + count) along dim 0 (a copy).
  torch::Tensor read_rows(const std::string& name, int64_t start, int64_t count) const;
  // The box [offset, offset + shape) of a tensor (a copy, contiguous): only its bytes are
  // read (one copy per innermost run). Throws naming the file when the box is outside.
  torch::Tensor read_box(const std::string& name, const std::vector<int64_t>& offset,
                         const std::vector<int64_t>& shape) const;
  // The raw bytes of a tensor (for checksums and byte-exact comparisons).
  std::pair<const uint8_t*, int64_t> bytes(const std::string& name) const;

 private:
  std::string path_;
  int fd_ = -1;
  const uint8_t* map_ = nullptr;
  int64_t size_ = 0;
  int64_t data_start_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// Writes `tensors` (any CPU dtype above, any layout: written contiguous) to `path`
// atomically: to a temporary name in the same directory, fsynced, then renamed, so a crash
// never leaves a half-written file under `path`. Names must be unique and non-empty.
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});


}  // namespace dhp::io
