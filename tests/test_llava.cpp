// LLaVA annotations and Qwen's chat template on the real tokenizer: records read from JSONL
// and JSON arrays; every kind of bad record reported with file:line (or [index]) and its
// reason and left out; image paths kept inside the data root; the template's ids equal the
// whole templated text's; labels only on the answers and their <|im_end|>; image pads per
// image; truncation that never cuts an image.
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "dhp/core/error.h"
#include "dhp/data/llava.h"
#include "files.h"

namespace {

using dhp::data::BadRecord;
using dhp::data::LlavaRecord;

const dhp::data::Tokenizer& qwen() {
  static const auto t = dhp::data::Tokenizer::from_file(DHP_QWEN_TOKENIZER);
  return t;
}

std::string find_reason(const std::vector<BadRecord>& bad, const std::string& where) {
  for (const auto& b : bad)
    if (b.where == where) return b.reason;
  return "(not reported)";
}

TEST(Llava, ReadsGoodRecordsAndNamesEveryBadOne) {
  dhp::testing::TempDir dir("llava_read");
  const auto root = dir.path().string();
  const auto file = (dir.path() / "train.jsonl").string();
  {
    std::ofstream f(file);
    f << R"({"image": "a.png", "conversations": [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "A cat."}]})" "\n"
      << "\n"
      << R"({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}, {"from": "human", "value": "Bye"}, {"from": "gpt", "value": "Bye."}]})" "\n"
      << R"({"image": ["a.png", "b.jpg"], "conversations": [{"from": "system", "value": "Be brief."}, {"from": "user", "value": "<image><image> Same?"}, {"from": "assistant", "value": "No."}]})" "\n"
      << R"({"image": "a.png", "conversations": [{"from": "human", "value": "no tag"}, {"from": "gpt", "value": "x"}]})" "\n"
      << R"({"image": "../secret.png", "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}]})" "\n"
      << R"({"image": "/etc/passwd", "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}]})" "\n"
      << R"({"conversations": [{"from": "gpt", "value": "first"}, {"from": "human", "value": "second"}]})" "\n"
      << R"({"conversations": [{"from": "human", "value": "only a question"}]})" "\n"
      << R"({"conversations": "text"})" "\n"
      << R"({"image": 7, "conversations": []})" "\n"
      << R"({"conversations": [{"from": "robot", "value": "x"}, {"from": "gpt", "value": "y"}]})" "\n"
      << R"({"conversations": [{"from": "human", "value": 5}, {"from": "gpt", "value": "y"}]})" "\n"
      << R"({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "<image> a"}]})" "\n"
      << R"({"image": "a.png", "conversations": [)" "\n";
  }
  std::vector<BadRecord> bad;
  const auto recs = dhp::data::read_llava(file, root, bad);
  ASSERT_EQ(recs.size(), 3u);
  EXPECT_EQ(recs[0].where, file + ":1");
  EXPECT_EQ(recs[0].images, std::vector<std::string>{"a.png"});
  EXPECT_EQ(recs[1].turns.size(), 4u);
  EXPECT_EQ(recs[1].where, file + ":3");
  EXPECT_EQ(recs[2].turns[0].role, "system");
  ASSERT_EQ(bad.size(), 11u);
  EXPECT_NE(find_reason(bad, file + ":5").find("0 <image> tag(s) but the record has 1 image"), std::string::npos);
  EXPECT_NE(find_reason(bad, file + ":6").find("leaves the data root"), std::string::npos);
  EXPECT_NE(find_reason(bad, file + ":7").find("leaves the data root"), std::string::npos);
  EXPECT_NE(find_reason(bad, file + ":8").find("expected the user"), std::string::npos);
  EXPECT_NE(find_reason(bad, file + ":9").find("does not end with an answer"), std::string::npos);
  EXPECT_NE(find_reason(bad, file + ":10").find("\"conversations\" must be a list"), std::string::npos);
  EXPECT_NE(find_reason(bad, file + ":11").find("\"image\" must be a string"), std::string::npos);
  EXPECT_NE(find_reason(bad, file + ":12").find("unknown speaker"), std::string::npos);
  EXPECT_NE(find_reason(bad, file + ":13").find("string \"from\" and \"value\""), std::string::npos);
  EXPECT_NE(find_reason(bad, file + ":14").find("<image> in a assistant turn"), std::string::npos);
  EXPECT_NE(find_reason(bad, file + ":15").find("invalid JSON"), std::string::npos);
  // A JSON array: positions named by index; a malformed array is one bad record for the file.
  const auto arr = (dir.path() / "train.json").string();
  {
    std::ofstream f(arr);
    f << R"([{"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}, {"conversations": 1}])";
  }
  bad.clear();
  EXPECT_EQ(dhp::data::read_llava(arr, root, bad).size(), 1u);
  ASSERT_EQ(bad.size(), 1u);
  EXPECT_EQ(bad[0].where, arr + "[1]");
  {
    std::ofstream f(arr);
    f << "[{\"conversations\": ";
  }
  bad.clear();
  EXPECT_TRUE(dhp::data::read_llava(arr, root, bad).empty());
  ASSERT_EQ(bad.size(), 1u);
  EXPECT_EQ(bad[0].where, arr);
  EXPECT_THROW(dhp::data::read_llava((dir.path() / "missing.jsonl").string(), root, bad), dhp::Error);
}

