// dhp's JSON and safetensors code: round trips of every dtype, the byte layout by hand,
// each kind of malformed file refused with a message naming the file and the fault, and
// a fuzz run (mutated and truncated files, random headers) in which every input either
// loads consistently or is refused with dhp::Error, never crashes.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "dhp/core/error.h"
#include "files.h"
#include "dhp/io/json.h"
#include "dhp/io/safetensors.h"

namespace {

namespace fs = std::filesystem;
using dhp::io::Json;
using dhp::io::SafetensorsReader;

using dhp::testing::slurp;
using dhp::testing::temp_dir;

void spit(const fs::path& p, const std::string& s) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << s;
}

// A file from a header text and a data buffer, as a hostile or buggy writer would make it.
std::string raw_file(const std::string& header, const std::string& data, int64_t claimed_len = -1) {
  const uint64_t n = claimed_len >= 0 ? static_cast<uint64_t>(claimed_len) : header.size();
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return s + header + data;
}

TEST(Json, ParsesAndDumpsRoundTrip) {
  const std::string text =
      R"({"a": [1, -2, 3.5, 1e3, true, false, null], "s": "q\"\\\/\b\f\n\r\t\u00e9\ud83d\ude00", "o": {}, "e": [],)"
      R"( "big": 9007199254740993, "neg": -9223372036854775808})";
  auto j = Json::parse(text, "test");
  const auto& a = j.at("a").elements();
  ASSERT_EQ(a.size(), 7u);
  EXPECT_EQ(a[0].integer(), 1);
  EXPECT_EQ(a[1].integer(), -2);
  EXPECT_DOUBLE_EQ(a[2].number(), 3.5);
  EXPECT_EQ(a[3].integer(), 1000);  // exact, written as a float
  EXPECT_FALSE(a[3].is_integer());
  EXPECT_TRUE(a[4].boolean());
  EXPECT_TRUE(a[6].is_null());
  EXPECT_EQ(j.at("s").str(), "q\"\\/\b\f\n\r\t\xc3\xa9\xf0\x9f\x98\x80");
  EXPECT_EQ(j.at("big").integer(), 9007199254740993LL);  // not rounded through double
  EXPECT_EQ(j.at("neg").integer(), INT64_MIN);
  auto again = Json::parse(j.dump(), "dump");
  EXPECT_EQ(again.dump(), j.dump());
  EXPECT_EQ(Json::parse(j.dump(2), "pretty").dump(), j.dump());
  EXPECT_EQ(Json(0.1).dump(), "0.1");
  EXPECT_EQ(Json(1e-6).dump(), "1e-06");  // the shortest text that reads back exactly
  EXPECT_EQ(Json(2.0).dump(), "2.0");
}

TEST(Json, RefusesMalformedInputWithTheOffset) {
  const char* bad[] = {"", "{", "[1,]", "{\"a\":1,}", "{\"a\" 1}", "[01]", "[1.]", "[.5]", "[1e]", "tru", "\"abc",
                       "\"\\x\"", "\"\\ud800\"", "\"\\udc00\"", "\"a\x01\"", "\"\xff\"", "\"\xc0\xaf\"", "[1] 2",
                       "{\"a\":1,\"a\":2}", "[-]", "nul", "{1:2}"};
  for (const char* b : bad) {
    try {
      Json::parse(b, "case");
      ADD_FAILURE() << "accepted: " << b;
    } catch (const dhp::Error& e) {
      EXPECT_NE(std::string(e.what()).find("case: invalid JSON at byte"), std::string::npos) << e.what();
    }
  }
  // A duplicate key far into a large object (the hash-set path) is refused too.
  std::string big = "{";
  for (int i = 0; i < 100; ++i) big += "\"k" + std::to_string(i) + "\": " + std::to_string(i) + ", ";
  EXPECT_EQ(Json::parse(big + "\"last\": 1}", "big").items().size(), 101u);
  EXPECT_THROW(Json::parse(big + "\"k7\": 1}", "big"), dhp::Error);
  // Hostile nesting is an error, not a stack overflow.
  EXPECT_THROW(Json::parse(std::string(100000, '['), "deep"), dhp::Error);
  auto j = Json::parse("{\"x\": \"s\"}", "t");
  EXPECT_THROW(j.at("x").integer("x"), dhp::Error);
  EXPECT_THROW(j.at("y"), dhp::Error);
  EXPECT_THROW(Json::parse("1.5", "t").integer(), dhp::Error);
}

