// `dhp train` as a multi-process job: --nproc 2 trains like --nproc 1 (losses within 1e-5
// relative), a rank that throws makes the whole job exit non-zero within the test's timeout
// naming that rank and its error, impossible layouts are refused before any worker starts,
// the binary runs as one rank under a torchrun-style environment, and `dhp forward` writes
// the logits the library computes for an exported model.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "dhp/io/checkpoint_store.h"
#include "dhp/io/safetensors.h"
#include "dhp/models/qwen2_5_vl/hf.h"
#include "dhp/models/qwen2_5_vl/model.h"
#include "runs.h"

namespace {

namespace fs = std::filesystem;
using dhp::testing::kTiny;
using dhp::testing::losses;
using dhp::testing::sh;

fs::path tmpdir(const std::string& name) {
  auto d = fs::temp_directory_path() / ("dhp-launcher-" + std::to_string(::getpid()) + "-" + name);
  fs::remove_all(d);
  return d;
}

TEST(Launcher, TwoProcessesTrainLikeOne) {
  const auto one = tmpdir("one"), two = tmpdir("two");
  auto a = sh(std::string(DHP_BINARY) + " train" + kTiny + " --out " + one.string());
  ASSERT_EQ(a.rc, 0) << a.output;
  for (const char* strategy : {"dhp", "tp", "zero3"}) {
    auto b = sh(std::string(DHP_BINARY) + " train --nproc 2 --set parallel.strategy=" + strategy + kTiny +
                " --out " + two.string());
    ASSERT_EQ(b.rc, 0) << b.output;
    EXPECT_NE(b.output.find("starting 2 workers"), std::string::npos) << b.output;
    auto la = losses(one), lb = losses(two);
    ASSERT_EQ(la.size(), 3u);
    ASSERT_EQ(lb.size(), 3u) << strategy;
    for (size_t i = 0; i < la.size(); ++i) EXPECT_NEAR(lb[i], la[i], 1e-5 * la[i]) << strategy << " step " << i + 1;
  }
  fs::remove_all(one);
  fs::remove_all(two);
}

// Disjoint placement as processes: vision alone on rank 0, text tp=2 on ranks 1-2, two
// micro-batches pipelined; rank 0 (vision only) still writes the run with the job's loss,
// and the per-rank idle times are recorded.
TEST(Launcher, DisjointPlacementTrainsLikeOneProcess) {
  const auto one = tmpdir("one-mb"), three = tmpdir("three");
  const std::string mb = " --set training.micro_batches=2";
  auto a = sh(std::string(DHP_BINARY) + " train" + kTiny + mb + " --out " + one.string());
  ASSERT_EQ(a.rc, 0) << a.output;
  auto b = sh(std::string(DHP_BINARY) + " train --nproc 3 --set parallel.strategy=custom" +
              " --set parallel.vision.strategy=none --set parallel.vision.ranks=[0]" +
              " --set parallel.text.strategy=tp --set parallel.text.ranks=[1,2]" + kTiny + mb + " --out " +
              three.string());
  ASSERT_EQ(b.rc, 0) << b.output;
  auto la = losses(one), lb = losses(three);
  ASSERT_EQ(la.size(), 3u);
  ASSERT_EQ(lb.size(), 3u) << b.output;
  for (size_t i = 0; i < la.size(); ++i) EXPECT_NEAR(lb[i], la[i], 1e-5 * la[i]) << "step " << i + 1;
  std::ifstream f(three / "metrics.jsonl");
  std::string line;
  std::getline(f, line);
  EXPECT_NE(line.find("\"idle_s_per_rank\": ["), std::string::npos) << line;
  fs::remove_all(one);
  fs::remove_all(three);
}

TEST(Launcher, PrintScheduleShowsEachRanksActions) {
  auto r = sh(std::string(DHP_BINARY) + " train --nproc 4 --print-schedule --set parallel.strategy=dhp" +
              " --set parallel.vision.ranks=[0,1] --set parallel.text.ranks=[2,3] --set training.micro_batches=2");
  EXPECT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("rank 0 [vision]: VF0 SA0 VF1 SA1 RG0 VB0 RG1 VB1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 3 [text]: RA0 TFB0 SG0 RA1 TFB1 SG1"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("starting"), std::string::npos) << "no worker starts:\n" << r.output;
}

TEST(Launcher, AFailingRankStopsTheJobAndIsNamed) {
  const auto dir = tmpdir("fail");
  auto r = sh(std::string(DHP_BINARY) + " train --inject-fault fail:1:2 --nproc 2 --set parallel.strategy=dhp" +
              kTiny + " --out " + dir.string());
  EXPECT_NE(r.rc, 0) << r.output;
  EXPECT_NE(r.rc, 124) << "the job hung until the test's timeout:\n" << r.output;
  EXPECT_NE(r.output.find("rank 1 failed"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("injected failure on rank 1 at step 2"), std::string::npos) << r.output;
  fs::remove_all(dir);
}

// A worker SIGKILLed before step 4 under --max-restarts 1: the launcher stops the other,
// restarts both from the newest checkpoint (step 2), and every step's loss equals the
// uninterrupted run's, bit for bit (same layout). A failure in every attempt gives up.
TEST(Launcher, AKilledWorkerIsRestartedFromTheNewestCheckpoint) {
  const auto whole = tmpdir("whole"), killed = tmpdir("killed"), failing = tmpdir("failing");
  const std::string run = std::string(DHP_BINARY) + " train --nproc 2 --set parallel.strategy=dhp" + kTiny +
                          " --set training.steps=6 --set checkpoint.every=2";
  auto a = sh(run + " --out " + whole.string());
  ASSERT_EQ(a.rc, 0) << a.output;
  auto b = sh(run + " --inject-fault kill:1:4 --max-restarts 1 --out " + killed.string());
  ASSERT_EQ(b.rc, 0) << b.output;
  EXPECT_NE(b.output.find("rank 1 failed (killed by signal"), std::string::npos) << b.output;
  EXPECT_NE(b.output.find("restart 1 of 1"), std::string::npos) << b.output;
  EXPECT_NE(b.output.find("resumed from " + (killed / "checkpoints" / "step-2").string() + " at step 2"),
            std::string::npos) << b.output;
  const auto la = losses(whole), lb = losses(killed);
  ASSERT_EQ(la.size(), 6u);
  ASSERT_EQ(lb.size(), 6u) << b.output;
  for (size_t i = 0; i < la.size(); ++i) EXPECT_EQ(lb[i], la[i]) << "step " << i + 1;
  auto c = sh(run + " --inject-fault fail:1:4 --max-restarts 1 --out " + failing.string());
  EXPECT_NE(c.rc, 0) << c.output;
  EXPECT_NE(c.output.find("giving up after 1 restart(s)"), std::string::npos) << c.output;
  for (const auto& d : {whole, killed, failing}) fs::remove_all(d);
}

// Rank 0 SIGKILLed in the middle of saving step 4 (its files written, no manifest, no
// rename): step-2 stays the newest checkpoint, the half-written one is invisible, and the
// restarted job continues from step 2 to the uninterrupted run's losses; the stale
// temporary directory is removed by the next save.
TEST(Launcher, ASaveKilledMidwayLeavesThePreviousCheckpoint) {
  const auto whole = tmpdir("whole2"), cut = tmpdir("cut2");
  const std::string run = std::string(DHP_BINARY) + " train --nproc 2 --set parallel.strategy=tp" + kTiny +
                          " --set training.steps=6 --set checkpoint.every=2";
  auto a = sh(run + " --out " + whole.string());
  ASSERT_EQ(a.rc, 0) << a.output;
  auto b = sh(run + " --inject-fault kill-in-save:4 --out " + cut.string());
  ASSERT_NE(b.rc, 0) << b.output;
  EXPECT_TRUE(fs::exists(cut / "checkpoints" / "step-2" / "manifest.json"));
  EXPECT_FALSE(fs::exists(cut / "checkpoints" / "step-4"));
  EXPECT_TRUE(fs::exists(cut / "checkpoints" / ".step-4.tmp" / "rank-00000.safetensors")) << b.output;
  EXPECT_FALSE(fs::exists(cut / "checkpoints" / ".step-4.tmp" / "manifest.json"));
  auto c = sh(run + " --resume --out " + cut.string());
  ASSERT_EQ(c.rc, 0) << c.output;
  EXPECT_NE(c.output.find("at step 2"), std::string::npos) << c.output;
  EXPECT_FALSE(fs::exists(cut / "checkpoints" / ".step-4.tmp"));
  const auto la = losses(whole), lb = losses(cut);
  ASSERT_EQ(lb.size(), 6u) << c.output;
  for (size_t i = 0; i < la.size(); ++i) EXPECT_EQ(lb[i], la[i]) << "step " << i + 1;
  // The finished models are identical too.
  dhp::io::CheckpointReader ra((whole / "checkpoints" / "step-6").string()), rb((cut / "checkpoints" / "step-6").string());
  for (const auto& [name, rec] : ra.manifest().tensors) {
    if (name.rfind("param/", 0) == 0) EXPECT_TRUE(torch::equal(ra.read_full(name), rb.read_full(name))) << name;
  }
  fs::remove_all(whole);
  fs::remove_all(cut);
}

// One process stopped by an error after step 4, then `dhp train --resume`: it continues
// from step-4 and the losses equal an uninterrupted run's; a damaged newest checkpoint is
// reported and the previous one used.
TEST(Launcher, ResumeContinuesAnInterruptedRun) {
  const auto whole = tmpdir("whole1"), cut = tmpdir("cut");
  const std::string run = std::string(DHP_BINARY) + " train" + kTiny + " --set training.steps=6 --set checkpoint.every=2";
  auto a = sh(run + " --out " + whole.string());
  ASSERT_EQ(a.rc, 0) << a.output;
  auto b = sh(run + " --inject-fault fail:0:6 --out " + cut.string());
  ASSERT_NE(b.rc, 0) << b.output;
  EXPECT_EQ(losses(cut).size(), 5u);
  // Damage step-4: the resume falls back to step-2.
  {
    std::fstream f(cut / "checkpoints" / "step-4" / "rank-00000.safetensors",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-64, std::ios::end);
    f.write("XXXXXXXX", 8);
  }
  auto c = sh(run + " --resume --out " + cut.string());
  ASSERT_EQ(c.rc, 0) << c.output;
  EXPECT_NE(c.output.find("step-4 is unusable"), std::string::npos) << c.output;
  EXPECT_NE(c.output.find("checksum"), std::string::npos) << c.output;
  EXPECT_NE(c.output.find("falling back to " + (cut / "checkpoints" / "step-2").string()), std::string::npos)
      << c.output;
  const auto la = losses(whole), lb = losses(cut);
  ASSERT_EQ(lb.size(), 6u) << c.output;
  for (size_t i = 0; i < la.size(); ++i) EXPECT_EQ(lb[i], la[i]) << "step " << i + 1;
  fs::remove_all(whole);
  fs::remove_all(cut);
}

// parallel.strategy=auto on a machine without a calibration: the launcher measures it once,
// the workers train under the layout the planner chose, logged with the reason and written
// to the run's config.yaml as a custom layout.
TEST(Launcher, AutoStrategyCalibratesOnceAndTrains) {
  const fs::path dir = fs::temp_directory_path() / ("dhp-launcher-auto-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const std::string cmd = "DHP_CALIBRATION_DIR=" + (dir / "cal").string() + " " + std::string(DHP_BINARY) +
                          " train --nproc 2 --set parallel.strategy=auto" + kTiny + " --out " + (dir / "run").string();
  auto r = sh(cmd);
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("measuring it once"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(dir / "cal" / "local-x2.json"));
  EXPECT_NE(r.output.find("parallel.strategy=auto on 2 ranks"), std::string::npos) << r.output;
  EXPECT_EQ(losses(dir / "run").size(), 3u);
  std::ifstream f(dir / "run" / "config.yaml");
  std::stringstream ss;
  ss << f.rdbuf();
  EXPECT_NE(ss.str().find("strategy: \"custom\""), std::string::npos) << ss.str();
  // The second run reuses the calibration.
  r = sh(cmd);
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_EQ(r.output.find("measuring it once"), std::string::npos) << r.output;
  fs::remove_all(dir);
}

TEST(Launcher, ImpossibleLayoutIsRefusedBeforeWorkersStart) {
  auto r = sh(std::string(DHP_BINARY) + " train --nproc 3 --set parallel.strategy=tp" + kTiny);
  EXPECT_EQ(r.rc, 1) << r.output;
  EXPECT_NE(r.output.find("tp=3 does not divide vision num_heads=4"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("starting"), std::string::npos) << r.output;
}

TEST(Launcher, RunsAsOneRankOfATorchrunStyleJob) {
  const auto dir = tmpdir("env");
  const std::string port = std::to_string(20000 + ::getpid() % 20000);
  const std::string cmd = std::string(DHP_BINARY) + " train --set parallel.strategy=dp" + kTiny + " --out " + dir.string();
  auto r = sh("export WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port + "; RANK=1 " + cmd + " & RANK=0 " + cmd +
              "; a=$?; wait $!; b=$?; exit $((a + b))");
  EXPECT_EQ(r.rc, 0) << r.output;
  EXPECT_EQ(losses(dir).size(), 3u) << r.output;  // rank 0 wrote the run
  fs::remove_all(dir);
}

TEST(Forward, WritesTheLogitsOfAnHfDirectory) {
  auto dir = tmpdir("forward");
  fs::create_directories(dir);
  const auto c = dhp::qwen::preset("demo");
  dhp::qwen::Qwen2_5_VL m(c);
  dhp::qwen::init_parameters(*m, 11, c.initializer_range);
  std::map<std::string, torch::Tensor> params;
  for (auto& kv : m->named_parameters(true)) params[kv.key()] = kv.value();
  dhp::qwen::save_hf((dir / "model").string(), params, c);
  std::vector<int64_t> ids = {10, c.vision_start_token_id, c.image_token_id, c.image_token_id, c.vision_end_token_id, 12};
  auto input_ids = torch::tensor(ids, torch::kInt64).view({1, 6});
  auto pixels = torch::randn({8, c.vision.patch_dim()});
  auto grid = torch::tensor({1, 2, 4}, torch::kInt64).view({1, 3});
  dhp::io::write_safetensors((dir / "in.safetensors").string(),
                             {{"input_ids", input_ids}, {"pixel_values", pixels}, {"image_grid_thw", grid}});
  auto r = sh(std::string(DHP_BINARY) + " forward --model " + (dir / "model").string() + " --inputs " +
              (dir / "in.safetensors").string() + " --out " + (dir / "out.safetensors").string());
  ASSERT_EQ(r.rc, 0) << r.output;
  auto got = dhp::io::SafetensorsReader((dir / "out.safetensors").string()).read("logits");
  auto want = dhp::qwen::forward_logits(*m, input_ids, pixels, grid);
  EXPECT_EQ(got.sizes(), want.sizes());
  EXPECT_TRUE(torch::allclose(got, want, 1e-6, 1e-6));
  // Under layouts (each rank reads its slices of the weights): the same logits within 1e-5,
  // on an image of 4 attention windows (16x16 patches) so that sequence parallelism splits it.
  std::vector<int64_t> big = {10, c.vision_start_token_id};
  for (int i = 0; i < 64; ++i) big.push_back(c.image_token_id);
  big.insert(big.end(), {c.vision_end_token_id, 12, 13});
  auto big_ids = torch::tensor(big, torch::kInt64).view({1, -1});
  auto big_pixels = torch::randn({256, c.vision.patch_dim()});
  auto big_grid = torch::tensor({1, 16, 16}, torch::kInt64).view({1, 3});
  dhp::io::write_safetensors((dir / "big.safetensors").string(),
                             {{"input_ids", big_ids}, {"pixel_values", big_pixels}, {"image_grid_thw", big_grid}});
  const auto big_want = dhp::qwen::forward_logits(*m, big_ids, big_pixels, big_grid);
  const std::vector<std::pair<int, std::string>> layouts = {
      {2, "--set parallel.strategy=dhp"},
      {2, "--set parallel.strategy=tp"},
      {4, "--set parallel.strategy=dhp --set parallel.vision.ranks=[0,1] --set parallel.text.ranks=[2,3]"},
      {3, "--set parallel.strategy=custom --set parallel.vision.strategy=zero3 --set parallel.vision.ranks=[2]"
          " --set parallel.text.strategy=tp --set parallel.text.ranks=[0,1]"}};
  for (const auto& [n, sets] : layouts) {
    const auto o = dir / ("big" + std::to_string(n) + ".safetensors");
    r = sh(std::string(DHP_BINARY) + " forward --nproc " + std::to_string(n) + " " + sets + " --model " +
           (dir / "model").string() + " --inputs " + (dir / "big.safetensors").string() + " --out " + o.string());
    ASSERT_EQ(r.rc, 0) << sets << "\n" << r.output;
    auto g = dhp::io::SafetensorsReader(o.string()).read("logits");
    ASSERT_EQ(g.sizes(), big_want.sizes()) << sets;
    EXPECT_TRUE(torch::allclose(g, big_want, 1e-5, 1e-5)) << sets << ": max difference "
                                                         << (g - big_want).abs().max().item<double>();
  }
  // Data-parallel replicas are refused with the keys to change.
  r = sh(std::string(DHP_BINARY) + " forward --nproc 2 --set parallel.strategy=dp --model " + (dir / "model").string() +
         " --inputs " + (dir / "big.safetensors").string() + " --out " + (dir / "dp.safetensors").string());
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.output.find("parallel.vision.dp=1"), std::string::npos) << r.output;
  // A wrong input file is named.
  dhp::io::write_safetensors((dir / "bad.safetensors").string(), {{"pixel_values", pixels}});
  r = sh(std::string(DHP_BINARY) + " forward --model " + (dir / "model").string() + " --inputs " +
         (dir / "bad.safetensors").string() + " --out " + (dir / "o2.safetensors").string());
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.output.find("has no tensor \'input_ids\'"), std::string::npos) << r.output;
  fs::remove_all(dir);
}

// `dhp convert`: a checkpoint written by 2 ranks (dhp, bf16) becomes the same Hugging Face
// directory as the run's own export of its gathered parameters (byte-identical tensors and
// config.json); --dtype fp32 writes the fp32 masters.
TEST(Convert, ACheckpointExportsLikeTheRunsOwnExport) {
  const auto run = tmpdir("convert");
  auto a = sh(std::string(DHP_BINARY) + " train --nproc 2 --set parallel.strategy=dhp --set training.precision=bf16" +
              kTiny + " --set output.hf_export=true --out " + run.string());
  ASSERT_EQ(a.rc, 0) << a.output;
  auto b = sh(std::string(DHP_BINARY) + " convert --checkpoint " + (run / "checkpoints").string() + " --out " +
              (run / "converted").string());
  ASSERT_EQ(b.rc, 0) << b.output;
  EXPECT_NE(b.output.find("step 3"), std::string::npos) << b.output;
  dhp::io::SafetensorsReader want((run / "hf" / "model.safetensors").string()),
      got((run / "converted" / "model.safetensors").string());
  auto names = [](const dhp::io::SafetensorsReader& r) {
    std::vector<std::string> out;
    for (const auto& t : r.tensors()) out.push_back(t.name);
    return out;
  };
  ASSERT_EQ(names(got), names(want));
  for (const auto& name : names(want)) {
    const auto w = want.bytes(name), g = got.bytes(name);
    ASSERT_EQ(g.second, w.second) << name;
    EXPECT_EQ(std::memcmp(g.first, w.first, static_cast<size_t>(w.second)), 0) << name;
  }
  std::ifstream c1(run / "hf" / "config.json"), c2(run / "converted" / "config.json");
  std::stringstream s1, s2;
  s1 << c1.rdbuf();
  s2 << c2.rdbuf();
  EXPECT_EQ(s1.str(), s2.str());
  auto c = sh(std::string(DHP_BINARY) + " convert --dtype fp32 --checkpoint " + (run / "checkpoints" / "step-3").string() +
              " --out " + (run / "fp32").string());
  ASSERT_EQ(c.rc, 0) << c.output;
  dhp::io::SafetensorsReader f32((run / "fp32" / "model.safetensors").string());
  for (const auto& name : names(f32)) {
    auto t = f32.read(name);
    EXPECT_EQ(t.scalar_type(), torch::kFloat32) << name;
    EXPECT_TRUE(torch::equal(t.to(torch::kBFloat16), want.read(name))) << name;
  }
  auto d = sh(std::string(DHP_BINARY) + " convert --checkpoint " + (run / "nowhere").string() + " --out " +
              (run / "x").string());
  EXPECT_NE(d.rc, 0);
  EXPECT_NE(d.output.find("neither a checkpoint"), std::string::npos) << d.output;
  fs::remove_all(run);
}

// `dhp tokenize`: ids of --text and of each line of --file, --decode back, errors named.
TEST(Tokenize, PrintsIdsAndDecodes) {
  const std::string bin = std::string(DHP_BINARY) + " tokenize --tokenizer " + DHP_QWEN_TOKENIZER;
  auto r = sh(bin + " --text \"Hello world<|im_end|>\"");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_EQ(r.output, "[9707, 1879, 151645]\n");
  const auto dir = tmpdir("tokenize");
  fs::create_directories(dir);
  {
    std::ofstream f(dir / "in.txt");
    f << "Hello world\n\n<|vision_start|><|image_pad|><|vision_end|>\n";
  }
  r = sh(bin + " --file " + (dir / "in.txt").string());
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_EQ(r.output, "[9707, 1879]\n[]\n[151652, 151655, 151653]\n");
  r = sh(bin + " --decode --text \"[9707, 1879, 151645]\"");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_EQ(r.output, "Hello world<|im_end|>\n");
  r = sh(bin + " --decode --text \"[9707, 99999999]\"");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.output.find("token id 99999999 is outside the vocabulary"), std::string::npos) << r.output;
  r = sh(bin);
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.output.find("exactly one of --text and --file"), std::string::npos) << r.output;
  fs::remove_all(dir);
}

// `dhp data preprocess` writes what Pillow + numpy give for the processor's steps.
TEST(DataPreprocess, WritesTheProcessorsTensors) {
  const auto dir = tmpdir("preprocess");
  fs::create_directories(dir);
  const std::string images = std::string(DHP_TEST_DATA) + "/images/";
  auto r = sh(std::string(DHP_BINARY) + " data preprocess --image " + images + "big_down.png --max-pixels 15680 --out " +
              (dir / "p.safetensors").string());
  ASSERT_EQ(r.rc, 0) << r.output;
  dhp::io::SafetensorsReader got((dir / "p.safetensors").string()), want(images + "expected.safetensors");
  EXPECT_TRUE(torch::equal(got.read("pixel_values"), want.read("big_down.png.pixel_values")));
  EXPECT_TRUE(torch::equal(got.read("image_grid_thw").view({-1}), want.read("big_down.png.grid")));
  r = sh(std::string(DHP_BINARY) + " data preprocess --image " + images + "nothing.png --out " +
         (dir / "q.safetensors").string());
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.output.find("nothing.png: cannot open the image"), std::string::npos) << r.output;
  fs::remove_all(dir);
}

}  // namespace
