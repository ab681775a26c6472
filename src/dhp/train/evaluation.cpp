#include "dhp/train/evaluation.h"

#include <torch/torch.h>

#include <limits>

namespace dhp::train {

EvalResult evaluate_model(qwen::Qwen2_5_VLImpl& model, DataStream& stream, int64_t num_samples, int64_t chunk,
                          const qwen::ModelConfig& cfg) {
  torch::NoGradGuard no_grad;
  const nn::EvalScope eval_mode(model);  // no dropout
  EvalResult r;
  double loss_sum = 0;
  int64_t tokens = 0;
  std::vector<int64_t> slot_hits, slot_total;
  chunk = std::max<int64_t>(1, chunk);
  const auto device = model.parameters().front().device();  // batches go there; the counting stays on the host
  for (int64_t start = 0; start < num_samples; start += chunk) {
    auto samples = stream.eval_samples(start, std::min(num_samples, start + chunk) - start);
    if (samples.empty()) break;  // the held-out files had fewer good samples
    auto b = data::collate(samples, cfg);
    auto logits = model.target_logits(qwen::to_device(b, device)).cpu();  // (n, vocab), target positions in order
    auto sel = b.targets.ne(-100).nonzero().squeeze(-1);
    auto tgt = b.targets.index_select(0, sel);
    loss_sum += torch::nn::functional::cross_entropy(
                    logits, tgt, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                    .item<double>();
    tokens += tgt.numel();
    auto correct = logits.argmax(-1).eq(tgt);
    // Sample of each target position: count of cu_seqlens offsets <= position, minus one.
    auto cu = torch::tensor(b.cu_seqlens, torch::kInt64);
    auto sample = torch::searchsorted(cu, sel, /*out_int32=*/false, /*right=*/true) - 1;
    auto wrong = torch::zeros({b.num_samples()}, torch::kInt64).index_add_(0, sample, correct.logical_not().to(torch::kInt64));
    r.exact += wrong.eq(0).sum().item<int64_t>();
    // Answer slot of each target position: its rank among the sample's target positions.
    auto first = torch::zeros({b.num_samples()}, torch::kInt64).fill_(std::numeric_limits<int64_t>::max());
    first.scatter_reduce_(0, sample, sel, "amin");
    auto slot = sel - first.index_select(0, sample);
    const int64_t nslots = slot.max().item<int64_t>() + 1;
    if (static_cast<int64_t>(slot_hits.size()) < nslots) {
      slot_hits.resize(nslots, 0);
      slot_total.resize(nslots, 0);
    }
    auto hits = torch::zeros({nslots}, torch::kInt64).index_add_(0, slot, correct.to(torch::kInt64));
    auto tot = torch::bincount(slot, {}, nslots);
    for (int64_t i = 0; i < nslots; ++i) {
      slot_hits[i] += hits[i].item<int64_t>();
      slot_total[i] += tot[i].item<int64_t>();
    }
    r.samples += b.num_samples();
  }
  r.accuracy = r.samples ? static_cast<double>(r.exact) / static_cast<double>(r.samples) : 0;
  r.loss = tokens ? loss_sum / static_cast<double>(tokens) : 0;
  for (size_t i = 0; i < slot_hits.size(); ++i) {
    r.slot_accuracy.push_back(static_cast<double>(slot_hits[i]) / static_cast<double>(std::max<int64_t>(1, slot_total[i])));
  }
  return r;
}

}  // namespace dhp::train
