#include "dhp/nn/attention.h"

#include <ATen/record_function.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <map>

#include "dhp/core/build_config.h"
#include "dhp/core/error.h"
#include "dhp/core/log.h"
#include "dhp/core/torch_version.h"

// libtorch's packed-sequence flash kernel: CUDA builds of libtorch 2.4 and later.
#if DHP_WITH_CUDA && DHP_TORCH_AT_LEAST(2, 4)
#define DHP_HAS_FLASH 1
#include <ATen/ops/_flash_attention_forward.h>
#else
#define DHP_HAS_FLASH 0
#endif

#include <mutex>
#include <set>

namespace dhp::nn {
namespace {

using torch::Tensor;
using torch::indexing::Slice;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A group of short segments padded to a common length: rows of idx (B, Lp) index the
// sequence; `valid` marks real (not padding) positions.
struct Bucket {
  int64_t length = 0;
  std::vector<int64_t> starts, lens;
};

struct BucketTensors {
  Tensor gather;     // (B*Lp) int64: sequence position per padded slot (0 for padding)
  Tensor valid_pos;  // (n) int64: padded slots that hold real tokens
  Tensor seq_pos;    // (n) int64: sequence position of each valid slot
  Tensor allowed;    // (B, Lp, Lp) bool: key j visible from query i
  Tensor valid_q;    // (B, Lp, 1) fp32: 1 for real query rows, 0 for padding
};

// Built on the host, then moved to `device` (the index lists come from cu_seqlens).
BucketTensors make_bucket_tensors(const Bucket& b, bool causal, const torch::Device& device) {
  const int64_t B = static_cast<int64_t>(b.starts.size()), Lp = b.length;
  std::vector<int64_t> gather(B * Lp, 0), valid_pos, seq_pos;
  std::vector<uint8_t> valid(B * Lp, 0);
  for (int64_t i = 0; i < B; ++i) {
    for (int64_t t = 0; t < b.lens[i]; ++t) {
      gather[i * Lp + t] = b.starts[i] + t;
      valid[i * Lp + t] = 1;
      valid_pos.push_back(i * Lp + t);
      seq_pos.push_back(b.starts[i] + t);
    }
  }
  BucketTensors bt;
  bt.gather = torch::tensor(gather, torch::kInt64);
  bt.valid_pos = torch::tensor(valid_pos, torch::kInt64);
  bt.seq_pos = torch::tensor(seq_pos, torch::kInt64);
  auto valid_k = torch::from_blob(valid.data(), {B, 1, Lp}, torch::kUInt8).to(torch::kBool);
  bt.allowed = valid_k.expand({B, Lp, Lp});
  bt.valid_q = valid_k.view({B, Lp, 1}).to(torch::kFloat32);
  if (causal) bt.allowed = bt.allowed & torch::ones({Lp, Lp}, torch::kBool).tril();
  if (!device.is_cpu()) {
    for (Tensor* t : {&bt.gather, &bt.valid_pos, &bt.seq_pos, &bt.allowed, &bt.valid_q}) *t = t->to(device);
  }
  return bt;
}

// The segments of one call: short ones grouped in dense buckets (length <= block, bucketed
// by next power of two, with their index tensors), long ones for the blockwise path.
struct SegmentPlan {
  std::vector<std::pair<Bucket, BucketTensors>> dense;
  std::vector<std::pair<int64_t, int64_t>> longs;  // (start, length)
};

SegmentPlan plan_segments(const std::vector<int64_t>& cu, int64_t block, bool causal, const torch::Device& device) {
  SegmentPlan plan;
  std::map<int64_t, Bucket> by_len;
  for (size_t i = 0; i + 1 < cu.size(); ++i) {
    const int64_t s = cu[i], len = cu[i + 1] - cu[i];
    if (len > block) {
      plan.longs.emplace_back(s, len);
      continue;
    }
    int64_t p = 1;
    while (p < len) p <<= 1;
    p = std::min(p, block);
    auto& b = by_len[p];
    b.length = p;
    b.starts.push_back(s);
    b.lens.push_back(len);
  }
  // A bucket's score tensors are (H, B, Lp, Lp): split it into chunks of at most block^2
  // query-key pairs per head, the size of one tile of the blockwise path. Whole buckets of
  // hundreds of windows made tens of MB per tensor, past the cache and near glibc's mmap
  // threshold: measured 2x slower (64-token windows x 256, 2 heads: 0.077 -> 0.050 s fwd+bwd).
  for (auto& kv : by_len) {
    const Bucket& all = kv.second;
    const int64_t per = std::max<int64_t>(1, block * block / (all.length * all.length));
    for (size_t i0 = 0; i0 < all.starts.size(); i0 += per) {
      Bucket b;
      b.length = all.length;
      const size_t i1 = std::min(all.starts.size(), i0 + static_cast<size_t>(per));
      b.starts.assign(all.starts.begin() + i0, all.starts.begin() + i1);
      b.lens.assign(all.lens.begin() + i0, all.lens.begin() + i1);
      auto bt = make_bucket_tensors(b, causal, device);
      plan.dense.emplace_back(std::move(b), std::move(bt));
    }
  }
  return plan;
}

// Gathers (H, S, D) -> (H, B, Lp, D) for one bucket.
Tensor gather_bucket(const Tensor& x, const BucketTensors& bt, int64_t B, int64_t Lp) {
  return x.index_select(1, bt.gather).view({x.size(0), B, Lp, x.size(2)});
}

// Writes the valid rows of (H, B, Lp, D|none) back into (H, S, ...) at the bucket's positions.
void scatter_bucket(Tensor& dst, const Tensor& src, const BucketTensors& bt) {
  auto flat = src.reshape({src.size(0), src.size(1) * src.size(2), -1});
  auto rows = flat.index_select(1, bt.valid_pos);
  if (dst.dim() == 2) rows = rows.squeeze(-1);
  dst.index_copy_(1, bt.seq_pos, rows);
}

Tensor bucket_scores(const Tensor& qb, const Tensor& kb, const BucketTensors& bt, double scale) {
  auto s = torch::matmul(qb, kb.transpose(-1, -2)).mul_(scale);  // (H, B, Lp, Lp)
  return s.masked_fill_(bt.allowed.logical_not().unsqueeze(0), kNegInf);
}

Tensor block_scores(const Tensor& qi, const Tensor& kj, int64_t i0, int64_t j0, bool causal,
                    double scale) {
  auto s = torch::matmul(qi, kj.transpose(-1, -2)).mul_(scale);  // (H, bq, bk)
  const int64_t bq = qi.size(1), bk = kj.size(1);
  if (causal && j0 + bk - 1 > i0) {
    const auto idx = torch::TensorOptions().dtype(torch::kInt64).device(qi.device());
    auto qpos = torch::arange(i0, i0 + bq, idx).unsqueeze(1);
    auto kpos = torch::arange(j0, j0 + bk, idx).unsqueeze(0);
    s.masked_fill_((kpos > qpos).unsqueeze(0), kNegInf);
  }
  return s;
}

struct Forward {
  Tensor out;  // (H, S, D) fp32
  Tensor lse;  // (H, S) fp32
};

Forward forward_impl(const Tensor& q, const Tensor& k, const Tensor& v,
                     const std::vector<int64_t>& cu, bool causal, int64_t block) {
  const int64_t H = q.size(0), S = q.size(1), D = q.size(2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  Forward f{torch::zeros({H, S, D}, q.options()), torch::zeros({H, S}, q.options())};
  const auto plan = plan_segments(cu, block, causal, q.device());
  for (const auto& [b, bt] : plan.dense) {
    const int64_t B = static_cast<int64_t>(b.starts.size()), Lp = b.length;
    auto s = bucket_scores(gather_bucket(q, bt, B, Lp), gather_bucket(k, bt, B, Lp), bt, scale);
    auto lse = s.logsumexp(-1, /*keepdim=*/true);  // (H, B, Lp, 1)
    auto out = torch::matmul(s.sub_(lse).exp_(), gather_bucket(v, bt, B, Lp));
    scatter_bucket(f.out, out, bt);
    scatter_bucket(f.lse, lse, bt);
  }
  for (const auto& [s0, len] : plan.longs) {
    for (int64_t i0 = 0; i0 < len; i0 += block) {
      const int64_t bq = std::min(block, len - i0);
      auto qi = q.narrow(1, s0 + i0, bq);
      auto m = torch::full({H, bq, 1}, kNegInf, q.options());
      auto l = torch::zeros({H, bq, 1}, q.options());
      auto acc = torch::zeros({H, bq, D}, q.options());
      const int64_t j_end = causal ? i0 + bq : len;
      for (int64_t j0 = 0; j0 < j_end; j0 += block) {
        const int64_t bk = std::min(block, j_end - j0);
        auto s = block_scores(qi, k.narrow(1, s0 + j0, bk), i0, j0, causal, scale);
        auto m_new = torch::maximum(m, std::get<0>(s.max(-1, /*keepdim=*/true)));
        auto p = s.sub_(m_new).exp_();
        auto alpha = (m - m_new).exp_();
        l.mul_(alpha).add_(p.sum(-1, /*keepdim=*/true));
        acc.mul_(alpha).add_(torch::matmul(p, v.narrow(1, s0 + j0, bk)));
        m = m_new;
      }
      f.out.narrow(1, s0 + i0, bq).copy_(acc.div_(l));
      f.lse.narrow(1, s0 + i0, bq).copy_((m + l.log()).squeeze(-1));
    }
  }
  return f;
}

struct Grads {
  Tensor dq, dk, dv;  // (H, S, D) fp32
};

Grads backward_impl(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                    const Tensor& lse, const Tensor& dout, const std::vector<int64_t>& cu,
                    bool causal, int64_t block) {
  const int64_t H = q.size(0), S = q.size(1), D = q.size(2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  Grads g{torch::zeros_like(q), torch::zeros_like(k), torch::zeros_like(v)};
  auto delta = (dout * out).sum(-1);  // (H, S)
  const auto plan = plan_segments(cu, block, causal, q.device());
  for (const auto& [b, bt] : plan.dense) {
    const int64_t B = static_cast<int64_t>(b.starts.size()), Lp = b.length;
    auto qb = gather_bucket(q, bt, B, Lp), kb = gather_bucket(k, bt, B, Lp);
    auto vb = gather_bucket(v, bt, B, Lp), dob = gather_bucket(dout, bt, B, Lp);
    // Padding query rows stand in with position 0's query and lse, which are not theirs: the
    // score against this bucket's keys minus that lse may exceed fp32's exp range, and inf x 0
    // is NaN. An lse of +inf there makes their probabilities exactly 0, so they add nothing
    // to dk, dv.
    auto lseb = lse.index_select(1, bt.gather).view({H, B, Lp, 1}).masked_fill(bt.valid_q.eq(0).unsqueeze(0),
                                                                                std::numeric_limits<float>::infinity());
    auto deltab = delta.index_select(1, bt.gather).view({H, B, Lp, 1});
    auto p = bucket_scores(qb, kb, bt, scale).sub_(lseb).exp_();  // (H, B, Lp, Lp)
    auto dv = torch::matmul(p.transpose(-1, -2), dob);
    auto ds = torch::matmul(dob, vb.transpose(-1, -2)).sub_(deltab).mul_(p).mul_(scale);
    scatter_bucket(g.dq, torch::matmul(ds, kb), bt);
    scatter_bucket(g.dk, torch::matmul(ds.transpose(-1, -2), qb), bt);
    scatter_bucket(g.dv, dv, bt);
  }
  for (const auto& [s0, len] : plan.longs) {
    for (int64_t i0 = 0; i0 < len; i0 += block) {
      const int64_t bq = std::min(block, len - i0);
      auto qi = q.narrow(1, s0 + i0, bq), doi = dout.narrow(1, s0 + i0, bq);
      auto lsei = lse.narrow(1, s0 + i0, bq).unsqueeze(-1);
      auto deltai = delta.narrow(1, s0 + i0, bq).unsqueeze(-1);
      auto dqi = g.dq.narrow(1, s0 + i0, bq);
      const int64_t j_end = causal ? i0 + bq : len;
      for (int64_t j0 = 0; j0 < j_end; j0 += block) {
        const int64_t bk = std::min(block, j_end - j0);
        auto kj = k.narrow(1, s0 + j0, bk), vj = v.narrow(1, s0 + j0, bk);
        auto p = block_scores(qi, kj, i0, j0, causal, scale).sub_(lsei).exp_();
        g.dv.narrow(1, s0 + j0, bk).add_(torch::matmul(p.transpose(-1, -2), doi));
        auto ds = torch::matmul(doi, vj.transpose(-1, -2)).sub_(deltai).mul_(p).mul_(scale);
        dqi.add_(torch::matmul(ds, kj));
        g.dk.narrow(1, s0 + j0, bk).add_(torch::matmul(ds.transpose(-1, -2), qi));
      }
    }
  }
  return g;
}

// (S, H, D) any dtype -> (H, S, D) fp32 contiguous.
Tensor to_heads_major(const Tensor& x) {
  return x.transpose(0, 1).to(torch::kFloat32).contiguous();
}

struct VarlenAttentionFn : public torch::autograd::Function<VarlenAttentionFn> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& q, const Tensor& k,
                        const Tensor& v, const std::vector<int64_t>& cu, bool causal,
                        int64_t block) {
    auto f = forward_impl(to_heads_major(q), to_heads_major(k), to_heads_major(v), cu, causal, block);
    // The inputs are saved as given (bf16 under mixed precision) and converted again in the
    // backward: half the memory of keeping the fp32 heads-major copies.
    // A view into a larger buffer (v out of a fused qkv projection) is copied, so that
    // saving it does not keep the whole buffer alive.
    auto own = [](const Tensor& t) {
      const auto bytes = static_cast<size_t>(t.numel()) * t.element_size();
      if (t.is_contiguous()) return t.storage().nbytes() == bytes ? t : t.clone();
      return t.contiguous();
    };
    ctx->save_for_backward({own(q), own(k), own(v), f.out, f.lse});
    ctx->saved_data["cu"] = cu;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["block"] = block;
    ctx->saved_data["dtype"] = static_cast<int64_t>(q.scalar_type());
    return f.out.transpose(0, 1).to(q.scalar_type());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto cu = ctx->saved_data["cu"].toIntVector();
    const bool causal = ctx->saved_data["causal"].toBool();
    const int64_t block = ctx->saved_data["block"].toInt();
    const auto dtype = static_cast<torch::ScalarType>(ctx->saved_data["dtype"].toInt());
    auto g = backward_impl(to_heads_major(saved[0]), to_heads_major(saved[1]), to_heads_major(saved[2]), saved[3],
                           saved[4],
                           to_heads_major(grads[0]), cu, causal, block);
    auto back = [&](const Tensor& t) { return t.transpose(0, 1).to(dtype); };
    return {back(g.dq), back(g.dk), back(g.dv), Tensor(), Tensor(), Tensor()};
  }
};

// The segment offsets as an int32 tensor on `device`, built once per distinct list: a
// micro-batch's layers all attend over the same two or three lists (windows, whole images,
// samples), so the copy happens once per micro-batch, not once per layer.
Tensor device_offsets(const std::vector<int64_t>& cu, const torch::Device& device) {
  struct Entry {
    std::vector<int64_t> cu;
    torch::Device device;
    Tensor offsets;
  };
  thread_local std::vector<Entry> cache;  // the most recent first, a few entries
  for (size_t i = 0; i < cache.size(); ++i) {
    if (cache[i].device == device && cache[i].cu == cu) {
      std::rotate(cache.begin(), cache.begin() + static_cast<std::ptrdiff_t>(i), cache.begin() + static_cast<std::ptrdiff_t>(i) + 1);
      return cache.front().offsets;
    }
  }
  const std::vector<int32_t> narrow(cu.begin(), cu.end());
  auto t = torch::tensor(narrow, torch::kInt32).to(device, /*non_blocking=*/true);
  cache.insert(cache.begin(), Entry{cu, device, t});
  if (cache.size() > 4) cache.pop_back();
  return t;
}

Tensor flash_attention(const Tensor& q, const Tensor& k, const Tensor& v, const std::vector<int64_t>& cu, bool causal) {
#if DHP_HAS_FLASH
  int64_t longest = 0;  // from the host list: no device sync for the maximum length
  for (size_t i = 0; i + 1 < cu.size(); ++i) longest = std::max(longest, cu[i + 1] - cu[i]);
  const auto offsets = device_offsets(cu, q.device());
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(2)));
  return std::get<0>(at::_flash_attention_forward(q.contiguous(), k.contiguous(), v.contiguous(), offsets, offsets,
                                                  longest, longest, /*dropout_p=*/0.0, causal,
                                                  /*return_debug_mask=*/false, scale));
#else
  (void)q, (void)k, (void)v, (void)cu, (void)causal;
  DHP_FAIL("flash attention: not in this build");
#endif
}

