/// \file test_conformance.cpp
/// \brief The GPU conformance matrix: every registered step x dtype x head dim x causal x
/// shapes (odd and even lengths, seqlen_q != seqlen_k, GQA, MQA, decoding), forward and, where
/// the step has one, backward in both modes, all rows checked against the fp64 oracle.
/// Plus named edge cases and self-tests that prove a wrong output would fail.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "fa/harness.h"
#include "fa/workspace.h"
#include "gpu_test_util.h"

namespace fa {
namespace {

/// Sizes of one conformance problem (dtype, head dim and mask vary around it).
struct Dims {
  int batch, heads, heads_kv, seqlen_q, seqlen_k;
  const char* label;
};

const Dims kDims[] = {
    {2, 4, 4, 128, 128, "even"},        // block multiples
    {1, 3, 1, 257, 257, "odd_mqa"},     // one past a block, MQA
    {1, 4, 2, 100, 300, "q_lt_k_gqa"},  // Nq < Nk: causal diagonal is offset
    {2, 2, 2, 300, 77, "q_gt_k"},       // Nq > Nk: under causal, rows that see no key
    {1, 2, 1, 1, 513, "decode"},        // one query row
};

struct Case {
  std::string step;
  fa_dtype dtype;
  int head_dim;
  bool causal;
  Dims dims;
  bool deterministic;  // backward only
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  std::string name = c.step + "_" + dtype_name(c.dtype) + "_d" + std::to_string(c.head_dim) +
                     (c.causal ? "_causal_" : "_full_") + c.dims.label;
  if (c.deterministic) name += "_det";
  return name;
}

std::vector<Case> make_cases(bool backward) {
  std::vector<Case> cases;
  for (const std::string& step : registered_steps()) {
    if (backward && fa_step_has_backward(step.c_str()) != 1) continue;
    for (fa_dtype dt : {FA_FP16, FA_BF16})
      for (int d : {64, 128})
        for (bool causal : {false, true})
          for (const Dims& dims : kDims)
            for (bool det : backward ? std::vector<bool>{false, true} : std::vector<bool>{false})
              cases.push_back({step, dt, d, causal, dims, det});
  }
  return cases;
}

ProblemShape shape_of(const Case& c) {
  return make_shape(c.dims.batch, c.dims.heads, c.dims.heads_kv, c.dims.seqlen_q, c.dims.seqlen_k,
                    c.head_dim, c.causal, c.dtype);
}

class ForwardConformance : public testing::TestWithParam<Case> {};

TEST_P(ForwardConformance, MatchesOracleOnAllRows) {
  FA_REQUIRE_GPU();
  const Case& c = GetParam();
  ASSERT_EQ(fa_step_supports_head_dim(c.step.c_str(), c.head_dim), 1)
      << "every step must support head dims 64 and 128";
  const uint64_t seed = test_seed(case_name(testing::TestParamInfo<Case>(c, 0)));
  const HostProblem p = make_problem(shape_of(c), InputSpec{seed});
  DeviceProblem dp(p, Layout::kContiguous, false);
  const CheckResult r = check_forward(c.step, dp, p, all_q_rows(p.shape));
  EXPECT_TRUE(r.ok) << p.shape.describe() << " seed " << seed << ": " << r.summary();
}

INSTANTIATE_TEST_SUITE_P(Steps, ForwardConformance, testing::ValuesIn(make_cases(false)),
                         case_name);

class BackwardConformance : public testing::TestWithParam<Case> {};
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(BackwardConformance);

TEST_P(BackwardConformance, MatchesOracleOnAllRows) {
  FA_REQUIRE_GPU();
  const Case& c = GetParam();
  const uint64_t seed = test_seed(case_name(testing::TestParamInfo<Case>(c, 0)));
  const HostProblem p = make_problem(shape_of(c), InputSpec{seed});
  DeviceProblem dp(p, Layout::kContiguous, true);
  const CheckResult r =
      check_backward(c.step, dp, p, all_q_rows(p.shape), all_kv_rows(p.shape), c.deterministic);
  EXPECT_TRUE(r.ok) << p.shape.describe() << " seed " << seed << ": " << r.summary();
}

INSTANTIATE_TEST_SUITE_P(Steps, BackwardConformance, testing::ValuesIn(make_cases(true)),
                         case_name);

// ---------------------------------------------------------------------------------------
// Named edge cases, for every step (forward; backward too where the step has one).

class EdgeCases : public testing::TestWithParam<std::string> {
 protected:
  /// Checks forward (and backward if the step has one) on all rows of `s` with `spec`.
  void expect_matches(ProblemShape s, InputSpec spec, Layout layout = Layout::kContiguous) {
    const std::string& step = GetParam();
    spec.seed = test_seed(step + testing::UnitTest::GetInstance()->current_test_info()->name());
    const HostProblem p = make_problem(s, spec);
    const bool bwd = fa_step_has_backward(step.c_str()) == 1;
    DeviceProblem dp(p, layout, bwd);
    const CheckResult f = check_forward(step, dp, p, all_q_rows(s));
    EXPECT_TRUE(f.ok) << "forward " << s.describe() << " seed " << spec.seed << ": " << f.summary();
    if (bwd) {
      const CheckResult b = check_backward(step, dp, p, all_q_rows(s), all_kv_rows(s), false);
      EXPECT_TRUE(b.ok) << "backward " << s.describe() << " seed " << spec.seed << ": "
                        << b.summary();
    }
  }
  /// One batch, two heads: the edge is in the sequence lengths.
  static ProblemShape base(int nq, int nk, int d = 64) { return make_shape(1, 2, 2, nq, nk, d); }
};

TEST_P(EdgeCases, SeqlenQOneDecoding) {
  FA_REQUIRE_GPU();
  ProblemShape s = base(1, 1000, 128);
  expect_matches(s, {});
  s.causal = true;  // one query row at the bottom-right: sees every key
  expect_matches(s, {});
}

TEST_P(EdgeCases, SeqlenKOne) {
  FA_REQUIRE_GPU();
  ProblemShape s = base(65, 1);
  expect_matches(s, {});  // O = V_0 in every row, L = S_i0
  s.causal = true;        // only the last row sees the key
  expect_matches(s, {});
}

TEST_P(EdgeCases, CausalRowsThatSeeNoKey) {
  FA_REQUIRE_GPU();
  ProblemShape s = base(200, 70);
  s.causal = true;  // rows 0..129 see no key: O = 0, L = +inf
  expect_matches(s, {});
}

TEST_P(EdgeCases, MultiQueryOneKvHead) {
  FA_REQUIRE_GPU();
  expect_matches(make_shape(1, 8, 1, 129, 191, 128, true), {});
}

TEST_P(EdgeCases, LargeMagnitudeInputs) {
  FA_REQUIRE_GPU();
  ProblemShape s = base(130, 250);
  InputSpec spec;
  spec.magnitude = 50.f;  // scores in the thousands: exp must not overflow
  expect_matches(s, spec);
  s.causal = true;
  s.dtype = FA_BF16;
  expect_matches(s, spec);
}

TEST_P(EdgeCases, CustomScale) {
  FA_REQUIRE_GPU();
  ProblemShape s = base(96, 160);
  s.scale = 0.37f;
  expect_matches(s, {});
}

TEST_P(EdgeCases, NonContiguousStrides) {
  FA_REQUIRE_GPU();
  ProblemShape s = make_shape(2, 4, 2, 77, 140, 128);
  expect_matches(s, {}, Layout::kPadded);
  s.causal = true;
  expect_matches(s, {}, Layout::kHeadMajor);
}

/// Two keys with the same, largest score, the first and the last of 32K, every other score far
/// below: row 0's O is exactly the mean of their V rows (1.5 and -0.5: 0.5). The running max
/// of row 0 never changes after its first key, so every later rescale factor
/// \f$e^{c (m - m)}\f$ must be exactly 1. Computed as \f$2^{m c' - m c'}\f$ with one product
/// rounded and the other kept exact by an FMA, it is \f$2^{r}\f$ with r the rounding of
/// \f$m c'\f$ (\f$c' = c \log_2 e\f$), and the first key's weight drifts by r once per K/V
/// block: 256 blocks of 128 keys turn an \f$|r|\f$ near its largest (about \f$2^{-9}\f$ here)
/// into an error of many bounds. The score is chosen so that r is large. Row 1's max grows in every
/// block (a ramp in column 0 of K), so that no step may skip the rescale for its warp. Forward
/// only.
TEST_P(EdgeCases, TiedKeysFarApart) {
  FA_REQUIRE_GPU();
  const std::string& step = GetParam();
  const int nk = 32768, d = 64;
  const ProblemShape s = make_shape(1, 1, 1, 2, nk, d);
  const float c = static_cast<float>(s.effective_scale() * 1.4426950408889634);  // the kernels'
  float v = 0.f;  // row 0's tied score is (d - 2) v^2: the v in [40, 60] rounded worst in m c'
  double worst = -1.0;
  for (int x = 40; x <= 60; ++x) {
    const double m = (d - 2.0) * x * x;
    const double r = std::fabs(m * c - static_cast<double>(static_cast<float>(m) * c));
    if (r > worst) {
      worst = r;
      v = static_cast<float>(x);
    }
  }
  const uint64_t seed = test_seed(step + "/tied_keys_far_apart");
  HostProblem p = make_problem(s, InputSpec{seed});
  for (int col = 0; col < d; ++col) {
    p.q[p.q_index(0, 0, 0, col)] = v;
    p.q[p.q_index(0, 1, 0, col)] = col == 0 ? 1.f : 0.f;
    for (int key : {0, nk - 1}) {
      p.k[p.kv_index(0, key, 0, col)] = col == 0 ? -v : v;
      p.v[p.kv_index(0, key, 0, col)] = key == 0 ? 1.5f : -0.5f;
    }
  }
  for (int key = 1; key < nk - 1; ++key)  // row 1: scores rising by 2^-7 per 128 keys
    p.k[p.kv_index(0, key, 0, 0)] = round_to(FA_FP16, -1.f + 2.f * key / nk);
  DeviceProblem dp(p, Layout::kContiguous, false);
  const CheckResult f = check_forward(step, dp, p, all_q_rows(s));
  EXPECT_TRUE(f.ok) << s.describe() << " v " << v << " seed " << seed << ": " << f.summary();
}

INSTANTIATE_TEST_SUITE_P(Steps, EdgeCases, testing::ValuesIn(registered_steps()),
                         [](const testing::TestParamInfo<std::string>& i) { return i.param; });

// ---------------------------------------------------------------------------------------
// Self-tests of the check itself: a wrong output must fail it.

TEST(HarnessSelfTest, UnwrittenOrPerturbedOutputFailsTheCheck) {
  FA_REQUIRE_GPU();
  const std::string step = registered_steps().front();
  const ProblemShape s = make_shape(1, 2, 2, 64, 64, 64);
  const HostProblem p = make_problem(s, InputSpec{11});
  DeviceProblem dp(p, Layout::kContiguous, false);
  const std::vector<RowId> rows = all_q_rows(s);
  ASSERT_TRUE(check_forward(step, dp, p, rows).ok);

  std::vector<float> all_o, lse;
  dp.download_forward(&all_o, &lse);
  std::vector<float> o;  // in the order of `rows`, as the reference
  for (const RowId& r : rows)
    for (int c = 0; c < s.head_dim; ++c) o.push_back(all_o[p.q_index(r.b, r.s, r.h, c)]);
  const ForwardRef ref = reference_forward(p, rows);
  const Tolerance tol = tolerance(s.dtype, Quantity::kOutput);
  ASSERT_TRUE(within(compare(o.data(), ref.o.data(), o.size()), tol));

  std::vector<float> bad = o;
  bad[bad.size() / 2] = std::nanf("");  // one element never written
  EXPECT_FALSE(within(compare(bad.data(), ref.o.data(), bad.size()), tol));
  bad = o;
  bad[5] += 0.05f;  // one element off by far more than rounding
  EXPECT_FALSE(within(compare(bad.data(), ref.o.data(), bad.size()), tol));

  // The poisoning itself: after poison_outputs() the device output is all NaN.
  dp.poison_outputs();
  dp.download_forward(&all_o, &lse);
  for (float x : all_o) ASSERT_TRUE(std::isnan(x));
  for (float x : lse) ASSERT_TRUE(std::isnan(x));
}

// The GPU-made inputs (DeviceProblem(shape, spec, ...), used by the runners, the bench and the
// large tests) are make_problem()'s, bit for bit, in every layout and dtype; and download_group()
// hands the oracle exactly those values.
TEST(HarnessSelfTest, InputsMadeOnTheGpuAreTheHostsBitForBit) {
  FA_REQUIRE_GPU();
  for (fa_dtype dtype : {FA_FP16, FA_BF16})
    for (Layout layout : {Layout::kContiguous, Layout::kPadded, Layout::kHeadMajor})
      for (float magnitude : {1.f, 50.f}) {
        const ProblemShape s = make_shape(3, 6, 2, 37, 70, 64, true, dtype);
        InputSpec spec;
        spec.seed = 12345;
        spec.magnitude = magnitude;
        const HostProblem host = make_problem(s, spec);
        DeviceProblem dp(s, spec, layout, true);
        const int group = s.heads / s.heads_kv;
        size_t differ = 0, compared = 0;
        for (int b = 0; b < s.batch; ++b)
          for (int kv = 0; kv < s.heads_kv; ++kv) {
            const HostProblem g = dp.download_group(b, kv);
            for (int h = 0; h < group; ++h)
              for (int i = 0; i < s.seqlen_q; ++i)
                for (int c = 0; c < s.head_dim; ++c) {
                  const size_t at = host.q_index(b, i, kv * group + h, c),
                               in = g.q_index(0, i, h, c);
                  differ += host.q[at] != g.q[in];
                  differ += host.d_o[at] != g.d_o[in];
                  compared += 2;
                }
            for (int j = 0; j < s.seqlen_k; ++j)
              for (int c = 0; c < s.head_dim; ++c) {
                differ += host.k[host.kv_index(b, j, kv, c)] != g.k[g.kv_index(0, j, 0, c)];
                differ += host.v[host.kv_index(b, j, kv, c)] != g.v[g.kv_index(0, j, 0, c)];
                compared += 2;
              }
          }
        EXPECT_EQ(compared, 2 * host.q.size() + 2 * host.k.size());
        EXPECT_EQ(differ, 0u) << dtype_name(dtype) << " layout " << static_cast<int>(layout)
                              << " magnitude " << magnitude;
      }
}

TEST(HarnessSelfTest, RejectedProblemIsReportedNotRun) {
  FA_REQUIRE_GPU();
  const ProblemShape s = make_shape(1, 2, 2, 16, 16, 64);
  const HostProblem p = make_problem(s, InputSpec{3});
  DeviceProblem dp(p, Layout::kContiguous, false);
  const CheckResult r = check_forward("no_such_step", dp, p, all_q_rows(s));
  EXPECT_FALSE(r.ran);
  EXPECT_NE(r.error.find("unknown step"), std::string::npos) << r.error;
}

// The scratch that 01, 02, 09 and 10 keep between calls (fa/workspace.h): one buffer per
// stream, reused by the next call on it; on cudaStreamPerThread, which is a different stream
// in every host thread (their work may run at the same time), one per thread.
TEST(HarnessSelfTest, WorkspaceIsOnePerStreamAndThread) {
  FA_REQUIRE_GPU();
  void *first = nullptr, *again = nullptr, *other_thread = nullptr;
  ASSERT_EQ(workspace(4096, cudaStreamPerThread, &first), cudaSuccess);
  ASSERT_EQ(workspace(1024, cudaStreamPerThread, &again), cudaSuccess);
  EXPECT_EQ(first, again) << "the next call on the same stream reuses the buffer";
  int device = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  cudaError_t other = cudaErrorUnknown;
  std::thread([&] {
    other = cudaSetDevice(device);
    if (other == cudaSuccess) other = workspace(4096, cudaStreamPerThread, &other_thread);
  }).join();
  ASSERT_EQ(other, cudaSuccess) << cudaGetErrorString(other);
  EXPECT_NE(first, other_thread) << "two threads' per-thread streams shared one buffer";
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  void* own = nullptr;
  EXPECT_EQ(workspace(4096, stream, &own), cudaSuccess);
  EXPECT_NE(own, first) << "two streams shared one buffer";
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

}  // namespace
}  // namespace fa
