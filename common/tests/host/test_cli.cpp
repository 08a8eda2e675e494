/// \file test_cli.cpp
/// \brief Runner and bench flags: defaults, every flag, and the errors for bad values.
#include <gtest/gtest.h>

#include "fa/cli.h"
#include "fa/flops.h"

namespace fa {
namespace {

RunnerOptions parse_ok(const std::vector<std::string>& args) {
  RunnerOptions o;
  std::string error;
  EXPECT_TRUE(parse_runner_args(args, &o, &error)) << error;
  return o;
}

std::string parse_error(const std::vector<std::string>& args) {
  RunnerOptions o;
  std::string error;
  EXPECT_FALSE(parse_runner_args(args, &o, &error));
  return error;
}

TEST(RunnerFlags, Defaults) {
  const RunnerOptions o = parse_ok({});
  EXPECT_EQ(o.shape.batch, 1);
  EXPECT_EQ(o.shape.heads, 16);
  EXPECT_EQ(o.shape.heads_kv, 16);
  EXPECT_EQ(o.shape.seqlen_q, 4096);
  EXPECT_EQ(o.shape.seqlen_k, 4096);
  EXPECT_EQ(o.shape.head_dim, 128);
  EXPECT_EQ(o.shape.dtype, FA_FP16);
  EXPECT_FALSE(o.shape.causal);
  EXPECT_TRUE(o.check);
  EXPECT_FALSE(o.backward);
  EXPECT_EQ(o.seed, 0u);
}

TEST(RunnerFlags, EveryFlag) {
  const RunnerOptions o = parse_ok({"--batch",
                                    "3",
                                    "--heads",
                                    "12",
                                    "--heads-kv=4",
                                    "--seqlen-q",
                                    "100",
                                    "--seqlen-k",
                                    "77",
                                    "--head-dim",
                                    "64",
                                    "--dtype",
                                    "bf16",
                                    "--causal",
                                    "--scale",
                                    "0.5",
                                    "--seed",
                                    "42",
                                    "--magnitude",
                                    "50",
                                    "--warmup",
                                    "0",
                                    "--repeats",
                                    "7",
                                    "--no-check",
                                    "--check-rows",
                                    "9",
                                    "--backward",
                                    "--deterministic",
                                    "--no-ceilings",
                                    "--out",
                                    "r.json"});
  EXPECT_EQ(o.shape.batch, 3);
  EXPECT_EQ(o.shape.heads, 12);
  EXPECT_EQ(o.shape.heads_kv, 4);
  EXPECT_EQ(o.shape.seqlen_q, 100);
  EXPECT_EQ(o.shape.seqlen_k, 77);
  EXPECT_EQ(o.shape.head_dim, 64);
  EXPECT_EQ(o.shape.dtype, FA_BF16);
  EXPECT_TRUE(o.shape.causal);
  EXPECT_FLOAT_EQ(o.shape.scale, 0.5f);
  EXPECT_EQ(o.seed, 42u);
  EXPECT_FLOAT_EQ(o.magnitude, 50.f);
  EXPECT_EQ(o.warmup, 0);
  EXPECT_EQ(o.repeats, 7);
  EXPECT_FALSE(o.check);
  EXPECT_EQ(o.check_rows, 9);
  EXPECT_TRUE(o.backward);
  EXPECT_TRUE(o.deterministic);
  EXPECT_FALSE(o.ceilings);
  EXPECT_EQ(o.out, "r.json");
}

TEST(RunnerFlags, SeqlenSetsBoth) {
  const RunnerOptions o = parse_ok({"--seqlen", "1000"});
  EXPECT_EQ(o.shape.seqlen_q, 1000);
  EXPECT_EQ(o.shape.seqlen_k, 1000);
}

TEST(RunnerFlags, Errors) {
  EXPECT_EQ(parse_error({"--bogus"}), "unknown flag '--bogus' (see --help)");
  EXPECT_EQ(parse_error({"--batch"}), "--batch needs a value");
  EXPECT_EQ(parse_error({"--batch", "two"}), "--batch expects an integer (got 'two')");
  EXPECT_EQ(parse_error({"--dtype", "fp8"}), "--dtype must be fp16 or bf16 (got 'fp8')");
  EXPECT_EQ(parse_error({"--repeats", "0"}), "--repeats must be >= 1 (got 0)");
  EXPECT_EQ(parse_error({"--seed", "-4"}), "--seed expects a non-negative integer (got '-4')");
  EXPECT_EQ(parse_error({"--causal=1"}), "--causal takes no value");
  EXPECT_EQ(parse_error({"--scale", "abc"}), "--scale expects a number (got 'abc')");
}

TEST(RunnerFlags, SizesAreLeftToTheApi) {
  // Range checks live in one place, the C API; the parser only parses.
  const RunnerOptions o = parse_ok({"--seqlen", "0", "--heads", "7", "--heads-kv", "2"});
  EXPECT_EQ(o.shape.seqlen_q, 0);
  EXPECT_EQ(o.shape.heads_kv, 2);
}

TEST(BenchFlags, DefaultsAreThePaperSweep) {
  BenchOptions o;
  std::string error;
  ASSERT_TRUE(parse_bench_args({}, &o, &error)) << error;
  EXPECT_EQ(o.seqlens, (std::vector<int>{512, 1024, 2048, 4096, 8192, 16384}));
  EXPECT_EQ(o.head_dims, (std::vector<int>{64, 128}));
  EXPECT_EQ(o.causal, (std::vector<int>{0, 1}));
  EXPECT_EQ(o.tokens, 16384);
  EXPECT_EQ(o.hidden, 2048);
  EXPECT_EQ(o.dtype, FA_FP16);
  EXPECT_TRUE(o.steps.empty());
  EXPECT_EQ(o.heat_ms, 2000);
}

TEST(BenchFlags, HeatMs) {
  BenchOptions o;
  std::string error;
  ASSERT_TRUE(parse_bench_args({"--heat-ms", "0"}, &o, &error)) << error;
  EXPECT_EQ(o.heat_ms, 0);
  ASSERT_TRUE(parse_bench_args({"--heat-ms=500"}, &o, &error)) << error;
  EXPECT_EQ(o.heat_ms, 500);
  EXPECT_FALSE(parse_bench_args({"--heat-ms", "-1"}, &o, &error));
  EXPECT_EQ(error, "--heat-ms must be >= 0");
  EXPECT_FALSE(parse_bench_args({"--heat-ms", "2s"}, &o, &error));
  EXPECT_NE(error.find("--heat-ms"), std::string::npos);
}

TEST(BenchFlags, Rounds) {
  BenchOptions o;
  std::string error;
  ASSERT_TRUE(parse_bench_args({}, &o, &error)) << error;
  EXPECT_EQ(o.rounds, 2);
  ASSERT_TRUE(parse_bench_args({"--rounds", "1"}, &o, &error)) << error;
  EXPECT_EQ(o.rounds, 1);
  ASSERT_TRUE(parse_bench_args({"--rounds=3"}, &o, &error)) << error;
  EXPECT_EQ(o.rounds, 3);
  EXPECT_FALSE(parse_bench_args({"--rounds", "0"}, &o, &error));
  EXPECT_NE(error.find("--rounds"), std::string::npos);
  EXPECT_FALSE(parse_bench_args({"--rounds", "two"}, &o, &error));
  EXPECT_NE(error.find("--rounds"), std::string::npos);
}

TEST(BenchFlags, ListsAndChoices) {
  BenchOptions o;
  std::string error;
  ASSERT_TRUE(parse_bench_args({"--steps", "01_naive,05_split_q", "--seqlens", "128,256",
                                "--head-dims", "64", "--causal", "on", "--direction", "fwd"},
                               &o, &error))
      << error;
  EXPECT_EQ(o.steps, (std::vector<std::string>{"01_naive", "05_split_q"}));
  EXPECT_EQ(o.seqlens, (std::vector<int>{128, 256}));
  EXPECT_EQ(o.head_dims, (std::vector<int>{64}));
  EXPECT_EQ(o.causal, (std::vector<int>{1}));
  EXPECT_EQ(o.directions, (std::vector<std::string>{"fwd"}));
  EXPECT_FALSE(parse_bench_args({"--causal", "maybe"}, &o, &error));
  EXPECT_EQ(error, "--causal must be on, off or both (got 'maybe')");
  EXPECT_FALSE(parse_bench_args({"--seqlens", "128,x"}, &o, &error));
  EXPECT_EQ(error, "--seqlens expects an integer (got 'x')");
  EXPECT_FALSE(parse_bench_args({"--seqlens", "0"}, &o, &error));
  EXPECT_EQ(error, "--seqlens values must be >= 1");
}

TEST(BenchFlags, DecodeSweep) {
  BenchOptions o;
  std::string error;
  ASSERT_TRUE(parse_bench_args({"--decode"}, &o, &error)) << error;
  EXPECT_TRUE(o.decode);
  EXPECT_EQ(o.head_dims, (std::vector<int>{128}));  // decode defaults
  EXPECT_EQ(o.causal, (std::vector<int>{0}));
  EXPECT_EQ(o.directions, (std::vector<std::string>{"fwd"}));
  const std::vector<ProblemShape> shapes = decode_shapes(o);
  // 2 heads_kv x 2 seqlen_q x 3 batches x 4 seqlen_k, minus those over 1 GiB of K and V:
  // heads_kv 8: batch 16 x 64K (4 GiB); heads_kv 32: batch 4 and 16 x 64K, 16 x 16K.
  EXPECT_EQ(shapes.size(), 2u * 2 * 3 * 4 - 2 * (1 + 3));
  for (const ProblemShape& s : shapes) {
    EXPECT_EQ(s.heads, 32);
    EXPECT_EQ(s.head_dim, 128);
    EXPECT_LE(kv_bytes(s.batch, s.heads_kv, s.seqlen_k, s.head_dim), 1024.0 * 1048576);
  }
  EXPECT_EQ(shapes.front().describe(), make_shape(1, 32, 8, 1, 1024, 128).describe());
  ASSERT_TRUE(parse_bench_args(
      {"--decode", "--seqlens-q", "1", "--seqlens-k", "4096,8192", "--batches", "2", "--heads",
       "16", "--heads-kv", "4,3", "--causal", "on", "--head-dims", "64,128"},
      &o, &error))
      << error;
  const std::vector<ProblemShape> few = decode_shapes(o);  // heads_kv 3 does not divide 16
  ASSERT_EQ(few.size(), 2u * 2);
  EXPECT_TRUE(few[0].causal);
  EXPECT_EQ(few[0].heads_kv, 4);
  EXPECT_EQ(few[3].head_dim, 128);
  EXPECT_EQ(few[3].seqlen_k, 8192);
  EXPECT_FALSE(parse_bench_args({"--decode", "--batches", "0"}, &o, &error));
}

TEST(Usage, MentionsEveryFlag) {
  const std::string r = runner_usage("01_naive");
  for (const char* flag : {"--batch", "--heads-kv", "--seqlen-q", "--dtype", "--causal", "--seed",
                           "--no-check", "--backward", "--out"})
    EXPECT_NE(r.find(flag), std::string::npos) << flag;
  const std::string b = bench_usage("bench");
  for (const char* flag : {"--steps", "--seqlens", "--head-dims", "--causal", "--out", "--decode",
                           "--seqlens-k", "--batches", "--heads-kv", "--max-kv-mib"})
    EXPECT_NE(b.find(flag), std::string::npos) << flag;
}

}  // namespace
}  // namespace fa
