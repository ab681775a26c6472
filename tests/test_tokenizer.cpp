// The byte-level BPE tokenizer on the real Qwen vocabulary (third_party/qwen-tokenizer,
// fetched by scripts/fetch_tokenizer.sh): exact ids on a corpus of English, code, digits,
// whitespace runs, CJK, emoji, accents (composed and combining), scripts with marks and
// the special tokens, against ids that Hugging Face's own JavaScript tokenizer computed
// from the same tokenizer.json (tests/data/tokenizer_expected.json, made by
// scripts/tokenizer_reference.mjs); decode(encode(x)) == NFC(x); the pre-tokenizer split on
// hand-checked cases; unsupported files and bad input refused with the reason.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dhp/core/error.h"
#include "dhp/data/tokenizer.h"
#include "dhp/io/json.h"
#include "dhp/io/safetensors.h"

namespace {

using dhp::data::Tokenizer;

const Tokenizer& qwen() {
  static const Tokenizer t = Tokenizer::from_file(DHP_QWEN_TOKENIZER);
  return t;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  for (auto p : dhp::data::qwen_split(s)) out.emplace_back(p);
  return out;
}

TEST(QwenSplit, HandCheckedCases) {
  using V = std::vector<std::string>;
  EXPECT_EQ(split("Hello world"), (V{"Hello", " world"}));
  EXPECT_EQ(split("I'm DON'T it's"), (V{"I", "'m", " DON", "'T", " it", "'s"}));
  EXPECT_EQ(split("12 345"), (V{"1", "2", " ", "3", "4", "5"}));
  EXPECT_EQ(split("a  b"), (V{"a", " ", " b"}));              // \s+(?!\S) leaves the last space to the word
  EXPECT_EQ(split("a \n\n b"), (V{"a", " \n\n", " b"}));       // \s*[\r\n]+ up to the last newline
  EXPECT_EQ(split("end   "), (V{"end", "   "}));              // trailing whitespace stays whole
  EXPECT_EQ(split("f(x):\n"), (V{"f", "(x", "):\n"}));          // one leading symbol joins the letters
  EXPECT_EQ(split("\tsum"), (V{"\tsum"}));
  EXPECT_EQ(split("x\r\ny"), (V{"x", "\r\n", "y"}));
  EXPECT_EQ(split("!!! ??"), (V{"!!!", " ??"}));
  EXPECT_EQ(split("我爱你"), (V{"我爱你"}));
  EXPECT_EQ(split("नमस्ते"), (V{"नमस", "्त", "े"}));  // marks are not \p{L}: one leads the next letters
  EXPECT_EQ(split(""), V{});
  EXPECT_THROW(dhp::data::qwen_split("\xff"), dhp::Error);
}

TEST(Tokenizer, MatchesHuggingFaceOnTheCorpus) {
  const auto path = std::string(DHP_TEST_DATA) + "/tokenizer_expected.json";
  const auto j = dhp::io::Json::parse(dhp::io::read_file(path), path);
  const auto& cases = j.at("cases").elements();
  ASSERT_GE(cases.size(), 40u);
  int checked = 0;
  for (const auto& c : cases) {
    const auto& text = c.at("text").str();
    std::vector<int64_t> want;
    for (const auto& id : c.at("ids").elements()) want.push_back(id.integer());
    const auto got = qwen().encode(text);
    EXPECT_EQ(got, want) << dhp::io::json_quote(text);
    EXPECT_EQ(qwen().decode(got), dhp::data::nfc(text)) << dhp::io::json_quote(text);
    ++checked;
  }
  EXPECT_EQ(checked, static_cast<int>(cases.size()));
}

TEST(Tokenizer, VisionAndChatTokensHaveQwensIds) {
  EXPECT_EQ(qwen().token_id("<|im_start|>"), 151644);
  EXPECT_EQ(qwen().token_id("<|im_end|>"), 151645);
  EXPECT_EQ(qwen().token_id("<|vision_start|>"), 151652);
  EXPECT_EQ(qwen().token_id("<|vision_end|>"), 151653);
  EXPECT_EQ(qwen().token_id("<|image_pad|>"), 151655);
  EXPECT_EQ(qwen().token_id("<|endoftext|>"), 151643);
  EXPECT_EQ(qwen().token_id("no such token"), -1);
  EXPECT_EQ(qwen().vocab_size(), 151669);
  EXPECT_EQ(qwen().encode("<|vision_start|><|image_pad|><|image_pad|><|vision_end|>"),
            (std::vector<int64_t>{151652, 151655, 151655, 151653}));
}

TEST(Tokenizer, DecodeIsTheInverseAndSplitCharactersBecomeReplacement) {
  const std::string text = "Round trip: 中文, émoji 😀, tabs\t\tand\n\nlines  ";
  EXPECT_EQ(qwen().decode(qwen().encode(text)), text);
  // A rare 4-byte character is several byte tokens; dropping the last leaves an invalid sequence.
  auto ids = qwen().encode("\U0002A6D6");  // a CJK Extension B ideograph
  ASSERT_GT(ids.size(), 1u);
  ids.pop_back();
  EXPECT_EQ(qwen().decode(ids).find("\xef\xbf\xbd"), 0u);  // U+FFFD
  EXPECT_THROW(qwen().decode({-1}), dhp::Error);
  EXPECT_THROW(qwen().decode({1 << 30}), dhp::Error);
  try {
    qwen().encode("ok \xc3\x28 bad");
    ADD_FAILURE();
  } catch (const dhp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("not valid UTF-8 at byte 3"), std::string::npos) << e.what();
  }
}

