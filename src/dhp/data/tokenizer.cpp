#include "dhp/data/tokenizer.h"

#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>

#include <algorithm>
#include <queue>

#include "dhp/core/error.h"
#include "dhp/core/utf8.h"
#include "dhp/io/json.h"
#include "dhp/io/safetensors.h"

namespace dhp::data {
namespace {

constexpr const char* kQwenPattern =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

void check_utf8(std::string_view s) {
  char32_t cp = 0;
  for (size_t i = 0; i < s.size();) {
    const int n = utf8_decode(s, i, cp);
    DHP_CHECK(n > 0, "text is not valid UTF-8 at byte ", i);
    i += static_cast<size_t>(n);
  }
}

// GPT-2's ByteLevel alphabet: printable bytes stand for themselves, the others for 256+n.
std::vector<char32_t> byte_to_char() {
  std::vector<char32_t> m(256, 0);
  std::vector<bool> kept(256, false);
  for (int b = '!'; b <= '~'; ++b) kept[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) kept[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) kept[b] = true;
  int n = 0;
  for (int b = 0; b < 256; ++b) m[b] = kept[b] ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + n++);
  return m;
}

// A vocabulary entry (ByteLevel spelling) -> its bytes; false if a character is not in the alphabet.
bool byte_level_decode(std::string_view s, const std::unordered_map<char32_t, unsigned char>& inv, std::string& out) {
  out.clear();
  char32_t cp = 0;
  for (size_t i = 0; i < s.size();) {
    const int n = utf8_decode(s, i, cp);
    if (n == 0) return false;
    auto it = inv.find(cp);
    if (it == inv.end()) return false;
    out += static_cast<char>(it->second);
    i += static_cast<size_t>(n);
  }
  return true;
}

bool is_letter(char32_t c) {
  switch (u_charType(static_cast<UChar32>(c))) {
    case U_UPPERCASE_LETTER:
    case U_LOWERCASE_LETTER:
    case U_TITLECASE_LETTER:
    case U_MODIFIER_LETTER:
    case U_OTHER_LETTER:
      return true;
    default:
      return false;
  }
}

bool is_number(char32_t c) {
  switch (u_charType(static_cast<UChar32>(c))) {
    case U_DECIMAL_DIGIT_NUMBER:
    case U_LETTER_NUMBER:
    case U_OTHER_NUMBER:
      return true;
    default:
      return false;
  }
}

bool is_space(char32_t c) { return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_WHITE_SPACE) != 0; }

bool is_newline(char32_t c) { return c == '\r' || c == '\n'; }

// Case-insensitive ASCII contraction suffix at text[i] ('s 't 're 've 'm 'll 'd): its length or 0.
size_t contraction(std::string_view s, size_t i) {
  if (s[i] != '\'' || i + 1 >= s.size()) return 0;
  auto lower = [&](size_t k) { return k < s.size() ? static_cast<char>(std::tolower(static_cast<unsigned char>(s[k]))) : '\0'; };
  const char a = lower(i + 1), b = lower(i + 2);
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  return 0;
}

}  // namespace

std::string nfc(std::string_view utf8) {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* n = icu::Normalizer2::getNFCInstance(status);
  DHP_CHECK(U_SUCCESS(status), "ICU NFC normaliser unavailable: ", u_errorName(status));
  const auto in = icu::UnicodeString::fromUTF8(icu::StringPiece(utf8.data(), static_cast<int32_t>(utf8.size())));
  if (n->isNormalized(in, status) && U_SUCCESS(status)) return std::string(utf8);
  status = U_ZERO_ERROR;
  const auto out = n->normalize(in, status);
  DHP_CHECK(U_SUCCESS(status), "NFC normalisation failed: ", u_errorName(status));
  std::string s;
  out.toUTF8String(s);
  return s;
}