// Whether the flash kernel has run in this process. A libtorch built without its flash kernels,
// or a GPU they do not support, fails only when called: the first call under auto is a probe,
// and after a failure (other than running out of memory) auto uses dhp's kernel for good.
struct FlashProbe {
  std::mutex mu;
  bool worked = false;
  std::string failed;  // why it cannot run here ("" until a first call failed)
};
FlashProbe& flash_probe() {
  static FlashProbe p;
  return p;
}

// The flash kernel's output, or undefined when its first call under auto failed (recorded).
Tensor probed_flash_attention(const Tensor& q, const Tensor& k, const Tensor& v, const std::vector<int64_t>& cu,
                              bool causal, AttentionKernel kernel) {
  auto& p = flash_probe();
  bool worked = false;
  {
    std::lock_guard<std::mutex> lock(p.mu);
    worked = p.worked;
  }
  if (worked || kernel == AttentionKernel::kFlash) return flash_attention(q, k, v, cu, causal);
  try {
    auto out = flash_attention(q, k, v, cu, causal);
    std::lock_guard<std::mutex> lock(p.mu);
    p.worked = true;
    return out;
  } catch (const c10::OutOfMemoryError&) {
    throw;
  } catch (const c10::Error& e) {
    std::lock_guard<std::mutex> lock(p.mu);
    p.failed = std::string("libtorch's flash kernel failed on its first call: ") + e.what_without_backtrace();
    return Tensor();
  }
}

