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

/// Runs a built program with `args`, stdout and stderr together.
Outcome run(const std::string& program, const std::string& args) {
  const std::string cmd = std::string(FA_BIN_DIR) + "/" + program + " " + args + " 2>&1";
  Outcome out{-1, ""};
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) return out;
  char buf[512];
  while (fgets(buf, sizeof buf, pipe)) out.output += buf;
  const int status = pclose(pipe);
  out.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

void expect_rejected(const std::string& args, const std::string& message) {
  const Outcome o = run("01_naive", args);
  EXPECT_EQ(o.exit_code, 2) << args << "\n" << o.output;
  EXPECT_NE(o.output.find(message), std::string::npos) << args << "\n" << o.output;
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
}

}  // namespace
