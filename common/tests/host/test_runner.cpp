/// \file test_runner.cpp
/// \brief The runner programs as a user meets them: bad flags and rejected problems print one
/// line and exit 2, before anything touches a GPU.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstdio>
#include <string>

#include <cuda_runtime.h>

#include "fa/api.h"

namespace {

struct Outcome {
  int exit_code;
  std::string output;
};

/// Runs a built program with `args` (and `env`, "NAME=value ..." before it), stdout and stderr
/// together.
Outcome run(const std::string& program, const std::string& args, const std::string& env = "") {
  const std::string cmd = env + (env.empty() ? "" : " ") + std::string(FA_BIN_DIR) + "/" + program +
                          " " + args + " 2>&1";
  Outcome out{-1, ""};
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) return out;
  char buf[512];
  while (fgets(buf, sizeof buf, pipe)) out.output += buf;
  const int status = pclose(pipe);
  out.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

void expect_rejected(const std::string& args, const std::string& message,
                     const std::string& env = "", const std::string& program = "01_naive") {
  const Outcome o = run(program, args, env);
  EXPECT_EQ(o.exit_code, 2) << env << " " << args << "\n" << o.output;
  EXPECT_NE(o.output.find(message), std::string::npos) << env << " " << args << "\n" << o.output;
  EXPECT_EQ(o.output.find('\n'), o.output.size() - 1) << "one line expected:\n" << o.output;
}

TEST(Runner, HelpListsFlagsAndExitsZero) {
  const Outcome o = run("01_naive", "--help");
  EXPECT_EQ(o.exit_code, 0);
  EXPECT_NE(o.output.find("standard attention"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("--seqlen-q"), std::string::npos);
}

TEST(Runner, BadFlags) {
  expect_rejected("--frobnicate", "unknown flag '--frobnicate'");
  expect_rejected("--dtype fp8", "--dtype must be fp16 or bf16");
  expect_rejected("--heads x", "--heads expects an integer");
}

TEST(Runner, RejectedProblems) {
  expect_rejected("--seqlen 0", "seqlen_q must be >= 1 (got 0)");
  expect_rejected("--batch -2", "batch must be >= 1 (got -2)");
  expect_rejected("--heads 6 --heads-kv 4", "heads (6) must be a multiple of heads_kv (4)");
  expect_rejected("--head-dim 12", "head_dim 12 is not supported by step 01_naive");
  expect_rejected("--scale -1", "scale must be finite and > 0");
}

// Issue 17's list: each bad value is one line and exit 2, found before any GPU work (these
// run on machines without a GPU, so nothing here can depend on one).
TEST(Runner, EveryBadValueIsOneLineAndExitTwo) {
  expect_rejected("--scale 0", "--scale must be > 0 (got '0', which is 0 in fp32)");
  expect_rejected("--scale -0", "--scale must be > 0 (got '-0'");
  expect_rejected("--scale 1e-50", "--scale must be > 0 (got '1e-50', which is 0 in fp32)");
  expect_rejected("--scale 3e38", "scale must be finite and > 0, from 1.18e-38 to 2.36e+38");
  expect_rejected("--scale 1e-40", "scale must be finite and > 0");  // subnormal in fp32
  expect_rejected("--scale nan", "scale must be finite and > 0");
  expect_rejected("--heads-kv 0", "heads_kv must be >= 1 (got 0)");
  expect_rejected("--magnitude nan", "--magnitude must be a finite number from 0 to 65504");
  expect_rejected("--magnitude -1", "--magnitude must be a finite number");
  expect_rejected("--magnitude 1e5", "(the largest fp16 value)");
  expect_rejected("--out /nonexistent/r.json",
                  "--out /nonexistent/r.json: the folder "
                  "/nonexistent does not exist");
  expect_rejected("--out results.txt", "must end in .csv or .json");
  expect_rejected("--deterministic", "--deterministic applies to the backward pass");
  expect_rejected("--seqlen 2147483647",
                  "seqlen_q (2147483647) and seqlen_k (2147483647) must be "
                  "<= 1073741824");
  expect_rejected("--seqlen 1024",
                  "FA_SMEM_LIMIT=99999999999999999999: expected a positive "
                  "number of bytes",
                  "FA_SMEM_LIMIT=99999999999999999999");
  expect_rejected("--seqlen 1024", "FA_SMEM_LIMIT=: expected", "FA_SMEM_LIMIT=");
  expect_rejected("--batch 65536", "must be <= 65535");
}

TEST(Bench, BadValuesAreOneLineAndExitTwo) {
  expect_rejected("--deterministic --direction fwd", "--deterministic applies to the backward", "",
                  "bench");
  expect_rejected("--out /nonexistent/b.csv", "the folder /nonexistent does not exist", "",
                  "bench");
  expect_rejected("--steps 99_nope", "unknown step '99_nope'", "", "bench");
  expect_rejected("", "FA_SMEM_LIMIT=12abc", "FA_SMEM_LIMIT=12abc", "bench");
}

// The GPU suite refuses to run (and so fails) on a variable it cannot read, before any test:
// FA_RANDOM_PROBLEMS=abc (and FA_DECODE_PROBLEMS=abc) used to run zero problems and pass.
TEST(GpuSuite, InvalidEnvironmentFailsBeforeAnyTest) {
  const struct {
    const char* env;
    const char* message;
  } cases[] = {
      {"FA_RANDOM_PROBLEMS=abc", "FA_RANDOM_PROBLEMS=abc: expected a whole number from 1 to"},
      {"FA_RANDOM_PROBLEMS=0", "FA_RANDOM_PROBLEMS=0: expected a whole number from 1 to"},
      {"FA_RANDOM_PROBLEMS=-3", "FA_RANDOM_PROBLEMS=-3"},
      {"FA_RANDOM_PROBLEMS=12x", "FA_RANDOM_PROBLEMS=12x"},
      {"FA_RANDOM_PROBLEMS=99999999999999999999", "FA_RANDOM_PROBLEMS=99999999999999999999"},
      {"FA_RANDOM_PROBLEMS=", "FA_RANDOM_PROBLEMS=: expected"},
      {"FA_TEST_SEED=-1", "FA_TEST_SEED=-1: expected a whole number"},
      {"FA_TEST_SEED=99999999999999999999999", "FA_TEST_SEED=99999999999999999999999"},
      {"FA_RANDOM_SEED=seed", "FA_RANDOM_SEED=seed"},
      {"FA_RANDOM_MAX_SEQLEN=0", "FA_RANDOM_MAX_SEQLEN=0"},
      {"FA_RANDOM_MAX_SEQLEN=4k", "FA_RANDOM_MAX_SEQLEN=4k"},
      {"FA_RANDOM_SECONDS=nan", "FA_RANDOM_SECONDS=nan: expected a number > 0"},
      {"FA_RANDOM_SECONDS=-5", "FA_RANDOM_SECONDS=-5"},
      {"FA_SMEM_LIMIT=1e5", "FA_SMEM_LIMIT=1e5: expected a positive number of bytes"},
      {"FA_DECODE_PROBLEMS=abc", "FA_DECODE_PROBLEMS=abc: expected a whole number from 1 to"},
      {"FA_DECODE_PROBLEMS=0", "FA_DECODE_PROBLEMS=0"},
      {"FA_DECODE_MAX_SEQLEN_K=64k", "FA_DECODE_MAX_SEQLEN_K=64k"},
      {"FA_DECODE_SEED=-7", "FA_DECODE_SEED=-7: expected a whole number"},
  };
  for (const auto& c : cases) {
    const Outcome o = run("fa_gpu_tests", "--gtest_filter=RandomGenerator.*", c.env);
    EXPECT_EQ(o.exit_code, 1) << c.env << "\n" << o.output;
    EXPECT_EQ(o.output, std::string("fa_gpu_tests: ") + o.output.substr(14)) << o.output;
    EXPECT_NE(o.output.find(c.message), std::string::npos) << c.env << "\n" << o.output;
    EXPECT_EQ(o.output.find("[ RUN"), std::string::npos) << "no test may run:\n" << o.output;
  }
  const Outcome ok = run("fa_gpu_tests", "--gtest_filter=RandomGenerator.*",
                         "FA_RANDOM_PROBLEMS=12 FA_TEST_SEED=5 FA_RANDOM_SECONDS=2.5");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
}

TEST(Runner, BackwardOnAStepWithoutOne) {
  for (int i = 0; i < fa_step_count(); ++i) {
    const std::string step = fa_step_name(i);
    if (fa_step_has_backward(step.c_str()) == 1) continue;
    const Outcome o = run(step, "--backward");
    EXPECT_EQ(o.exit_code, 2) << o.output;
    EXPECT_NE(o.output.find("has no backward pass"), std::string::npos) << o.output;
  }
}

TEST(Runner, NoGpuIsOneLineAndNonZero) {
  int count = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess && count > 0)
    GTEST_SKIP() << "a GPU is present: the GPU suite covers the run itself";
  const Outcome o = run("01_naive", "--seqlen 128");
  EXPECT_EQ(o.exit_code, 1) << o.output;
  EXPECT_NE(o.output.find("no usable CUDA GPU"), std::string::npos) << o.output;
  const Outcome b = run("bench", "--seqlens 128");
  EXPECT_EQ(b.exit_code, 1) << b.output;
  EXPECT_NE(b.output.find("no usable CUDA GPU"), std::string::npos) << b.output;
  // Not the CUDA runtime's "CUDA driver version is insufficient" when there is no driver.
  if (std::FILE* f = std::fopen("/proc/driver/nvidia/version", "r")) {
    std::fclose(f);
  } else {
    EXPECT_NE(b.output.find("no NVIDIA driver is loaded: this machine has no GPU"),
              std::string::npos)
        << b.output;
    EXPECT_EQ(b.output.find("insufficient"), std::string::npos) << b.output;
  }
}

}  // namespace
