// training.device: its resolution and errors, and that the code follows its inputs' device.
// Here (CPU libtorch) the "meta" device stands in for a GPU: a meta tensor has a device and
// no data, and element-wise ops and index copies that mix it with a CPU tensor throw
// (TensorIterator's device check; libtorch 1.13's meta masked_fill_ and matmul do not check),
// so a computation that runs on meta inputs end to end mixes no CPU tensor into those. On a
// machine with CUDA, training on the GPU is compared with training on the CPU: the real check.
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include "dhp/core/build_config.h"
#include "dhp/core/device_memory.h"
#include "dhp/core/error.h"
#include "dhp/core/memory.h"
#include "dhp/dist/comm.h"
#include "dhp/data/shapes.h"
#include "dhp/nn/attention.h"
#include "dhp/parallel/zero.h"
#include "dhp/train/parallel_model.h"
#include "dhp/train/trainer.h"
#include "errors.h"

namespace {

using dhp::testing::error_of;

dhp::Config with_device(const std::string& d, std::vector<std::string> sets = {}) {
  sets.push_back("training.device=" + d);
  return dhp::load_config("", sets);
}

TEST(Device, ResolvesCpuAndNamesWhatIsMissingForCuda) {
  dhp::train::Runtime one;
  EXPECT_TRUE(dhp::train::resolve_device(with_device("cpu"), one).is_cpu());
  std::string msg;
  const int64_t count = static_cast<int64_t>(torch::cuda::device_count());
  if (count == 0) {
    msg = error_of([&] { dhp::train::resolve_device(with_device("cuda"), one); });
    EXPECT_NE(msg.find("training.device=cuda but no CUDA device"), std::string::npos) << msg;
    EXPECT_NE(msg.find("device_count() = 0"), std::string::npos) << msg;
  } else {
    EXPECT_EQ(dhp::train::resolve_device(with_device("cuda"), one), torch::Device(torch::kCUDA, 0));
    const std::string past = "cuda:" + std::to_string(count);
    msg = error_of([&] { dhp::train::resolve_device(with_device(past), one); });
    EXPECT_NE(msg.find("has " + std::to_string(count) + " CUDA device(s)"), std::string::npos) << msg;
  }
}

// A rank's device and backend from training.device and parallel.backend, for machines this
// one is not (place_rank takes the device count and the build's NCCL as inputs).
TEST(Device, PlacementFollowsDeviceBackendAndLocalRank) {
  using dhp::dist::Backend;
  using dhp::train::place_rank;
  const torch::Device cpu(torch::kCPU);
  auto cuda = [](int i) { return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(i)); };
  EXPECT_EQ(place_rank("cpu", "auto", 4, 3, 8, true).device, cpu);
  EXPECT_EQ(place_rank("cpu", "auto", 4, 3, 8, true).backend, Backend::kGloo);
  // auto: NCCL on CUDA where the build has it, every rank on its own GPU.
  EXPECT_EQ(place_rank("cuda", "auto", 4, 3, 8, true).device, cuda(3));
  EXPECT_EQ(place_rank("cuda", "auto", 4, 3, 8, true).backend, Backend::kNccl);
  EXPECT_EQ(place_rank("cuda", "auto", 4, 3, 8, false).backend, Backend::kGloo);
  EXPECT_EQ(place_rank("cuda", "auto", 1, 0, 8, true).device, cuda(0));
  // Gloo on CUDA: ranks share the GPUs there are (the parity matrix on one GPU).
  EXPECT_EQ(place_rank("cuda", "gloo", 4, 3, 1, true).device, cuda(0));
  EXPECT_EQ(place_rank("cuda", "gloo", 4, 3, 2, true).device, cuda(1));
  EXPECT_EQ(place_rank("cuda:1", "gloo", 4, 3, 2, true).device, cuda(1));
  EXPECT_EQ(place_rank("cuda:1", "nccl", 1, 0, 2, true).device, cuda(1));
  // Refusals name the setting and the way out.
  auto msg = error_of([&] { place_rank("cuda", "nccl", 4, 3, 2, true); });
  EXPECT_NE(msg.find("local rank 3 needs cuda:3 but this machine has 2 CUDA device(s)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("parallel.backend=gloo"), std::string::npos) << msg;
  msg = error_of([&] { place_rank("cuda:0", "auto", 2, 1, 2, true); });
  EXPECT_NE(msg.find("puts all 2 ranks on one GPU, which NCCL refuses"), std::string::npos) << msg;
  msg = error_of([&] { place_rank("cpu", "nccl", 2, 0, 2, true); });
  EXPECT_NE(msg.find("parallel.backend=nccl with training.device=cpu"), std::string::npos) << msg;
  msg = error_of([&] { place_rank("cuda", "nccl", 2, 0, 2, false); });
  EXPECT_NE(msg.find("without NCCL"), std::string::npos) << msg;
  msg = error_of([&] { place_rank("cuda", "auto", 2, 0, 0, true); });
  EXPECT_NE(msg.find("no CUDA device is usable here"), std::string::npos) << msg;
  msg = error_of([&] { place_rank("cuda:2", "gloo", 1, 0, 2, true); });
  EXPECT_NE(msg.find("has 2 CUDA device(s) (0..1)"), std::string::npos) << msg;
  msg = error_of([&] { dhp::load_config("", {"parallel.backend=mpi"}); });
  EXPECT_NE(msg.find("parallel.backend='mpi' is not auto, nccl or gloo"), std::string::npos) << msg;
}

// ZeRO-1's masters, moments, decay mask, padding and norm live on the parameters' device.
TEST(Device, ZeroOneStateFollowsTheParameters) {
  const auto meta = torch::TensorOptions().device(torch::kMeta);
  std::vector<dhp::optim::NamedParam> params;
  params.push_back({"w", torch::empty({4, 3}, meta).requires_grad_(true), true});
  params.push_back({"b", torch::empty({5}, meta).requires_grad_(true), false});
  dhp::parallel::Zero1AdamW z(params, dhp::optim::AdamWOptions{}, dhp::dist::Group());
  EXPECT_TRUE(z.master().is_meta() && z.exp_avg().is_meta() && z.exp_avg_sq().is_meta());
  for (auto& p : params) p.param.mutable_grad() = torch::empty(p.param.sizes(), meta);
  params[1].param.mutable_grad() = torch::Tensor();  // a parameter without a gradient: zeros
  z.reduce_gradients();
  EXPECT_TRUE(z.grad_sq_norm().is_meta());
  z.step(1e-3);
  EXPECT_TRUE(params[0].param.is_meta());
}

TEST(Device, TrainerStopsBeforeWorkOnAMissingDevice) {
  if (torch::cuda::device_count() > 0) GTEST_SKIP() << "this machine has CUDA";
  auto msg = error_of([] { dhp::train::Trainer t(with_device("cuda:1", {"output.dir=" + testing::TempDir() + "dev"})); });
  EXPECT_NE(msg.find("training.device=cuda:1"), std::string::npos) << msg;
}

// The device's memory figures: on the CPU those of the accounting allocator; a CUDA device
// in a build without CUDA is named, not silently reported as 0 bytes.
TEST(Device, MemoryFiguresFollowTheDevice) {
  const torch::Device cpu(torch::kCPU);
  dhp::install_memory_accounting();
  dhp::reset_device_peak(cpu);
  {
    auto t = torch::empty({1 << 20}, torch::kFloat32);  // 4 MiB
    EXPECT_GE(dhp::device_peak_bytes(cpu), int64_t{4} << 20);
    EXPECT_EQ(dhp::device_peak_bytes(cpu), dhp::memory_peak_bytes());
  }
  dhp::set_device_memory_limit(cpu, int64_t{3} << 30);
  EXPECT_EQ(dhp::memory_limit(), int64_t{3} << 30);
  dhp::set_device_memory_limit(cpu, 0);
  EXPECT_EQ(dhp::memory_limit(), 0);
  if (DHP_WITH_CUDA) GTEST_SKIP() << "a CUDA build: the CUDA figures need a GPU (bench/device/run.sh)";
  const torch::Device gpu(torch::kCUDA, 0);
  auto msg = error_of([&] { dhp::device_peak_bytes(gpu); });
  EXPECT_NE(msg.find("device cuda:0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("without CUDA"), std::string::npos) << msg;
  msg = error_of([&] { dhp::set_device_memory_limit(gpu, int64_t{1} << 30); });
  EXPECT_NE(msg.find("without CUDA"), std::string::npos) << msg;
  dhp::use_device(cpu);  // nothing to do on the CPU
  msg = error_of([&] { dhp::use_device(gpu); });
  EXPECT_NE(msg.find("without CUDA"), std::string::npos) << msg;
}

TEST(Device, BatchMovesItsTensorsAndKeepsItsLists) {
  const auto cfg = dhp::load_config("", {"data.min_side=56", "data.max_side=112"});
  dhp::data::ShapesDataset data(cfg.model.config, {});
  auto b = dhp::data::collate({data.get(0), data.get(1)}, cfg.model.config);
  ASSERT_TRUE(b.pixel_values.defined());
  auto same = dhp::qwen::to_device(b, torch::kCPU);
  EXPECT_TRUE(same.input_ids.is_same(b.input_ids));  // already there: not copied
  EXPECT_TRUE(same.pixel_values.is_same(b.pixel_values));
  auto meta = dhp::qwen::to_device(b, torch::Device(torch::kMeta));
  for (const auto* t : {&meta.pixel_values, &meta.input_ids, &meta.targets, &meta.position_ids}) {
    EXPECT_TRUE(t->is_meta());
  }
  EXPECT_EQ(meta.input_ids.sizes(), b.input_ids.sizes());
  EXPECT_EQ(meta.cu_seqlens, b.cu_seqlens);
  EXPECT_EQ(meta.grid_thw.size(), b.grid_thw.size());
  EXPECT_TRUE(b.input_ids.device().is_cpu());  // the source batch is left as it was
}

// Runs varlen_attention forward and backward on meta tensors of segments `cu` (block 32),
// causal and not: every index and mask tensor it makes must follow q's device.
void attention_on_meta(const std::vector<int64_t>& cu) {
  const int64_t S = cu.back(), H = 2, D = 8;
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "full");
    auto opts = torch::TensorOptions().device(torch::kMeta);
    auto q = torch::empty({S, H, D}, opts).requires_grad_(true);
    auto k = torch::empty({S, H, D}, opts).requires_grad_(true);
    auto v = torch::empty({S, H, D}, opts).requires_grad_(true);
    dhp::nn::VarlenAttentionOptions o;
    o.causal = causal;
    o.block_size = 32;
    auto out = dhp::nn::varlen_attention(q, k, v, cu, o);
    EXPECT_TRUE(out.is_meta());
    EXPECT_EQ(out.sizes(), q.sizes());
    out.sum().backward();
    EXPECT_TRUE(q.grad().is_meta() && k.grad().is_meta() && v.grad().is_meta());
  }
}

// Segments longer than the block: the blockwise path (its causal masks built per tile).
TEST(Device, BlockwiseAttentionFollowsItsInputsDevice) { attention_on_meta({0, 70, 150}); }

// Short segments: the dense buckets (gathers, masks and scatters built from the offsets on
// the host, then moved). libtorch 1.13 has no meta kernel for index_select: skipped there,
// run on libtorch 2.x.
TEST(Device, DenseAttentionFollowsItsInputsDevice) {
  try {
    auto i = torch::zeros({1}, torch::kInt64).to(torch::kMeta);
    torch::empty({4, 2}, torch::TensorOptions().device(torch::kMeta)).index_select(0, i);
  } catch (const c10::NotImplementedError&) {
    GTEST_SKIP() << "this libtorch has no meta kernel for index_select";
  }
  attention_on_meta({0, 5, 45, 115, 120});
}

// On a CUDA machine: the demo model's first steps on the GPU equal the CPU's (fp32, TF32 off,
// the same samples), loss within 1e-4 relative at every step of 3.
TEST(Device, CudaTrainsLikeCpu) {
  if (torch::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  at::globalContext().setAllowTF32CuBLAS(false);
  at::globalContext().setAllowTF32CuDNN(false);
  const std::vector<std::string> sets = {"data.batch_size=4", "data.min_side=56", "data.max_side=112",
                                         "training.steps=3", "data.eval_samples=8",
                                         "output.dir=" + testing::TempDir() + "dev-cuda"};
  dhp::train::Trainer cpu(with_device("cpu", sets)), gpu(with_device("cuda", sets));
  for (int i = 0; i < 3; ++i) {
    const double a = cpu.train_step().loss, b = gpu.train_step().loss;
    EXPECT_NEAR(b, a, 1e-4 * std::abs(a)) << "step " << i;
  }
  EXPECT_TRUE(gpu.model().parameters().front().is_cuda());
  const auto ea = cpu.evaluate(8), eb = gpu.evaluate(8);
  EXPECT_NEAR(eb.loss, ea.loss, 1e-4 * std::abs(ea.loss));
}

// On a CUDA machine with NCCL: a one-rank NCCL group runs every collective on the GPU, and
// its calls are timed on the stream (CUDA events), not at the enqueue.
TEST(Device, NcclGroupOfOneRunsEveryCollective) {
  if (torch::cuda::device_count() == 0 || !dhp::dist::nccl_available()) GTEST_SKIP() << "no CUDA device or no NCCL";
  const torch::Device gpu(torch::kCUDA, 0);
  dhp::dist::Group g(dhp::dist::make_hash_store(), "smoke", {0}, 0, std::chrono::seconds(60), dhp::dist::Backend::kNccl,
                     gpu);
  EXPECT_TRUE(g.connected());
  EXPECT_EQ(g.backend(), dhp::dist::Backend::kNccl);
  const auto before = dhp::dist::comm_stats();
  auto x = torch::arange(8, torch::TensorOptions().dtype(torch::kFloat32).device(gpu));
  auto y = x.clone();
  g.all_reduce_sum_(y);
  g.all_reduce_max_(y);
  EXPECT_TRUE(torch::equal(y.cpu(), x.cpu()));
  EXPECT_TRUE(torch::equal(g.all_gather(x.to(torch::kBFloat16), 0).cpu(), x.to(torch::kBFloat16).cpu()));
  EXPECT_TRUE(torch::equal(g.all_to_all(x, {8}, {8}).cpu(), x.cpu()));
  EXPECT_TRUE(torch::equal(g.reduce_scatter_sum(x).cpu(), x.cpu()));
  g.barrier();
  const auto after = dhp::dist::comm_stats();
  EXPECT_EQ(after.calls - before.calls, 5);
  EXPECT_GT(after.seconds, before.seconds);
}

// On a CUDA machine whose libtorch has the flash kernel: flash against dhp's kernel in bf16,
// forward and backward, causal and full, GQA, ragged lengths (a one-token segment among them).
// Both round to bf16; the difference is bounded by a few bf16 ulps of the outputs' scale.
TEST(Device, FlashAttentionMatchesDhpsKernel) {
  if (torch::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const auto opts = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  if (const auto why = dhp::nn::flash_unsupported(torch::empty({1, 4, 64}, opts), torch::empty({1, 2, 64}, opts));
      !why.empty()) {
    GTEST_SKIP() << why;
  }
  torch::manual_seed(7);
  const std::vector<int64_t> cu{0, 37, 300, 301, 812};
  for (bool causal : {true, false}) {
    SCOPED_TRACE(causal ? "causal" : "full");
    auto q = torch::randn({812, 8, 64}, opts).requires_grad_(true);
    auto k = torch::randn({812, 2, 64}, opts).requires_grad_(true);
    auto v = torch::randn({812, 2, 64}, opts).requires_grad_(true);
    dhp::nn::VarlenAttentionOptions o;
    o.causal = causal;
    o.kernel = dhp::nn::AttentionKernel::kFlash;
    auto out = dhp::nn::varlen_attention(q, k, v, cu, o);
    auto dy = torch::randn_like(out);
    auto g = torch::autograd::grad({out}, {q, k, v}, {dy});
    o.kernel = dhp::nn::AttentionKernel::kDhp;
    auto ref = dhp::nn::varlen_attention(q, k, v, cu, o);
    auto r = torch::autograd::grad({ref}, {q, k, v}, {dy});
    auto close = [](const torch::Tensor& a, const torch::Tensor& b) {
      const double scale = b.to(torch::kFloat32).abs().max().item<double>();
      return (a.to(torch::kFloat32) - b.to(torch::kFloat32)).abs().max().item<double>() / scale;
    };
    EXPECT_LT(close(out, ref), 2e-2);
    for (int i = 0; i < 3; ++i) EXPECT_LT(close(g[i], r[i]), 3e-2) << "grad " << i;
  }
}

}  // namespace
