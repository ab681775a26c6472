#include "dhp/core/options.h"

#include <cmath>
#include <fstream>
#include <iomanip>
#include <limits>

namespace dhp {

void ConfigTree::merge_file(const std::string& path) {
  std::ifstream in(path);
  DHP_CHECK(in.good(), "cannot open config file '", path, "'");
  std::stringstream ss;
  ss << in.rdbuf();
  merge_text(ss.str(), path);
}

void ConfigTree::merge_text(const std::string& text, const std::string& origin) {
  YAML::Node doc;
  try {
    doc = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    DHP_FAIL("YAML syntax error in ", origin, " at line ", e.mark.line + 1, ", column ",
             e.mark.column + 1, ": ", e.msg);
  }
  if (!doc || doc.IsNull()) return;
  DHP_CHECK(doc.IsMap(), origin, ": a config must be a map of sections (model:, data:, ...), got ",
            detail::describe(doc));
  merge_node(root_, doc, "", origin);
}

void ConfigTree::merge_node(YAML::Node dst, const YAML::Node& src, const std::string& prefix,
                            const std::string& origin) {
  for (const auto& kv : src) {
    const std::string key = kv.first.as<std::string>();
    const std::string path = prefix + key;
    if (kv.second.IsMap() && dst[key] && dst[key].IsMap()) {
      merge_node(dst[key], kv.second, path + ".", origin);
    } else {
      dst[key] = YAML::Clone(kv.second);
      origin_[path] = origin;
      if (kv.second.IsMap()) {
        // Record the origin of every leaf below a freshly inserted map.
        std::vector<std::pair<YAML::Node, std::string>> todo{{kv.second, path + "."}};
        while (!todo.empty()) {
          auto [n, p] = todo.back();
          todo.pop_back();
          for (const auto& sub : n) {
            const std::string sp = p + sub.first.as<std::string>();
            origin_[sp] = origin;
            if (sub.second.IsMap()) todo.push_back({sub.second, sp + "."});
          }
        }
      }
    }
  }
}

void ConfigTree::merge_set(const std::string& assignment) {
  const auto eq = assignment.find('=');
  DHP_CHECK(eq != std::string::npos && eq > 0,
            "--set expects key=value (for example --set training.steps=100), got '", assignment,
            "'");
  const std::string key = assignment.substr(0, eq);
  const std::string value = assignment.substr(eq + 1);
  YAML::Node v;
  try {
    v = YAML::Load(value);
  } catch (const YAML::Exception& e) {
    DHP_FAIL("--set ", assignment, ": the value is not valid YAML: ", e.msg);
  }
  // Build {a: {b: {c: v}}} and merge it.
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const auto dot = key.find('.', start);
    parts.push_back(key.substr(start, dot - start));
    DHP_CHECK(!parts.back().empty(), "--set ", assignment, ": empty key part in '", key, "'");
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  YAML::Node doc(YAML::NodeType::Map);
  YAML::Node cur = doc;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    cur[parts[i]] = YAML::Node(YAML::NodeType::Map);
    cur.reset(cur[parts[i]]);  // rebind (operator= would assign through)
  }
  cur[parts.back()] = v;
  merge_node(root_, doc, "", "--set " + assignment);
}

std::string ConfigTree::origin(const std::string& path) const {
  auto it = origin_.find(path);
  return it == origin_.end() ? std::string() : it->second;
}

std::string Binder::from(const std::string& path) const {
  const std::string o = tree_.origin(path);
  return o.empty() ? std::string() : " (from " + o + ")";
}

void Binder::check_unknown() const {
  if (!node_ || !node_.IsMap()) return;
  for (const auto& kv : node_) {
    const std::string key = kv.first.as<std::string>();
    bool found = false;
    for (const auto& k : known_) found = found || k == key;
    if (!found) {
      std::string list;
      for (const auto& k : known_) list += (list.empty() ? "" : ", ") + k;
      DHP_FAIL("unknown key '", prefix_ + key, "'", from(prefix_ + key), "; known keys",
               prefix_.empty() ? "" : " in '" + prefix_.substr(0, prefix_.size() - 1) + "'",
               ": ", list);
    }
  }
}

