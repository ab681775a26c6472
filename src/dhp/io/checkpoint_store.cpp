#include "dhp/io/checkpoint_store.h"

#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <filesystem>

#include "dhp/core/error.h"
#include "dhp/io/safetensors.h"

namespace dhp::io {
namespace {

namespace fs = std::filesystem;

// Slicing-by-8 tables: t[0] is the byte-wise table, t[k][i] the CRC of byte i followed by
// k zero bytes, so eight bytes are folded per step (several times the byte-wise speed).
using CrcTables = std::array<std::array<uint32_t, 256>, 8>;
CrcTables make_crc_tables() {
  CrcTables t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    t[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i) {
    for (int k = 1; k < 8; ++k) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFF];
  }
  return t;
}

int64_t volume(const std::vector<int64_t>& shape) {
  int64_t v = 1;
  for (auto d : shape) v *= d;
  return v;
}

Json ints(const std::vector<int64_t>& v) {
  Json a = Json::array();
  for (auto x : v) a.push(Json(x));
  return a;
}

std::vector<int64_t> ints_of(const Json& j, const std::string& what) {
  std::vector<int64_t> out;
  for (const auto& e : j.elements(what)) out.push_back(e.integer(what));
  return out;
}

Json tensor_json(const TensorRecord& t, bool with_file) {
  Json e = Json::object();
  e.set("dtype", Json(t.dtype));
  e.set("shape", ints(t.shape));
  Json slices = Json::array();
  for (const auto& s : t.slices) {
    Json j = Json::object();
    if (with_file) j.set("file", Json(s.file));
    j.set("key", Json(s.key));
    j.set("offset", ints(s.offset));
    j.set("shape", ints(s.shape));
    j.set("crc32", Json(static_cast<int64_t>(s.crc)));
    slices.push(std::move(j));
  }
  e.set("slices", std::move(slices));
  return e;
}

TensorRecord tensor_from_json(const Json& e, const std::string& what, const std::string& file) {
  TensorRecord t;
  t.dtype = e.at("dtype", what).str(what + " dtype");
  safetensors_dtype(t.dtype);  // known
  t.shape = ints_of(e.at("shape", what), what + " shape");
  for (const auto& s : e.at("slices", what).elements(what + " slices")) {
    SliceRecord r;
    r.file = file.empty() ? s.at("file", what).str(what + " file") : file;
    r.key = s.at("key", what).str(what + " key");
    r.offset = ints_of(s.at("offset", what), what + " offset");
    r.shape = ints_of(s.at("shape", what), what + " slice shape");
    const int64_t crc = s.at("crc32", what).integer(what + " crc32");
    DHP_CHECK(crc >= 0 && crc <= 0xFFFFFFFFLL, what, ": crc32 ", crc, " out of range");
    r.crc = static_cast<uint32_t>(crc);
    t.slices.push_back(std::move(r));
  }
  return t;
}

// Every slice inside the global shape, no two overlapping, volumes adding up: an exact tiling.
void check_tiling(const std::string& name, const TensorRecord& t, const std::string& where) {
  int64_t covered = 0;
  for (size_t i = 0; i < t.slices.size(); ++i) {
    const auto& a = t.slices[i];
    DHP_CHECK(a.offset.size() == t.shape.size() && a.shape.size() == t.shape.size(), where, ": tensor ", name,
              " has a slice of rank ", a.shape.size(), " in a tensor of rank ", t.shape.size());
    for (size_t d = 0; d < t.shape.size(); ++d) {
      DHP_CHECK(a.offset[d] >= 0 && a.shape[d] >= 0 && a.offset[d] + a.shape[d] <= t.shape[d], where, ": tensor ",
                name, " slice in ", a.file, " reaches outside the global shape on dim ", d);
    }
    covered += volume(a.shape);
    for (size_t j = 0; j < i; ++j) {
      const auto& b = t.slices[j];
      bool overlap = volume(a.shape) > 0 && volume(b.shape) > 0;
      for (size_t d = 0; d < t.shape.size() && overlap; ++d) {
        overlap = a.offset[d] < b.offset[d] + b.shape[d] && b.offset[d] < a.offset[d] + a.shape[d];
      }
      DHP_CHECK(!overlap, where, ": tensor ", name, " has overlapping slices in ", a.file, " and ", b.file);
    }
  }
  DHP_CHECK(covered == volume(t.shape), where, ": tensor ", name, " slices cover ", covered, " of its ",
            volume(t.shape), " elements (a rank's file is missing from the checkpoint?)");
}

}  // namespace