std::vector<std::string_view> qwen_split(std::string_view s) {
  // Code points with their byte offsets (one past the end included).
  std::vector<char32_t> cps;
  std::vector<size_t> at;
  for (size_t i = 0; i < s.size();) {
    char32_t cp = 0;
    const int n = utf8_decode(s, i, cp);
    DHP_CHECK(n > 0, "text is not valid UTF-8 at byte ", i);
    cps.push_back(cp);
    at.push_back(i);
    i += static_cast<size_t>(n);
  }
  at.push_back(s.size());
  const size_t n = cps.size();
  std::vector<std::string_view> out;
  size_t p = 0;
  auto letters_from = [&](size_t k) {
    while (k < n && is_letter(cps[k])) ++k;
    return k;
  };
  while (p < n) {
    size_t end = p;
    const char32_t c = cps[p];
    if (const size_t len = contraction(s.substr(at[p]), 0); len > 0) {
      end = p + len;  // ASCII only: code points == bytes
    } else if (is_letter(c)) {
      end = letters_from(p);  // [^\r\n\p{L}\p{N}]? empty, \p{L}+
    } else if (!is_newline(c) && !is_number(c) && p + 1 < n && is_letter(cps[p + 1])) {
      end = letters_from(p + 1);  // one leading non-letter (a space, a quote) then letters
    } else if (is_number(c)) {
      end = p + 1;
    } else {
      // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
      size_t k = p + (c == ' ' ? 1 : 0);
      const size_t first = k;
      while (k < n && !is_space(cps[k]) && !is_letter(cps[k]) && !is_number(cps[k])) ++k;
      if (k > first) {
        while (k < n && is_newline(cps[k])) ++k;
        end = k;
      } else {
        // Whitespace from p (c is whitespace here: every other character matched above).
        size_t w = p;
        while (w < n && is_space(cps[w])) ++w;
        size_t last_nl = n;
        for (size_t k2 = p; k2 < w; ++k2)
          if (is_newline(cps[k2])) last_nl = k2;
        if (last_nl != n) end = last_nl + 1;                // \s*[\r\n]+
        else if (w == n || w - p == 1) end = w;            // \s+(?!\S) at the end, or \s+
        else end = w - 1;                                   // \s+(?!\S): leave one before the word
      }
    }
    out.push_back(s.substr(at[p], at[end] - at[p]));
    p = end;
  }
  return out;
}

struct Tokenizer::Impl {
  std::unordered_map<std::string, int64_t> vocab;  // raw bytes -> id
  std::vector<std::string> bytes_of;               // id -> raw bytes (vocabulary tokens)
  std::vector<std::string> added_text;             // id -> text ("" unless an added token)
  std::unordered_map<std::string, int64_t> added;  // text -> id
  std::vector<std::string> added_by_length;        // longest first
  int64_t byte_id[256] = {};
  struct Merge {
    int32_t rank;
    int32_t id;
  };
  std::unordered_map<uint64_t, Merge> merges;       // (left id, right id) -> rank, merged id
  mutable std::mutex mu;
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache;

  // Each reads one part of a tokenizer.json (`what` names the file in errors).
  void read_vocab(const io::Json& model, const std::unordered_map<char32_t, unsigned char>& c2b,
                  const std::string& what) {
    std::string raw;
    for (const auto& [tok, idj] : model.at("vocab", what + " model").items(what + " model.vocab")) {
      const int64_t id = idj.integer(what + " vocab id of " + tok);
      DHP_CHECK(id >= 0 && id < (int64_t{1} << 31), what, ": vocab id ", id, " of ", tok, " out of range");
      DHP_CHECK(byte_level_decode(tok, c2b, raw), what, ": vocab token ", io::json_quote(tok),
                " has a character outside the ByteLevel alphabet");
      if (static_cast<size_t>(id) >= bytes_of.size()) bytes_of.resize(static_cast<size_t>(id) + 1);
      bytes_of[static_cast<size_t>(id)] = raw;
      DHP_CHECK(vocab.emplace(raw, id).second, what, ": vocab token ", io::json_quote(tok), " appears twice");
    }
    for (int b = 0; b < 256; ++b) {
      auto it = vocab.find(std::string(1, static_cast<char>(b)));
      DHP_CHECK(it != vocab.end(), what, ": the vocabulary lacks the token of byte ", b);
      byte_id[b] = it->second;
    }
  }

