/// \file test_large.cpp
/// \brief Problems with more than \f$2^{31}\f$ elements per tensor, so that every 64-bit offset
/// of the kernels is exercised: opt-in (ctest label `large`, `ctest --preset large`), because
/// they take tens of GiB of device memory and a minute in all.
///
/// The inputs are made on the GPU (DeviceProblem(shape, spec, ...), seconds for tens of
/// GiB) and the oracle reads back only what it needs: the first and the last key/value head
/// group, the last one at the highest addresses (check_forward_sampled(),
/// check_backward_sampled()).
///
/// The tests are named `Large/LargeProblems.DISABLED_Forward/<step>` and `..._Backward/<step>`:
/// gtest skips DISABLED_ tests unless asked (`--gtest_also_run_disabled_tests`), so the
/// per-step conformance runs never start them. common/tests/CMakeLists.txt registers the
/// steps of FA_LARGE_TESTS with ctest.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "fa/harness.h"
#include "gpu_test_util.h"

namespace fa {
namespace {

/// Query rows checked per key/value head group (forward), query and key rows (backward).
constexpr int kCheckedRows = 32;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double elements(int batch, int seqlen, int heads, int d) {
  return static_cast<double>(batch) * seqlen * heads * d;
}

/// Makes the problem on the GPU, runs `check`, and reports the times of both.
template <typename Check>
void run_large(const std::string& step, const ProblemShape& s, Layout layout, bool backward,
               Check check) {
  ASSERT_GT(elements(s.batch, s.seqlen_q, s.heads, s.head_dim), 2147483648.0)
      << "a large problem needs a tensor above 2^31 elements";
  InputSpec spec;
  spec.seed = test_seed("large/" + step + "/" + s.describe());
  const auto t0 = std::chrono::steady_clock::now();
  DeviceProblem dp(s, spec, layout, backward);
  const double setup = seconds_since(t0);
  const auto t1 = std::chrono::steady_clock::now();
  const CheckResult r = check(dp, spec.seed);
  std::printf("[ large    ] %s %s %s: set-up %.1f s, run and check %.1f s: %s\n", step.c_str(),
              backward ? "bwd" : "fwd", s.describe().c_str(), setup, seconds_since(t1),
              r.summary().c_str());
  std::fflush(stdout);
  EXPECT_TRUE(r.ok) << step << " " << s.describe() << " seed " << spec.seed << ": " << r.summary();
  EXPECT_LT(setup, 60.0) << "making the inputs on the GPU should take seconds";
}

class LargeProblems : public testing::TestWithParam<std::string> {};

// The example: Q, K, V and O of 2.7e9 elements each (21 GB, 20 GiB, in all), causal.
TEST_P(LargeProblems, DISABLED_Forward) {
  FA_REQUIRE_GPU();
  const std::string& step = GetParam();
  const ProblemShape s = make_shape(5, 32, 32, 131072, 131072, 128, true);
  run_large(step, s, Layout::kContiguous, false, [&](DeviceProblem& dp, uint64_t seed) {
    return check_forward_sampled(step, dp, kCheckedRows, seed);
  });
}

// Eight tensors of 2.15e9 elements each (34 GB, 32 GiB), moderate lengths so that the FLOPs stay
// small: d = 128 causal in BSHD, and d = 64 without a mask in BHSD (head-major).
TEST_P(LargeProblems, DISABLED_Backward) {
  FA_REQUIRE_GPU();
  const std::string& step = GetParam();
  if (fa_step_has_backward(step.c_str()) != 1) GTEST_SKIP() << step << " has no backward pass";
  const struct {
    ProblemShape shape;
    Layout layout;
  } problems[] = {{make_shape(256, 32, 32, 2053, 2053, 128, true), Layout::kContiguous},
                  {make_shape(512, 32, 32, 2053, 2053, 64, false), Layout::kHeadMajor}};
  for (const auto& p : problems)
    run_large(step, p.shape, p.layout, true, [&](DeviceProblem& dp, uint64_t seed) {
      return check_backward_sampled(step, dp, kCheckedRows, seed, false);
    });
}

INSTANTIATE_TEST_SUITE_P(Large, LargeProblems, testing::ValuesIn(registered_steps()),
                         [](const testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace fa
