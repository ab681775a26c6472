#include "dhp/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <torch/torch.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <limits>
#include <set>
#include <string_view>

#include "dhp/core/error.h"
#include "dhp/io/json.h"

namespace dhp::io {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kMaxHeader = 100LL << 20;  // as the reference implementation

struct DtypeName {
  const char* name;
  torch::ScalarType type;
};
const DtypeName kDtypes[] = {
    {"F64", torch::kFloat64}, {"F32", torch::kFloat32}, {"F16", torch::kFloat16}, {"BF16", torch::kBFloat16},
    {"I64", torch::kInt64},   {"I32", torch::kInt32},   {"I16", torch::kInt16},   {"I8", torch::kInt8},
    {"U8", torch::kUInt8},    {"BOOL", torch::kBool},
};

int64_t element_size(torch::ScalarType t) { return static_cast<int64_t>(c10::elementSize(t)); }

// An open temporary file next to `path` that becomes `path` on commit() and is removed if
// never committed.
class AtomicFile {
 public:
  explicit AtomicFile(const std::string& path) : path_(path) {
    tmp_ = path + ".tmp." + std::to_string(::getpid());
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    DHP_CHECK(fd_ >= 0, "cannot create ", tmp_, ": ", std::strerror(errno));
  }
  ~AtomicFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(tmp_.c_str());
  }
  void write(const void* data, size_t n) {
    const auto* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, std::min<size_t>(n, size_t{1} << 30));
      if (w < 0 && errno == EINTR) continue;
      DHP_CHECK(w > 0, "writing ", tmp_, ": ", std::strerror(errno));
      p += w;
      n -= static_cast<size_t>(w);
    }
  }
  void commit() {
    DHP_CHECK(::fsync(fd_) == 0, "fsync ", tmp_, ": ", std::strerror(errno));
    DHP_CHECK(::close(fd_) == 0, "closing ", tmp_, ": ", std::strerror(errno));
    fd_ = -1;
    DHP_CHECK(::rename(tmp_.c_str(), path_.c_str()) == 0, "renaming ", tmp_, " to ", path_, ": ",
              std::strerror(errno));
    committed_ = true;
    // The rename itself must reach the disk.
    auto dir = fs::path(path_).parent_path();
    if (dir.empty()) dir = ".";
    const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
      ::fsync(dfd);
      ::close(dfd);
    }
  }

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  bool committed_ = false;
};

}  // namespace

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

torch::ScalarType safetensors_dtype(const std::string& name) {
  for (const auto& d : kDtypes) {
    if (name == d.name) return d.type;
  }
  std::string known;
  for (const auto& d : kDtypes) known += std::string(known.empty() ? "" : ", ") + d.name;
  DHP_FAIL("unsupported safetensors dtype \"", name, "\" (supported: ", known, ")");
}

std::string safetensors_dtype_name(torch::ScalarType t) {
  for (const auto& d : kDtypes) {
    if (t == d.type) return d.name;
  }
  DHP_FAIL("dtype ", t, " has no safetensors name");
}