TEST(Safetensors, RoundTripsEveryDtypeBitExactly) {
  auto dir = temp_dir("st_roundtrip");
  torch::manual_seed(1);
  std::vector<std::pair<std::string, torch::Tensor>> ts = {
      {"f32", torch::randn({3, 5})},
      {"bf16", torch::randn({4, 2}).to(torch::kBFloat16)},
      {"f16", torch::randn({7}).to(torch::kFloat16)},
      {"f64", torch::randn({2, 2, 2}).to(torch::kFloat64)},
      {"i64", torch::arange(-5, 5, torch::kInt64)},
      {"i32", torch::arange(0, 6, torch::kInt32).view({2, 3})},
      {"i16", torch::arange(0, 4, torch::kInt16)},
      {"i8", torch::arange(-3, 3, torch::kInt8)},
      {"u8", torch::arange(0, 9, torch::kUInt8)},
      {"bool", torch::tensor({true, false, true})},
      {"scalar", torch::tensor(3.25f)},
      {"empty", torch::zeros({0, 4})},
      {"strided", torch::randn({4, 6}).t()},  // written contiguous
  };
  const auto path = (dir / "m.safetensors").string();
  dhp::io::write_safetensors(path, ts, {{"format", "pt"}});
  SafetensorsReader r(path);
  EXPECT_EQ(r.metadata().at("format"), "pt");
  ASSERT_EQ(r.tensors().size(), ts.size());
  for (const auto& [name, t] : ts) {
    auto got = r.read(name);
    EXPECT_EQ(got.scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(got.sizes(), t.sizes()) << name;
    EXPECT_TRUE(torch::equal(got, t)) << name;
    EXPECT_EQ(r.info(name).dtype_name, dhp::io::safetensors_dtype_name(t.scalar_type()));
  }
  auto rows = r.read_rows("f32", 1, 2);
  EXPECT_TRUE(torch::equal(rows, ts[0].second.narrow(0, 1, 2)));
  EXPECT_EQ(r.read_rows("f32", 3, 0).size(0), 0);
  EXPECT_THROW(r.read_rows("f32", 2, 2), dhp::Error);
  EXPECT_THROW(r.read_rows("scalar", 0, 1), dhp::Error);
  EXPECT_THROW(r.read("nope"), dhp::Error);
  // Nothing but the file itself is left in the directory (the temporary was renamed).
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1);
  fs::remove_all(dir);
}

