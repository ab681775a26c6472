// Typed option structs and the YAML binder that fills them.
//
// Every options struct has defaults on its fields and a
//   template <class V> void visit(V& v)
// that calls v.field("name", member, "help") for each field and
// v.section("name", member, "help") for each nested options struct. That one list drives
// loading (unknown keys and bad values are errors naming the key and where the value came
// from), printing the resolved config, and `--help`.
#pragma once

#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "dhp/core/error.h"

namespace dhp {

// A YAML tree plus, for every key path, where its value came from (a file, or
// "--set key=value"). Not thread-safe; a plain value.
class ConfigTree {
 public:
  // Merges the YAML file at `path` over the tree. Throws dhp::Error on a missing file or a
  // YAML syntax error (with the line and column).
  void merge_file(const std::string& path);
  // Merges "a.b.c=VALUE" (VALUE parsed as YAML, so lists and maps work). Throws on a
  // malformed assignment.
  void merge_set(const std::string& assignment);
  // Merges a YAML text (used by tests and presets); `origin` names it in errors.
  void merge_text(const std::string& text, const std::string& origin);

  const YAML::Node& root() const { return root_; }
  // Where the value at `path` ("training.steps") came from; "" when from defaults.
  std::string origin(const std::string& path) const;

 private:
  void merge_node(YAML::Node dst, const YAML::Node& src, const std::string& prefix,
                  const std::string& origin);
  YAML::Node root_ = YAML::Node(YAML::NodeType::Map);
  std::map<std::string, std::string> origin_;
};

namespace detail {
void yaml_convert(const YAML::Node& n, int64_t& out);
void yaml_convert(const YAML::Node& n, double& out);
void yaml_convert(const YAML::Node& n, bool& out);
void yaml_convert(const YAML::Node& n, std::string& out);
void yaml_convert(const YAML::Node& n, std::vector<int64_t>& out);
void yaml_convert(const YAML::Node& n, std::vector<double>& out);
void yaml_convert(const YAML::Node& n, std::vector<std::string>& out);
std::string type_name(const int64_t&);
std::string type_name(const double&);
std::string type_name(const bool&);
std::string type_name(const std::string&);
std::string type_name(const std::vector<int64_t>&);
std::string type_name(const std::vector<double>&);
std::string type_name(const std::vector<std::string>&);
std::string to_yaml_text(int64_t v);
std::string to_yaml_text(double v);
std::string to_yaml_text(bool v);
std::string to_yaml_text(const std::string& v);
std::string to_yaml_text(const std::vector<int64_t>& v);
std::string to_yaml_text(const std::vector<double>& v);
std::string to_yaml_text(const std::vector<std::string>& v);
std::string describe(const YAML::Node& n);
}  // namespace detail

// Fills an options struct from one YAML map. Keys not named by the struct's visit() are
// errors ("unknown key 'training.stepz' (from run.yaml); known keys: ...").
class Binder {
 public:
  Binder(const ConfigTree& tree, YAML::Node node, std::string prefix)
      : tree_(tree), node_(std::move(node)), prefix_(std::move(prefix)) {}

  template <class T>
  void field(const char* name, T& member, const char*) {
    known_.push_back(name);
    if (!node_.IsMap()) return;
    YAML::Node n = node_[name];
    if (!n) return;
    const std::string path = prefix_ + name;
    try {
      detail::yaml_convert(n, member);
    } catch (const std::exception&) {
      DHP_FAIL("bad value for '", path, "'", from(path), ": expected ", detail::type_name(member),
               ", got ", detail::describe(n));
    }
  }

  template <class T>
  void section(const char* name, T& member, const char*) {
    known_.push_back(name);
    YAML::Node n = node_.IsMap() ? node_[name] : YAML::Node();
    bind(tree_, n, prefix_ + name + ".", member);
  }

  // Binds `node` (a map, or null for "all defaults") onto `opts`, then rejects unknown keys.
  template <class T>
  static void bind(const ConfigTree& tree, const YAML::Node& node, const std::string& prefix,
                   T& opts) {
    if (node && !node.IsNull() && !node.IsMap()) {
      const std::string path = prefix.empty() ? "<root>" : prefix.substr(0, prefix.size() - 1);
      DHP_FAIL("'", path, "'", Binder(tree, node, prefix).from(path),
               " must be a map of keys, got ", detail::describe(node));
    }
    Binder b(tree, node, prefix);
    opts.visit(b);
    b.check_unknown();
  }

  std::string from(const std::string& path) const;

 private:
  void check_unknown() const;
  const ConfigTree& tree_;
  YAML::Node node_;
  std::string prefix_;
  std::vector<std::string> known_;
};

// Two options structs bound as one section, their keys side by side (e.g. a model part's
// architecture and its fine-tuning settings under model.vision).
template <class A, class B>
struct Joined {
  A& a;
  B& b;
  template <class V>
  void visit(V& v) {
    a.visit(v);
    b.visit(v);
  }
};

// Writes an options struct as YAML (the resolved config), with help as comments when asked.
class Printer {
 public:
  Printer(std::ostream& os, bool with_help, int indent = 0)
      : os_(os), with_help_(with_help), indent_(indent) {}
  template <class T>
  void field(const char* name, const T& member, const char* help) {
    os_ << std::string(indent_, ' ') << name << ": " << detail::to_yaml_text(member);
    if (with_help_ && help && *help) os_ << "  # " << help;
    os_ << "\n";
  }
  template <class T>
  void section(const char* name, T& member, const char* help) {
    os_ << std::string(indent_, ' ') << name << ":";
    if (with_help_ && help && *help) os_ << "  # " << help;
    os_ << "\n";
    Printer p(os_, with_help_, indent_ + 2);
    member.visit(p);
  }

 private:
  std::ostream& os_;
  bool with_help_;
  int indent_;
};

template <class T>
std::string to_yaml(T& opts, bool with_help = false) {
  std::ostringstream os;
  Printer p(os, with_help);
  opts.visit(p);
  return os.str();
}

}  // namespace dhp