namespace {

// One tensor's header entry, checked: dtype, shape (non-negative, no overflow), offsets inside
// the data buffer of `data_size` bytes and matching the shape's bytes.
TensorInfo parse_entry(const std::string& name, const Json& entry, int64_t data_size) {
  const std::string what = "tensor \"" + name + "\"";
  DHP_CHECK(!name.empty(), "a tensor with an empty name");
  TensorInfo t;
  t.name = name;
  t.dtype_name = entry.at("dtype", what).str(what + " dtype");
  t.dtype = safetensors_dtype(t.dtype_name);
  const int64_t esize = element_size(t.dtype);
  int64_t bytes = esize;
  for (const auto& d : entry.at("shape", what).elements(what + " shape")) {
    const int64_t v = d.integer(what + " shape");
    DHP_CHECK(v >= 0, what, " has a negative dimension ", v);
    DHP_CHECK(v == 0 || bytes <= std::numeric_limits<int64_t>::max() / v, what, " is too large (shape overflows)");
    bytes *= v;
    t.shape.push_back(v);
  }
  const auto& off = entry.at("data_offsets", what).elements(what + " data_offsets");
  DHP_CHECK(off.size() == 2, what, " data_offsets must be [begin, end], got ", off.size(), " numbers");
  t.begin = off[0].integer(what + " data_offsets");
  t.end = off[1].integer(what + " data_offsets");
  DHP_CHECK(t.begin >= 0 && t.begin <= t.end && t.end <= data_size, what, " data_offsets [", t.begin, ", ",
            t.end, "] outside the data buffer of ", data_size, " bytes");
  DHP_CHECK(t.end - t.begin == bytes, what, " has ", t.end - t.begin, " bytes but its shape and dtype ",
            t.dtype_name, " need ", bytes);
  return t;
}

// The tensors (sorted by offset here) cover the data buffer exactly: no overlap, gap or tail.
void check_contiguous(std::vector<TensorInfo>& tensors, int64_t data_size) {
  std::stable_sort(tensors.begin(), tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  int64_t at = 0;
  for (const auto& t : tensors) {
    DHP_CHECK(t.begin == at, "tensor \"", t.name, "\" starts at byte ", t.begin, " of the data buffer, expected ", at,
              t.begin < at ? " (overlaps the previous tensor)" : " (a gap before it)");
    at = t.end;
  }
  DHP_CHECK(at == data_size, "the tensors cover ", at, " of the ", data_size, " data bytes (trailing bytes)");
}

}  // namespace

SafetensorsReader::SafetensorsReader(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DHP_CHECK(fd_ >= 0, "cannot open ", path, ": ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    const int e = errno;
    ::close(fd_);
    DHP_FAIL("cannot stat ", path, ": ", std::strerror(e));
  }
  size_ = static_cast<int64_t>(st.st_size);
  auto fail_closed = [&](const std::string& msg) {
    if (map_) ::munmap(const_cast<uint8_t*>(map_), static_cast<size_t>(size_));
    ::close(fd_);
    map_ = nullptr;
    fd_ = -1;
    throw Error(path + ": " + msg);
  };
  if (size_ < 8) fail_closed("not a safetensors file: " + std::to_string(size_) + " bytes, less than the 8-byte header length");
  void* m = ::mmap(nullptr, static_cast<size_t>(size_), PROT_READ, MAP_PRIVATE, fd_, 0);
  if (m == MAP_FAILED) fail_closed(std::string("mmap failed: ") + std::strerror(errno));
  map_ = static_cast<const uint8_t*>(m);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | map_[i];
  if (n > static_cast<uint64_t>(kMaxHeader)) {
    fail_closed("header length " + std::to_string(n) + " is over the 100 MiB limit (corrupt or not safetensors)");
  }
  if (static_cast<int64_t>(n) > size_ - 8) {
    fail_closed("header length " + std::to_string(n) + " but only " + std::to_string(size_ - 8) +
                " bytes follow it (truncated?)");
  }
  data_start_ = 8 + static_cast<int64_t>(n);
  const int64_t data_size = size_ - data_start_;
  try {
    std::string_view text(reinterpret_cast<const char*>(map_ + 8), static_cast<size_t>(n));
    if (text.empty() || text[0] != '{') throw Error("the header must be a JSON object starting with '{'");
    const Json header = Json::parse(text, "header");
    for (const auto& [name, entry] : header.items("header")) {
      if (name == "__metadata__") {
        for (const auto& [k, v] : entry.items("__metadata__")) metadata_[k] = v.str("__metadata__ \"" + k + "\"");
        continue;
      }
      index_[name] = tensors_.size();
      tensors_.push_back(parse_entry(name, entry, data_size));
    }
    check_contiguous(tensors_, data_size);
    for (size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].name] = i;
  } catch (const Error& e) {
    fail_closed(e.what());
  }
}

SafetensorsReader::~SafetensorsReader() {
  if (map_) ::munmap(const_cast<uint8_t*>(map_), static_cast<size_t>(size_));
  if (fd_ >= 0) ::close(fd_);
}

const TensorInfo* SafetensorsReader::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& SafetensorsReader::info(const std::string& name) const {
  const auto* t = find(name);
  DHP_CHECK(t != nullptr, path_, ": no tensor named \"", name, "\"");
  return *t;
}

torch::Tensor SafetensorsReader::read(const std::string& name) const {
  const auto& t = info(name);
  auto out = torch::empty(t.shape, torch::TensorOptions().dtype(t.dtype));
  if (t.end > t.begin) std::memcpy(out.data_ptr(), map_ + data_start_ + t.begin, static_cast<size_t>(t.end - t.begin));
  return out;
}

torch::Tensor SafetensorsReader::read_rows(const std::string& name, int64_t start, int64_t count) const {
  const auto& t = info(name);
  DHP_CHECK(!t.shape.empty(), path_, ": tensor \"", name, "\" is a scalar; it has no rows");
  DHP_CHECK(start >= 0 && count >= 0 && start + count <= t.shape[0], path_, ": rows [", start, ", ", start + count,
            ") of tensor \"", name, "\" with ", t.shape[0], " rows");
  auto shape = t.shape;
  shape[0] = count;
  auto out = torch::empty(shape, torch::TensorOptions().dtype(t.dtype));
  const int64_t row_bytes = t.shape[0] == 0 ? 0 : (t.end - t.begin) / t.shape[0];
  if (count > 0 && row_bytes > 0) {
    std::memcpy(out.data_ptr(), map_ + data_start_ + t.begin + start * row_bytes, static_cast<size_t>(count * row_bytes));
  }
  return out;
}