// read_box copies exactly the box, for every dtype width and rank (scalars included), and
// refuses a box outside the tensor naming the file.
TEST(Safetensors, ReadBoxEqualsNarrowingTheWholeTensor) {
  auto dir = temp_dir("st_box");
  std::vector<std::pair<std::string, torch::Tensor>> ts = {
      {"a", torch::randn({5, 7, 3})},
      {"b", torch::randn({9, 4}).to(torch::kBFloat16)},
      {"c", torch::arange(11, torch::kInt64)},
      {"s", torch::tensor(3.5)}};
  const auto path = (dir / "box.safetensors").string();
  dhp::io::write_safetensors(path, ts);
  SafetensorsReader r(path);
  std::mt19937 rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    const auto& [name, t] = ts[trial % 3];
    std::vector<int64_t> off, shape;
    auto want = t;
    for (int64_t d = 0; d < t.dim(); ++d) {
      const int64_t o = std::uniform_int_distribution<int64_t>(0, t.size(d))(rng);
      const int64_t n = std::uniform_int_distribution<int64_t>(0, t.size(d) - o)(rng);
      off.push_back(o);
      shape.push_back(n);
      want = want.narrow(d, o, n);
    }
    EXPECT_TRUE(torch::equal(r.read_box(name, off, shape), want)) << name << " trial " << trial;
  }
  EXPECT_TRUE(torch::equal(r.read_box("s", {}, {}), ts[3].second));
  try {
    r.read_box("a", {4, 0, 0}, {2, 7, 3});
    ADD_FAILURE();
  } catch (const dhp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("box.safetensors"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("outside"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

TEST(Safetensors, ByteLayoutByHand) {
  auto dir = temp_dir("st_layout");
  const auto path = (dir / "a.safetensors").string();
  dhp::io::write_safetensors(path, {{"w", torch::tensor({1.f, 2.f})}, {"b", torch::tensor({int64_t{7}})}});
  const auto s = slurp(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(s[static_cast<size_t>(i)]);
  EXPECT_EQ((8 + n) % 8, 0u);  // the data starts aligned
  EXPECT_EQ(s.size(), 8 + n + 8 + 8);
  auto h = Json::parse(s.substr(8, n), "header");
  EXPECT_EQ(h.at("w").at("dtype").str(), "F32");
  EXPECT_EQ(h.at("w").at("data_offsets").elements()[1].integer(), 8);
  EXPECT_EQ(h.at("b").at("dtype").str(), "I64");
  EXPECT_EQ(h.at("b").at("data_offsets").elements()[0].integer(), 8);
  float w1 = 0;
  std::memcpy(&w1, s.data() + 8 + n + 4, 4);
  EXPECT_EQ(w1, 2.f);
  fs::remove_all(dir);
}

TEST(Safetensors, RefusesMalformedFilesNamingTheFault) {
  auto dir = temp_dir("st_bad");
  const auto p = dir / "bad.safetensors";
  const std::string f8(8, '\0');  // 8 data bytes: two F32 or one I64
  struct Case {
    std::string file, expect;
  };
  const std::vector<Case> cases = {
      {"", "less than the 8-byte header length"},
      {std::string(5, 'x'), "less than the 8-byte header length"},
      {raw_file("{}", "", 1000), "only 2 bytes follow"},
      {raw_file("{}", "", 1LL << 40), "over the 100 MiB limit"},
      {raw_file("[]", ""), "JSON object"},
      {raw_file("{\"a\":", ""), "invalid JSON"},
      {raw_file(R"({"a":{"dtype":"F8","shape":[1],"data_offsets":[0,1]}})", std::string(1, '\0')), "unsupported safetensors dtype \"F8\""},
      {raw_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", f8), "negative dimension"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", f8), "outside the data buffer"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", f8), "need 12"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[2,6]}})", f8), "overlaps"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", f8), "a gap before it"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", f8), "trailing bytes"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", f8), "must be [begin, end]"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]}})", f8), "overflows"},
      {raw_file(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", f8), "has no \"dtype\""},
      {raw_file(R"({"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", f8), "must be an integer"},
      {raw_file(R"({"__metadata__":{"k":1}})", ""), "__metadata__ \"k\" must be a string"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", std::string(4, '\0')), "outside the data buffer"},
  };
  for (const auto& c : cases) {
    spit(p, c.file);
    try {
      SafetensorsReader r(p.string());
      ADD_FAILURE() << "accepted a file expected to fail with: " << c.expect;
    } catch (const dhp::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
      EXPECT_NE(msg.find(c.expect), std::string::npos) << "expected '" << c.expect << "' in: " << msg;
    }
  }
  EXPECT_THROW(SafetensorsReader((dir / "missing").string()), dhp::Error);
  // Trailing spaces in the header are allowed (writers pad it).
  spit(p, raw_file(std::string(R"({"a":{"dtype":"I64","shape":[],"data_offsets":[0,8]}})") + "   ", f8));
  EXPECT_EQ(SafetensorsReader(p.string()).read("a").item<int64_t>(), 0);
  fs::remove_all(dir);
}

// Every mutated file either loads (and then every tensor reads back with its declared
// size) or is refused with dhp::Error. A crash or another exception fails the test.
TEST(Safetensors, FuzzedFilesNeverCrash) {
  auto dir = temp_dir("st_fuzz");
  const auto good = (dir / "good.safetensors").string();
  dhp::io::write_safetensors(good, {{"x", torch::randn({3, 4})}, {"y", torch::arange(0, 5)},
                                    {"z", torch::randn({2}).to(torch::kBFloat16)}}, {{"k", "v"}});
  const std::string base = slurp(good);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(base[static_cast<size_t>(i)]);
  std::mt19937_64 rng(12345);
  const auto p = dir / "f.safetensors";
  const char* tokens[] = {"{", "}", "[", "]", ",", ":", "\"", "0", "-1", "1e9", "99999999999999999999", "\"F32\"",
                          "\"dtype\"", "\"shape\"", "\"data_offsets\"", "null", "\\u0000", " "};
  int loaded = 0, refused = 0;
  for (int it = 0; it < 3000; ++it) {
    std::string s = base;
    const int kind = static_cast<int>(rng() % 5);
    if (kind == 0) {  // flip bytes in the header
      for (int k = 0; k < 1 + static_cast<int>(rng() % 4); ++k) s[8 + rng() % n] ^= static_cast<char>(1 + rng() % 255);
    } else if (kind == 1) {  // truncate anywhere
      s.resize(rng() % s.size());
    } else if (kind == 2) {  // another header length
      uint64_t v = rng() % 3 == 0 ? rng() : rng() % (s.size() + 16);
      for (int i = 0; i < 8; ++i) s[static_cast<size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xFF);
    } else if (kind == 3) {  // splice a JSON token into the header
      const std::string tok = tokens[rng() % (sizeof(tokens) / sizeof(tokens[0]))];
      s.replace(8 + rng() % n, rng() % 3, tok);
      const uint64_t len = n + tok.size();  // keep the length plausible half of the time
      if (rng() % 2) for (int i = 0; i < 8; ++i) s[static_cast<size_t>(i)] = static_cast<char>((len >> (8 * i)) & 0xFF);
    } else {  // random bytes for a header
      std::string h(1 + rng() % 64, '\0');
      for (auto& c : h) c = static_cast<char>(rng() % 256);
      s = raw_file(h, std::string(rng() % 32, '\0'));
    }
    spit(p, s);
    try {
      SafetensorsReader r(p.string());
      for (const auto& t : r.tensors()) {
        auto x = r.read(t.name);
        ASSERT_EQ(x.numel() * static_cast<int64_t>(x.element_size()), t.end - t.begin);
      }
      ++loaded;
    } catch (const dhp::Error&) {
      ++refused;
    }
  }
  EXPECT_GT(refused, 1000);
  EXPECT_GT(loaded, 0);  // some mutations (metadata bytes, spaces) leave a valid file
  fs::remove_all(dir);
}

TEST(Safetensors, FailedWriteLeavesThePreviousFile) {
  auto dir = temp_dir("st_atomic");
  const auto path = (dir / "m.safetensors").string();
  dhp::io::write_safetensors(path, {{"a", torch::ones({2})}});
  const auto before = slurp(path);
  EXPECT_THROW(dhp::io::write_safetensors(path, {{"a", torch::zeros({2})}, {"a", torch::zeros({2})}}), dhp::Error);
  EXPECT_THROW(dhp::io::write_safetensors(path, {{"a", torch::zeros({2})}, {"b", torch::Tensor()}}), dhp::Error);
  EXPECT_EQ(slurp(path), before);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1);  // no temporary left
  fs::remove_all(dir);
}

}  // namespace
