/// \file test_report.cpp
/// \brief Rates, speed-ups and the three report formats on hand-made rows.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>

#include "fa/flops.h"
#include "fa/harness.h"
#include "fa/report.h"

namespace fa {
namespace {

ResultRow row(const std::string& step, double ms, bool causal = false) {
  ResultRow r;
  r.step = step;
  r.shape.batch = 1;
  r.shape.heads = r.shape.heads_kv = 16;
  r.shape.seqlen_q = r.shape.seqlen_k = 4096;
  r.shape.head_dim = 128;
  r.shape.causal = causal;
  r.timing = {ms, ms * 0.9, ms * 1.2, 10};
  r.checked = true;
  r.passed = true;
  r.max_abs = 1e-3;
  r.rel_l2 = 2e-4;
  return r;
}

TEST(Report, RatesFromTimingAndFlops) {
  std::vector<ResultRow> rows = {row("a", 2.0)};
  compute_rates(&rows, Ceilings{500, 700});
  const double flops = forward_flops(1, 16, 4096, 4096, 128, false);
  EXPECT_NEAR(rows[0].tflops, flops / 2e-3 / 1e12, 1e-9);
  EXPECT_NEAR(rows[0].pct_mma, 100 * rows[0].tflops / 500, 1e-9);
  EXPECT_NEAR(rows[0].pct_cublas, 100 * rows[0].tflops / 700, 1e-9);
  rows[0].direction = "bwd";
  compute_rates(&rows, Ceilings{500, 700});
  EXPECT_NEAR(rows[0].tflops, 2.5 * flops / 2e-3 / 1e12, 1e-9);
  EXPECT_EQ(rows[0].gbps, 0);  // K/V bandwidth is a forward figure
}

TEST(Report, KvBandwidthOfDecodeRows) {
  ResultRow r = row("08_split_kv", 0.1);
  r.shape.batch = 4;
  r.shape.heads = 32;
  r.shape.heads_kv = 8;
  r.shape.seqlen_q = 1;
  r.shape.seqlen_k = 32768;
  std::vector<ResultRow> rows = {r};
  compute_rates(&rows, Ceilings{641, 710, 4000});
  const double bytes = kv_bytes(4, 8, 32768, 128);  // 537 MB in 0.1 ms
  EXPECT_NEAR(rows[0].gbps, bytes / 1e-4 / 1e9, 1e-6);
  EXPECT_NEAR(rows[0].pct_copy, 100 * rows[0].gbps / 4000, 1e-9);
  std::ostringstream os;
  print_table(os, GpuInfo{"NVIDIA H200", 132, 9, 0, "580", "13.0"}, Ceilings{641, 710, 4000}, rows);
  EXPECT_NE(os.str().find("copy 4000 GB/s"), std::string::npos) << os.str();
  EXPECT_NE(os.str().find(" 5369 "), std::string::npos) << os.str();  // GB/s column
  std::ostringstream js;
  write_json(js, GpuInfo{}, Ceilings{641, 710, 4000}, RunInfo{}, rows);
  EXPECT_NE(js.str().find("\"copy_gbps\": 4000"), std::string::npos);
  EXPECT_NE(js.str().find("\"gbps\": 5368.71"), std::string::npos) << js.str();
}

TEST(Report, SpeedupsFollowStepOrderPerProblem) {
  std::vector<ResultRow> rows = {row("03", 2.0), row("01", 8.0), row("02", 4.0),
                                 row("01", 5.0, true), row("03", 1.0, true)};
  rows.push_back(row("02", 1.0));
  rows.back().error = "unsupported";  // failed rows neither get nor give a speed-up
  compute_speedups(&rows, {"01", "02", "03"});
  EXPECT_EQ(rows[1].speedup_prev, 0);  // 01 has no predecessor
  EXPECT_EQ(rows[1].speedup_first, 0);
  EXPECT_DOUBLE_EQ(rows[2].speedup_prev, 2.0);   // 02: 8 / 4
  EXPECT_DOUBLE_EQ(rows[0].speedup_prev, 2.0);   // 03 over 02: 4 / 2
  EXPECT_DOUBLE_EQ(rows[0].speedup_first, 4.0);  // 03 over 01: 8 / 2
  EXPECT_DOUBLE_EQ(rows[4].speedup_prev, 5.0);   // causal: 02 missing, so over 01
  EXPECT_EQ(rows[5].speedup_prev, 0);
}

TEST(Report, TableHasGpuCeilingsAndRows) {
  std::vector<ResultRow> rows = {row("01_naive", 4.0), row("02_tiled_fa1", 2.0)};
  rows.push_back(row("05_split_q", 1.0));
  rows.back().error = "head_dim 96 is not supported";
  compute_rates(&rows, Ceilings{641, 710});
  compute_speedups(&rows, {"01_naive", "02_tiled_fa1", "05_split_q"});
  std::ostringstream os;
  print_table(os, GpuInfo{"NVIDIA H200", 132, 9, 0, "580", "13.0"}, Ceilings{641, 710}, rows);
  const std::string t = os.str();
  EXPECT_NE(t.find("NVIDIA H200"), std::string::npos);
  EXPECT_NE(t.find("641.0"), std::string::npos);
  EXPECT_NE(t.find("02_tiled_fa1"), std::string::npos);
  EXPECT_NE(t.find("2.00x"), std::string::npos);
  EXPECT_NE(t.find("error: head_dim 96"), std::string::npos);
  EXPECT_NE(t.find("ok max|err|"), std::string::npos);
}

TEST(Report, CsvHasHeaderAndOneLinePerRow) {
  std::vector<ResultRow> rows = {row("01_naive", 4.0), row("x,y", 1.0)};
  rows[1].error = "say \"hi\"";
  std::ostringstream os;
  write_csv(os, rows);
  std::istringstream is(os.str());
  std::string header, line1, line2, extra;
  std::getline(is, header);
  std::getline(is, line1);
  std::getline(is, line2);
  EXPECT_FALSE(std::getline(is, extra));
  EXPECT_EQ(header.rfind("step,direction,dtype,batch", 0), 0u);
  EXPECT_EQ(line1.rfind("01_naive,fwd,fp16,1,16,16,4096,4096,128,", 0), 0u);
  EXPECT_EQ(line2.rfind("\"x,y\",fwd", 0), 0u);
  EXPECT_NE(line2.find("\"say \"\"hi\"\"\""), std::string::npos);
}

TEST(Report, JsonIsWellFormedAndComplete) {
  std::vector<ResultRow> rows = {row("01_naive", 4.0)};
  rows[0].max_abs = std::numeric_limits<double>::infinity();  // JSON has no inf: null
  std::ostringstream os;
  write_json(os, GpuInfo{"GPU \"x\"", 1, 8, 0, "d", "r"}, Ceilings{1, 2},
             RunInfo{"abc123", "2026-11-29T00:00:00Z", "bench --x"}, rows);
  const std::string j = os.str();
  EXPECT_NE(j.find("\"name\": \"GPU \\\"x\\\"\""), std::string::npos);
  EXPECT_NE(j.find("\"commit\": \"abc123\""), std::string::npos);
  EXPECT_NE(j.find("\"max_abs\": null"), std::string::npos);
  EXPECT_NE(j.find("\"median_ms\": 4"), std::string::npos);
  int depth = 0;
  for (char c : j) {
    if (c == '{' || c == '[') ++depth;
    if (c == '}' || c == ']') --depth;
    ASSERT_GE(depth, 0);
  }
  EXPECT_EQ(depth, 0);
}

TEST(Report, TimingOfSortsAndTakesTheMedian) {
  const Timing t = timing_of({3.0, 1.0, 2.0, 10.0});
  EXPECT_EQ(t.samples_ms, (std::vector<double>{1.0, 2.0, 3.0, 10.0}));
  EXPECT_EQ(t.repeats, 4);
  EXPECT_DOUBLE_EQ(t.median_ms, 2.5);
  EXPECT_DOUBLE_EQ(t.min_ms, 1.0);
  EXPECT_DOUBLE_EQ(t.max_ms, 10.0);
  EXPECT_TRUE(t.round_median_ms.empty());
  EXPECT_EQ(timing_of({}).repeats, 0);
}

TEST(Report, WarmupBatchesAreAboutFiveMilliseconds) {
  // time_step() queues its warm-up in batches of about kWarmupBatchMs, waited for after each:
  // one run after another, each waited for, warmed a 0.2 ms kernel at a lower power than the
  // back-to-back timed runs (docs/results/README.md, twenty-sixth session).
  EXPECT_EQ(warmup_batch(0.2), 25);
  EXPECT_EQ(warmup_batch(0.18), 28);
  EXPECT_EQ(warmup_batch(5.0), 1);
  EXPECT_EQ(warmup_batch(60.0), 1);
  EXPECT_EQ(warmup_batch(0.0), kWarmupMaxBatch);
  EXPECT_EQ(warmup_batch(1e-6), kWarmupMaxBatch);
  EXPECT_EQ(warmup_batch(std::numeric_limits<double>::quiet_NaN()), kWarmupMaxBatch);
}

TEST(Report, PoolRoundsTakesTheMedianOfEveryRun) {
  // Round 1 ran cooler (faster) than round 2: the pooled median lies between the two.
  const Timing pooled = pool_rounds({timing_of({1.0, 1.1, 1.2}), timing_of({1.3, 1.4, 1.5})});
  EXPECT_EQ(pooled.repeats, 6);
  EXPECT_DOUBLE_EQ(pooled.median_ms, 0.5 * (1.2 + 1.3));
  EXPECT_DOUBLE_EQ(pooled.min_ms, 1.0);
  EXPECT_DOUBLE_EQ(pooled.max_ms, 1.5);
  EXPECT_EQ(pooled.round_median_ms, (std::vector<double>{1.1, 1.4}));
  EXPECT_EQ(pool_rounds({}).repeats, 0);

  std::vector<ResultRow> rows = {row("a", 1.0), row("b", 1.0)};
  rows[1].timing = pooled;
  std::ostringstream os;
  write_json(os, GpuInfo{"G", 1, 8, 0, "d", "r"}, Ceilings{1, 2}, RunInfo{}, rows);
  const std::string j = os.str();
  EXPECT_EQ(j.find("\"round_ms\""), j.rfind("\"round_ms\""));  // only the pooled row has it
  EXPECT_NE(j.find("\"round_ms\": [1.1, 1.4]"), std::string::npos);
  EXPECT_NE(j.find("\"repeats\": 6"), std::string::npos);
}

TEST(Report, FileByExtension) {
  const std::vector<ResultRow> rows = {row("01_naive", 4.0)};
  std::string error;
  const std::string csv = testing::TempDir() + "fa_report_test.csv";
  ASSERT_TRUE(write_report_file(csv, GpuInfo{}, Ceilings{}, RunInfo{}, rows, &error)) << error;
  std::ifstream f(csv);
  std::string first;
  std::getline(f, first);
  EXPECT_EQ(first.rfind("step,", 0), 0u);
  std::remove(csv.c_str());
  EXPECT_FALSE(write_report_file("out.txt", GpuInfo{}, Ceilings{}, RunInfo{}, rows, &error));
  EXPECT_EQ(error, "output file 'out.txt' must end in .csv or .json");
  EXPECT_FALSE(
      write_report_file("/nonexistent/dir/x.json", GpuInfo{}, Ceilings{}, RunInfo{}, rows, &error));
  EXPECT_NE(error.find("cannot write"), std::string::npos);
}

TEST(Report, RunInfoNamesTheSharedMemoryLimit) {
  char arg0[] = "bench", arg1[] = "--seqlens", arg2[] = "4096";
  char* argv[] = {arg0, arg1, arg2};
  unsetenv("FA_SMEM_LIMIT");
  unsetenv("FA_NUM_SPLITS");
  unsetenv("FA_BWD_TAIL_SPLIT");
  EXPECT_EQ(run_info(3, argv).command, "bench --seqlens 4096");
  setenv("FA_SMEM_LIMIT", "101376", 1);
  EXPECT_EQ(run_info(3, argv).command, "FA_SMEM_LIMIT=101376 bench --seqlens 4096");
  setenv("FA_NUM_SPLITS", "4", 1);  // 08_split_kv's split of the keys
  EXPECT_EQ(run_info(3, argv).command, "FA_SMEM_LIMIT=101376 FA_NUM_SPLITS=4 bench --seqlens 4096");
  setenv("FA_BWD_TAIL_SPLIT", "0", 1);  // 07_backward's split of the last wave
  EXPECT_EQ(run_info(3, argv).command,
            "FA_SMEM_LIMIT=101376 FA_NUM_SPLITS=4 FA_BWD_TAIL_SPLIT=0 bench --seqlens 4096");
  unsetenv("FA_SMEM_LIMIT");
  unsetenv("FA_NUM_SPLITS");
  unsetenv("FA_BWD_TAIL_SPLIT");
}

}  // namespace
}  // namespace fa