torch::Tensor SafetensorsReader::read_box(const std::string& name, const std::vector<int64_t>& offset,
                                         const std::vector<int64_t>& shape) const {
  const auto& t = info(name);
  const auto nd = static_cast<int64_t>(t.shape.size());
  DHP_CHECK(static_cast<int64_t>(offset.size()) == nd && static_cast<int64_t>(shape.size()) == nd, path_,
            ": a box of rank ", shape.size(), " of tensor \"", name, "\" of rank ", nd);
  for (int64_t d = 0; d < nd; ++d) {
    DHP_CHECK(offset[d] >= 0 && shape[d] >= 0 && offset[d] + shape[d] <= t.shape[d], path_, ": box offset ",
              c10::IntArrayRef(offset), " shape ", c10::IntArrayRef(shape), " is outside tensor \"", name,
              "\" of shape ", c10::IntArrayRef(t.shape));
  }
  auto out = torch::empty(shape, torch::TensorOptions().dtype(t.dtype));
  if (out.numel() == 0) return out;
  const int64_t esize = out.element_size();
  std::vector<int64_t> stride(nd, 1);  // elements, in the file's tensor
  for (int64_t d = nd - 2; d >= 0; --d) stride[d] = stride[d + 1] * t.shape[d + 1];
  const int64_t run = nd == 0 ? 1 : shape[nd - 1];  // innermost contiguous run
  const int64_t runs = out.numel() / run;
  const uint8_t* src = map_ + data_start_ + t.begin;
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  std::vector<int64_t> at(static_cast<size_t>(std::max<int64_t>(nd - 1, 0)), 0);  // index over the outer dims
  for (int64_t r = 0; r < runs; ++r) {
    int64_t e = nd == 0 ? 0 : offset[nd - 1];
    for (int64_t d = 0; d + 1 < nd; ++d) e += (offset[d] + at[d]) * stride[d];
    std::memcpy(dst + r * run * esize, src + e * esize, static_cast<size_t>(run * esize));
    for (int64_t d = nd - 2; d >= 0; --d) {  // next outer index, row-major
      if (++at[d] < shape[d]) break;
      at[d] = 0;
    }
  }
  return out;
}

std::pair<const uint8_t*, int64_t> SafetensorsReader::bytes(const std::string& name) const {
  const auto& t = info(name);
  return {map_ + data_start_ + t.begin, t.end - t.begin};
}

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  Json header = Json::object();
  if (!metadata.empty()) {
    Json m = Json::object();
    for (const auto& [k, v] : metadata) m.set(k, Json(v));
    header.set("__metadata__", std::move(m));
  }
  std::set<std::string> names;
  std::vector<torch::Tensor> data;
  int64_t off = 0;
  for (const auto& [name, t] : tensors) {
    DHP_CHECK(!name.empty() && name != "__metadata__", path, ": bad tensor name \"", name, "\"");
    DHP_CHECK(names.insert(name).second, path, ": tensor \"", name, "\" given twice");
    DHP_CHECK(t.defined() && t.device().is_cpu(), path, ": tensor \"", name, "\" must be a defined CPU tensor");
    auto c = t.contiguous();
    Json e = Json::object();
    e.set("dtype", Json(safetensors_dtype_name(c.scalar_type())));
    Json shape = Json::array();
    for (auto d : c.sizes()) shape.push(Json(static_cast<int64_t>(d)));
    e.set("shape", std::move(shape));
    const int64_t bytes = c.numel() * element_size(c.scalar_type());
    Json offs = Json::array();
    offs.push(Json(off));
    offs.push(Json(off + bytes));
    e.set("data_offsets", std::move(offs));
    header.set(name, std::move(e));
    off += bytes;
    data.push_back(std::move(c));
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data buffer starts 8-byte aligned
  uint8_t len[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>((n >> (8 * i)) & 0xFF);
  AtomicFile f(path);
  f.write(len, 8);
  f.write(text.data(), text.size());
  for (const auto& c : data) {
    if (c.numel() > 0) f.write(c.data_ptr(), static_cast<size_t>(c.numel() * element_size(c.scalar_type())));
  }
  f.commit();
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  DHP_CHECK(f.good(), "cannot read ", path);
  std::stringstream ss;
  ss << f.rdbuf();
  DHP_CHECK(!f.bad(), "error reading ", path);
  return ss.str();
}

void write_file_atomic(const std::string& path, const std::string& bytes) {
  AtomicFile f(path);
  f.write(bytes.data(), bytes.size());
  f.commit();
}

}  // namespace dhp::io