std::string flash_failed() {
  auto& p = flash_probe();
  std::lock_guard<std::mutex> lock(p.mu);
  return p.failed;
}

// Logs, once per reason, why auto attention runs dhp's kernel on a GPU.
void log_fallback(const std::string& why) {
  static std::mutex mu;
  static std::set<std::string> said;
  std::lock_guard<std::mutex> lock(mu);
  if (said.insert(why).second) log_info("attention: dhp's kernel instead of flash (training.attention=auto): " + why);
}

}  // namespace

AttentionKernel parse_attention_kernel(const std::string& value, const std::string& key) {
  if (value == "auto") return AttentionKernel::kAuto;
  if (value == "dhp") return AttentionKernel::kDhp;
  if (value == "flash") return AttentionKernel::kFlash;
  DHP_FAIL(key, "='", value, "' is not auto, dhp or flash");
}

std::string flash_unsupported(const Tensor& q, const Tensor& k) {
  if (!DHP_HAS_FLASH) return "this dhp is built against a libtorch without CUDA, or older than 2.4";
  if (!q.is_cuda()) return "the tensors are on " + q.device().str() + ", not on a CUDA device";
  if (q.scalar_type() != torch::kBFloat16 && q.scalar_type() != torch::kHalf) {
    return std::string("the tensors are ") + c10::toString(q.scalar_type()) + " (flash takes bf16 or fp16)";
  }
  const int64_t d = q.size(-1);
  if (d % 8 != 0 || d > 256) return "head size " + std::to_string(d) + " (flash takes multiples of 8 up to 256)";
  if (k.size(1) == 0 || q.size(1) % k.size(1) != 0) {
    return std::to_string(k.size(1)) + " kv heads do not divide " + std::to_string(q.size(1)) + " query heads";
  }
  return "";
}

