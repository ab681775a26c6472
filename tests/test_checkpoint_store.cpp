// The checkpoint store: global tensors saved as slices by several ranks, read back whole
// and by any box (what resharding needs); a save that never committed is invisible; a
// missing rank file, a truncated or corrupted file is refused naming the file; pruning.
#include <gtest/gtest.h>

#include <vector>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

#include "dhp/core/error.h"
#include "dhp/io/checkpoint_store.h"
#include "files.h"

namespace {

namespace fs = std::filesystem;
using dhp::io::CheckpointReader;
using dhp::io::Json;
using dhp::io::SliceWriter;
using dhp::testing::temp_dir;

TEST(CheckpointStore, Crc32KnownValue) {
  const char* s = "123456789";
  EXPECT_EQ(dhp::io::crc32(s, 9), 0xCBF43926u);
  EXPECT_EQ(dhp::io::crc32(s + 4, 5, dhp::io::crc32(s, 4)), 0xCBF43926u);  // continues
  // The 8-bytes-at-a-time code against the bit-by-bit definition, every length and split.
  auto bitwise = [](const uint8_t* p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; ++i) {
      c ^= p[i];
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    }
    return ~c;
  };
  std::vector<uint8_t> buf(4099);
  uint32_t x = 12345;
  for (auto& b : buf) b = static_cast<uint8_t>((x = x * 1103515245u + 12345u) >> 16);
  for (size_t n : {0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000, 4099}) {
    EXPECT_EQ(dhp::io::crc32(buf.data(), n), bitwise(buf.data(), n)) << n;
    const size_t cut = n / 3;
    EXPECT_EQ(dhp::io::crc32(buf.data() + cut, n - cut, dhp::io::crc32(buf.data(), cut)), bitwise(buf.data(), n)) << n;
    EXPECT_EQ(dhp::io::crc32(buf.data() + 1, n ? n - 1 : 0), bitwise(buf.data() + 1, n ? n - 1 : 0)) << n;  // unaligned
  }
}

struct Saved {
  torch::Tensor w, b, flat, s;
};

Saved tensors() {
  torch::manual_seed(2);
  return {torch::randn({6, 8}), torch::randn({5}).to(torch::kBFloat16), torch::randn({11}), torch::tensor(3.5)};
}

// Three ranks: w split by rows (ranks 0, 1) and rank 2 holding nothing of it; b whole on
// rank 2; flat split 4/4/3 as ZeRO slices; the scalar on rank 0.
std::vector<std::string> save_three_ranks(const fs::path& tmp, const Saved& t) {
  fs::create_directories(tmp);
  SliceWriter r0("rank-0.safetensors"), r1("rank-1.safetensors"), r2("rank-2.safetensors");
  r0.add("w", {6, 8}, {0, 0}, t.w.narrow(0, 0, 4));
  r1.add("w", {6, 8}, {4, 0}, t.w.narrow(0, 4, 2));
  r2.add("b", {5}, {0}, t.b);
  r0.add("flat", {11}, {0}, t.flat.narrow(0, 0, 4));
  r1.add("flat", {11}, {4}, t.flat.narrow(0, 4, 4));
  r2.add("flat", {11}, {8}, t.flat.narrow(0, 8, 3));
  r0.add("s", {}, {}, t.s);
  return {r0.write(tmp.string()), r1.write(tmp.string()), r2.write(tmp.string())};
}

TEST(CheckpointStore, SlicesFromSeveralRanksReadBackWholeAndByAnyBox) {
  auto root = temp_dir("ckpt_store");
  const auto t = tensors();
  const auto tmp = root / ".step-3.tmp", fin = root / "step-3";
  Json meta = Json::object();
  meta.set("lr", Json(0.5));
  dhp::io::commit_checkpoint(tmp.string(), fin.string(), 3, meta, save_three_ranks(tmp, t));
  EXPECT_FALSE(fs::exists(tmp));
  CheckpointReader r(fin.string());
  EXPECT_EQ(r.manifest().step, 3);
  EXPECT_DOUBLE_EQ(r.manifest().meta.at("lr").number(), 0.5);
  r.verify_all();
  EXPECT_TRUE(torch::equal(r.read_full("w"), t.w));
  EXPECT_TRUE(torch::equal(r.read_full("b"), t.b));
  EXPECT_TRUE(torch::equal(r.read_full("flat"), t.flat));
  EXPECT_TRUE(torch::equal(r.read_full("s"), t.s));
  // Boxes that cross slice boundaries: a column block over both row slices (a TP column
  // shard read from a row-sharded save), and a flat range over two ZeRO slices.
  EXPECT_TRUE(torch::equal(r.read("w", {2, 3}, {3, 4}), t.w.narrow(0, 2, 3).narrow(1, 3, 4)));
  EXPECT_TRUE(torch::equal(r.read("flat", {3, }, {6}), t.flat.narrow(0, 3, 6)));
  EXPECT_EQ(r.read("w", {6, 0}, {0, 8}).numel(), 0);
  EXPECT_THROW(r.read("w", {5, 0}, {2, 8}), dhp::Error);
  EXPECT_THROW(r.read_full("nope"), dhp::Error);
  ASSERT_EQ(dhp::io::list_checkpoints(root.string()).size(), 1u);
  fs::remove_all(root);
}