TEST(Llava, ResolveImageStaysInsideTheRoot) {
  EXPECT_EQ(dhp::data::resolve_image("/data/set", "img/a.png"), "/data/set/img/a.png");
  EXPECT_EQ(dhp::data::resolve_image("/data/set", "img/../b.png"), "/data/set/b.png");
  EXPECT_EQ(dhp::data::resolve_image("/data/set", "/data/set/c.png"), "/data/set/c.png");
  EXPECT_THROW(dhp::data::resolve_image("/data/set", "../other/a.png"), dhp::Error);
  EXPECT_THROW(dhp::data::resolve_image("/data/set", "/data/settle/a.png"), dhp::Error);
  EXPECT_THROW(dhp::data::resolve_image("/data/set", "img/../../a.png"), dhp::Error);
  EXPECT_THROW(dhp::data::resolve_image("/data/set", ""), dhp::Error);
}

LlavaRecord record(std::vector<std::string> images, std::vector<std::pair<std::string, std::string>> turns) {
  LlavaRecord r;
  r.images = std::move(images);
  for (auto& [role, text] : turns) r.turns.push_back({role, text});
  r.where = "test";
  return r;
}

TEST(ChatTemplate, IdsEqualTheWholeTextAndLabelsOnlyTheAnswers) {
  const auto r = record({"a.png", "b.png"}, {{"user", "<image>\nCompare with <image> please."},
                                             {"assistant", "The first is red."},
                                             {"user", "And 2+2?"},
                                             {"assistant", "4, of course."}});
  const auto e = dhp::data::encode_chat(qwen(), r, {3, 2}, {});
  const std::string pad3 = "<|vision_start|><|image_pad|><|image_pad|><|image_pad|><|vision_end|>";
  const std::string pad2 = "<|vision_start|><|image_pad|><|image_pad|><|vision_end|>";
  const std::string text = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                           "<|im_start|>user\n" + pad3 + "\nCompare with " + pad2 + " please.<|im_end|>\n"
                           "<|im_start|>assistant\nThe first is red.<|im_end|>\n"
                           "<|im_start|>user\nAnd 2+2?<|im_end|>\n"
                           "<|im_start|>assistant\n4, of course.<|im_end|>\n";
  EXPECT_EQ(e.ids, qwen().encode(text));
  ASSERT_EQ(e.labels.size(), e.ids.size());
  // Labelled tokens, decoded, are exactly the answers with their <|im_end|>.
  std::vector<int64_t> labelled;
  for (auto l : e.labels)
    if (l != -100) labelled.push_back(l);
  EXPECT_EQ(qwen().decode(labelled), "The first is red.<|im_end|>4, of course.<|im_end|>");
  int64_t pads = 0;
  for (auto id : e.ids) pads += id == qwen().token_id("<|image_pad|>");
  EXPECT_EQ(pads, 5);
  EXPECT_FALSE(e.truncated);
  // A record's own system prompt replaces the default one.
  const auto s = record({}, {{"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello."}});
  EXPECT_EQ(dhp::data::encode_chat(qwen(), s, {}, {}).ids,
            qwen().encode("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                          "<|im_start|>assistant\nHello.<|im_end|>\n"));
}

TEST(ChatTemplate, TruncationNeverCutsAnImage) {
  const auto r = record({"a.png"}, {{"user", "<image> Describe it in detail."},
                                    {"assistant", "It is a long answer with many words in it."}});
  const auto full = dhp::data::encode_chat(qwen(), r, {50}, {});
  dhp::data::ChatOptions o;
  o.max_length = static_cast<int64_t>(full.ids.size()) - 5;  // cuts into the answer: kept, truncated
  const auto cut = dhp::data::encode_chat(qwen(), r, {50}, o);
  EXPECT_TRUE(cut.truncated);
  EXPECT_EQ(static_cast<int64_t>(cut.ids.size()), o.max_length);
  EXPECT_TRUE(std::equal(cut.ids.begin(), cut.ids.end(), full.ids.begin()));
  o.max_length = 30;  // inside the image: refused
  try {
    dhp::data::encode_chat(qwen(), r, {50}, o);
    ADD_FAILURE();
  } catch (const dhp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cutting would split an image"), std::string::npos) << e.what();
  }
  o.max_length = 70;  // after the image but before any answer token: refused
  EXPECT_THROW(dhp::data::encode_chat(qwen(), r, {50}, o), dhp::Error);
  EXPECT_THROW(dhp::data::encode_chat(qwen(), r, {50, 50}, {}), dhp::Error);  // sizes for 2 images, 1 image
}

}  // namespace
