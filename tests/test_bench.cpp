// dhp bench's sweep logic: vision lengths to image sides, the batch-size search (largest
// that fits, OOM recorded, refusals and failures), the metric arithmetic from metrics.jsonl,
// the table's ratios, and one real sweep on a tiny model where a memory limit between two
// batches' measured peaks makes the search keep the smaller one.
#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "dhp/bench/bench.h"
#include "dhp/core/error.h"
#include "support/test_machine.h"

namespace {

namespace fs = std::filesystem;
using dhp::bench::Attempt;
using dhp::bench::Outcome;
using dhp::bench::PointResult;

TEST(Bench, VisionTokensMapToSquareImages) {
  EXPECT_EQ(dhp::bench::image_side_for(1024, 14, 2), 448);    // 32 x 32 patches
  EXPECT_EQ(dhp::bench::image_side_for(65536, 14, 2), 3584);  // 256 x 256
  EXPECT_EQ(dhp::bench::image_side_for(64, 14, 2), 112);
  for (int64_t bad : {1000, 25, 0, -4}) {
    try {
      dhp::bench::image_side_for(bad, 14, 2);
      ADD_FAILURE() << bad << " accepted";
    } catch (const dhp::Error& e) {
      EXPECT_NE(std::string(e.what()).find("vision tokens " + std::to_string(bad)), std::string::npos) << e.what();
    }
  }
}

Attempt outcome(Outcome o, double step_s = 1.0) {
  Attempt a;
  a.outcome = o;
  a.message = dhp::bench::outcome_name(o);
  a.metrics.step_time_s = step_s;
  return a;
}

TEST(Bench, PointsParseAndKeysTheSweepOwnsAreRefused) {
  const auto p = dhp::bench::parse_points("dhp,tp", {"seq:parallel.strategy=dhp;parallel.pipeline=false"});
  ASSERT_EQ(p.size(), 3u);
  EXPECT_EQ(p[2].name, "seq");
  EXPECT_EQ(p[2].sets, (std::vector<std::string>{"parallel.strategy=dhp", "parallel.pipeline=false"}));
  EXPECT_THROW(dhp::bench::parse_points("", {"x:data.batch_size=2"}), dhp::Error);
  EXPECT_THROW(dhp::bench::parse_points("", {"nocolon"}), dhp::Error);
  EXPECT_THROW(dhp::bench::parse_points("dhp,dhp", {}), dhp::Error);
  EXPECT_THROW(dhp::bench::parse_points("", {}), dhp::Error);
}

TEST(Bench, SearchKeepsTheLargestBatchThatFits) {
  PointResult r;
  r.vision_tokens = 100;
  std::vector<int64_t> tried;
  dhp::bench::search_batch({1, 8, 2, 4}, [&](int64_t b) {
    tried.push_back(b);
    return outcome(b > 2 ? Outcome::kOom : Outcome::kOk, 0.5);
  }, r);
  EXPECT_EQ(tried, (std::vector<int64_t>{8, 4, 2}));  // largest first, stops at the first fit
  EXPECT_EQ(r.batch_size, 2);
  EXPECT_FALSE(r.oom);
  EXPECT_DOUBLE_EQ(r.throughput(), 100.0 * 2 / 0.5);
  ASSERT_EQ(r.attempts.size(), 3u);
  EXPECT_EQ(r.attempts[0].outcome, Outcome::kOom);
}

TEST(Bench, NothingFitsIsRecordedAsOom) {
  PointResult r;
  dhp::bench::search_batch({4, 2, 1}, [&](int64_t b) { return outcome(b == 1 ? Outcome::kInvalid : Outcome::kOom); }, r);
  EXPECT_EQ(r.batch_size, 0);
  EXPECT_TRUE(r.oom);
  EXPECT_EQ(r.throughput(), 0);
  EXPECT_EQ(r.attempts.size(), 3u);
}

TEST(Bench, FailuresAndRefusalsAreRecordedNotFatal) {
  PointResult a;
  dhp::bench::search_batch({8, 4}, [&](int64_t b) { return outcome(b == 8 ? Outcome::kFailed : Outcome::kOk); }, a);
  EXPECT_EQ(a.batch_size, 4);
  EXPECT_TRUE(a.error.empty());
  PointResult b;
  dhp::bench::search_batch({2, 1}, [&](int64_t) { return outcome(Outcome::kInvalid); }, b);
  EXPECT_EQ(b.batch_size, 0);
  EXPECT_FALSE(b.oom);
  EXPECT_EQ(b.error, "invalid");
}

TEST(Bench, MetricsAreAveragedAfterTheWarmUp) {
  const auto path = fs::temp_directory_path() / ("dhp-bench-metrics-" + std::to_string(::getpid()) + ".jsonl");
  {
    std::ofstream f(path);
    for (int s = 1; s <= 4; ++s) {
      f << "{\"step\": " << s << ", \"step_time_s\": " << s << ", \"patches_per_s\": " << 10 * s
        << ", \"tokens_per_s\": " << 100 * s << ", \"model_flops\": 1e9, \"peak_bytes_per_rank\": [" << s << ", "
        << 5 - s << "], \"comm_s_per_rank\": [0.5, 1.5], \"busy_s_per_rank\": [1, 2], \"idle_s_per_rank\": [0, "
        << 0.1 * s << "]}\n";
    }
    // The profiled step (slower): kept apart from the averages.
    f << "{\"step\": 5, \"step_time_s\": 100, \"patches_per_s\": 1, \"tokens_per_s\": 1, \"model_flops\": 1e9, "
         "\"peak_bytes_per_rank\": [1, 1], \"comm_s_per_rank\": [0, 0], \"busy_s_per_rank\": [1, 1], "
         "\"idle_s_per_rank\": [0, 0], \"breakdown_per_rank\": {\"gemm_s\": [6, 2], \"attention_s\": [1, 1], "
         "\"elementwise_s\": [1, 1], \"comm_s\": [1, 4], \"update_s\": [1, 1], \"data_s\": [0, 0], "
         "\"other_s\": [0, 1]}}\n";
  }
  const auto m = dhp::bench::read_metrics(path.string(), 2);
  fs::remove(path);
  ASSERT_EQ(m.breakdown_per_rank.size(), 7u);
  EXPECT_DOUBLE_EQ(m.breakdown_fraction(0), (6.0 / 10 + 2.0 / 10) / 2);  // GEMM: 60% and 20%
  EXPECT_DOUBLE_EQ(m.breakdown_fraction(3), (1.0 / 10 + 4.0 / 10) / 2);
  EXPECT_EQ(m.steps_measured, 2);
  EXPECT_DOUBLE_EQ(m.step_time_s, 3.5);  // steps 3 and 4
  EXPECT_DOUBLE_EQ(m.patches_per_s, 35);
  EXPECT_DOUBLE_EQ(m.tokens_per_s, 350);
  EXPECT_EQ(m.peak_bytes_per_rank, (std::vector<double>{4, 2}));  // max over the measured steps
  EXPECT_DOUBLE_EQ(m.comm_fraction(), 1.0 / 3.5);
  EXPECT_NEAR(m.idle_fraction({1}), 0.35 / 3.5, 1e-12);
  EXPECT_DOUBLE_EQ(m.idle_fraction({0}), 0);
  EXPECT_THROW(dhp::bench::read_metrics(path.string(), 2), dhp::Error);  // gone: a clear error
}

TEST(Bench, TableShowsRatiosOfTheFirstPoint) {
  auto point = [](const char* name, int64_t tokens, int64_t batch, double step_s) {
    PointResult r;
    r.name = name;
    r.vision_tokens = tokens;
    r.image_side = 112;
    r.batch_size = batch;
    r.metrics.step_time_s = step_s;
    r.oom = batch == 0;
    return r;
  };
  dhp::bench::Options o;
  o.batch_sizes = {4, 2, 1};
  const auto md = dhp::bench::markdown({point("dhp", 64, 4, 1.0), point("tp", 64, 4, 1.5), point("zero3", 64, 0, 0)},
                                       o, 100.0);
  EXPECT_NE(md.find("| 64 | 112 | 256 (4) | 171 (4) | OOM | 1.50 | - |"), std::string::npos) << md;
}

TEST(Bench, RepeatsKeepTheRoundOfMedianStepTime) {
  PointResult r;
  r.name = "dhp";
  std::vector<dhp::bench::RunMetrics> rounds(4);
  const double step[] = {2.0, 1.0, 4.0, 3.0};
  for (size_t k = 0; k < 4; ++k) {
    rounds[k].step_time_s = step[k];
    rounds[k].tokens_per_s = 10.0 * static_cast<double>(k);  // marks which round was kept
  }
  dhp::bench::keep_median_round(r, rounds);
  EXPECT_DOUBLE_EQ(r.metrics.step_time_s, 2.0);  // the lower of the middle two (2, 3)
  EXPECT_DOUBLE_EQ(r.metrics.tokens_per_s, 0.0);  // every figure from that one round
  EXPECT_EQ(r.round_step_s, (std::vector<double>{2, 1, 4, 3}));  // in run order
  rounds.pop_back();
  dhp::bench::keep_median_round(r, rounds);
  EXPECT_DOUBLE_EQ(r.metrics.step_time_s, 2.0);
  EXPECT_EQ(r.round_step_s.size(), 3u);
  EXPECT_THROW(dhp::bench::keep_median_round(r, {}), dhp::Error);
  // The table shows the median with the rounds' range.
  r.vision_tokens = 64;
  r.image_side = 112;
  r.batch_size = 2;
  dhp::bench::Options o;
  o.repeats = 3;
  const auto md = dhp::bench::markdown({r}, o, 100.0);
  EXPECT_NE(md.find("| 2.000 [1.000-4.000] |"), std::string::npos) << md;
  EXPECT_NE(md.find("the median of 3 rounds"), std::string::npos) << md;
}

// A real sweep: 1 process, the demo model, 64 patches per image. First the peaks of batch 1
// and 4 alone, then a limit halfway between them: the search must keep batch 1 and record
// batch 4 as out of memory.
std::string run_bench(const fs::path& out, const std::string& extra) {
  const std::string cmd = std::string(DHP_BINARY) + " bench --strategies none --vision-tokens 64 --nproc 1 --steps 2" +
                          " --warmup 1 --no-plot --out " + out.string() + " " + extra + " > " +
                          (out / "stdout.txt").string() + " 2>&1";
  fs::create_directories(out);
  EXPECT_EQ(std::system(("timeout 300 " + cmd).c_str()), 0) << cmd;
  std::ifstream f(out / "results.json");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

TEST(Bench, MemoryLimitMakesTheSearchKeepASmallerBatch) {
  const auto dir = fs::temp_directory_path() / ("dhp-bench-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  auto peak = [&](const std::string& json) {
    return YAML::Load(json)["points"][0]["peak_bytes_per_rank"][0].as<double>();
  };
  const double p1 = peak(run_bench(dir / "b1", "--batch-sizes 1"));
  const double p4 = peak(run_bench(dir / "b4", "--batch-sizes 4"));
  ASSERT_LT(p1, p4);
  const auto limit = std::to_string(static_cast<int64_t>((p1 + p4) / 2));
  const auto json = run_bench(dir / "both", "--batch-sizes 1,4 --memory-limit " + limit);
  const auto point = YAML::Load(json)["points"][0];
  EXPECT_EQ(point["batch_size"].as<int64_t>(), 1) << json;
  EXPECT_FALSE(point["oom"].as<bool>());
  EXPECT_EQ(point["attempts"][0]["batch_size"].as<int64_t>(), 4);
  EXPECT_EQ(point["attempts"][0]["outcome"].as<std::string>(), "oom") << json;
  EXPECT_GT(point["throughput"].as<double>(), 0);
  // A limit below both: recorded as OOM, the sweep still finishes and writes its table.
  const auto none = YAML::Load(run_bench(dir / "none", "--batch-sizes 1,4 --memory-limit 1MiB"))["points"][0];
  EXPECT_TRUE(none["oom"].as<bool>());
  EXPECT_EQ(none["batch_size"].as<int64_t>(), 0);
  EXPECT_TRUE(fs::exists(dir / "none" / "table.md"));
  // Three rounds of the kept batch: each a job of its own, the row the median one.
  const auto rep = YAML::Load(run_bench(dir / "rep", "--batch-sizes 1 --repeats 3"))["points"][0];
  const auto steps = rep["round_step_time_s"].as<std::vector<double>>();
  ASSERT_EQ(steps.size(), 3u);
  auto sorted = steps;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_DOUBLE_EQ(rep["step_time_s"].as<double>(), sorted[1]);
  EXPECT_EQ(rep["failed_rounds"].as<int64_t>(), 0);
  EXPECT_TRUE(fs::exists(dir / "rep" / "runs" / "none_64_b1_r3" / "metrics.jsonl"));
  fs::remove_all(dir);
}

}  // namespace

namespace {

// Video points: every sample a clip of the moving task; the length given per frame and the
// sweep's patches per clip = per frame x temporal patches; the jobs train on clips.
TEST(Bench, VideoPointsRunClipsOfTheMovingTask) {
  const auto dir = fs::temp_directory_path() / ("dhp-bench-video-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const auto json = YAML::Load(run_bench(dir / "v", "--batch-sizes 2 --frames 4"));
  const auto point = json["points"][0];
  EXPECT_EQ(point["frames"].as<int64_t>(), 4);
  EXPECT_EQ(point["vision_tokens"].as<int64_t>(), 64 * 2);  // 8x8 patches a frame, 2 temporal patches
  EXPECT_EQ(point["image_side"].as<int64_t>(), 112);
  EXPECT_EQ(point["batch_size"].as<int64_t>(), 2);
  // The job's own count of patches per step agrees: 2 clips x 128 patches.
  std::ifstream m(dir / "v" / "runs" / "none_128_b2" / "metrics.jsonl");
  std::string line;
  ASSERT_TRUE(std::getline(m, line));
  EXPECT_EQ(YAML::Load(line)["patches"].as<int64_t>(), 256) << line;
  std::stringstream table;
  table << std::ifstream(dir / "v" / "table.md").rdbuf();
  EXPECT_NE(table.str().find("clip of 4 frames"), std::string::npos) << table.str();
  EXPECT_NE(std::system((std::string(DHP_BINARY) + " bench --frames 3 --out " + (dir / "bad").string() +
                         " > /dev/null 2>&1").c_str()),
            0);
  fs::remove_all(dir);
}


// A mixed-resolution point: one length whose images take sides drawn from a range; the
// throughput is the jobs' own count of patches per second.
TEST(Bench, MixedSidesAreOnePointMeasuredInPatchesPerSecond) {
  const auto dir = fs::temp_directory_path() / ("dhp-bench-mixed-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const auto json = YAML::Load(run_bench(dir / "m", "--batch-sizes 4 --mixed-sides 56-168"));
  ASSERT_EQ(json["points"].size(), 1u);
  const auto point = json["points"][0];
  EXPECT_EQ(point["vision_tokens"].as<int64_t>(), 0);
  EXPECT_EQ(point["image_side"].as<int64_t>(), 56);
  EXPECT_EQ(point["max_side"].as<int64_t>(), 168);
  EXPECT_GT(point["throughput"].as<double>(), 0);
  EXPECT_NEAR(point["throughput"].as<double>(),
              point["patches_per_step"].as<double>() / point["step_time_s"].as<double>(),
              1e-6 * point["throughput"].as<double>());
  EXPECT_TRUE(point["stall_fraction_vision"].IsDefined());
  // The extra, profiled step: its breakdown, out of the averages.
  EXPECT_EQ(point["steps_measured"].as<int64_t>(), json["settings"]["steps"].as<int64_t>() - json["settings"]["warmup"].as<int64_t>());
  EXPECT_GT(point["breakdown_fraction"]["gemm_s"].as<double>(), 0);
  // The job's images do vary in size within the range.
  std::ifstream m(dir / "m" / "runs" / "none_mixed_b4" / "metrics.jsonl");
  std::string line;
  std::set<int64_t> patches;
  while (std::getline(m, line)) patches.insert(YAML::Load(line)["patches"].as<int64_t>());
  EXPECT_GT(patches.size(), 1u) << "every step drew the same total of patches";
  for (auto p : patches) {
    EXPECT_GE(p, 4 * 4 * 4);    // 4 images of at least 56x56 px (4x4 patches)
    EXPECT_LE(p, 4 * 12 * 12);  // and at most 168x168
  }
  std::stringstream table;
  table << std::ifstream(dir / "m" / "table.md").rdbuf();
  EXPECT_NE(table.str().find("| mixed (measured) | 56-168 |"), std::string::npos) << table.str();
  EXPECT_NE(table.str().find("| point | vision patches | GEMM % | attention % |"), std::string::npos) << table.str();
  for (const char* bad : {"100-50", "60-168", "168"}) {
    EXPECT_NE(std::system((std::string(DHP_BINARY) + " bench --mixed-sides " + bad + " --out " + (dir / "bad").string() +
                           " > /dev/null 2>&1").c_str()),
              0)
        << bad;
  }
  fs::remove_all(dir);
}


// An `auto` point: each batch runs the layout and micro-batch count the planner picks from
// this machine's calibration (here one written by hand), spelled out in the results; a
// batch for which the planner finds nothing that fits is refused with its reason.
TEST(Bench, AutoRunsThePlannersChoiceAndSaysWhich) {
  const auto dir = fs::temp_directory_path() / ("dhp-bench-auto-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "machine");
  dhp::testing::write_test_machine((dir / "machine").string(), 1e-5, 2);
  setenv("DHP_CALIBRATION_DIR", (dir / "machine").c_str(), 1);
  const auto json = YAML::Load(run_bench(dir / "a", "--strategies auto --nproc 2 --batch-sizes 4"));
  const auto point = json["points"][0];
  EXPECT_EQ(point["strategy"].as<std::string>(), "auto");
  EXPECT_EQ(point["batch_size"].as<int64_t>(), 4) << point;
  const auto layout = point["layout"].as<std::string>();
  EXPECT_EQ(layout.rfind("auto: vision ", 0), 0u) << layout;
  EXPECT_NE(layout.find(" micro-batch"), std::string::npos) << layout;
  std::stringstream why;
  why << std::ifstream(dir / "a" / "runs" / "auto_64_b4" / "auto.txt").rdbuf();
  EXPECT_NE(why.str().find("predicted"), std::string::npos) << why.str();
  // The job ran what was chosen: the pinned keys are in its command line, so it did not choose again.
  std::stringstream log;
  log << std::ifstream(dir / "a" / "runs" / "auto_64_b4" / "log.txt").rdbuf();
  EXPECT_EQ(log.str().find("parallel.strategy=auto on"), std::string::npos) << log.str();
  // Nothing fits 1 MiB: refused before any job starts, the planner's reason kept.
  fs::create_directories(dir / "n");
  const std::string cmd = std::string(DHP_BINARY) + " bench --strategies auto --vision-tokens 64 --nproc 2 " +
                          "--batch-sizes 4 --memory-limit 1MiB --steps 2 --warmup 1 --no-plot --out " +
                          (dir / "n").string() + " > " + (dir / "n" / "stdout.txt").string() + " 2>&1";
  EXPECT_NE(std::system(cmd.c_str()), 0) << "a point that cannot run fails the sweep's exit status";
  const auto none = YAML::LoadFile((dir / "n" / "results.json").string());
  EXPECT_EQ(none["points"][0]["batch_size"].as<int64_t>(), 0);
  EXPECT_EQ(none["points"][0]["attempts"][0]["outcome"].as<std::string>(), "invalid");
  EXPECT_NE(none["points"][0]["error"].as<std::string>().find("no plan fits"), std::string::npos);
  unsetenv("DHP_CALIBRATION_DIR");
  fs::remove_all(dir);
}

}  // namespace
