#include "dhp/io/json.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <unordered_set>

#include "dhp/core/error.h"
#include "dhp/core/utf8.h"

namespace dhp::io {

Json::Json(bool b) : type_(Type::kBool), bool_(b) {}
Json::Json(int64_t i) : type_(Type::kNumber), is_int_(true), int_(i), num_(static_cast<double>(i)) {}
Json::Json(double d) : type_(Type::kNumber), num_(d) {}
Json::Json(std::string s) : type_(Type::kString), str_(std::move(s)) {}

Json Json::array() {
  Json j;
  j.type_ = Type::kArray;
  return j;
}

Json Json::object() {
  Json j;
  j.type_ = Type::kObject;
  return j;
}

namespace {

const char* type_name(Json::Type t) {
  switch (t) {
    case Json::Type::kNull: return "null";
    case Json::Type::kBool: return "a boolean";
    case Json::Type::kNumber: return "a number";
    case Json::Type::kString: return "a string";
    case Json::Type::kArray: return "an array";
    case Json::Type::kObject: return "an object";
  }
  return "?";
}

constexpr int kMaxDepth = 512;

}  // namespace

class JsonParser {
 public:
  JsonParser(std::string_view text, const std::string& what) : s_(text), what_(what) {}

  Json parse_document() {
    skip_ws();
    Json v = value(0);
    skip_ws();
    if (pos_ != s_.size()) fail("unexpected text after the value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& msg) const {
    DHP_FAIL(what_, ": invalid JSON at byte ", pos_, ": ", msg);
  }
  bool at_end() const { return pos_ >= s_.size(); }
  char peek() const { return at_end() ? '\0' : s_[pos_]; }
  void skip_ws() {
    while (!at_end() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) ++pos_;
  }
  void expect(char c) {
    if (peek() != c || at_end()) fail(std::string("expected '") + c + "'");
    ++pos_;
  }
  void literal(const char* word) {
    for (const char* p = word; *p; ++p) {
      if (at_end() || s_[pos_] != *p) fail(std::string("expected '") + word + "'");
      ++pos_;
    }
  }

  Json value(int depth) {
    if (depth > kMaxDepth) fail("nesting deeper than " + std::to_string(kMaxDepth));
    if (at_end()) fail("unexpected end of input");
    const char c = s_[pos_];
    if (c == '{') return object(depth);
    if (c == '[') return array(depth);
    if (c == '"') return Json(string());
    if (c == 't') { literal("true"); return Json(true); }
    if (c == 'f') { literal("false"); return Json(false); }
    if (c == 'n') { literal("null"); return Json(); }
    if (c == '-' || (c >= '0' && c <= '9')) return number();
    fail(std::string("unexpected character '") + (c >= 0x20 && c < 0x7f ? std::string(1, c) : "\\x..") + "'");
  }

  Json object(int depth) {
    expect('{');
    Json o = Json::object();
    std::unordered_set<std::string> seen;
    skip_ws();
    if (peek() == '}' && !at_end()) {
      ++pos_;
      return o;
    }
    while (true) {
      skip_ws();
      if (peek() != '"' || at_end()) fail("expected a string key");
      std::string key = string();
      skip_ws();
      expect(':');
      skip_ws();
      Json v = value(depth + 1);
      // Duplicate keys: a scan while the object is small, a hash set once it is not (a
      // tokenizer.json vocabulary has 150k keys).
      if (o.obj_.size() < 32) {
        for (const auto& kv : o.obj_) {
          if (kv.first == key) fail("duplicate key \"" + key + "\"");
        }
      } else {
        if (seen.empty())
          for (const auto& kv : o.obj_) seen.insert(kv.first);
        if (!seen.insert(key).second) fail("duplicate key \"" + key + "\"");
      }
      o.obj_.emplace_back(std::move(key), std::move(v));
      skip_ws();
      if (peek() == ',' && !at_end()) {
        ++pos_;
        continue;
      }
      expect('}');
      return o;
    }
  }

  Json array(int depth) {
    expect('[');
    Json a = Json::array();
    skip_ws();
    if (peek() == ']' && !at_end()) {
      ++pos_;
      return a;
    }
    while (true) {
      skip_ws();
      a.arr_.push_back(value(depth + 1));
      skip_ws();
      if (peek() == ',' && !at_end()) {
        ++pos_;
        continue;
      }
      expect(']');
      return a;
    }
  }

  uint32_t hex4() {
    if (s_.size() - pos_ < 4) fail("truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = s_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= static_cast<uint32_t>(c - '0');
      else if (c >= 'a' && c <= 'f') v |= static_cast<uint32_t>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') v |= static_cast<uint32_t>(c - 'A' + 10);
      else fail("bad hex digit in \\u escape");
    }
    return v;
  }

  // One UTF-8 sequence starting at pos_, validated (no overlong forms, no surrogates).
  void utf8(std::string& out) {
    char32_t cp = 0;
    const int n = utf8_decode(s_, pos_, cp);
    if (n < 2) fail("invalid UTF-8 sequence");
    out.append(s_.substr(pos_, static_cast<size_t>(n)));
    pos_ += static_cast<size_t>(n);
  }

  std::string string() {
    expect('"');
    std::string out;
    while (true) {
      if (at_end()) fail("unterminated string");
      const char c = s_[pos_];
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
      if (static_cast<unsigned char>(c) >= 0x80) {
        utf8(out);
        continue;
      }
      ++pos_;
      if (c != '\\') {
        out += c;
        continue;
      }
      if (at_end()) fail("unterminated escape");
      const char e = s_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (s_.size() - pos_ < 2 || s_[pos_] != '\\' || s_[pos_ + 1] != 'u') fail("lone high surrogate");
            pos_ += 2;
            const uint32_t lo = hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) fail("bad low surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            fail("lone low surrogate");
          }
          append_utf8(out, cp);
          break;
        }
        default: fail(std::string("bad escape '\\") + e + "'");
      }
    }
  }

  Json number() {
    const size_t start = pos_;
    if (peek() == '-') ++pos_;
    auto digits = [&] {
      const size_t d0 = pos_;
      while (!at_end() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
      return pos_ - d0;
    };
    if (peek() == '0' && !at_end()) {
      ++pos_;
    } else if (digits() == 0) {
      fail("expected a digit");
    }
    bool is_int = true;
    if (peek() == '.' && !at_end()) {
      ++pos_;
      is_int = false;
      if (digits() == 0) fail("expected a digit after '.'");
    }
    if ((peek() == 'e' || peek() == 'E') && !at_end()) {
      ++pos_;
      is_int = false;
      if ((peek() == '+' || peek() == '-') && !at_end()) ++pos_;
      if (digits() == 0) fail("expected a digit in the exponent");
    }
    const std::string text(s_.substr(start, pos_ - start));
    Json j;
    j.type_ = Json::Type::kNumber;
    if (is_int) {
      errno = 0;
      char* end = nullptr;
      const long long v = std::strtoll(text.c_str(), &end, 10);
      if (errno == 0 && end == text.c_str() + text.size()) {
        j.is_int_ = true;
        j.int_ = v;
        j.num_ = static_cast<double>(v);
        return j;
      }
    }
    j.num_ = std::strtod(text.c_str(), nullptr);
    return j;
  }

  std::string_view s_;
  const std::string& what_;
  size_t pos_ = 0;
};

