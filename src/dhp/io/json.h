// A small strict JSON value: parse (RFC 8259, UTF-8, \uXXXX escapes with surrogate pairs,
// nesting limited so that hostile input cannot exhaust the stack) and dump. Used for the
// formats dhp reads and writes: safetensors headers, Hugging Face config.json and
// model.safetensors.index.json, checkpoint manifests. Objects keep their key order.
// Every error is a dhp::Error naming the source and the byte offset; nothing in here
// aborts on bad input.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dhp::io {

class Json {
 public:
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };

  Json() = default;  // null
  Json(bool b);      // NOLINT(google-explicit-constructor): literals read naturally
  Json(int64_t i);   // NOLINT
  Json(int i) : Json(static_cast<int64_t>(i)) {}  // NOLINT
  Json(double d);    // NOLINT
  Json(std::string s);  // NOLINT
  Json(const char* s) : Json(std::string(s)) {}  // NOLINT
  static Json array();
  static Json object();

  // Parses `text`; `what` names the source in errors ("model.safetensors header").
  static Json parse(std::string_view text, const std::string& what);

  Type type() const { return type_; }
  bool is_null() const { return type_ == Type::kNull; }
  bool is_object() const { return type_ == Type::kObject; }
  bool is_array() const { return type_ == Type::kArray; }
  bool is_string() const { return type_ == Type::kString; }
  bool is_number() const { return type_ == Type::kNumber; }
  bool is_integer() const { return type_ == Type::kNumber && is_int_; }

  // Accessors throw dhp::Error naming `what` when the type differs.
  bool boolean(const std::string& what = "value") const;
  double number(const std::string& what = "value") const;
  int64_t integer(const std::string& what = "value") const;  // an exact integer in int64 range
  const std::string& str(const std::string& what = "value") const;
  const std::vector<Json>& elements(const std::string& what = "value") const;
  const std::vector<std::pair<std::string, Json>>& items(const std::string& what = "value") const;

  // Object member or nullptr (objects only; throws for other types).
  const Json* find(const std::string& key) const;
  // Object member; throws naming `what` and the key when absent.
  const Json& at(const std::string& key, const std::string& what = "object") const;

  // Builders: set replaces an existing key.
  Json& set(const std::string& key, Json value);
  Json& push(Json value);

  // Compact text; `indent` > 0 pretty-prints.
  std::string dump(int indent = 0) const;

 private:
  void dump_to(std::string& out, int indent, int level) const;
  Type type_ = Type::kNull;
  bool bool_ = false;
  bool is_int_ = false;
  int64_t int_ = 0;
  double num_ = 0;
  std::string str_;
  std::vector<Json> arr_;
  std::vector<std::pair<std::string, Json>> obj_;
  friend class JsonParser;
};

// `s` as a JSON string literal, quotes included.
std::string json_quote(const std::string& s);

}  // namespace dhp::io
