#include "dhp/data/llava.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "dhp/core/error.h"
#include "dhp/io/json.h"
#include "dhp/io/safetensors.h"

namespace dhp::data {
namespace {

namespace fs = std::filesystem;

const std::string kImageTag = "<image>";
const std::string kVideoTag = "<video>";

// The next <image> or <video> tag at or after `from`: its position (npos: none) and kind.
std::pair<size_t, char> next_tag(const std::string& s, size_t from) {
  const size_t i = s.find(kImageTag, from), v = s.find(kVideoTag, from);
  if (i == std::string::npos && v == std::string::npos) return {std::string::npos, 0};
  return i < v ? std::make_pair(i, 'i') : std::make_pair(v, 'v');
}

// 'i' / 'v' per tag of `s`, in order.
std::string tags_of(const std::string& s) {
  std::string out;
  for (auto t = next_tag(s, 0); t.first != std::string::npos; t = next_tag(s, t.first + 1)) out += t.second;
  return out;
}

// A string or a list of strings under `key` (absent or null: none).
std::vector<std::string> paths(const io::Json& j, const char* key) {
  std::vector<std::string> out;
  const auto* v = j.find(key);
  if (!v || v->is_null()) return out;
  if (v->is_string()) return {v->str()};
  DHP_CHECK(v->is_array(), "\"", key, "\" must be a string or a list of strings");
  for (const auto& e : v->elements()) {
    DHP_CHECK(e.is_string(), "\"", key, "\" must be a string or a list of strings");
    out.push_back(e.str());
  }
  return out;
}

// A number under `key`, or `fallback` when absent; refused unless > 0 (>= 0 for times).
double number(const io::Json& j, const char* key, double fallback, bool zero_ok = false) {
  const auto* v = j.find(key);
  if (!v || v->is_null()) return fallback;
  DHP_CHECK(v->is_number(), "\"", key, "\" must be a number");
  const double x = v->number();
  DHP_CHECK(std::isfinite(x) && (zero_ok ? x >= 0 : x > 0), "\"", key, "\" is ", x, "; it must be ",
            zero_ok ? ">= 0" : "> 0");
  return x;
}

// One record from its JSON; throws dhp::Error with the reason.
LlavaRecord parse_record(const io::Json& j, const std::string& root) {
  DHP_CHECK(j.is_object(), "a record must be a JSON object");
  LlavaRecord r;
  r.images = paths(j, "image");
  r.videos = paths(j, "video");
  for (const auto& p : r.images) resolve_image(root, p);  // throws when it leaves the root
  for (const auto& p : r.videos) resolve_image(root, p);
  auto& v = r.video;
  v.start = number(j, "video_start", -1, true);
  v.end = number(j, "video_end", -1, true);
  DHP_CHECK(v.start < 0 || v.end < 0 || v.start < v.end, "\"video_start\" ", v.start, " is not before \"video_end\" ",
            v.end);
  DHP_CHECK(!(j.find("fps") && j.find("nframes")), "give \"fps\" or \"nframes\", not both");
  v.fps = number(j, "fps", -1);
  const double nframes = number(j, "nframes", 0, true);
  DHP_CHECK(nframes == std::floor(nframes) && nframes <= 1e6, "\"nframes\" must be a whole number, got ", nframes);
  v.nframes = static_cast<int64_t>(nframes);
  v.min_pixels = number(j, "min_pixels", -1);
  v.max_pixels = number(j, "max_pixels", -1);
  v.total_pixels = number(j, "total_pixels", -1);
  const auto* conv = j.find("conversations");
  DHP_CHECK(conv && conv->is_array(), "\"conversations\" must be a list");
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
    const std::string tags = tags_of(turn.text);
    DHP_CHECK(tags.empty() || turn.role == "user", tags[0] == 'i' ? "<image>" : "<video>", " in a ", turn.role, " turn");
    r.order += tags;
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
  const auto images = std::count(r.order.begin(), r.order.end(), 'i');
  const auto videos = std::count(r.order.begin(), r.order.end(), 'v');
  DHP_CHECK(images == static_cast<int64_t>(r.images.size()), "the text has ", images,
            " <image> tag(s) but the record has ", r.images.size(), " image(s)");
  DHP_CHECK(videos == static_cast<int64_t>(r.videos.size()), "the text has ", videos,
            " <video> tag(s) but the record has ", r.videos.size(), " video(s)");
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
                    const ChatOptions& o, const std::vector<int64_t>& video_tokens) {
  DHP_CHECK(image_tokens.size() == r.images.size(), r.where, ": ", image_tokens.size(), " image sizes for ",
            r.images.size(), " images");
  DHP_CHECK(video_tokens.size() == r.videos.size(), r.where, ": ", video_tokens.size(), " video sizes for ",
            r.videos.size(), " videos");
  const int64_t vs = tok.token_id("<|vision_start|>"), ve = tok.token_id("<|vision_end|>"),
                pad = tok.token_id("<|image_pad|>"), video_pad = tok.token_id("<|video_pad|>");
  DHP_CHECK(vs >= 0 && ve >= 0 && pad >= 0, "the tokenizer has no <|vision_start|> / <|image_pad|> / <|vision_end|>");
  DHP_CHECK(r.videos.empty() || video_pad >= 0, "the tokenizer has no <|video_pad|>");
  Encoded e;
  size_t t = 0;
  const std::string system = !r.turns.empty() && r.turns[0].role == "system" ? r.turns[t++].text : o.system;
  append(e, tok.encode("<|im_start|>system\n" + system + "<|im_end|>\n"), false);
  size_t image = 0, video = 0;
  int64_t last_vision_end = -1;
  for (; t < r.turns.size(); ++t) {
    const auto& turn = r.turns[t];
    if (turn.role == "user") {
      append(e, tok.encode("<|im_start|>user\n"), false);
      size_t a = 0;
      for (auto tag = next_tag(turn.text, 0);; tag = next_tag(turn.text, a)) {
        const size_t p = tag.first;
        const size_t stop = p == std::string::npos ? turn.text.size() : p;
        append(e, tok.encode(turn.text.substr(a, stop - a)), false);
        if (p == std::string::npos) break;
        const bool is_video = tag.second == 'v';
        const int64_t n = is_video ? video_tokens[video++] : image_tokens[image++];
        append(e, {vs}, false);
        append(e, std::vector<int64_t>(static_cast<size_t>(n), is_video ? video_pad : pad), false);
        append(e, {ve}, false);
        last_vision_end = static_cast<int64_t>(e.ids.size()) - 1;
        a = p + (is_video ? kVideoTag : kImageTag).size();
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
              " and cutting would split an image or video (the last one ends at token ", last_vision_end + 1, ")");
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
