// varlen_attention against the naive masked softmax: values and gradients, fp32, 1e-5.
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include "dhp/core/error.h"
#include "dhp/core/memory.h"
#include "dhp/nn/attention.h"
#include "support/attention_reference.h"

namespace {

struct Case {
  const char* name;
  std::vector<int64_t> cu;
  bool causal;
  int64_t block;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

// Offsets of segments of the given lengths, repeated `times` times.
std::vector<int64_t> repeated(const std::vector<int64_t>& lens, int times) {
  std::vector<int64_t> cu{0};
  for (int t = 0; t < times; ++t)
    for (int64_t l : lens) cu.push_back(cu.back() + l);
  return cu;
}

class AttentionParity : public ::testing::TestWithParam<Case> {};

TEST_P(AttentionParity, ValuesAndGradsMatchNaive) {
  const auto& c = GetParam();
  torch::manual_seed(7);
  const int64_t S = c.cu.back(), H = 3, D = 16;
  auto q = torch::randn({S, H, D}).requires_grad_(true);
  auto k = torch::randn({S, H, D}).requires_grad_(true);
  auto v = torch::randn({S, H, D}).requires_grad_(true);
  auto dout = torch::randn({S, H, D});
  dhp::nn::VarlenAttentionOptions o;
  o.causal = c.causal;
  o.block_size = c.block;
  auto out = dhp::nn::varlen_attention(q, k, v, c.cu, o);
  auto grads = torch::autograd::grad({out}, {q, k, v}, {dout});
  auto ref = dhp::testing::varlen_attention_naive(q, k, v, c.cu, c.causal);
  auto ref_grads = torch::autograd::grad({ref}, {q, k, v}, {dout});
  EXPECT_LT((out - ref).abs().max().item<double>(), 1e-5) << c.name;
  for (int i = 0; i < 3; ++i) {
    EXPECT_LT((grads[i] - ref_grads[i]).abs().max().item<double>(), 1e-5) << c.name << " grad " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Segments, AttentionParity,
    ::testing::Values(
        Case{"windows_dense", {0, 64, 128, 160, 176, 240}, false, 64},
        Case{"windows_dense_padded", {0, 64, 100, 113, 177}, false, 64},
        Case{"windows_causal", {0, 7, 20, 64, 65}, true, 64},
        Case{"long_blockwise", {0, 100, 130}, false, 16},
        Case{"long_blockwise_causal", {0, 100, 130}, true, 16},
        Case{"mixed_causal_ragged_blocks", {0, 5, 61, 62, 150}, true, 24},
        Case{"single_token_segments", {0, 1, 2, 3}, false, 8},
        // Buckets split in chunks of block^2 pairs: 4-token segments 16 per chunk, 8-token 4 per
        // chunk (40 and 10 segments: full chunks and a partial last one), interleaved.
        Case{"dense_buckets_in_chunks", repeated({4, 3, 8, 4}, 10), false, 16},
        Case{"dense_buckets_in_chunks_causal", repeated({8, 2, 5}, 9), true, 16}),
    [](const auto& info) { return std::string(info.param.name); });

// A padded segment's padding rows stand in with position 0's query and log-sum-exp. Where
// that query meets the padded segment's keys with a large score, exp(score - lse) overflowed
// to inf and inf x 0 made every gradient of the bucket NaN (found as a NaN gradient norm at
// step 606 of a 4-frame video run, the forward's loss finite).
TEST(Attention, PaddingRowsCannotOverflowTheBackward) {
  torch::manual_seed(3);
  const int64_t S = 7, H = 2, D = 4;
  const std::vector<int64_t> cu = {0, 4, 7};  // the second segment padded to 4 in the first's bucket
  auto q = torch::randn({S, H, D}).mul_(0.1);
  auto k = torch::randn({S, H, D}).mul_(0.1);
  q[0].select(1, 0).fill_(60);          // position 0's query ...
  k.narrow(0, 4, 3).select(2, 0).fill_(60);  // ... against the padded segment's keys: 1800
  q.requires_grad_(true);
  k.requires_grad_(true);
  auto v = torch::randn({S, H, D}).requires_grad_(true);
  auto dout = torch::randn({S, H, D});
  auto grads = torch::autograd::grad({dhp::nn::varlen_attention(q, k, v, cu)}, {q, k, v}, {dout});
  auto ref = torch::autograd::grad({dhp::testing::varlen_attention_naive(q, k, v, cu, false)}, {q, k, v}, {dout});
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(torch::isfinite(grads[i]).all().item<bool>()) << "grad " << i;
    EXPECT_LT((grads[i] - ref[i]).abs().max().item<double>(), 1e-5 * (1 + ref[i].abs().max().item<double>()))
        << "grad " << i;
  }
}

TEST(Attention, BlockwiseMemoryIsLinearInSequence) {
  // One 2048-token segment with block 128: the naive path holds S*S*H floats (48 MiB);
  // the blockwise path must stay well under that.
  const int64_t S = 2048, H = 3, D = 16;
  auto q = torch::randn({S, H, D}), k = torch::randn({S, H, D}), v = torch::randn({S, H, D});
  torch::NoGradGuard ng;
  dhp::reset_memory_peak();
  const int64_t base = dhp::memory_live_bytes();
  dhp::nn::VarlenAttentionOptions o;
  o.block_size = 128;
  auto out = dhp::nn::varlen_attention(q, k, v, {0, S}, o);
  const int64_t extra = dhp::memory_peak_bytes() - base;
  EXPECT_LT(extra, S * S * H * 4 / 4) << "blockwise attention used " << extra << " bytes";
  EXPECT_EQ(out.sizes(), q.sizes());
}

TEST(Attention, Bf16InputsGiveBf16OutputsCloseToFp32) {
  torch::manual_seed(1);
  auto q = torch::randn({80, 2, 16}), k = torch::randn({80, 2, 16}), v = torch::randn({80, 2, 16});
  auto ref = dhp::nn::varlen_attention(q, k, v, {0, 30, 80});
  auto out = dhp::nn::varlen_attention(q.to(torch::kBFloat16), k.to(torch::kBFloat16), v.to(torch::kBFloat16), {0, 30, 80});
  EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
  EXPECT_LT((out.to(torch::kFloat32) - ref).abs().max().item<double>(), 5e-2);
}

TEST(Attention, BadCuSeqlensIsAClearError) {
  auto q = torch::randn({10, 1, 8});
  EXPECT_THROW(dhp::nn::varlen_attention(q, q, q, {0, 5, 9}), dhp::Error);
  EXPECT_THROW(dhp::nn::varlen_attention(q, q, q, {0, 5, 5, 10}), dhp::Error);
  EXPECT_THROW(dhp::nn::varlen_attention(q, q, q, {1, 10}), dhp::Error);
}

// GQA: k and v with fewer heads than q; query head h attends with kv head h / (H / Hk), as
// if k and v were expanded by repeat_interleave (the decoder's order), values and gradients.
TEST(Attention, GroupedKvHeadsEqualExpandedOnes) {
  torch::manual_seed(3);
  const std::vector<int64_t> cu{0, 7, 40, 41, 90};
  for (bool causal : {true, false}) {
    auto q = torch::randn({90, 6, 8}).requires_grad_(true);
    auto k = torch::randn({90, 2, 8}).requires_grad_(true);
    auto v = torch::randn({90, 2, 8}).requires_grad_(true);
    dhp::nn::VarlenAttentionOptions o;
    o.causal = causal;
    o.block_size = 16;
    auto out = dhp::nn::varlen_attention(q, k, v, cu, o);
    auto dy = torch::randn_like(out);
    auto g = torch::autograd::grad({out}, {q, k, v}, {dy});
    auto ref = dhp::nn::varlen_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), cu, o);
    auto r = torch::autograd::grad({ref}, {q, k, v}, {dy});
    EXPECT_TRUE(torch::allclose(out, ref, 1e-6, 1e-6));
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(torch::allclose(g[i], r[i], 1e-5, 1e-6)) << "grad " << i;
  }
  auto q = torch::randn({10, 4, 8});
  EXPECT_THROW(dhp::nn::varlen_attention(q, torch::randn({10, 3, 8}), torch::randn({10, 3, 8}), {0, 10}), c10::Error);
}

