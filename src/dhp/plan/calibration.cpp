#include "dhp/plan/calibration.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "dhp/core/error.h"
#include "dhp/io/files.h"
#include "dhp/io/json.h"

namespace dhp::plan {

std::string default_calibration_path(int64_t ranks) {
  const char* env = std::getenv("DHP_CALIBRATION_DIR");
  const std::string dir = env && *env ? env : "runs/plan";
  return dir + "/local-x" + std::to_string(ranks) + ".json";
}

void save_cluster(const Cluster& c, const std::string& path) {
  io::Json j = io::Json::object();
  j.set("name", io::Json(c.name));
  j.set("device", io::Json(c.device));
  j.set("devices_per_node", io::Json(c.devices_per_node));
  j.set("nodes", io::Json(c.nodes));
  j.set("memory_bytes", io::Json(c.memory_bytes));
  j.set("reserved_bytes", io::Json(c.reserved_bytes));
  j.set("flops_bf16", io::Json(c.flops_bf16));
  j.set("flops_fp32", io::Json(c.flops_fp32));
  j.set("gemm_efficiency", io::Json(c.gemm_efficiency));
  j.set("attention_efficiency", io::Json(c.attention_efficiency));
  j.set("attention_flops", io::Json(c.attention_flops));
  j.set("attention_tile", io::Json(c.attention_tile));
  j.set("attention_block", io::Json(c.attention_block));
  io::Json dl = io::Json::array(), df = io::Json::array();
  for (double x : c.attention_dense_len) dl.push(io::Json(x));
  for (double y : c.attention_dense_flops) df.push(io::Json(y));
  j.set("attention_dense_len", dl);
  j.set("attention_dense_flops", df);
  j.set("hbm_bandwidth", io::Json(c.hbm_bandwidth));
  j.set("hbm_efficiency", io::Json(c.hbm_efficiency));
  j.set("launch_s", io::Json(c.launch_s));
  j.set("optimizer_s_per_param", io::Json(c.optimizer_s_per_param));
  j.set("synthetic_s_per_patch", io::Json(c.synthetic_s_per_patch));
  j.set("zero3_unit_s_per_byte", io::Json(c.zero3_unit_s_per_byte));
  j.set("half_all_reduce_in_fp32", io::Json(c.half_all_reduce_in_fp32));
  j.set("overlap_hidden", io::Json(c.overlap_hidden));
  for (const auto& [prefix, l] : {std::pair<std::string, const Link*>{"intra", &c.intra}, {"inter", &c.inter}}) {
    j.set(prefix + "_bus_bandwidth", io::Json(l->bus_bandwidth));
    j.set(prefix + "_gather_bandwidth", io::Json(l->gather_bandwidth));
    j.set(prefix + "_a2a_bandwidth", io::Json(l->a2a_bandwidth));
    j.set(prefix + "_latency_s", io::Json(l->latency_s));
    io::Json xs = io::Json::array(), ys = io::Json::array();
    for (double x : l->sync_interval_s) xs.push(io::Json(x));
    for (double y : l->sync_cost_s) ys.push(io::Json(y));
    j.set(prefix + "_sync_interval_s", xs);
    j.set(prefix + "_sync_cost_s", ys);
  }
  j.set("source", io::Json(c.source));
  const std::filesystem::path p(path);
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path());
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    DHP_CHECK(f.good(), "cannot write ", tmp);
    f << j.dump(2) << "\n";
    DHP_CHECK(f.good(), "writing ", tmp, " failed");
  }
  std::filesystem::rename(tmp, path);
}

