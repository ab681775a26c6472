// The LLaVA data stream: a synthetic dataset written as PNG + JSONL reads back as the same
// images (pixel_values equal to ShapesDataset's, through PNG and the processor) and
// answers; mixing fractions give each dataset its share of an epoch; the seeded order is
// reproducible and differs by epoch; replicas' positions are disjoint and cover the
// stream; background workers give the sequential samples; a loader restarted at position()
// continues identically; bad samples (missing or corrupt image) are skipped, counted and
// named; an all-bad dataset stops with an error; strict mode stops at the first. Packing to
// a token budget takes the stream in order, fills each micro-batch greedily within the
// budget, resumes bit-exactly with a look-ahead sample pending, and trains the same under
// data parallelism.
#include <gtest/gtest.h>

#include <cmath>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>

#include "dhp/core/error.h"
#include "dhp/data/loader.h"
#include "dhp/models/qwen2_5_vl/config.h"
#include "dhp/train/trainer.h"
#include "files.h"
#include "ranks.h"

namespace {

namespace fs = std::filesystem;
using dhp::data::LlavaDataset;
using dhp::data::Loader;
using dhp::data::LoaderOptions;

std::shared_ptr<const dhp::data::Tokenizer> qwen() {
  static const auto t = std::make_shared<const dhp::data::Tokenizer>(dhp::data::Tokenizer::from_file(DHP_QWEN_TOKENIZER));
  return t;
}

dhp::data::ShapesOptions shapes_options() {
  dhp::data::ShapesOptions so;
  so.min_side = 56;
  so.max_side = 112;
  so.seed = 3;
  return so;
}

LoaderOptions options(const std::vector<std::pair<std::string, double>>& files) {
  LoaderOptions o;
  for (const auto& [f, frac] : files) o.datasets.push_back({f, "", frac});
  o.seed = 11;
  return o;
}

TEST(SyntheticData, ReadsBackAsTheShapesSamples) {
  dhp::testing::TempDir dir("loader_synth");
  const auto model = dhp::qwen::preset("demo");
  dhp::data::write_synthetic(dir.path().string(), 6, model, shapes_options());
  ASSERT_TRUE(fs::exists(dir.path() / "images" / "000005.png"));
  auto o = options({{(dir.path() / "train.jsonl").string(), 1.0}});
  o.image.min_pixels = 56 * 56;  // the synthetic sides are already multiples of 28
  LlavaDataset data(o, qwen());
  ASSERT_EQ(data.epoch_size(), 6);
  dhp::data::ShapesDataset shapes(model, shapes_options());
  std::set<std::string> seen;
  for (int64_t p = 0; p < 6; ++p) {
    const auto s = data.load(p);
    const auto& where = data.where(p);
    const int64_t i = std::stoll(where.substr(where.rfind(':') + 1)) - 1;  // line i+1 is image i
    const auto want = shapes.get(i);
    EXPECT_EQ(s.answer, want.answer);
    ASSERT_EQ(s.grids, want.grids);
    // Through 8-bit PNG and the processor: within half a grey level of the float rendering.
    const double tol = 0.5 / 255.0 / 0.26130258 + 1e-6;
    EXPECT_LE((s.pixel_values - want.pixel_values).abs().max().item<double>(), tol) << where;
    int64_t pads = 0;
    for (auto id : s.ids) pads += id == qwen()->token_id("<|image_pad|>");
    EXPECT_EQ(pads, want.grids[0][1] * want.grids[0][2] / 4);
    seen.insert(where);
  }
  EXPECT_EQ(seen.size(), 6u);  // an epoch is a permutation
}

TEST(Stream, MixingShuffleAndShards) {
  dhp::testing::TempDir dir("loader_mix");
  const auto model = dhp::qwen::preset("demo");
  dhp::data::write_synthetic((dir.path() / "a").string(), 10, model, shapes_options());
  dhp::data::write_synthetic((dir.path() / "b").string(), 3, model, shapes_options());
  const auto a = (dir.path() / "a" / "train.jsonl").string(), b = (dir.path() / "b" / "train.jsonl").string();
  LlavaDataset data(options({{a, 0.5}, {b, 2.0}}), qwen());
  ASSERT_EQ(data.epoch_size(), 5 + 6);
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    int from_a = 0, from_b = 0;
    std::set<std::string> a_records;
    for (int64_t i = 0; i < 11; ++i) {
      const auto& w = data.where(epoch * 11 + i);
      if (w.rfind(a, 0) == 0) ++from_a, a_records.insert(w);
      else ++from_b;
    }
    EXPECT_EQ(from_a, 5);
    EXPECT_EQ(from_b, 6);
    EXPECT_EQ(a_records.size(), 5u);  // a fraction below 1 draws distinct records
  }
  // Reproducible for a seed; epochs differ.
  LlavaDataset again(options({{a, 0.5}, {b, 2.0}}), qwen());
  std::vector<std::string> e0, e1;
  for (int64_t i = 0; i < 11; ++i) {
    EXPECT_EQ(again.where(i), data.where(i));
    e0.push_back(data.where(i));
    e1.push_back(data.where(11 + i));
  }
  EXPECT_NE(e0, e1);
  // Three replicas: disjoint positions covering the stream, each in order.
  std::set<int64_t> all;
  for (int64_t r = 0; r < 3; ++r) {
    Loader l(std::make_shared<LlavaDataset>(options({{a, 0.5}, {b, 2.0}}), qwen()), 0, r, 3, 1, 2);
    for (int k = 0; k < 8; ++k) {
      const int64_t p = l.position();
      EXPECT_EQ(p % 3, r);
      EXPECT_TRUE(all.insert(p).second);
      l.next();
    }
  }
  for (int64_t p = 0; p < 24; ++p) EXPECT_TRUE(all.count(p)) << p;
}