TEST(CheckpointStore, AMissingRankOrOverlapIsNotCommitted) {
  auto root = temp_dir("ckpt_missing");
  const auto t = tensors();
  const auto tmp = root / ".step-1.tmp", fin = root / "step-1";
  auto recs = save_three_ranks(tmp, t);
  recs.pop_back();  // rank 2's records never arrived
  try {
    dhp::io::commit_checkpoint(tmp.string(), fin.string(), 1, Json::object(), recs);
    ADD_FAILURE() << "committed without rank 2";
  } catch (const dhp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("slices cover"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(fin));
  auto dup = save_three_ranks(tmp, t);
  dup.push_back(dup[0]);  // the same slices twice
  EXPECT_THROW(dhp::io::commit_checkpoint(tmp.string(), fin.string(), 1, Json::object(), dup), dhp::Error);
  EXPECT_TRUE(dhp::io::list_checkpoints(root.string()).empty());
  fs::remove_all(root);
}

TEST(CheckpointStore, InterruptedSaveLeavesThePreviousCheckpointUsable) {
  auto root = temp_dir("ckpt_crash");
  const auto t = tensors();
  dhp::io::commit_checkpoint((root / ".step-2.tmp").string(), (root / "step-2").string(), 2, Json::object(),
                             save_three_ranks(root / ".step-2.tmp", t));
  // The next save dies after writing its rank files, before the manifest and the rename.
  save_three_ranks(root / ".step-4.tmp", t);
  const auto all = dhp::io::list_checkpoints(root.string());
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0].first, 2);
  EXPECT_TRUE(torch::equal(CheckpointReader(all[0].second).read_full("w"), t.w));
  dhp::io::prune_checkpoints(root.string(), 0);  // removes the stale temporary directory
  EXPECT_FALSE(fs::exists(root / ".step-4.tmp"));
  // A step directory without its manifest is not a checkpoint either.
  fs::create_directories(root / "step-9");
  EXPECT_EQ(dhp::io::list_checkpoints(root.string()).size(), 1u);
  try {
    CheckpointReader r((root / "step-9").string());
    ADD_FAILURE();
  } catch (const dhp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no manifest.json"), std::string::npos) << e.what();
  }
  fs::remove_all(root);
}

TEST(CheckpointStore, CorruptedAndTruncatedFilesAreNamed) {
  auto root = temp_dir("ckpt_corrupt");
  const auto t = tensors();
  const auto fin = root / "step-5";
  dhp::io::commit_checkpoint((root / ".step-5.tmp").string(), fin.string(), 5, Json::object(),
                             save_three_ranks(root / ".step-5.tmp", t));
  const auto f1 = fin / "rank-1.safetensors";
  const auto size = fs::file_size(f1);
  {  // flip the last data byte (part of flat's slice on rank 1)
    std::fstream f(f1, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(size - 1));
    char c = 0;
    f.read(&c, 1);
    c ^= 0x5A;
    f.seekp(static_cast<std::streamoff>(size - 1));
    f.write(&c, 1);
  }
  {
    CheckpointReader r(fin.string());  // the structure is intact
    EXPECT_TRUE(torch::equal(r.read_full("w"), t.w));  // rank 1's w slice is still good
    try {
      r.read_full("flat");
      ADD_FAILURE() << "read a corrupted slice";
    } catch (const dhp::Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("rank-1.safetensors"), std::string::npos) << m;
      EXPECT_NE(m.find("checksum"), std::string::npos) << m;
    }
    EXPECT_THROW(r.verify_all(), dhp::Error);
  }
  fs::resize_file(f1, size / 2);
  try {
    CheckpointReader r(fin.string());
    ADD_FAILURE() << "opened a truncated checkpoint";
  } catch (const dhp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank-1.safetensors"), std::string::npos) << e.what();
  }
  fs::remove(fin / "rank-2.safetensors");
  EXPECT_THROW(CheckpointReader(fin.string()), dhp::Error);
  fs::remove_all(root);
}

TEST(CheckpointStore, PruneKeepsTheNewest) {
  auto root = temp_dir("ckpt_prune");
  const auto t = tensors();
  for (int step : {10, 20, 30, 40}) {
    const auto tmp = root / (".step-" + std::to_string(step) + ".tmp");
    dhp::io::commit_checkpoint(tmp.string(), (root / ("step-" + std::to_string(step))).string(), step,
                               Json::object(), save_three_ranks(tmp, t));
  }
  dhp::io::prune_checkpoints(root.string(), 2);
  const auto left = dhp::io::list_checkpoints(root.string());
  ASSERT_EQ(left.size(), 2u);
  EXPECT_EQ(left[0].first, 40);
  EXPECT_EQ(left[1].first, 30);
  fs::remove_all(root);
}

}  // namespace