namespace detail {

std::string describe(const YAML::Node& n) {
  if (!n || n.IsNull()) return "null";
  if (n.IsScalar()) return "'" + n.Scalar() + "'";
  if (n.IsSequence()) return "a list";
  return "a map";
}

void yaml_convert(const YAML::Node& n, int64_t& out) {
  if (!n.IsScalar()) throw std::invalid_argument("not a scalar");
  const std::string s = n.Scalar();
  size_t pos = 0;
  const long long v = std::stoll(s, &pos);
  if (pos != s.size()) throw std::invalid_argument("trailing characters");
  out = v;
}

void yaml_convert(const YAML::Node& n, double& out) {
  if (!n.IsScalar()) throw std::invalid_argument("not a scalar");
  const std::string s = n.Scalar();
  size_t pos = 0;
  const double v = std::stod(s, &pos);
  if (pos != s.size() || !std::isfinite(v)) throw std::invalid_argument("not a finite number");
  out = v;
}

void yaml_convert(const YAML::Node& n, bool& out) {
  if (!n.IsScalar()) throw std::invalid_argument("not a scalar");
  const std::string s = n.Scalar();
  if (s == "true" || s == "True" || s == "yes" || s == "on") {
    out = true;
  } else if (s == "false" || s == "False" || s == "no" || s == "off") {
    out = false;
  } else {
    throw std::invalid_argument("not a bool");
  }
}

void yaml_convert(const YAML::Node& n, std::string& out) {
  if (!n.IsScalar()) throw std::invalid_argument("not a scalar");
  out = n.Scalar();
}

namespace {
template <class T>
void convert_list(const YAML::Node& n, std::vector<T>& out) {
  if (!n.IsSequence()) throw std::invalid_argument("not a list");
  std::vector<T> v;
  for (const auto& e : n) {
    T x{};
    yaml_convert(e, x);
    v.push_back(std::move(x));
  }
  out = std::move(v);
}

template <class T>
std::string list_text(const std::vector<T>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + to_yaml_text(v[i]);
  return s + "]";
}
}  // namespace

void yaml_convert(const YAML::Node& n, std::vector<int64_t>& out) { convert_list(n, out); }
void yaml_convert(const YAML::Node& n, std::vector<double>& out) { convert_list(n, out); }
void yaml_convert(const YAML::Node& n, std::vector<std::string>& out) { convert_list(n, out); }

std::string type_name(const int64_t&) { return "an integer"; }
std::string type_name(const double&) { return "a number"; }
std::string type_name(const bool&) { return "true or false"; }
std::string type_name(const std::string&) { return "a string"; }
std::string type_name(const std::vector<int64_t>&) { return "a list of integers"; }
std::string type_name(const std::vector<double>&) { return "a list of numbers"; }
std::string type_name(const std::vector<std::string>&) { return "a list of strings"; }

std::string to_yaml_text(int64_t v) { return std::to_string(v); }
std::string to_yaml_text(double v) {
  // Shortest text that reads back as the same double.
  std::string s;
  for (int prec = 1; prec <= std::numeric_limits<double>::max_digits10; ++prec) {
    std::ostringstream os;
    os << std::setprecision(prec) << v;
    s = os.str();
    if (std::stod(s) == v) break;
  }
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}
std::string to_yaml_text(bool v) { return v ? "true" : "false"; }
std::string to_yaml_text(const std::string& v) {
  YAML::Emitter e;
  e << YAML::DoubleQuoted << v;
  return e.c_str();
}
std::string to_yaml_text(const std::vector<int64_t>& v) { return list_text(v); }
std::string to_yaml_text(const std::vector<double>& v) { return list_text(v); }
std::string to_yaml_text(const std::vector<std::string>& v) { return list_text(v); }

}  // namespace detail
}  // namespace dhp
