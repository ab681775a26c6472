#include "dhp/train/checkpointing.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <sstream>

#include "dhp/core/log.h"
#include "dhp/dist/comm.h"
#include "dhp/core/machine.h"
#include "dhp/io/checkpoint_store.h"
#include "dhp/io/json.h"
#include "dhp/train/checkpoint.h"

namespace dhp::train {

namespace {

// This rank's file of the checkpoint in `tmp`: its pieces (and, on rank 0, the RNG state).
// Returns "+<record>" or "!rank R: <error>", and adds the bytes it wrote to `bytes`.
std::string write_rank_file(ParallelModel& model, const std::string& tmp, int64_t& bytes) {
  const Runtime& rt = model.runtime();
  try {
    char file[32];
    std::snprintf(file, sizeof(file), "rank-%05lld.safetensors", static_cast<long long>(rt.rank));
    io::SliceWriter w(file);
    const auto pieces = model.checkpoint_pieces();
    add_pieces(w, pieces);
    for (const auto& p : pieces)
      if (p.write) bytes += p.data.numel() * p.data.element_size();
    if (rt.rank == 0) {
      auto gen = at::detail::getDefaultCPUGenerator();
      torch::Tensor rng;
      {
        std::lock_guard<std::mutex> lock(gen.mutex());
        rng = gen.get_state();
      }
      w.add("rng/cpu", {rng.numel()}, {0}, rng);
    }
    return "+" + w.write(tmp);
  } catch (const std::exception& e) {
    return "!rank " + std::to_string(rt.rank) + ": " + e.what();
  }
}

// Rank 0: the manifest with every rank's record and the run's metadata, the rename that
// commits, and the pruning of old checkpoints. Returns the error ("" when committed); a
// failed commit removes the temporary directory.
std::string commit(ParallelModel& model, const Config& cfg, int64_t step, int64_t samples_seen,
                   const std::vector<std::string>& records, const std::string& tmp, const std::string& final_dir) {
  std::string error;
  std::vector<std::string> ok;
  for (const auto& r : records) {
    if (r[0] == '!' && error.empty()) error = r.substr(1);
    ok.push_back(r.substr(1));
  }
  try {
    if (!error.empty()) DHP_FAIL(error);
    io::Json meta = io::Json::object();
    meta.set("samples_seen", io::Json(samples_seen));  // the data stream's next position
    meta.set("batch_size", io::Json(cfg.data.batch_size));
    meta.set("world", io::Json(model.runtime().world));
    meta.set("layout", io::Json(describe(model.layouts())));
    meta.set("precision", io::Json(cfg.training.precision));
    meta.set("dhp_version", io::Json(std::string(DHP_VERSION)));
    Config resolved = cfg;  // to_yaml visits (non-const)
    meta.set("config", io::Json(to_yaml(resolved)));
    io::commit_checkpoint(tmp, final_dir, step, meta, ok);
    io::prune_checkpoints(checkpoint_root(cfg), cfg.checkpoint.keep);
  } catch (const std::exception& e) {
    error = e.what();
    std::error_code ec;
    std::filesystem::remove_all(tmp, ec);
  }
  return error;
}

}  // namespace

std::string save_checkpoint(ParallelModel& model, const Config& cfg, int64_t step, int64_t samples_seen) {
  const Runtime& rt = model.runtime();
  const bool main = rt.rank == 0;
  namespace fs = std::filesystem;
  Timer timer;
  const fs::path root(checkpoint_root(cfg));
  const std::string name = "step-" + std::to_string(step);
  const fs::path tmp = root / ("." + name + ".tmp"), final_dir = root / name;
  std::string error;
  if (main) {
    try {
      fs::remove_all(tmp);
      fs::create_directories(tmp);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  error = model.all_gather_strings(error)[0];
  DHP_CHECK(error.empty(), "checkpoint ", final_dir.string(), " not written: ", error);
  // Every rank writes its pieces; the records (or the error) travel to rank 0.
  int64_t bytes = 0;
  const auto records = model.all_gather_strings(write_rank_file(model, tmp.string(), bytes));
  if (main && rt.restart == 0 && step == rt.faults.kill_in_save_step) ::raise(SIGKILL);
  bytes = static_cast<int64_t>(model.sum_over_job(static_cast<double>(bytes)));
  if (main) error = commit(model, cfg, step, samples_seen, records, tmp.string(), final_dir.string());
  error = model.all_gather_strings(error)[0];  // rank 0's verdict
  DHP_CHECK(error.empty(), "checkpoint ", final_dir.string(), " not written (earlier ones are kept): ", error);
  if (main) {
    const double s = timer.seconds();
    char line[160];
    std::snprintf(line, sizeof(line), " (%.1f MB in %.2f s, %.0f MB/s)", static_cast<double>(bytes) / 1e6, s,
                  static_cast<double>(bytes) / 1e6 / std::max(s, 1e-9));
    log_info("saved checkpoint " + final_dir.string() + line);
  }
  return final_dir.string();
}

Restored load_checkpoint(ParallelModel& model, const std::string& dir) {
  io::CheckpointReader r(dir);
  // A checkpoint holds what trained: another freeze setting would leave parameters that now
  // train without state (or frozen ones with stale state). Refused, naming the keys.
  auto settings = [](const Config& c) {
    auto out = c.model.freezing.settings();  // and what decides which adapters exist
    out.emplace_back("lora.rank", detail::to_yaml_text(c.lora.rank));
    if (c.lora.rank > 0) {
      out.emplace_back("lora.alpha", detail::to_yaml_text(c.lora.alpha));
      out.emplace_back("lora.targets", detail::to_yaml_text(c.lora.targets));
      out.emplace_back("lora.modules", detail::to_yaml_text(c.lora.modules));
    }
    return out;
  };
  const auto saved = settings(checkpoint_config(r)), now = settings(model.config());
  std::string differ;
  for (size_t i = 0; i < std::min(saved.size(), now.size()); ++i) {
    if (saved[i].second != now[i].second)
      differ += (differ.empty() ? "" : ", ") + saved[i].first + ": " + saved[i].second + " there, " + now[i].second + " here";
  }
  DHP_CHECK(differ.empty(), dir, " was trained with other frozen parameters or adapters (", differ,
            "); resume with its settings, ",
            "or start a new run from its exported weights (dhp convert, then model.from)");
  load_pieces(checkpoint_source(r), model.checkpoint_pieces());
  const auto& meta = r.manifest().meta;
  const std::string what = dir + "/manifest.json meta";
  Restored out;
  out.step = r.manifest().step;
  out.samples_seen = meta.at("samples_seen", what).integer(what + " samples_seen");
  model.set_optimizer_steps(out.step);
  if (r.has("rng/cpu")) {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(r.read_full("rng/cpu"));
  }
  return out;
}

void check_shared_checkpoint_dir(const Config& cfg, const Runtime& rt) {
  namespace fs = std::filesystem;
  const auto& c = cfg.checkpoint;
  if (rt.world <= 1 || !rt.store || rt.local_world <= 0 || rt.local_world >= rt.world) return;
  if (c.every <= 0 && !c.at_end && c.resume.empty()) return;  // no checkpoint is written or read
  const fs::path root = checkpoint_root(cfg);
  const auto& store = *rt.store;
  const bool first_of_host = rt.local_rank == 0;
  const auto key = [](const char* what, int64_t r) { return std::string("dhp/shared-dir/") + what + "/" + std::to_string(r); };
  const auto probe = [&](int64_t r) { return root / (".dhp-host-of-rank-" + std::to_string(r)); };
  std::string token;
  if (first_of_host) {
    std::random_device rd;
    token = std::to_string(rd()) + "-" + std::to_string(rd()) + "\n" + rt.host;
    std::error_code ec;
    fs::create_directories(root, ec);
    std::ofstream(probe(rt.rank)) << token;
  }
  store.set(key("token", rt.rank), token);
  std::string problem;
  for (int64_t r = 0; r < rt.world && first_of_host; ++r) {
    const auto theirs = store.get(key("token", r));
    if (r == rt.rank || theirs.empty()) continue;
    std::ifstream f(probe(r));
    std::stringstream seen;
    seen << f.rdbuf();
    if (seen.str() != theirs && problem.empty()) {
      problem = "checkpoint.dir " + root.string() + " is not one directory for every host of the job: " + rt.host +
                " (rank " + std::to_string(rt.rank) + ") cannot see the file that " + theirs.substr(theirs.find('\n') + 1) +
                " (rank " + std::to_string(r) + ") wrote there (" + probe(r).string() + "). Every host must see the same " +
                "directory (a shared file system), or a checkpoint written by the job could never be loaded";
    }
  }
  store.set(key("verdict", rt.rank), problem);
  std::string first_problem;
  for (int64_t r = 0; r < rt.world; ++r) {
    const auto v = store.get(key("verdict", r));
    if (first_problem.empty()) first_problem = v;
  }
  if (first_of_host) {
    std::error_code ec;
    fs::remove(probe(rt.rank), ec);
  }
  DHP_CHECK(first_problem.empty(), first_problem);
}

std::optional<Restored> resume(ParallelModel& model, const Config& cfg) {
  const Runtime& rt = model.runtime();
  const bool main = rt.rank == 0;
  namespace fs = std::filesystem;
  const auto& how = cfg.checkpoint.resume;
  if (how.empty()) return std::nullopt;
  const std::string root = checkpoint_root(cfg);
  std::vector<std::string> dirs;
  if (how == "auto") {
    // Rank 0's listing decides, so every rank tries the same checkpoints.
    std::string list;
    if (main)
      for (const auto& c : io::list_checkpoints(root)) list += c.second + "\n";
    list = model.all_gather_strings(list)[0];
    for (size_t a = 0, b; (b = list.find('\n', a)) != std::string::npos; a = b + 1) dirs.push_back(list.substr(a, b - a));
    if (dirs.empty()) {
      if (main) log_info("checkpoint.resume=auto: no checkpoint under " + root + "; starting from step 0");
      return std::nullopt;
    }
  } else {
    dirs.push_back(how);
  }
  for (size_t i = 0; i < dirs.size(); ++i) {
    std::string error;
    Restored restored;
    try {
      restored = load_checkpoint(model, dirs[i]);
    } catch (const std::exception& e) {
      error = "rank " + std::to_string(rt.rank) + ": " + e.what();
    }
    std::string first;
    for (const auto& e : model.all_gather_strings(error))
      if (first.empty()) first = e;
    if (first.empty()) {
      if (main) log_info("resumed from " + dirs[i] + " at step " + std::to_string(restored.step));
      return restored;
    }
    DHP_CHECK(how == "auto", "cannot resume from checkpoint.resume=", how, ": ", first);
    if (i + 1 == dirs.size()) {
      DHP_FAIL("checkpoint.resume=auto: no usable checkpoint under ", root, "; the oldest, ", dirs[i], ", failed with: ",
               first);
    }
    if (main) log_warn("checkpoint " + dirs[i] + " is unusable (" + first + "); falling back to " + dirs[i + 1]);
  }
  return std::nullopt;
}

}  // namespace dhp::train