Cluster load_local_cluster(const std::string& path) {
  std::ifstream f(path);
  DHP_CHECK(f.good(), "no calibration of this machine at ", path, "; run `dhp plan --calibrate --ranks N` first");
  std::stringstream ss;
  ss << f.rdbuf();
  const auto j = io::Json::parse(ss.str(), path);
  const std::string what = path;
  auto num = [&](const char* k) { return j.at(k, what).number(what + " " + k); };
  Cluster c;
  c.name = j.at("name", what).str(what + " name");
  c.device = j.at("device", what).str(what + " device");
  c.devices_per_node = j.at("devices_per_node", what).integer(what + " devices_per_node");
  c.nodes = j.at("nodes", what).integer(what + " nodes");
  c.memory_bytes = num("memory_bytes");
  c.reserved_bytes = num("reserved_bytes");
  c.flops_bf16 = num("flops_bf16");
  c.flops_fp32 = num("flops_fp32");
  c.gemm_efficiency = num("gemm_efficiency");
  c.attention_efficiency = num("attention_efficiency");
  c.attention_flops = num("attention_flops");
  c.attention_tile = j.at("attention_tile", what).integer(what + " attention_tile");
  if (const auto* v = j.find("attention_block")) c.attention_block = v->integer(what + " attention_block");
  for (const char* k : {"attention_dense_len", "attention_dense_flops"}) {
    auto& out = std::string(k) == "attention_dense_len" ? c.attention_dense_len : c.attention_dense_flops;
    if (const auto* v = j.find(k)) {
      for (const auto& e : v->elements(what + " " + k)) out.push_back(e.number(what + " " + k));
    }
  }
  DHP_CHECK(c.attention_dense_len.size() == c.attention_dense_flops.size(), path,
            ": attention_dense_len and attention_dense_flops differ in length; run `dhp plan --calibrate` again");
  c.hbm_bandwidth = num("hbm_bandwidth");
  c.hbm_efficiency = num("hbm_efficiency");
  c.launch_s = num("launch_s");
  if (const auto* v = j.find("optimizer_s_per_param")) c.optimizer_s_per_param = v->number(what + " optimizer_s_per_param");
  if (const auto* v = j.find("synthetic_s_per_patch")) c.synthetic_s_per_patch = v->number(what + " synthetic_s_per_patch");
  if (const auto* v = j.find("zero3_unit_s_per_byte")) c.zero3_unit_s_per_byte = v->number(what + " zero3_unit_s_per_byte");
  if (const auto* w = j.find("half_all_reduce_in_fp32")) c.half_all_reduce_in_fp32 = w->boolean(what + " half_all_reduce_in_fp32");
  if (const auto* v = j.find("overlap_hidden")) c.overlap_hidden = v->number(what + " overlap_hidden");
  DHP_CHECK(c.overlap_hidden >= 0 && c.overlap_hidden <= 1, path, ": overlap_hidden must be in [0, 1], got ",
            c.overlap_hidden);
  auto link = [&](const std::string& p) {
    auto opt = [&](const std::string& k) {
      const auto* v = j.find(p + k);
      return v ? v->number(what + " " + p + k) : 0.0;
    };
    Link l{num((p + "_bus_bandwidth").c_str()), num((p + "_latency_s").c_str()), opt("_gather_bandwidth"),
           opt("_a2a_bandwidth")};
    auto list = [&](const std::string& k, std::vector<double>& out) {
      if (const auto* v = j.find(p + k)) {
        for (const auto& e : v->elements(what + " " + p + k)) out.push_back(e.number(what + " " + p + k));
      }
    };
    list("_sync_interval_s", l.sync_interval_s);
    list("_sync_cost_s", l.sync_cost_s);
    DHP_CHECK(l.sync_interval_s.size() == l.sync_cost_s.size(), path, ": ", p, "_sync_interval_s and ", p,
              "_sync_cost_s differ in length; run `dhp plan --calibrate` again");
    return l;
  };
  c.intra = link("intra");
  c.inter = link("inter");
  c.source = j.at("source", what).str(what + " source");
  DHP_CHECK(c.flops_bf16 > 0 && c.flops_fp32 > 0 && c.hbm_bandwidth > 0 && c.devices_per_node >= 1, path,
            ": calibration figures must be positive; run `dhp plan --calibrate` again");
  return c;
}

void load_eager_host_times(Cluster& c, const std::string& path) {
  DHP_CHECK(std::filesystem::is_regular_file(path), "no eager host times at ", path,
            " (bench/device/reference_layers.py writes them on a GPU machine)");
  const auto j = io::Json::parse(io::read_file(path), path);
  const std::string& what = path;
  const std::map<std::string, std::string> keys = {{"vision tp dtensor", "vision/tp"},
                                                   {"vision sp plain", "vision/plain"},
                                                   {"text tp dtensor", "text/tp"},
                                                   {"text tp plain", "text/plain"}};
  std::map<std::string, double> found;
  for (const auto& row : j.at("rows", what).elements(what + " rows")) {
    if (row.find("error") || row.at("patches", what).integer(what + " patches") != 0) continue;
    const std::string id = row.at("module", what).str(what + " module") + " " + row.at("strategy", what).str(what + " strategy") +
                           " " + row.at("impl", what).str(what + " impl");
    const auto k = keys.find(id);
    if (k == keys.end()) continue;
    const double s = row.at("host_s", what).number(what + " host_s");
    DHP_CHECK(s > 0 && s < 10, path, ": host_s=", s, " of the ", id, " row is not a time per layer in seconds");
    found[k->second] = s;
  }
  DHP_CHECK(!found.empty(), path, " has no host-only rows (patches 0) of vision/text tp dtensor or plain layers");
  c.eager_layer_host_s = found;
  c.eager_host_source = j.at("device", what).str(what + " device") + ", torch " + j.at("torch", what).str(what + " torch") +
                        " (" + path + ")";
}

}  // namespace dhp::plan