// The kernel choice: flash is an error where it cannot run (here: CPU tensors), auto runs
// dhp's kernel, and the reasons name what is missing.
TEST(Attention, FlashIsRefusedWhereItCannotRunAndAutoFallsBack) {
  auto q = torch::randn({12, 2, 8});
  dhp::nn::VarlenAttentionOptions flash;
  flash.kernel = dhp::nn::AttentionKernel::kFlash;
  try {
    dhp::nn::varlen_attention(q, q, q, {0, 12}, flash);
    ADD_FAILURE() << "flash on CPU tensors ran";
  } catch (const dhp::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("training.attention=flash"), std::string::npos) << msg;
    EXPECT_NE(msg.find("training.attention=auto or dhp"), std::string::npos) << msg;
  }
  dhp::nn::VarlenAttentionOptions autok;  // kAuto by default
  EXPECT_TRUE(torch::equal(dhp::nn::varlen_attention(q, q, q, {0, 12}, autok),
                           dhp::nn::varlen_attention(q, q, q, {0, 12}, dhp::nn::VarlenAttentionOptions{false, 256,
                                                                                   dhp::nn::AttentionKernel::kDhp})));
  EXPECT_FALSE(dhp::nn::flash_unsupported(q, q).empty());
  EXPECT_EQ(dhp::nn::parse_attention_kernel("flash", "training.attention"), dhp::nn::AttentionKernel::kFlash);
  EXPECT_THROW(dhp::nn::parse_attention_kernel("fast", "training.attention"), dhp::Error);
  if (torch::cuda::is_available()) {
    const auto opts = torch::TensorOptions().device(torch::kCUDA);
    auto g = torch::randn({4, 4, 8}, opts);
    EXPECT_NE(dhp::nn::flash_unsupported(g, g).find("bf16 or fp16"), std::string::npos);
    auto h = torch::randn({4, 4, 12}, opts.dtype(torch::kBFloat16));
    EXPECT_NE(dhp::nn::flash_unsupported(h, h).find("head size 12"), std::string::npos);
  }
}

}  // namespace
