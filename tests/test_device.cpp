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
#include "dhp/data/shapes.h"
#include "dhp/nn/attention.h"
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
  dhp::train::Runtime two;
  two.world = 2;
  auto msg = error_of([&] { dhp::train::resolve_device(with_device("cuda"), two); });
  EXPECT_NE(msg.find("training.device=cuda in a job of 2 ranks"), std::string::npos) << msg;
  EXPECT_NE(msg.find("Gloo"), std::string::npos) << msg;
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

}  // namespace
