#include "dhp/train/run_report.h"

#include <torch/torch.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <iomanip>
#include <sstream>

#include "dhp/core/log.h"
#include "dhp/core/machine.h"
#include "dhp/core/memory.h"
#include "dhp/io/json.h"
#include "dhp/models/qwen2_5_vl/config.h"

namespace dhp::train {

std::string format_duration(double s) {
  char buf[32];
  const int t = static_cast<int>(s + 0.5);
  if (t >= 3600) std::snprintf(buf, sizeof(buf), "%dh%02dm", t / 3600, (t / 60) % 60);
  else std::snprintf(buf, sizeof(buf), "%dm%02ds", t / 60, t % 60);
  return buf;
}

std::string metrics_json(const StepMetrics& m) {
  std::ostringstream os;
  os << std::setprecision(8) << "{\"step\": " << m.step << ", \"loss\": " << m.loss << ", \"lr\": " << m.lr
     << ", \"grad_norm\": " << m.grad_norm << ", \"tokens_per_s\": " << m.tokens_per_s
     << ", \"patches_per_s\": " << m.patches_per_s << ", \"step_time_s\": " << m.step_time_s
     << ", \"tokens\": " << m.tokens << ", \"target_tokens\": " << m.target_tokens
     << ", \"patches\": " << m.patches << ", \"peak_bytes\": " << m.peak_bytes
     << ", \"model_flops\": " << m.model_flops << ", \"comm_s\": " << m.comm_s
     << ", \"comm_calls\": " << m.comm_calls << ", \"comm_bytes\": " << m.comm_bytes
     << ", \"wait_s\": " << m.wait_s << ", \"data_wait_s\": " << m.data_wait_s
     << ", \"skipped_samples\": " << m.skipped_samples << ", \"samples\": " << m.samples
     << ", \"samples_s\": " << m.samples_s << ", \"update_s\": " << m.update_s;
  auto list = [&](const char* key, const std::vector<double>& v) {
    os << ", \"" << key << "\": [";
    for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
    os << "]";
  };
  list("peak_bytes_per_rank", m.peak_bytes_per_rank);
  list("comm_s_per_rank", m.comm_s_per_rank);
  list("busy_s_per_rank", m.busy_s_per_rank);
  list("idle_s_per_rank", m.idle_s_per_rank);
  list("vision_s_per_rank", m.vision_s_per_rank);
  list("text_s_per_rank", m.text_s_per_rank);
  list("update_s_per_rank", m.update_s_per_rank);
  if (!m.breakdown_per_rank.empty()) {
    os << ", \"breakdown_per_rank\": {";
    for (size_t k = 0; k < kBreakdownCount; ++k) {
      os << (k ? ", " : "") << "\"" << kBreakdownParts[k] << "\": [";
      for (size_t i = 0; i < m.breakdown_per_rank[k].size(); ++i) os << (i ? ", " : "") << m.breakdown_per_rank[k][i];
      os << "]";
    }
    os << "}";
  }
  os << "}";
  return os.str();
}

RunReport::RunReport(const Config& cfg, bool main, int64_t resumed_step)
    : cfg_(cfg), main_(main), tty_(isatty(2)), dir_(cfg.output.dir) {
  if (!main_) return;
  namespace fs = std::filesystem;
  const fs::path dir(dir_);
  fs::create_directories(dir);
  std::ofstream c(dir / "config.yaml");
  Config resolved = cfg_;  // to_yaml visits (non-const)
  c << "# resolved dhp config (dhp " << DHP_VERSION << ")\n" << to_yaml(resolved);
  // Resumed: the lines of the steps up to the checkpoint stay, later ones (from an
  // interrupted attempt) are written again; a line that does not parse (cut by a kill) goes.
  std::string kept;
  if (resumed_step > 0) {
    std::ifstream old(dir / "metrics.jsonl");
    std::string line;
    int64_t number = 0;
    while (std::getline(old, line)) {
      ++number;
      try {
        const auto j = io::Json::parse(line, "metrics.jsonl line " + std::to_string(number));
        if (j.at("step").integer("step") > resumed_step) continue;
        const double loss = j.at("loss").number("loss");
        if (!have_first_) first_loss_ = loss;
        have_first_ = true;
        last_loss_ = loss;
        kept += line + "\n";
      } catch (const Error& e) {
        log_warn(std::string("dropped from the resumed ") + (dir / "metrics.jsonl").string() + ": " + e.what());
      }
    }
  }
  metrics_.open(dir / "metrics.jsonl");
  DHP_CHECK(metrics_.good(), "cannot write ", (dir / "metrics.jsonl").string());
  metrics_ << kept;
}

void RunReport::start(const std::vector<std::string>& lines) {
  if (!main_) return;
  const auto pc = qwen::count_parameters(cfg_.model.config);
  log_info("model " + cfg_.model.preset + ": " + std::to_string(pc.vision) + " vision + " + std::to_string(pc.text) +
           " text parameters; " + std::to_string(cfg_.training.steps) + " steps of " +
           (cfg_.data.pack_tokens > 0 ? std::to_string(cfg_.training.micro_batches) + " micro-batch(es) packed to " +
                                            std::to_string(cfg_.data.pack_tokens) + " tokens"
                                      : std::to_string(cfg_.data.batch_size) + " samples") +
           "; threads " + std::to_string(torch::get_num_threads()) + "; run dir " + dir_);
  for (const auto& l : lines) log_info(l);
  log_info("fp32 GEMMs: " + blas_description());
  if (!blas_hint().empty()) log_warn(blas_hint());
}

void RunReport::step(const StepMetrics& m, double eta) {
  if (!main_) return;
  metrics_ << metrics_json(m) << "\n";
  metrics_.flush();
  if (!have_first_) first_loss_ = m.loss;
  have_first_ = true;
  last_loss_ = m.loss;
  const int64_t steps = cfg_.training.steps;
  char line[256];
  std::snprintf(line, sizeof(line), "step %lld/%lld loss %.4f lr %.2e tok/s %.0f ETA %s peak %s",
                static_cast<long long>(m.step), static_cast<long long>(steps), m.loss, m.lr, m.tokens_per_s,
                format_duration(eta).c_str(), format_bytes(m.peak_bytes).c_str());
  if (tty_) {
    const int width = 24, done = static_cast<int>(width * m.step / steps);
    std::fprintf(stderr, "\r[%s%s] %s   ", std::string(done, '#').c_str(), std::string(width - done, '.').c_str(), line);
    if (m.step == steps) std::fprintf(stderr, "\n");
  } else if (m.step % cfg_.training.log_every == 0 || m.step == 1 || m.step == steps) {
    std::fprintf(stderr, "%s\n", line);
  }
  std::fflush(stderr);
}

void RunReport::data_wait(double wait_s, double train_s, int64_t skipped) {
  if (!main_) return;
  char line[200];
  std::snprintf(line, sizeof(line), "data: waited %.2f s for samples in %.1f s of training (%.1f%%); %lld bad sample(s) skipped",
                wait_s, train_s, 100 * wait_s / std::max(train_s, 1e-9), static_cast<long long>(skipped));
  log_info(line);
}

void RunReport::finish(const EvalResult& ev, double train_s, double data_wait, int64_t skipped, double chance,
                       const std::string& no_eval_reason) {
  if (!main_) return;
  std::ofstream summary(std::filesystem::path(dir_) / "summary.json");
  summary << std::setprecision(8) << "{\"steps\": " << cfg_.training.steps << ", \"first_loss\": " << first_loss_
          << ", \"final_loss\": " << last_loss_ << ", \"train_seconds\": " << train_s
          << ", \"eval_samples\": " << ev.samples << ", \"eval_exact_match\": " << ev.accuracy
          << ", \"eval_loss\": " << ev.loss << ", \"data_wait_fraction\": " << data_wait / std::max(train_s, 1e-9)
          << ", \"skipped_samples\": " << skipped << ", \"chance\": " << chance << "}\n";
  char line[256];
  if (ev.samples > 0) {
    char chance_text[48] = "";
    if (chance > 0) std::snprintf(chance_text, sizeof(chance_text), " (chance %.1f%%)", 100.0 * chance);
    std::snprintf(line, sizeof(line),
                  "done in %s: loss %.4f -> %.4f; held-out loss %.4f, exact match %lld/%lld = %.1f%%%s",
                  format_duration(train_s).c_str(), first_loss_, last_loss_, ev.loss, static_cast<long long>(ev.exact),
                  static_cast<long long>(ev.samples), 100 * ev.accuracy, chance_text);
  } else {
    std::snprintf(line, sizeof(line), "done in %s: loss %.4f -> %.4f (no held-out evaluation: %s)",
                  format_duration(train_s).c_str(), first_loss_, last_loss_, no_eval_reason.c_str());
  }
  log_info(line);
  std::string slots = "held-out token accuracy per answer position:";
  for (double a : ev.slot_accuracy) {
    char buf[16];
    std::snprintf(buf, sizeof(buf), " %.2f", a);
    slots += buf;
  }
  if (!ev.slot_accuracy.empty()) log_info(slots);
}

}  // namespace dhp::train