TEST(Loader, WorkersMatchSequentialAndResumeContinues) {
  dhp::testing::TempDir dir("loader_workers");
  dhp::data::write_synthetic(dir.path().string(), 9, dhp::qwen::preset("demo"), shapes_options());
  auto data = std::make_shared<LlavaDataset>(options({{(dir.path() / "train.jsonl").string(), 1.0}}), qwen());
  std::vector<dhp::data::Sample> seq;
  for (int64_t p = 0; p < 14; ++p) seq.push_back(data->load(p));
  Loader l(data, 0, 0, 1, 2, 4);
  for (int64_t p = 0; p < 7; ++p) {
    const auto s = l.next();
    EXPECT_EQ(s.ids, seq[p].ids) << p;
    EXPECT_TRUE(torch::equal(s.pixel_values, seq[p].pixel_values)) << p;
  }
  EXPECT_EQ(l.position(), 7);
  Loader resumed(data, l.position(), 0, 1, 2, 4);
  for (int64_t p = 7; p < 14; ++p) EXPECT_EQ(resumed.next().ids, seq[p].ids) << p;
  EXPECT_GE(l.wait_seconds(), 0.0);
}

TEST(Loader, BadSamplesAreSkippedCountedAndNamed) {
  dhp::testing::TempDir dir("loader_bad");
  dhp::data::write_synthetic(dir.path().string(), 6, dhp::qwen::preset("demo"), shapes_options());
  fs::remove(dir.path() / "images" / "000001.png");
  {
    std::ofstream f(dir.path() / "images" / "000002.png", std::ios::binary | std::ios::trunc);
    f << "\x89PNG\r\n\x1a\n garbage";
  }
  const auto file = (dir.path() / "train.jsonl").string();
  auto data = std::make_shared<LlavaDataset>(options({{file, 1.0}}), qwen());
  Loader l(data, 0, 0, 1, 2, 3);
  for (int k = 0; k < 4; ++k) l.next();  // the 4 good samples of the first epoch
  EXPECT_EQ(l.skipped(), 2);
  ASSERT_EQ(l.first_reasons().size(), 2u);
  std::string reasons = l.first_reasons()[0] + "\n" + l.first_reasons()[1];
  EXPECT_NE(reasons.find("000001.png: cannot open the image"), std::string::npos) << reasons;
  EXPECT_NE(reasons.find("000002.png: corrupt PNG"), std::string::npos) << reasons;
  EXPECT_NE(reasons.find(file + ":"), std::string::npos) << reasons;
  // Strict: the first bad sample stops the stream.
  auto o = options({{file, 1.0}});
  o.strict = true;
  Loader strict(std::make_shared<LlavaDataset>(o, qwen()), 0, 0, 1, 1, 2);
  EXPECT_THROW(for (int k = 0; k < 6; ++k) strict.next(), dhp::Error);
  // Every image gone: an error after an epoch of failures, not a hang.
  for (int i = 0; i < 6; ++i) {
    char name[32];
    std::snprintf(name, sizeof(name), "%06d.png", i);
    fs::remove(dir.path() / "images" / name);
  }
  Loader none(std::make_shared<LlavaDataset>(options({{file, 1.0}}), qwen()), 0, 0, 1, 2, 2);
  EXPECT_THROW(none.next(), dhp::Error);
  // A file with no usable record at all is refused when the dataset is opened.
  {
    std::ofstream f(dir.path() / "empty.jsonl");
    f << "{\"conversations\": 1}\n";
  }
  EXPECT_THROW(LlavaDataset(options({{(dir.path() / "empty.jsonl").string(), 1.0}}), qwen()), dhp::Error);
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Training from LLaVA files (configs/demo_llava.yaml's model, small batches).


namespace {

dhp::Config llava_config(const std::string& dir, std::vector<std::string> extra) {
  std::vector<std::string> sets = {"model.text.vocab_size=151936", "model.image_token_id=151655", "model.video_token_id=151656",
                                   "model.vision_start_token_id=151652", "model.vision_end_token_id=151653",
                                   "model.text.num_heads=8", "model.text.num_kv_heads=4",
                                   "model.text.mrope_section=[2,3,3]",
                                   "data.dataset=llava", "data.files=[" + dir + "/train.jsonl]",
                                   std::string("data.tokenizer=") + DHP_QWEN_TOKENIZER, "data.batch_size=4",
                                   "data.min_pixels=3136", "data.max_pixels=12544", "training.steps=4",
                                   "training.warmup_steps=1", "checkpoint.dir=" + dir + "/ck",
                                   "output.dir=" + dir + "/run", "parallel.timeout_s=60"};
  sets.insert(sets.end(), extra.begin(), extra.end());
  return dhp::load_config("", sets);
}

// Rank 0's losses of `steps` steps of `cfg` on 2 ranks (threads).
std::vector<double> losses_on_two_ranks(const dhp::Config& cfg, int steps) {
  std::vector<double> out;
  std::mutex mu;
  dhp::testing::run_ranks(2, [&](int64_t rank, const dhp::dist::Store& store) {
    dhp::train::Runtime rt;
    rt.rank = rank;
    rt.world = 2;
    rt.store = std::make_shared<dhp::dist::Store>(store);
    rt.timeout = dhp::testing::kTestTimeout;
    dhp::train::Trainer t(cfg, rt);
    std::vector<double> l;
    for (int i = 0; i < steps; ++i) l.push_back(t.train_step().loss);
    if (rank == 0) {
      std::lock_guard<std::mutex> lock(mu);
      out = l;
    }
  });
  return out;
}

TEST(LlavaTraining, ResumesBitExactlyWithTheDataPosition) {
  dhp::testing::TempDir dir("loader_train");
  dhp::data::write_synthetic(dir.path().string(), 10, dhp::qwen::preset("demo"), shapes_options());
  fs::remove(dir.path() / "images" / "000003.png");  // a bad sample: skipped the same way in both runs
  std::vector<double> whole;
  int64_t skipped = 0;
  {
    dhp::train::Trainer t(llava_config(dir.path().string(), {}));
    for (int i = 0; i < 4; ++i) {
      const auto m = t.train_step();
      whole.push_back(m.loss);
      skipped = m.skipped_samples;
      if (t.step() == 2) t.save_checkpoint();
    }
  }
  EXPECT_GE(skipped, 1);  // 16 samples read from 10-record epochs with one bad record
  EXPECT_LT(whole[3], whole[0]);
  dhp::train::Trainer r(llava_config(dir.path().string(), {"checkpoint.resume=auto"}));
  ASSERT_EQ(r.step(), 2);
  EXPECT_EQ(r.train_step().loss, whole[2]);
  EXPECT_EQ(r.train_step().loss, whole[3]);
}

// The same files under dhp on 2 ranks (vision sp, text tp with the vocabulary split):
// the single-process losses within 1e-5.
TEST(LlavaTraining, DhpOnTwoRanksTrainsLikeOneProcess) {
  dhp::testing::TempDir dir("loader_dhp");
  dhp::data::write_synthetic(dir.path().string(), 8, dhp::qwen::preset("demo"), shapes_options());
  std::vector<double> one;
  {
    dhp::train::Trainer t(llava_config(dir.path().string(), {}));
    for (int i = 0; i < 2; ++i) one.push_back(t.train_step().loss);
  }
  const auto cfg = llava_config(dir.path().string(), {"parallel.strategy=dhp"});
  const auto two = losses_on_two_ranks(cfg, 2);
  ASSERT_EQ(two.size(), 2u);
  for (int i = 0; i < 2; ++i) EXPECT_NEAR(two[i], one[i], 1e-5 * one[i]) << "step " << i + 1;
}

// Packing: micro-batches take the stream in order (nothing lost or repeated, across steps
// too), each stays within data.pack_tokens and is full (the next sample would not fit).
TEST(LlavaTraining, PacksGreedilyToTheTokenBudgetInStreamOrder) {
  dhp::testing::TempDir dir("loader_pack");
  dhp::data::write_synthetic(dir.path().string(), 12, dhp::qwen::preset("demo"), shapes_options());
  auto o = options({{(dir.path() / "train.jsonl").string(), 1.0}});
  o.image.min_pixels = 3136;
  o.image.max_pixels = 12544;
  o.seed = dhp::DataOptions().seed;  // the trainer's stream
  auto data = std::make_shared<const LlavaDataset>(o, qwen());
  Loader ref(data, 0, 0, 1, 1, 4);
  std::vector<int64_t> lengths;
  std::vector<std::vector<int64_t>> stream;
  for (int i = 0; i < 40; ++i) {
    auto s = ref.next();
    lengths.push_back(static_cast<int64_t>(s.ids.size()));
    stream.push_back(s.ids);
  }
  const auto [lo, hi] = std::minmax_element(lengths.begin(), lengths.end());
  ASSERT_LT(*lo, *hi) << "the synthetic samples should differ in length";
  const int64_t budget = 3 * *hi + *lo / 2;  // three or four samples per micro-batch
  const std::vector<std::string> pack = {"data.pack_tokens=" + std::to_string(budget), "training.micro_batches=2",
                                         "data.max_length=" + std::to_string(*hi)};
  dhp::train::Trainer t(llava_config(dir.path().string(), pack));
  size_t next = 0;
  for (int step = 0; step < 3; ++step) {
    const auto micro = t.next_step_samples();
    ASSERT_EQ(micro.size(), 2u);
    for (const auto& mb : micro) {
      int64_t tokens = 0;
      for (const auto& s : mb) {
        ASSERT_LT(next, stream.size());
        EXPECT_EQ(s.ids, stream[next]) << "stream position " << next;
        ++next;
        tokens += static_cast<int64_t>(s.ids.size());
      }
      EXPECT_GE(mb.size(), 3u);
      EXPECT_LE(tokens, budget);
      EXPECT_GT(tokens + lengths[next], budget) << "the next sample would have fit";
    }
  }
  // The parameters: samples per step vary, tokens stay within the budget.
  dhp::train::Trainer u(llava_config(dir.path().string(), pack));
  const auto m = u.train_step();
  EXPECT_GE(m.samples, 6);
  EXPECT_LE(m.tokens, 2 * budget);
  EXPECT_THROW(llava_config(dir.path().string(), {"data.pack_tokens=100", "data.max_length=200"}), dhp::Error);
}

// A checkpoint taken while a look-ahead sample waits for the next micro-batch resumes with
// it: the same losses bit for bit.
// Images and videos mixed from two files (the moving task's clips written by FFmpeg), a
// corrupt clip in the stream: the resumed run reads and skips exactly as the whole run did,
// and its losses are bit-exact; dhp on two ranks trains the same mixture like one process.
TEST(LlavaTraining, MixedImagesAndVideosResumeBitExactlyWithABadClip) {
  dhp::testing::TempDir dir("loader_video");
  const auto images = dir.path() / "images_set", videos = dir.path() / "videos_set";
  dhp::data::write_synthetic(images.string(), 6, dhp::qwen::preset("demo"), shapes_options());
  auto vo = shapes_options();
  vo.frames = 4;
  dhp::data::write_synthetic(videos.string(), 6, dhp::qwen::preset("demo"), vo);
  {
    std::ofstream f(videos / "videos" / "000002.mp4", std::ios::binary | std::ios::trunc);
    f << "not a video at all";
  }
  const std::vector<std::string> mixed = {
      "data.files=[" + (images / "train.jsonl").string() + "," + (videos / "train.jsonl").string() + "]",
      "data.video_min_pixels=3136", "data.video_max_pixels=12544"};
  std::vector<double> whole;
  int64_t skipped = 0;
  {
    dhp::train::Trainer t(llava_config(dir.path().string(), mixed));
    for (int i = 0; i < 4; ++i) {
      const auto m = t.train_step();
      whole.push_back(m.loss);
      skipped = m.skipped_samples;
      if (t.step() == 2) t.save_checkpoint();
    }
  }
  EXPECT_GE(skipped, 1);  // 16 samples from 12-record epochs with one bad clip
  EXPECT_TRUE(std::isfinite(whole[3]));
  auto resumed = mixed;
  resumed.push_back("checkpoint.resume=auto");
  dhp::train::Trainer r(llava_config(dir.path().string(), resumed));
  ASSERT_EQ(r.step(), 2);
  EXPECT_EQ(r.train_step().loss, whole[2]);
  EXPECT_EQ(r.train_step().loss, whole[3]);
  auto two = mixed;
  two.push_back("parallel.strategy=dhp");
  const auto parallel = losses_on_two_ranks(llava_config(dir.path().string(), two), 2);
  ASSERT_EQ(parallel.size(), 2u);
  for (int i = 0; i < 2; ++i) EXPECT_NEAR(parallel[i], whole[i], 1e-5 * std::abs(whole[i])) << i;
}

TEST(LlavaTraining, PackedRunResumesBitExactly) {
  dhp::testing::TempDir dir("loader_pack_resume");
  dhp::data::write_synthetic(dir.path().string(), 10, dhp::qwen::preset("demo"), shapes_options());
  const std::vector<std::string> pack = {"data.pack_tokens=400", "data.max_length=200"};
  std::vector<double> whole;
  std::vector<int64_t> samples;
  {
    dhp::train::Trainer t(llava_config(dir.path().string(), pack));
    for (int i = 0; i < 4; ++i) {
      const auto m = t.train_step();
      whole.push_back(m.loss);
      samples.push_back(m.samples);
      if (t.step() == 2) t.save_checkpoint();
    }
  }
  auto resumed = pack;
  resumed.push_back("checkpoint.resume=auto");
  dhp::train::Trainer r(llava_config(dir.path().string(), resumed));
  ASSERT_EQ(r.step(), 2);
  for (int i = 2; i < 4; ++i) {
    const auto m = r.train_step();
    EXPECT_EQ(m.loss, whole[i]) << "step " << i + 1;
    EXPECT_EQ(m.samples, samples[i]) << "step " << i + 1;
  }
}

// Packed micro-batches under data parallelism (each replica its share of a micro-batch)
// give the single-process losses within 1e-5.
TEST(LlavaTraining, PackedDataParallelTrainsLikeOneProcess) {
  dhp::testing::TempDir dir("loader_pack_dp");
  dhp::data::write_synthetic(dir.path().string(), 8, dhp::qwen::preset("demo"), shapes_options());
  const std::vector<std::string> pack = {"data.pack_tokens=400", "data.max_length=200", "training.micro_batches=2"};
  std::vector<double> one;
  {
    dhp::train::Trainer t(llava_config(dir.path().string(), pack));
    for (int i = 0; i < 2; ++i) one.push_back(t.train_step().loss);
  }
  auto dp = pack;
  dp.push_back("parallel.strategy=dp");
  const auto cfg = llava_config(dir.path().string(), dp);
  const auto two = losses_on_two_ranks(cfg, 2);
  ASSERT_EQ(two.size(), 2u);
  for (int i = 0; i < 2; ++i) EXPECT_NEAR(two[i], one[i], 1e-5 * one[i]) << "step " << i + 1;
}

// Held-out evaluation from files: the eval files' good samples, at most one epoch (a bad one
// skipped, none repeated), their mean answer loss; the shapes task refuses eval files.
TEST(LlavaTraining, EvaluatesHeldOutFiles) {
  dhp::testing::TempDir dir("loader_eval");
  dhp::data::write_synthetic(dir.path().string(), 8, dhp::qwen::preset("demo"), shapes_options());
  auto so = shapes_options();
  so.seed = 99;  // other images and answers
  dhp::data::write_synthetic((dir.path() / "eval").string(), 6, dhp::qwen::preset("demo"), so);
  fs::remove(dir.path() / "eval" / "images" / "000002.png");
  const auto eval_file = (dir.path() / "eval" / "train.jsonl").string();
  dhp::train::Trainer t(llava_config(dir.path().string(), {"data.eval_files=[" + eval_file + "]"}));
  const auto before = t.evaluate(100);
  EXPECT_EQ(before.samples, 5);  // 6 records, one without its image, no repeats
  EXPECT_GT(before.loss, 0);
  for (int i = 0; i < 3; ++i) t.train_step();
  const auto after = t.evaluate(3);
  EXPECT_EQ(after.samples, 3);
  EXPECT_LT(after.loss, before.loss);  // the same task: training lowers the held-out loss
  EXPECT_THROW(dhp::load_config("", {"data.eval_files=[x.jsonl]"}), dhp::Error);
}

}  // namespace