// A tiny tokenizer.json by hand: the BPE merge order decides, leftmost first among equals.
TEST(Tokenizer, MergesApplyByRankThenLeftmost) {
  // The vocabulary needs every byte's token, spelled in the ByteLevel alphabet: printable
  // bytes as themselves, the others as U+0100 + n in byte order.
  std::vector<std::string> tokens;
  int shifted = 0;
  for (int b = 0; b < 256; ++b) {
    const bool kept = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    const int c = kept ? b : 256 + shifted++;
    std::string s;
    if (c < 0x80) {
      s += static_cast<char>(c);
    } else {
      s += static_cast<char>(0xC0 | (c >> 6));
      s += static_cast<char>(0x80 | (c & 0x3F));
    }
    tokens.push_back(s);
  }
  dhp::io::Json v = dhp::io::Json::object();
  int64_t id = 0;
  for (const auto& t : tokens) v.set(t, dhp::io::Json(id++));
  v.set("aa", dhp::io::Json(id++));
  v.set("ab", dhp::io::Json(id++));
  v.set("aab", dhp::io::Json(id++));
  const std::string json = std::string(R"({"model": {"type": "BPE", "vocab": )") + v.dump() +
                           R"(, "merges": ["a b", "a a", "aa b"]}, "normalizer": {"type": "NFC"},
      "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]},
      "added_tokens": [{"id": 300, "content": "<x>", "special": true}]})";
  const Tokenizer t(dhp::io::Json::parse(json, "tiny"), "tiny");
  const int64_t a = 'a', b = 'b', aa = 256, ab = 257;
  EXPECT_EQ(t.encode("ab"), (std::vector<int64_t>{ab}));        // rank 0
  EXPECT_EQ(t.encode("aab"), (std::vector<int64_t>{a, ab}));    // "a b" (rank 0) before "a a"
  EXPECT_EQ(t.encode("aaa"), (std::vector<int64_t>{aa, a}));    // leftmost first
  EXPECT_EQ(t.encode("aaaa"), (std::vector<int64_t>{aa, aa}));
  EXPECT_EQ(t.encode("a<x>a"), (std::vector<int64_t>{a, 300, a}));
  EXPECT_EQ(t.decode({aa, 300, b}), "aa<x>b");
  // Unsupported files are refused with the reason.
  auto refused = [](const std::string& j, const std::string& why) {
    try {
      Tokenizer(dhp::io::Json::parse(j, "bad"), "bad.json");
      ADD_FAILURE() << j;
    } catch (const dhp::Error& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  };
  refused(R"({"model": {"type": "WordPiece"}})", "only byte-level BPE");
  refused(R"({"model": {"type": "BPE", "byte_fallback": true}})", "byte_fallback=true");
  refused(R"({"model": {"type": "BPE"}, "normalizer": {"type": "NFKC"}, "pre_tokenizer": {}})", "only NFC");
  refused(R"({"model": {"type": "BPE"}, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
           {"type": "Split", "pattern": {"Regex": "\\w+"}}, {"type": "ByteLevel"}]}})",
          "is not Qwen's");
}

}  // namespace
