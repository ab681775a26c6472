// Each layer against a small hand-computed or naive case: rotary, M-RoPE positions,
// window index and its reverse, patch order, RMSNorm, merger, the vision tower's window
// machinery against a masked reference in processor order.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>

#include "dhp/core/error.h"
#include "dhp/core/memory.h"
#include "dhp/data/shapes.h"
#include "dhp/models/qwen2_5_vl/model.h"
#include "dhp/nn/attention.h"
#include "dhp/nn/layers.h"

namespace {

using dhp::qwen::GridTHW;

dhp::qwen::VisionConfig small_vision() {
  dhp::qwen::VisionConfig v;
  v.depth = 3;
  v.hidden_size = 32;
  v.num_heads = 2;
  v.intermediate_size = 48;
  v.out_hidden_size = 24;
  v.fullatt_block_indexes = {1};
  return v;
}

TEST(Rotary, RotateHalfAndApplyByHand) {
  auto x = torch::tensor({1.f, 2.f, 3.f, 4.f}).view({1, 1, 4});
  auto r = dhp::nn::rotate_half(x);
  EXPECT_TRUE(torch::equal(r, torch::tensor({-3.f, -4.f, 1.f, 2.f}).view({1, 1, 4})));
  // angle pi/2 on every channel: x*0 + rotate_half(x)*1
  auto cos = torch::zeros({1, 4}), sin = torch::ones({1, 4});
  EXPECT_TRUE(torch::allclose(dhp::nn::apply_rotary(x, cos, sin), r));
  auto inv = dhp::nn::rope_inv_freq(8, 10000.0);
  EXPECT_NEAR(inv[0].item<float>(), 1.0, 1e-7);
  EXPECT_NEAR(inv[1].item<float>(), std::pow(10000.0, -2.0 / 8), 1e-7);
  EXPECT_NEAR(inv[3].item<float>(), std::pow(10000.0, -6.0 / 8), 1e-7);
}

TEST(Rotary, MropeTakesEachChannelFromItsAxis) {
  dhp::qwen::TextConfig t;
  t.hidden_size = 24;
  t.num_heads = 2;  // head_dim 12, 6 rotary pairs
  t.mrope_section = {1, 2, 3};
  t.rope_theta = 100.0;
  auto pos = torch::tensor({5, 7, 11}, torch::kInt64).view({3, 1});  // t=5, h=7, w=11
  auto [cos, sin] = dhp::qwen::mrope_cos_sin(pos, t);
  auto inv = dhp::nn::rope_inv_freq(12, 100.0);
  const int axis_pos[6] = {5, 7, 7, 11, 11, 11};
  for (int j = 0; j < 6; ++j) {
    const double angle = axis_pos[j] * inv[j].item<double>();
    EXPECT_NEAR(cos[0][j].item<double>(), std::cos(angle), 1e-6) << j;
    EXPECT_NEAR(cos[0][j + 6].item<double>(), std::cos(angle), 1e-6) << j;
    EXPECT_NEAR(sin[0][j].item<double>(), std::sin(angle), 1e-6) << j;
  }
}

TEST(RopeIndex, TextImageTextByHand) {
  auto cfg = dhp::qwen::preset("demo");
  const int64_t I = cfg.image_token_id;
  // t t VS [4 image tokens of a 4x4 patch grid = 2x2 merged] VE t
  std::vector<int64_t> ids = {10, 11, 3, I, I, I, I, 4, 12};
  auto p = dhp::qwen::rope_index(ids, {GridTHW{1, 4, 4}}, cfg);
  auto expect = torch::tensor({0, 1, 2, 3, 3, 3, 3, 5, 6,
                               0, 1, 2, 3, 3, 4, 4, 5, 6,
                               0, 1, 2, 3, 4, 3, 4, 5, 6}, torch::kInt64).view({3, 9});
  EXPECT_TRUE(torch::equal(p, expect)) << p;
  // Text only: plain positions on all axes.
  auto q = dhp::qwen::rope_index({1, 2, 3}, {}, cfg);
  EXPECT_TRUE(torch::equal(q, torch::arange(3).repeat({3, 1})));
  // A wide image: h over 1 row, w over 3 columns; text resumes at max + 1.
  auto r = dhp::qwen::rope_index({I, I, I, 9}, {GridTHW{1, 2, 6}}, cfg);
  EXPECT_TRUE(torch::equal(r, torch::tensor({0, 0, 0, 3, 0, 0, 0, 3, 0, 1, 2, 3}, torch::kInt64).view({3, 4})));
  EXPECT_THROW(dhp::qwen::rope_index({I, I, 9}, {GridTHW{1, 4, 4}}, cfg), dhp::Error);
  EXPECT_THROW(dhp::qwen::rope_index({I, I, I, I}, {}, cfg), dhp::Error);
}

TEST(WindowIndex, ByHandAndReverse) {
  auto v = small_vision();  // window 112 px = 4x4 merged units
  std::vector<int64_t> idx, cu;
  // Image 1: 8x12 patches = 4x6 merged units -> windows [4x4 | 4x2]. Image 2: 4x4 patches.
  dhp::qwen::window_index({GridTHW{1, 8, 12}, GridTHW{1, 4, 4}}, v, idx, cu);
  std::vector<int64_t> expect = {0, 1, 2, 3, 6, 7, 8, 9, 12, 13, 14, 15, 18, 19, 20, 21,
                                 4, 5, 10, 11, 16, 17, 22, 23, 24, 25, 26, 27};
  EXPECT_EQ(idx, expect);
  EXPECT_EQ(cu, (std::vector<int64_t>{0, 64, 96, 112}));
  auto inv = dhp::qwen::inverse_permutation(idx);
  for (size_t i = 0; i < idx.size(); ++i) EXPECT_EQ(idx[inv[i]], static_cast<int64_t>(i));
  auto x = torch::arange(28 * 4).view({28 * 4, 1});
  auto back = dhp::qwen::reorder_units(dhp::qwen::reorder_units(x, idx, 4), inv, 4);
  EXPECT_TRUE(torch::equal(back, x));
  // Exact multiple of the window: no empty windows in the offsets.
  dhp::qwen::window_index({GridTHW{1, 8, 8}}, v, idx, cu);
  EXPECT_EQ(cu, (std::vector<int64_t>{0, 64}));
  EXPECT_THROW(dhp::qwen::window_index({GridTHW{1, 5, 8}}, v, idx, cu), dhp::Error);
}

TEST(PatchOrder, MatchesProcessorLayout) {
  auto v = small_vision();
  // Pixel value encodes (c, y, x).
  const int64_t H = 56, W = 84;
  auto img = torch::empty({3, H, W});
  auto a = img.accessor<float, 3>();
  for (int c = 0; c < 3; ++c)
    for (int y = 0; y < H; ++y)
      for (int x = 0; x < W; ++x) a[c][y][x] = static_cast<float>(c * 100000 + y * 1000 + x);
  GridTHW grid;
  auto p = dhp::data::patchify(img, v, grid);
  EXPECT_EQ(grid, (GridTHW{1, 4, 6}));
  ASSERT_EQ(p.sizes(), (torch::IntArrayRef{24, 3 * 2 * 14 * 14}));
  auto pa = p.accessor<float, 2>();
  for (int py = 0; py < 4; ++py) {
    for (int px = 0; px < 6; ++px) {
      const int row = ((py / 2) * 3 + px / 2) * 4 + (py % 2) * 2 + px % 2;
      for (int c : {0, 2})
        for (int t : {0, 1})
          for (int dy : {0, 13})
            for (int dx : {0, 5}) {
              const int col = ((c * 2 + t) * 14 + dy) * 14 + dx;
              EXPECT_EQ(pa[row][col], a[c][py * 14 + dy][px * 14 + dx]) << row << "," << col;
            }
    }
  }
  auto pos = dhp::qwen::vision_pos_ids({grid}, 2);
  for (int py = 0; py < 4; ++py)
    for (int px = 0; px < 6; ++px) {
      const int row = ((py / 2) * 3 + px / 2) * 4 + (py % 2) * 2 + px % 2;
      EXPECT_EQ(pos[row][0].item<int64_t>(), py);
      EXPECT_EQ(pos[row][1].item<int64_t>(), px);
    }
}

TEST(Layers, RMSNormByHand) {
  dhp::nn::RMSNorm n(2, 0.0);
  auto y = n(torch::tensor({3.f, 4.f}).view({1, 2}));
  const float rms = std::sqrt(12.5f);
  EXPECT_NEAR(y[0][0].item<float>(), 3 / rms, 1e-6);
  EXPECT_NEAR(y[0][1].item<float>(), 4 / rms, 1e-6);
}

// The fused autograd nodes against the same math in plain autograd ops: values and the
// gradients of every input, fp32 (1e-5) and bf16 (rounding of the 16-bit results: 2e-2).
torch::Tensor plain_rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  auto xf = x.to(torch::kFloat32);
  return w * (xf * torch::rsqrt(xf.pow(2).mean(-1, true) + eps)).to(x.scalar_type());
}