void check_cu_seqlens(const std::vector<int64_t>& cu, int64_t total, const char* what) {
  DHP_CHECK(cu.size() >= 2 && cu.front() == 0 && cu.back() == total, what,
            ": cu_seqlens must start at 0 and end at the sequence length ", total, ", got ",
            cu.size(), " offsets ending at ", cu.empty() ? -1 : cu.back());
  for (size_t i = 0; i + 1 < cu.size(); ++i) {
    DHP_CHECK(cu[i + 1] > cu[i], what, ": cu_seqlens must be strictly increasing, got ", cu[i],
              " then ", cu[i + 1], " at index ", i);
  }
}

Tensor varlen_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                        const std::vector<int64_t>& cu_seqlens,
                        const VarlenAttentionOptions& options) {
  RECORD_USER_SCOPE("dhp::attention");  // the profiled step's attention time (core/op_profile.h)
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && k.size(0) == q.size(0) &&
                  k.size(2) == q.size(2) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "varlen_attention: q must be (S, H, D) and k, v (S, Hk, D) with Hk dividing H, got ", q.sizes(), ", ",
              k.sizes(), ", ", v.sizes());
  TORCH_CHECK(options.block_size > 0, "varlen_attention: block_size must be > 0");
  check_cu_seqlens(cu_seqlens, q.size(0), "varlen_attention");
  if (options.kernel != AttentionKernel::kDhp) {
    auto why = flash_unsupported(q, k);
    if (why.empty()) why = flash_failed();
    DHP_CHECK(options.kernel != AttentionKernel::kFlash || why.empty(),
              "training.attention=flash, but libtorch's flash kernel cannot take these inputs: ", why,
              "; use training.attention=auto or dhp");
    if (why.empty()) {
      auto out = probed_flash_attention(q, k, v, cu_seqlens, options.causal, options.kernel);
      if (out.defined()) return out;
      why = flash_failed();
    }
    if (q.is_cuda()) log_fallback(why);
  }
  const int64_t groups = q.size(1) / k.size(1);
  if (groups > 1) {  // GQA on dhp's kernel: query head h uses kv head h / groups
    return VarlenAttentionFn::apply(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), cu_seqlens,
                                    options.causal, options.block_size);
  }
  return VarlenAttentionFn::apply(q, k, v, cu_seqlens, options.causal, options.block_size);
}

}  // namespace dhp::nn