uint32_t crc32(const void* data, size_t n, uint32_t crc) {
  static const auto t = make_crc_tables();
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint32_t lo = 0, hi = 0;
    std::memcpy(&lo, p, 4);  // little-endian hosts (x86-64, aarch64)
    std::memcpy(&hi, p + 4, 4);
    lo ^= crc;
    crc = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
          t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
  }
  for (; n > 0; --n, ++p) crc = t[0][(crc ^ *p) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

void SliceWriter::add(const std::string& name, const std::vector<int64_t>& shape, const std::vector<int64_t>& offset,
                      const torch::Tensor& t) {
  DHP_CHECK(offset.size() == shape.size() && t.dim() == static_cast<int64_t>(shape.size()), "checkpoint slice of ",
            name, ": offset, global shape and tensor disagree in rank");
  for (size_t d = 0; d < shape.size(); ++d) {
    DHP_CHECK(offset[d] >= 0 && offset[d] + t.size(static_cast<int64_t>(d)) <= shape[d], "checkpoint slice of ", name,
              " reaches outside its global shape on dim ", d);
  }
  auto& rec = records_[name];
  const auto c = t.detach().cpu().contiguous();
  const std::string dtype = safetensors_dtype_name(c.scalar_type());
  if (rec.slices.empty()) {
    rec.dtype = dtype;
    rec.shape = shape;
  }
  DHP_CHECK(rec.dtype == dtype && rec.shape == shape, "checkpoint tensor ", name, " added with two dtypes or shapes");
  SliceRecord s;
  s.file = file_;
  s.key = name;
  for (auto o : offset) s.key += "@" + std::to_string(o);
  s.offset = offset;
  s.shape = c.sizes().vec();
  s.crc = crc32(c.data_ptr(), static_cast<size_t>(c.numel()) * c.element_size());
  rec.slices.push_back(s);
  tensors_.emplace_back(s.key, c);
}

std::string SliceWriter::write(const std::string& dir) const {
  write_safetensors((fs::path(dir) / file_).string(), tensors_);
  Json j = Json::object();
  j.set("file", Json(file_));
  Json ts = Json::object();
  for (const auto& [name, rec] : records_) ts.set(name, tensor_json(rec, /*with_file=*/false));
  j.set("tensors", std::move(ts));
  return j.dump();
}

void commit_checkpoint(const std::string& tmp_dir, const std::string& final_dir, int64_t step, const Json& meta,
                       const std::vector<std::string>& rank_records) {
  std::map<std::string, TensorRecord> tensors;
  for (size_t r = 0; r < rank_records.size(); ++r) {
    const std::string what = "checkpoint records of rank " + std::to_string(r);
    const auto j = Json::parse(rank_records[r], what);
    const auto& file = j.at("file", what).str(what);
    for (const auto& [name, e] : j.at("tensors", what).items(what)) {
      auto t = tensor_from_json(e, what + " tensor " + name, file);
      auto it = tensors.find(name);
      if (it == tensors.end()) {
        tensors.emplace(name, std::move(t));
        continue;
      }
      DHP_CHECK(it->second.dtype == t.dtype && it->second.shape == t.shape, "checkpoint tensor ", name,
                ": ranks disagree on its dtype or global shape");
      for (auto& s : t.slices) it->second.slices.push_back(std::move(s));
    }
  }
  for (const auto& [name, t] : tensors) check_tiling(name, t, tmp_dir);
  Json m = Json::object();
  m.set("format", Json("dhp-checkpoint"));
  m.set("format_version", Json(int64_t{1}));
  m.set("step", Json(step));
  m.set("meta", meta);
  Json ts = Json::object();
  for (const auto& [name, t] : tensors) ts.set(name, tensor_json(t, /*with_file=*/true));
  m.set("tensors", std::move(ts));
  write_file_atomic((fs::path(tmp_dir) / "manifest.json").string(), m.dump(1) + "\n");
  // The rename makes it a checkpoint; an existing one of the same step is replaced.
  const fs::path fin(final_dir);
  const fs::path old = fin.parent_path() / ("." + fin.filename().string() + ".old");
  fs::remove_all(old);
  if (fs::exists(fin)) fs::rename(fin, old);
  fs::rename(tmp_dir, fin);
  fs::remove_all(old);
}

CheckpointReader::CheckpointReader(const std::string& dir) : dir_(dir) {
  const fs::path mpath = fs::path(dir) / "manifest.json";
  DHP_CHECK(fs::exists(mpath), dir, ": no manifest.json (not a checkpoint, or one whose save did not finish)");
  const std::string what = mpath.string();
  const auto m = Json::parse(read_file(mpath.string()), what);
  DHP_CHECK(m.at("format", what).str(what) == "dhp-checkpoint", what, ": not a dhp checkpoint manifest");
  DHP_CHECK(m.at("format_version", what).integer(what) == 1, what, ": unsupported format_version");
  manifest_.step = m.at("step", what).integer(what + " step");
  manifest_.meta = m.at("meta", what);
  for (const auto& [name, e] : m.at("tensors", what).items(what)) {
    auto t = tensor_from_json(e, what + " tensor " + name, "");
    check_tiling(name, t, what);
    for (const auto& s : t.slices) {
      DHP_CHECK(s.file.find('/') == std::string::npos && !s.file.empty(), what, ": bad file name ", s.file);
      const auto* info = file(s.file).find(s.key);
      DHP_CHECK(info != nullptr, (fs::path(dir) / s.file).string(), " does not hold ", s.key, " (tensor ", name,
                ") that the manifest names");
      DHP_CHECK(info->dtype_name == t.dtype && info->shape == s.shape, (fs::path(dir) / s.file).string(), ": ", s.key,
                " has dtype ", info->dtype_name, " shape ", c10::IntArrayRef(info->shape), ", the manifest says ",
                t.dtype, " ", c10::IntArrayRef(s.shape));
    }
    manifest_.tensors.emplace(name, std::move(t));
  }
}

CheckpointReader::~CheckpointReader() = default;

const SafetensorsReader& CheckpointReader::file(const std::string& name) const {
  auto it = files_.find(name);
  if (it == files_.end()) {
    it = files_.emplace(name, std::make_unique<SafetensorsReader>((fs::path(dir_) / name).string())).first;
  }
  return *it->second;
}

void CheckpointReader::check_crc(const SliceRecord& s) const {
  const std::string id = s.file + "/" + s.key;
  if (verified_.count(id)) return;
  const auto bytes = file(s.file).bytes(s.key);
  const uint32_t got = crc32(bytes.first, static_cast<size_t>(bytes.second));
  DHP_CHECK(got == s.crc, (fs::path(dir_) / s.file).string(), ": ", s.key, " fails its checksum (crc32 ", got,
            ", manifest ", s.crc, "): the file is corrupted");
  verified_[id] = true;
}

torch::Tensor CheckpointReader::read(const std::string& name, const std::vector<int64_t>& offset,
                                     const std::vector<int64_t>& shape) const {
  auto it = manifest_.tensors.find(name);
  DHP_CHECK(it != manifest_.tensors.end(), dir_, ": the checkpoint has no tensor ", name);
  const auto& t = it->second;
  DHP_CHECK(offset.size() == t.shape.size() && shape.size() == t.shape.size(), dir_, ": reading ", name,
            " with a box of rank ", shape.size(), " from a tensor of rank ", t.shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    DHP_CHECK(offset[d] >= 0 && shape[d] >= 0 && offset[d] + shape[d] <= t.shape[d], dir_, ": reading ", name,
              " outside its shape ", c10::IntArrayRef(t.shape), " on dim ", d);
  }
  auto out = torch::empty(shape, torch::TensorOptions().dtype(safetensors_dtype(t.dtype)));
  int64_t filled = 0;
  for (const auto& s : t.slices) {
    std::vector<int64_t> lo(shape.size()), len(shape.size());
    bool any = true;
    for (size_t d = 0; d < shape.size() && any; ++d) {
      lo[d] = std::max(offset[d], s.offset[d]);
      const int64_t hi = std::min(offset[d] + shape[d], s.offset[d] + s.shape[d]);
      len[d] = hi - lo[d];
      any = len[d] > 0;
    }
    if (!any) continue;
    check_crc(s);
    std::vector<int64_t> in_slice(shape.size());
    auto dst = out;
    for (size_t d = 0; d < shape.size(); ++d) {
      in_slice[d] = lo[d] - s.offset[d];
      dst = dst.narrow(static_cast<int64_t>(d), lo[d] - offset[d], len[d]);
    }
    dst.copy_(file(s.file).read_box(s.key, in_slice, len));
    filled += volume(len);
  }
  DHP_CHECK(filled == volume(shape), dir_, ": tensor ", name, " is not fully covered by its slices");
  return out;
}

torch::Tensor CheckpointReader::read_full(const std::string& name) const {
  auto it = manifest_.tensors.find(name);
  DHP_CHECK(it != manifest_.tensors.end(), dir_, ": the checkpoint has no tensor ", name);
  return read(name, std::vector<int64_t>(it->second.shape.size(), 0), it->second.shape);
}

void CheckpointReader::verify_all() const {
  for (const auto& [name, t] : manifest_.tensors) {
    for (const auto& s : t.slices) check_crc(s);
  }
}

std::vector<std::pair<int64_t, std::string>> list_checkpoints(const std::string& root) {
  std::vector<std::pair<int64_t, std::string>> out;
  if (!fs::is_directory(root)) return out;
  for (const auto& e : fs::directory_iterator(root)) {
    const auto name = e.path().filename().string();
    if (!e.is_directory() || name.rfind("step-", 0) != 0) continue;
    const auto digits = name.substr(5);
    if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    if (!fs::exists(e.path() / "manifest.json")) continue;
    out.emplace_back(std::stoll(digits), e.path().string());
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

void prune_checkpoints(const std::string& root, int64_t keep) {
  if (!fs::is_directory(root)) return;
  for (const auto& e : fs::directory_iterator(root)) {
    const auto name = e.path().filename().string();
    if (e.is_directory() && name.rfind(".step-", 0) == 0) fs::remove_all(e.path());
  }
  if (keep <= 0) return;
  const auto all = list_checkpoints(root);
  for (size_t i = static_cast<size_t>(keep); i < all.size(); ++i) fs::remove_all(all[i].second);
}

}  // namespace dhp::io
