#include "dhp/data/llava.h"

#include <filesystem>

#include "dhp/core/error.h"
#include "dhp/io/json.h"
#include "dhp/io/safetensors.h"

namespace dhp::data {
namespace {

namespace fs = std::filesystem;

const char* kImageTag = "<image>";

int64_t count_tags(const std::string& s) {
  int64_t n = 0;
  for (size_t p = s.find(kImageTag); p != std::string::npos; p = s.find(kImageTag, p + 1)) ++n;
  return n;
}

// One record from its JSON; throws dhp::Error with the reason.
LlavaRecord parse_record(const io::Json& j, const std::string& root) {
  DHP_CHECK(j.is_object(), "a record must be a JSON object");
  LlavaRecord r;
  if (const auto* im = j.find("image"); im && !im->is_null()) {
    if (im->is_string()) {
      r.images.push_back(im->str());
    } else {
      DHP_CHECK(im->is_array(), "\"image\" must be a string or a list of strings");
      for (const auto& e : im->elements()) {
        DHP_CHECK(e.is_string(), "\"image\" must be a string or a list of strings");
        r.images.push_back(e.str());
      }
    }
  }
  for (const auto& p : r.images) resolve_image(root, p);  // throws when it leaves the root
  const auto* conv = j.find("conversations");
  DHP_CHECK(conv && conv->is_array(), "\"conversations\" must be a list");
  int64_t tags = 0;
  for (const auto& t : conv->elements()) {
    DHP_CHECK(t.is_object() && t.find("from") && t.find("value") && t.at("from").is_string() &&
                  t.at("value").is_string(),
              "every turn needs string \"from\" and \"value\"");
    const auto& from = t.at("from").str();
    Turn turn;
    if (from == "human" || from == "user") turn.role = "user";
    else if (from == "gpt" || from == "assistant") turn.role = "assistant";
    else if (from == "system") turn.role = "system";
    else DHP_FAIL("unknown speaker \"from\": \"", from, "\" (human, gpt, user, assistant or system)");
    turn.text = t.at("value").str();
    const int64_t n = count_tags(turn.text);
    DHP_CHECK(n == 0 || turn.role == "user", "<image> in a ", turn.role, " turn");
    tags += n;
    r.turns.push_back(std::move(turn));
  }
  // [system] then user/assistant pairs.
  size_t i = !r.turns.empty() && r.turns[0].role == "system" ? 1 : 0;
  DHP_CHECK(r.turns.size() > i, "no conversation turns");
  for (size_t k = i; k < r.turns.size(); ++k) {
    const char* want = (k - i) % 2 == 0 ? "user" : "assistant";
    DHP_CHECK(r.turns[k].role == want, "turn ", k, " is from the ", r.turns[k].role, ", expected the ", want,
              " (turns alternate, starting with the user)");
  }
  DHP_CHECK(r.turns.back().role == "assistant", "the conversation does not end with an answer");
  DHP_CHECK(tags == static_cast<int64_t>(r.images.size()), "the text has ", tags, " <image> tag(s) but the record has ",
            r.images.size(), " image(s)");
  return r;
}

void append(Encoded& e, const std::vector<int64_t>& ids, bool label) {
  for (auto id : ids) {
    e.ids.push_back(id);
    e.labels.push_back(label ? id : -100);
  }
}

}  // namespace

std::string resolve_image(const std::string& root, const std::string& rel) {
  DHP_CHECK(!rel.empty(), "empty image path");
  const fs::path base = fs::absolute(fs::path(root)).lexically_normal();
  const fs::path p = (fs::path(rel).is_absolute() ? fs::path(rel) : base / rel).lexically_normal();
  auto b = base.begin(), q = p.begin();
  for (; b != base.end() && !b->empty(); ++b, ++q) {
    DHP_CHECK(q != p.end() && *b == *q, "image path \"", rel, "\" leaves the data root ", base.string());
  }
  DHP_CHECK(q != p.end(), "image path \"", rel, "\" is the data root itself");
  return p.string();
}

std::vector<LlavaRecord> read_llava(const std::string& path, const std::string& root, std::vector<BadRecord>& bad) {
  const std::string text = io::read_file(path);
  std::vector<LlavaRecord> out;
  auto one = [&](const io::Json& j, const std::string& where) {
    try {
      auto r = parse_record(j, root);
      r.where = where;
      out.push_back(std::move(r));
    } catch (const Error& e) {
      bad.push_back({where, e.what()});
    }
  };
  const size_t first = text.find_first_not_of(" \t\r\n");
  if (first != std::string::npos && text[first] == '[') {
    io::Json all;
    try {
      all = io::Json::parse(text, path);
    } catch (const Error& e) {
      bad.push_back({path, e.what()});
      return out;
    }
    const auto& items = all.elements(path);
    for (size_t i = 0; i < items.size(); ++i) one(items[i], path + "[" + std::to_string(i) + "]");
    return out;
  }
  size_t line = 0;
  for (size_t a = 0; a < text.size();) {
    size_t b = text.find('\n', a);
    if (b == std::string::npos) b = text.size();
    ++line;
    const std::string l = text.substr(a, b - a);
    a = b + 1;
    if (l.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(line);
    io::Json j;
    try {
      j = io::Json::parse(l, where);
    } catch (const Error& e) {
      bad.push_back({where, e.what()});
      continue;
    }
    one(j, where);
  }
  return out;
}

Encoded encode_chat(const Tokenizer& tok, const LlavaRecord& r, const std::vector<int64_t>& image_tokens,
                    const ChatOptions& o) {
  DHP_CHECK(image_tokens.size() == r.images.size(), r.where, ": ", image_tokens.size(), " image sizes for ",
            r.images.size(), " images");
  const int64_t vs = tok.token_id("<|vision_start|>"), ve = tok.token_id("<|vision_end|>"),
                pad = tok.token_id("<|image_pad|>");
  DHP_CHECK(vs >= 0 && ve >= 0 && pad >= 0, "the tokenizer has no <|vision_start|> / <|image_pad|> / <|vision_end|>");
  Encoded e;
  size_t t = 0;
  const std::string system = !r.turns.empty() && r.turns[0].role == "system" ? r.turns[t++].text : o.system;
  append(e, tok.encode("<|im_start|>system\n" + system + "<|im_end|>\n"), false);
  size_t image = 0;
  int64_t last_vision_end = -1;
  for (; t < r.turns.size(); ++t) {
    const auto& turn = r.turns[t];
    if (turn.role == "user") {
      append(e, tok.encode("<|im_start|>user\n"), false);
      size_t a = 0;
      for (size_t p = turn.text.find(kImageTag);; p = turn.text.find(kImageTag, a)) {
        const size_t stop = p == std::string::npos ? turn.text.size() : p;
        append(e, tok.encode(turn.text.substr(a, stop - a)), false);
        if (p == std::string::npos) break;
        append(e, {vs}, false);
        append(e, std::vector<int64_t>(static_cast<size_t>(image_tokens[image++]), pad), false);
        append(e, {ve}, false);
        last_vision_end = static_cast<int64_t>(e.ids.size()) - 1;
        a = p + std::string(kImageTag).size();
      }
      append(e, tok.encode("<|im_end|>\n"), false);
    } else {
      append(e, tok.encode("<|im_start|>assistant\n"), false);
      append(e, tok.encode(turn.text), true);
      append(e, tok.encode("<|im_end|>"), true);
      append(e, tok.encode("\n"), false);
    }
  }
  const auto n = static_cast<int64_t>(e.ids.size());
  if (n > o.max_length) {
    DHP_CHECK(last_vision_end < o.max_length, r.where, ": ", n, " tokens exceed max_length ", o.max_length,
              " and cutting would split an image (its last image ends at token ", last_vision_end + 1, ")");
    e.ids.resize(static_cast<size_t>(o.max_length));
    e.labels.resize(static_cast<size_t>(o.max_length));
    e.truncated = true;
  }
  bool any = false;
  for (size_t i = 1; i < e.labels.size(); ++i) any = any || e.labels[i] != -100;
  DHP_CHECK(any, r.where, ": no answer token left", e.truncated ? " after truncation to max_length" : "");
  return e;
}

}  // namespace dhp::data