Json Json::parse(std::string_view text, const std::string& what) { return JsonParser(text, what).parse_document(); }

bool Json::boolean(const std::string& what) const {
  DHP_CHECK(type_ == Type::kBool, what, " must be a boolean, got ", type_name(type_));
  return bool_;
}

double Json::number(const std::string& what) const {
  DHP_CHECK(type_ == Type::kNumber, what, " must be a number, got ", type_name(type_));
  return num_;
}

int64_t Json::integer(const std::string& what) const {
  DHP_CHECK(type_ == Type::kNumber, what, " must be an integer, got ", type_name(type_));
  if (is_int_) return int_;
  // 2.0 or 1e3 are integers too, when exact and in range.
  DHP_CHECK(std::isfinite(num_) && std::floor(num_) == num_ && std::fabs(num_) < 9.2e18, what,
            " must be an integer, got ", num_);
  return static_cast<int64_t>(num_);
}

const std::string& Json::str(const std::string& what) const {
  DHP_CHECK(type_ == Type::kString, what, " must be a string, got ", type_name(type_));
  return str_;
}

const std::vector<Json>& Json::elements(const std::string& what) const {
  DHP_CHECK(type_ == Type::kArray, what, " must be an array, got ", type_name(type_));
  return arr_;
}

const std::vector<std::pair<std::string, Json>>& Json::items(const std::string& what) const {
  DHP_CHECK(type_ == Type::kObject, what, " must be an object, got ", type_name(type_));
  return obj_;
}