torch::Tensor plain_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  auto xf = x.to(torch::kFloat32);
  auto c = cos.unsqueeze(1), s = sin.unsqueeze(1);
  return (xf * c + dhp::nn::rotate_half(xf) * s).to(x.scalar_type());
}

void expect_close(const torch::Tensor& a, const torch::Tensor& b, double tol, const char* what) {
  const double err = (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
  const double scale = b.to(torch::kFloat64).abs().max().item<double>();
  EXPECT_LE(err, tol * scale) << what << ": max error " << err << " vs max " << scale;
}

class FusedLayers : public ::testing::TestWithParam<torch::ScalarType> {};

TEST_P(FusedLayers, RMSNormGradientsEqualPlainAutograd) {
  const auto dt = GetParam();
  const double tol = dt == torch::kFloat32 ? 1e-5 : 2e-2;
  torch::manual_seed(3);
  dhp::nn::RMSNorm n(48, 1e-6);
  n->weight.data().uniform_(0.5, 1.5);
  n->to(dt);
  auto x = (torch::randn({7, 5, 48}) * 3).to(dt).requires_grad_(true);
  auto x2 = x.detach().clone().requires_grad_(true);
  auto w2 = n->weight.detach().clone().requires_grad_(true);
  auto g = torch::randn({7, 5, 48}).to(dt);
  auto y = n(x);
  auto y2 = plain_rms_norm(x2, w2, 1e-6);
  expect_close(y, y2, tol, "output");
  y.backward(g);
  y2.backward(g);
  expect_close(x.grad(), x2.grad(), tol, "input gradient");
  expect_close(n->weight.grad(), w2.grad(), tol, "weight gradient");
}

TEST_P(FusedLayers, RotaryGradientEqualsPlainAutograd) {
  const auto dt = GetParam();
  const double tol = dt == torch::kFloat32 ? 1e-5 : 2e-2;
  torch::manual_seed(4);
  auto ang = torch::randn({9, 16});
  auto cos = ang.cos(), sin = ang.sin();
  auto x = torch::randn({9, 3, 16}).to(dt).requires_grad_(true);
  auto x2 = x.detach().clone().requires_grad_(true);
  auto g = torch::randn({9, 3, 16}).to(dt);
  auto y = dhp::nn::apply_rotary(x, cos, sin);
  auto y2 = plain_rotary(x2, cos, sin);
  expect_close(y, y2, tol, "output");
  y.backward(g);
  y2.backward(g);
  expect_close(x.grad(), x2.grad(), tol, "input gradient");
}

INSTANTIATE_TEST_SUITE_P(Dtypes, FusedLayers, ::testing::Values(torch::kFloat32, torch::kBFloat16));

// What a norm keeps for the backward: its input is held by the caller anyway, so beyond
// the output only the per-row rstd (plain autograd kept ~3 fp32 copies of the activations).
// LoRA on a linear: y = x W^T + b + alpha/r * x A^T B^T (B zero at first: the base output);
// with dropout, a checkpointed recomputation replays the forward's masks, so gradients equal
// the plain run's; evaluation mode draws none.
TEST(Layers, LoraAdapterByHandAndDropoutReplayedWhenRecomputed) {
  torch::manual_seed(1);
  dhp::nn::Linear lin(12, 6, true);
  const auto x = torch::randn({5, 12});
  const auto base = lin(x).detach();
  lin->add_lora({4, 8, 0.0});
  EXPECT_TRUE(torch::equal(lin(x), base));  // B = 0
  EXPECT_EQ(lin->named_parameters().size(), 4u);
  EXPECT_TRUE(lin->named_parameters().contains("lora_A.weight"));
  {
    torch::NoGradGuard no_grad;
    lin->lora_b.normal_();
  }
  const auto want = base + torch::matmul(torch::matmul(x, lin->lora_a.t()), lin->lora_b.t()) * 2.0;  // 8 / 4
  EXPECT_TRUE(torch::allclose(lin(x), want, 1e-5, 1e-6));

  dhp::nn::Linear drop(12, 6, false);
  drop->add_lora({4, 8, 0.5});
  ASSERT_TRUE(dhp::nn::random_ops_in_use());
  {
    torch::NoGradGuard no_grad;
    drop->lora_b.normal_();
  }
  std::vector<torch::Tensor> grads[2];
  for (int ck = 0; ck < 2; ++ck) {
    torch::manual_seed(7);
    auto xi = x.clone().requires_grad_(true);
    auto fn = [&](const torch::Tensor& t) { return torch::tanh(drop(t)); };
    auto y = ck ? dhp::nn::checkpoint(fn, xi) : fn(xi);
    y.pow(2).sum().backward();
    grads[ck] = {xi.grad().clone(), drop->lora_a.grad().clone(), drop->lora_b.grad().clone()};
    drop->zero_grad();
  }
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(torch::allclose(grads[0][i], grads[1][i], 1e-6, 1e-7)) << i;
  drop->eval();
  EXPECT_TRUE(torch::equal(drop(x), drop(x)));  // no dropout in evaluation
  drop->train();
  EXPECT_FALSE(torch::equal(drop(x), drop(x)));
}

TEST(Layers, RMSNormSavesOnlyRowStatistics) {
  dhp::install_memory_accounting();
  dhp::nn::RMSNorm n(256, 1e-6);
  n->to(torch::kBFloat16);
  auto x = torch::randn({2048, 256}).to(torch::kBFloat16).requires_grad_(true);
  const int64_t act = x.numel() * 2;
  const int64_t before = dhp::memory_live_bytes();
  auto y = n(x);
  const int64_t held = dhp::memory_live_bytes() - before;  // output + saved tensors
  EXPECT_LE(held, act + 2048 * 4 + 4096) << "the norm holds " << held << " bytes for a " << act
                                         << "-byte activation";
  y.sum().backward();
  EXPECT_TRUE(x.grad().defined());
}

TEST(Layers, MergerConcatenatesFourPatches) {
  auto v = small_vision();
  dhp::qwen::PatchMerger m(v);
  torch::manual_seed(0);
  auto x = torch::randn({8, v.hidden_size});
  auto y = m(x);
  ASSERT_EQ(y.sizes(), (torch::IntArrayRef{2, v.out_hidden_size}));
  auto l0 = m->fc1.get(), l2 = m->fc2.get();
  auto cat = m->ln_q(x).view({2, 4 * v.hidden_size});
  auto ref = l2->forward(torch::gelu(l0->forward(cat)));
  EXPECT_TRUE(torch::allclose(y, ref, 1e-6, 1e-6));
}

// The vision tower in processor order with explicit S x S masks: window membership for
// window blocks, same image for full blocks; no reorder. Equals the windowed tower.
torch::Tensor naive_vision(dhp::qwen::VisionTransformerImpl& vt, const torch::Tensor& patches,
                           const std::vector<GridTHW>& grids) {
  const auto& c = vt.cfg;
  const int64_t m = c.spatial_merge_size, win = c.window_size / m / c.patch_size;
  std::vector<int64_t> window_of, image_of;
  int64_t wbase = 0;
  int64_t frame = 0;  // full attention spans one temporal patch of one item (HF's cu_seqlens)
  for (size_t i = 0; i < grids.size(); ++i) {
    const int64_t lh = grids[i][1] / m, lw = grids[i][2] / m, nww = (lw + win - 1) / win;
    for (int64_t t = 0; t < grids[i][0]; ++t, ++frame) {
      for (int64_t y = 0; y < lh; ++y)
        for (int64_t x = 0; x < lw; ++x)
          for (int64_t u = 0; u < m * m; ++u) {
            window_of.push_back(wbase + (y / win) * nww + x / win);
            image_of.push_back(frame);
          }
      wbase += ((lh + win - 1) / win) * nww;
    }
  }
  auto wo = torch::tensor(window_of), io = torch::tensor(image_of);
  auto win_mask = wo.unsqueeze(0) == wo.unsqueeze(1), img_mask = io.unsqueeze(0) == io.unsqueeze(1);
  auto pos = dhp::qwen::vision_pos_ids(grids, m).to(torch::kFloat32);
  auto inv = dhp::nn::rope_inv_freq(c.head_dim() / 2, c.rope_theta);
  auto f = (pos.unsqueeze(-1) * inv).reshape({pos.size(0), -1});
  auto emb = torch::cat({f, f}, -1);
  auto cos = emb.cos(), sin = emb.sin();
  const std::set<int64_t> full(c.fullatt_block_indexes.begin(), c.fullatt_block_indexes.end());
  auto h = vt.patch_embed(patches);
  const int64_t S = h.size(0), H = c.num_heads, D = c.head_dim();
  for (int64_t i = 0; i < c.depth; ++i) {
    auto blk = vt.blocks->ptr<dhp::qwen::VisionBlockImpl>(i);
    auto qkv = blk->attn->qkv(blk->norm1(h)).view({S, 3, H, D}).unbind(1);
    auto q = dhp::nn::apply_rotary(qkv[0], cos, sin).transpose(0, 1);
    auto k = dhp::nn::apply_rotary(qkv[1], cos, sin).transpose(0, 1);
    auto s = torch::matmul(q, k.transpose(-1, -2)) / std::sqrt(static_cast<double>(D));
    s = s.masked_fill((full.count(i) ? img_mask : win_mask).logical_not(), -1e30);
    auto o = torch::matmul(torch::softmax(s, -1), qkv[2].transpose(0, 1)).transpose(0, 1).reshape({S, -1});
    h = h + blk->attn->proj(o);
    h = h + blk->mlp(blk->norm2(h));
  }
  return vt.merger(h);
}

TEST(VisionTower, WindowedEqualsMaskedReferenceInProcessorOrder) {
  auto v = small_vision();
  dhp::qwen::VisionTransformer vt(v);
  dhp::qwen::init_parameters(*vt, 3, 0.2);
  torch::manual_seed(5);
  std::vector<GridTHW> grids = {GridTHW{1, 12, 20}, GridTHW{1, 4, 8}, GridTHW{1, 8, 8}};
  int64_t n = 0;
  for (auto& g : grids) n += g[1] * g[2];
  auto patches = torch::randn({n, v.patch_dim()});
  auto plan = dhp::qwen::make_vision_plan(grids, v);
  auto out = vt->forward(patches, plan);
  auto ref = naive_vision(*vt, patches, grids);
  ASSERT_EQ(out.sizes(), ref.sizes());
  const double err = (out - ref).abs().max().item<double>(), scale = ref.abs().max().item<double>();
  EXPECT_LT(err, 1e-5 * scale) << "max abs error " << err << " at output scale " << scale;
}

// Video grids (t > 1): windows and full attention per temporal patch, the 2-D rotary
// repeated for each, as Qwen2.5-VL's tower does; an image and two clips in one call.
TEST(VisionTower, VideoGridsAttendWithinEachTemporalPatch) {
  auto v = small_vision();
  dhp::qwen::VisionTransformer vt(v);
  dhp::qwen::init_parameters(*vt, 4, 0.2);
  torch::manual_seed(6);
  std::vector<GridTHW> grids = {GridTHW{3, 8, 12}, GridTHW{1, 4, 8}, GridTHW{2, 12, 4}};
  int64_t n = 0;
  for (auto& g : grids) n += g[0] * g[1] * g[2];
  auto patches = torch::randn({n, v.patch_dim()});
  auto plan = dhp::qwen::make_vision_plan(grids, v);
  EXPECT_EQ(plan.cu_seqlens, (std::vector<int64_t>{0, 96, 192, 288, 320, 368, 416}));
  auto out = vt->forward(patches, plan);
  auto ref = naive_vision(*vt, patches, grids);
  ASSERT_EQ(out.sizes(), ref.sizes());
  const double err = (out - ref).abs().max().item<double>(), scale = ref.abs().max().item<double>();
  EXPECT_LT(err, 1e-5 * scale) << "max abs error " << err << " at output scale " << scale;
  // A clip is not three images: its temporal patches share nothing but the order.
  auto one = vt->forward(patches.narrow(0, 96, 96), dhp::qwen::make_vision_plan({GridTHW{1, 8, 12}}, v));
  EXPECT_LT((one - out.narrow(0, 24, 24)).abs().max().item<double>(), 1e-5 * scale);
}

// The tower's rotary tables for one rank's rows (sequence parallelism) are those rows of the
// whole table, and are built on the activations' device (meta stands in for a GPU: a table
// built on the host and mixed in would not be meta). libtorch 1.13 has no meta index_select:
// the device half is skipped there and runs on libtorch 2.x.
TEST(VisionTower, RotaryRowsAreTheWholeTablesRowsOnTheActivationsDevice) {
  auto v = small_vision();
  dhp::qwen::VisionTransformer vt(v);
  const std::vector<GridTHW> grids = {GridTHW{1, 12, 20}, GridTHW{1, 8, 8}};
  const auto plan = dhp::qwen::make_vision_plan(grids, v);
  const torch::Device cpu(torch::kCPU);
  const auto [cos, sin] = vt->rotary(plan, cpu, 0, plan.num_patches);
  ASSERT_EQ(cos.sizes(), (std::vector<int64_t>{plan.num_patches, v.head_dim()}));
  const int64_t lo = 64, hi = 176;  // window boundaries of the first image (4x4 merged units of 4 rows)
  const auto [c2, s2] = vt->rotary(plan, cpu, lo, hi);
  EXPECT_TRUE(torch::equal(c2, cos.narrow(0, lo, hi - lo)));
  EXPECT_TRUE(torch::equal(s2, sin.narrow(0, lo, hi - lo)));
  // Row i of the window order is patch window_index's: its (h, w) angles, by hand for one row.
  const int64_t unit = v.spatial_merge_size * v.spatial_merge_size;
  const int64_t row = 70, patch = plan.window_index[row / unit] * unit + row % unit;
  const auto pos = plan.pos_ids[patch];
  const auto inv = dhp::nn::rope_inv_freq(v.head_dim() / 2, v.rope_theta);
  const auto f = torch::cat({pos[0].to(torch::kFloat32) * inv, pos[1].to(torch::kFloat32) * inv});
  EXPECT_TRUE(torch::allclose(cos[row], torch::cat({f, f}).cos()));
  try {
    auto i = torch::zeros({1}, torch::kInt64).to(torch::kMeta);
    torch::empty({4, 2}, torch::TensorOptions().device(torch::kMeta)).index_select(0, i);
  } catch (const c10::NotImplementedError&) {
    GTEST_SKIP() << "this libtorch has no meta kernel for index_select";
  }
  const auto [cm, sm] = vt->rotary(plan, torch::Device(torch::kMeta), lo, hi);
  EXPECT_TRUE(cm.is_meta() && sm.is_meta());
  EXPECT_EQ(cm.sizes(), c2.sizes());
}

}  // namespace