  // "a b" strings (older files) or ["a", "b"] pairs.
  void read_merges(const io::Json& model, const std::unordered_map<char32_t, unsigned char>& c2b,
                   const std::string& what) {
    int32_t rank = 0;
    std::string left, right;
    for (const auto& mj : model.at("merges", what + " model").elements(what + " model.merges")) {
      std::string a, b;
      if (mj.is_string()) {
        const auto& s = mj.str();
        const auto sp = s.find(' ');
        DHP_CHECK(sp != std::string::npos, what, ": merge ", io::json_quote(s), " is not \"left right\"");
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else {
        const auto& e = mj.elements(what + " merge");
        DHP_CHECK(e.size() == 2, what, ": merge ", rank, " is not a pair");
        a = e[0].str(what + " merge");
        b = e[1].str(what + " merge");
      }
      DHP_CHECK(byte_level_decode(a, c2b, left) && byte_level_decode(b, c2b, right), what, ": merge ", rank,
                " has a character outside the ByteLevel alphabet");
      auto l = vocab.find(left), r = vocab.find(right), both = vocab.find(left + right);
      DHP_CHECK(l != vocab.end() && r != vocab.end() && both != vocab.end(), what, ": merge ", rank, " (",
                io::json_quote(a), " ", io::json_quote(b), ") names a token outside the vocabulary");
      const uint64_t key = (static_cast<uint64_t>(l->second) << 32) | static_cast<uint64_t>(r->second);
      merges.emplace(key, Merge{rank, static_cast<int32_t>(both->second)});  // the first rank wins
      ++rank;
    }
  }

  void read_added(const io::Json& j, const std::string& what) {
    if (const auto* list = j.find("added_tokens")) {
      for (const auto& a : list->elements(what + " added_tokens")) {
        const auto& content = a.at("content", what + " added token").str();
        const int64_t id = a.at("id", what + " added token").integer();
        for (const char* flag : {"lstrip", "rstrip", "single_word"}) {
          const auto* f = a.find(flag);
          DHP_CHECK(!f || !f->boolean(), what, ": added token ", content, " has ", flag, "=true (not supported)");
        }
        DHP_CHECK(!content.empty() && id >= 0, what, ": added token ", io::json_quote(content), " id ", id);
        if (static_cast<size_t>(id) >= added_text.size()) added_text.resize(static_cast<size_t>(id) + 1);
        added_text[static_cast<size_t>(id)] = content;
        added[content] = id;
        added_by_length.push_back(content);
      }
    }
    std::stable_sort(added_by_length.begin(), added_by_length.end(),
                     [](const std::string& a, const std::string& b) { return a.size() > b.size(); });
  }
};

Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_file(const std::string& path) {
  return Tokenizer(io::Json::parse(io::read_file(path), path), path);
}

namespace {

// What dhp's tokenizer implements: byte-level BPE with Qwen's pre-tokenizer and NFC.
void check_supported(const io::Json& j, const io::Json& model, const std::string& what) {
  const std::string type = model.find("type") ? model.at("type").str(what + " model.type") : "BPE";
  DHP_CHECK(type == "BPE", what, ": model.type is ", type, "; only byte-level BPE is supported");
  for (const char* flag : {"byte_fallback", "fuse_unk"}) {
    const auto* f = model.find(flag);
    DHP_CHECK(!f || f->is_null() || !f->boolean(what), what, ": model.", flag, "=true is not supported");
  }
  if (const auto* n = j.find("normalizer"); n && !n->is_null()) {
    const auto& t = n->at("type", what + " normalizer").str(what + " normalizer.type");
    DHP_CHECK(t == "NFC", what, ": normalizer ", t, " is not supported (only NFC)");
  }
  // Pre-tokenizer: Qwen's Split regex followed by ByteLevel without its own regex.
  {
    const auto& pt = j.at("pre_tokenizer", what);
    const auto& list = pt.at("pretokenizers", what + " pre_tokenizer").elements(what + " pre_tokenizer");
    DHP_CHECK(list.size() == 2 && list[0].at("type").str() == "Split" && list[1].at("type").str() == "ByteLevel",
              what, ": the pre-tokenizer must be Split (Qwen's pattern) then ByteLevel");
    const auto& pattern = list[0].at("pattern", what + " Split").at("Regex", what + " Split pattern").str();
    DHP_CHECK(pattern == kQwenPattern, what, ": Split pattern ", pattern, " is not Qwen's; only ", kQwenPattern,
              " is implemented");
    const auto* ur = list[1].find("use_regex");
    DHP_CHECK(!ur || !ur->boolean(), what, ": ByteLevel use_regex=true is not supported");
    const auto* aps = list[1].find("add_prefix_space");
    DHP_CHECK(!aps || !aps->boolean(), what, ": ByteLevel add_prefix_space=true is not supported");
  }
}

}  // namespace

Tokenizer::Tokenizer(const io::Json& j, const std::string& what) : impl_(std::make_unique<Impl>()) {
  auto& m = *impl_;
  const auto& model = j.at("model", what);
  check_supported(j, model, what);
  const auto b2c = byte_to_char();  // the vocabulary is spelled in the ByteLevel alphabet
  std::unordered_map<char32_t, unsigned char> c2b;
  for (int b = 0; b < 256; ++b) c2b[b2c[b]] = static_cast<unsigned char>(b);
  m.read_vocab(model, c2b, what);
  m.read_merges(model, c2b, what);
  m.read_added(j, what);
  vocab_size_ = static_cast<int64_t>(std::max(m.bytes_of.size(), m.added_text.size()));
}

int64_t Tokenizer::token_id(const std::string& token) const {
  if (auto it = impl_->added.find(token); it != impl_->added.end()) return it->second;
  if (auto it = impl_->vocab.find(token); it != impl_->vocab.end()) return it->second;
  return -1;
}

void Tokenizer::bpe(std::string_view piece, std::vector<int64_t>& out) const {
  const auto& m = *impl_;
  if (auto it = m.vocab.find(std::string(piece)); it != m.vocab.end() && piece.size() == 1) {
    out.push_back(it->second);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(m.mu);
    if (auto it = m.cache.find(std::string(piece)); it != m.cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  // Symbols in a linked list; a heap of candidate merges keyed by (rank, position).
  const int n = static_cast<int>(piece.size());
  std::vector<int64_t> id(n);
  std::vector<int> prev(n), next(n);
  for (int i = 0; i < n; ++i) {
    id[i] = m.byte_id[static_cast<unsigned char>(piece[static_cast<size_t>(i)])];
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  struct Cand {
    int32_t rank;
    int pos;
    int64_t left, right;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  auto push = [&](int i) {
    if (i < 0 || next[i] < 0) return;
    const uint64_t key = (static_cast<uint64_t>(id[i]) << 32) | static_cast<uint64_t>(id[next[i]]);
    if (auto it = m.merges.find(key); it != m.merges.end()) heap.push({it->second.rank, i, id[i], id[next[i]]});
  };
  for (int i = 0; i + 1 < n; ++i) push(i);
  std::vector<bool> dead(n, false);
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    const int i = c.pos;
    if (dead[i] || next[i] < 0 || id[i] != c.left || id[next[i]] != c.right) continue;  // stale
    const int j = next[i];
    const uint64_t key = (static_cast<uint64_t>(id[i]) << 32) | static_cast<uint64_t>(id[j]);
    id[i] = m.merges.at(key).id;
    dead[j] = true;
    next[i] = next[j];
    if (next[j] >= 0) prev[next[j]] = i;
    push(prev[i]);
    push(i);
  }
  std::vector<int64_t> ids;
  for (int i = 0; i >= 0 && i < n; i = next[i]) ids.push_back(id[i]);
  out.insert(out.end(), ids.begin(), ids.end());
  std::lock_guard<std::mutex> lock(m.mu);
  if (m.cache.size() > 100000) m.cache.clear();
  m.cache.emplace(std::string(piece), std::move(ids));
}

std::vector<int64_t> Tokenizer::encode(std::string_view text) const {
  check_utf8(text);
  const auto& m = *impl_;
  std::vector<int64_t> out;
  auto plain = [&](std::string_view seg) {
    if (seg.empty()) return;
    const std::string norm = nfc(seg);
    for (auto piece : qwen_split(norm)) bpe(piece, out);
  };
  size_t start = 0;
  for (size_t i = 0; i < text.size();) {
    const std::string* hit = nullptr;
    for (const auto& a : m.added_by_length) {
      if (text.compare(i, a.size(), a) == 0) {
        hit = &a;
        break;
      }
    }
    if (!hit) {
      ++i;
      continue;
    }
    plain(text.substr(start, i - start));
    out.push_back(m.added.at(*hit));
    i += hit->size();
    start = i;
  }
  plain(text.substr(start));
  return out;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids) const {
  const auto& m = *impl_;
  std::string bytes;
  for (auto id : ids) {
    const auto i = static_cast<size_t>(id);
    if (id >= 0 && i < m.added_text.size() && !m.added_text[i].empty()) {
      bytes += m.added_text[i];
    } else {
      DHP_CHECK(id >= 0 && i < m.bytes_of.size() && (!m.bytes_of[i].empty()), "token id ", id,
                " is outside the vocabulary of ", vocab_size_);
      bytes += m.bytes_of[i];
    }
  }
  // Invalid sequences (a character split across ids) become U+FFFD, one per bad byte run.
  std::string out;
  for (size_t i = 0; i < bytes.size();) {
    char32_t cp = 0;
    const int n = utf8_decode(bytes, i, cp);
    if (n > 0) {
      out.append(bytes, i, static_cast<size_t>(n));
      i += static_cast<size_t>(n);
    } else {
      append_utf8(out, 0xFFFD);
      ++i;
    }
  }
  return out;
}

}  // namespace dhp::data