const Json* Json::find(const std::string& key) const {
  DHP_CHECK(type_ == Type::kObject, "looking up \"", key, "\" in ", type_name(type_), ", not an object");
  for (const auto& kv : obj_) {
    if (kv.first == key) return &kv.second;
  }
  return nullptr;
}

const Json& Json::at(const std::string& key, const std::string& what) const {
  DHP_CHECK(type_ == Type::kObject, what, " must be an object, got ", type_name(type_));
  const Json* v = find(key);
  DHP_CHECK(v != nullptr, what, " has no \"", key, "\"");
  return *v;
}

Json& Json::set(const std::string& key, Json value) {
  DHP_CHECK(type_ == Type::kObject, "Json::set(\"", key, "\") on ", type_name(type_));
  for (auto& kv : obj_) {
    if (kv.first == key) {
      kv.second = std::move(value);
      return kv.second;
    }
  }
  obj_.emplace_back(key, std::move(value));
  return obj_.back().second;
}

Json& Json::push(Json value) {
  DHP_CHECK(type_ == Type::kArray, "Json::push on ", type_name(type_));
  arr_.push_back(std::move(value));
  return arr_.back();
}

std::string json_quote(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string Json::dump(int indent) const {
  std::string out;
  dump_to(out, indent, 0);
  return out;
}

void Json::dump_to(std::string& out, int indent, int level) const {
  auto newline = [&](int l) {
    if (indent <= 0) return;
    out += '\n';
    out.append(static_cast<size_t>(indent * l), ' ');
  };
  switch (type_) {
    case Type::kNull: out += "null"; break;
    case Type::kBool: out += bool_ ? "true" : "false"; break;
    case Type::kNumber: {
      if (is_int_) {
        out += std::to_string(int_);
      } else if (!std::isfinite(num_)) {
        out += "null";  // JSON has no inf/nan
      } else {
        char buf[32];
        for (int digits = 15; digits <= 17; ++digits) {  // the shortest text that reads back exactly
          std::snprintf(buf, sizeof(buf), "%.*g", digits, num_);
          if (std::strtod(buf, nullptr) == num_) break;
        }
        out += buf;
        // Keep it a number JSON readers see as floating point (1.0, not 1).
        if (std::string(buf).find_first_of(".eE") == std::string::npos) out += ".0";
      }
      break;
    }
    case Type::kString: out += json_quote(str_); break;
    case Type::kArray: {
      out += '[';
      for (size_t i = 0; i < arr_.size(); ++i) {
        if (i) out += ',';
        newline(level + 1);
        arr_[i].dump_to(out, indent, level + 1);
      }
      if (!arr_.empty()) newline(level);
      out += ']';
      break;
    }
    case Type::kObject: {
      out += '{';
      for (size_t i = 0; i < obj_.size(); ++i) {
        if (i) out += ',';
        newline(level + 1);
        out += json_quote(obj_[i].first);
        out += indent > 0 ? ": " : ":";
        obj_[i].second.dump_to(out, indent, level + 1);
      }
      if (!obj_.empty()) newline(level);
      out += '}';
      break;
    }
  }
}

}  // namespace dhp::io
