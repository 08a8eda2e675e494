/// \file test_edge_cases.cpp
/// \brief Edge cases beyond the named ones in test_conformance.cpp, for every registered step:
/// exact values for rows that see no key, both lengths 1, the largest grids the API accepts,
/// long sequences, writes that stay inside the outputs' rows (inputs untouched, gaps of padded
/// layouts untouched), every row written on a causal grid of many pairs, and a bitwise
/// repeatable deterministic backward.
///
/// Named `Steps/SafetyEdgeCases.<case>/<step>`, so `gpu.conformance.<step>` runs them.
/// docs/conformance.md says what each property means.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "fa/harness.h"
#include "gpu_test_util.h"

namespace fa {
namespace {

constexpr uint16_t kPoisonBits = 0xffff;  // what DeviceProblem::poison_outputs() writes
constexpr uint16_t kGapBits = 0x7fff;     // what the gaps of an input tensor hold

/// The whole allocation behind a tensor of the DeviceProblem, raw 16-bit values.
std::vector<uint16_t> download_raw(const fa_tensor& t, int batch) {
  std::vector<uint16_t> raw(static_cast<size_t>(t.batch_stride) * batch);
  cuda_check(cudaMemcpy(raw.data(), t.ptr, raw.size() * 2, cudaMemcpyDeviceToHost),
             "cudaMemcpy (raw)");
  return raw;
}

/// For each element of the allocation, whether it belongs to a (b, s, h, c) of the tensor.
std::vector<char> logical_mask(const fa_tensor& t, int batch, int seqlen, int heads, int d) {
  std::vector<char> mask(static_cast<size_t>(t.batch_stride) * batch, 0);
  for (int b = 0; b < batch; ++b)
    for (int s = 0; s < seqlen; ++s)
      for (int h = 0; h < heads; ++h) {
        const size_t base = b * t.batch_stride + s * t.row_stride + h * t.head_stride;
        for (int c = 0; c < d; ++c) mask[base + c] = 1;
      }
  return mask;
}

/// Counts elements of an output's allocation outside its rows that are no longer poisoned.
size_t touched_gaps(const fa_tensor& t, int batch, int seqlen, int heads, int d) {
  const std::vector<uint16_t> raw = download_raw(t, batch);
  const std::vector<char> mask = logical_mask(t, batch, seqlen, heads, d);
  size_t touched = 0;
  for (size_t i = 0; i < raw.size(); ++i) touched += !mask[i] && raw[i] != kPoisonBits;
  return touched;
}

/// Counts elements of an input's allocation that differ from what was uploaded.
size_t changed_inputs(const fa_tensor& t, const std::vector<float>& host, fa_dtype dtype, int batch,
                      int seqlen, int heads, int d) {
  const std::vector<uint16_t> raw = download_raw(t, batch);
  std::vector<uint16_t> expected(raw.size(), kGapBits);
  size_t i = 0;
  for (int b = 0; b < batch; ++b)
    for (int s = 0; s < seqlen; ++s)
      for (int h = 0; h < heads; ++h) {
        const size_t base = b * t.batch_stride + s * t.row_stride + h * t.head_stride;
        for (int c = 0; c < d; ++c) expected[base + c] = to_bits(dtype, host[i++]);
      }
  size_t changed = 0;
  for (size_t k = 0; k < raw.size(); ++k) changed += raw[k] != expected[k];
  return changed;
}

class SafetyEdgeCases : public testing::TestWithParam<std::string> {
 protected:
  const std::string& step() const { return GetParam(); }
  bool has_backward() const { return fa_step_has_backward(step().c_str()) == 1; }
  uint64_t seed() const {
    return test_seed(step() + "/" + testing::UnitTest::GetInstance()->current_test_info()->name());
  }
  /// Forward (and backward, where the step has one) against the oracle on `q_rows`/`kv_rows`
  /// (all rows when empty).
  void expect_matches(const ProblemShape& s, Layout layout = Layout::kContiguous,
                      std::vector<RowId> q_rows = {}, std::vector<RowId> kv_rows = {}) {
    const uint64_t sd = seed();
    const HostProblem p = make_problem(s, InputSpec{sd});
    if (q_rows.empty()) q_rows = all_q_rows(s);
    if (kv_rows.empty()) kv_rows = all_kv_rows(s);
    DeviceProblem dp(p, layout, has_backward());
    const CheckResult f = check_forward(step(), dp, p, q_rows);
    EXPECT_TRUE(f.ok) << "forward " << s.describe() << " seed " << sd << ": " << f.summary();
    if (has_backward()) {
      const CheckResult b = check_backward(step(), dp, p, q_rows, kv_rows, false);
      EXPECT_TRUE(b.ok) << "backward " << s.describe() << " seed " << sd << ": " << b.summary();
    }
  }
};

TEST_P(SafetyEdgeCases, BothLengthsOne) {
  FA_REQUIRE_GPU();
  expect_matches(make_shape(2, 4, 2, 1, 1, 64, false));
  expect_matches(make_shape(2, 4, 2, 1, 1, 128, true));  // the one row sees the one key
}

// Rows that see no key: O is exactly 0, L exactly +inf, and (backward) dQ exactly 0. Whole
// blocks of such rows (Nq - Nk = 297 and 512) test the early exits of the tiled kernels.
TEST_P(SafetyEdgeCases, RowsWithoutKeysAreExactlyZeroWithInfiniteLse) {
  FA_REQUIRE_GPU();
  for (const ProblemShape& s :
       {make_shape(1, 2, 1, 300, 3, 64, true), make_shape(2, 2, 2, 513, 1, 128, true)}) {
    const uint64_t sd = seed();
    const HostProblem p = make_problem(s, InputSpec{sd});
    DeviceProblem dp(p, Layout::kContiguous, has_backward());
    const CheckResult f = check_forward(step(), dp, p, all_q_rows(s));
    EXPECT_TRUE(f.ok) << s.describe() << " seed " << sd << ": " << f.summary();
    std::vector<float> o, lse;
    dp.download_forward(&o, &lse);
    const int no_key_rows = s.seqlen_q - s.seqlen_k;
    size_t nonzero = 0, finite_lse = 0;
    for (int b = 0; b < s.batch; ++b)
      for (int h = 0; h < s.heads; ++h)
        for (int i = 0; i < no_key_rows; ++i) {
          for (int c = 0; c < s.head_dim; ++c) nonzero += o[p.q_index(b, i, h, c)] != 0.f;
          const float l = lse[p.lse_index(b, h, i)];
          finite_lse += !(std::isinf(l) && l > 0);
        }
    EXPECT_EQ(nonzero, 0u) << s.describe() << ": O of rows that see no key must be exactly 0";
    EXPECT_EQ(finite_lse, 0u) << s.describe() << ": L of rows that see no key must be +inf";
    if (!has_backward()) continue;
    const CheckResult b = check_backward(step(), dp, p, all_q_rows(s), all_kv_rows(s), false);
    EXPECT_TRUE(b.ok) << "backward " << s.describe() << " seed " << sd << ": " << b.summary();
    std::vector<float> dq, dk, dv;
    dp.download_backward(&dq, &dk, &dv);
    nonzero = 0;
    for (int bb = 0; bb < s.batch; ++bb)
      for (int h = 0; h < s.heads; ++h)
        for (int i = 0; i < no_key_rows; ++i)
          for (int c = 0; c < s.head_dim; ++c) nonzero += dq[p.q_index(bb, i, h, c)] != 0.f;
    EXPECT_EQ(nonzero, 0u) << s.describe() << ": dQ of rows that see no key must be exactly 0";
  }
}

// The API accepts batch and heads up to 65535 (grid dimensions y and z).
TEST_P(SafetyEdgeCases, LargestGrid) {
  FA_REQUIRE_GPU();
  expect_matches(make_shape(65535, 1, 1, 2, 3, 64, false));
  expect_matches(make_shape(1, 65535, 5, 3, 2, 64, true));  // 13107 query heads per kv head
}

// Long sequences, checked on sampled rows (the oracle's cost grows with N^2).
TEST_P(SafetyEdgeCases, LongSequences) {
  FA_REQUIRE_GPU();
  const uint64_t sd = seed();
  for (bool causal : {false, true}) {
    const ProblemShape s = make_shape(1, 2, 1, 16411, 16411, 128, causal);  // 16411 is prime
    const HostProblem p = make_problem(s, InputSpec{sd});
    DeviceProblem dp(p, Layout::kContiguous, false);
    const CheckResult f = check_forward(step(), dp, p, sample_q_rows(s, 64, sd));
    EXPECT_TRUE(f.ok) << s.describe() << " seed " << sd << ": " << f.summary();
  }
  if (!has_backward()) return;
  const ProblemShape s = make_shape(1, 2, 1, 8209, 2053, 64, true);  // both prime
  const HostProblem p = make_problem(s, InputSpec{sd});
  DeviceProblem dp(p, Layout::kContiguous, true);
  for (bool det : {false, true}) {
    const CheckResult b =
        check_backward(step(), dp, p, sample_q_rows(s, 64, sd), sample_kv_rows(s, 64, sd), det);
    EXPECT_TRUE(b.ok) << "backward " << (det ? "deterministic " : "") << s.describe() << " seed "
                      << sd << ": " << b.summary();
  }
}

// A step writes only the rows of its outputs: the gaps of a padded layout keep the poison,
// and Q, K, V (and dO) are bit for bit what was uploaded, gaps included.
TEST_P(SafetyEdgeCases, WritesStayInsideTheOutputs) {
  FA_REQUIRE_GPU();
  for (bool causal : {false, true}) {
    const ProblemShape s = make_shape(2, 4, 2, 77, 140, 64, causal);
    const uint64_t sd = seed();
    const HostProblem p = make_problem(s, InputSpec{sd});
    DeviceProblem dp(p, Layout::kPadded, has_backward());
    const CheckResult f = check_forward(step(), dp, p, all_q_rows(s));
    EXPECT_TRUE(f.ok) << s.describe() << ": " << f.summary();
    const fa_fwd_args a = dp.forward_args();
    EXPECT_EQ(touched_gaps(a.o, s.batch, s.seqlen_q, s.heads, s.head_dim), 0u)
        << s.describe() << ": forward wrote outside O's rows";
    if (has_backward()) {
      const CheckResult b = check_backward(step(), dp, p, all_q_rows(s), all_kv_rows(s), false);
      EXPECT_TRUE(b.ok) << s.describe() << ": " << b.summary();
      const fa_bwd_args g = dp.backward_args(false);
      EXPECT_EQ(touched_gaps(g.fwd.o, s.batch, s.seqlen_q, s.heads, s.head_dim), 0u)
          << s.describe() << ": wrote outside O's rows";
      EXPECT_EQ(touched_gaps(g.dq, s.batch, s.seqlen_q, s.heads, s.head_dim), 0u)
          << s.describe() << ": backward wrote outside dQ's rows";
      EXPECT_EQ(touched_gaps(g.dk, s.batch, s.seqlen_k, s.heads_kv, s.head_dim), 0u)
          << s.describe() << ": backward wrote outside dK's rows";
      EXPECT_EQ(touched_gaps(g.dv, s.batch, s.seqlen_k, s.heads_kv, s.head_dim), 0u)
          << s.describe() << ": backward wrote outside dV's rows";
      EXPECT_EQ(changed_inputs(g.d_o, p.d_o, s.dtype, s.batch, s.seqlen_q, s.heads, s.head_dim), 0u)
          << s.describe() << ": dO was modified";
    }
    EXPECT_EQ(changed_inputs(a.q, p.q, s.dtype, s.batch, s.seqlen_q, s.heads, s.head_dim), 0u)
        << s.describe() << ": Q was modified";
    EXPECT_EQ(changed_inputs(a.k, p.k, s.dtype, s.batch, s.seqlen_k, s.heads_kv, s.head_dim), 0u)
        << s.describe() << ": K was modified";
    EXPECT_EQ(changed_inputs(a.v, p.v, s.dtype, s.batch, s.seqlen_k, s.heads_kv, s.head_dim), 0u)
        << s.describe() << ": V was modified";
  }
}

// Fails the test unless two runs' dQ, dK and dV (runs[run][0..2]) are the same bits.
void expect_same_bits(const std::vector<float> (&runs)[2][3], const ProblemShape& s) {
  const char* names[3] = {"dQ", "dK", "dV"};
  for (int q = 0; q < 3; ++q) {
    ASSERT_EQ(runs[0][q].size(), runs[1][q].size()) << names[q] << ", " << s.describe();
    size_t differ = 0;
    for (size_t i = 0; i < runs[0][q].size(); ++i)
      differ += std::memcmp(&runs[0][q][i], &runs[1][q][i], sizeof(float)) != 0;
    EXPECT_EQ(differ, 0u) << names[q] << " differs between two deterministic runs, "
                          << s.describe();
  }
}

// deterministic = 1 promises results independent of thread block order: two runs agree bit
// for bit (GQA, so that dK and dV sum over several query heads; both head dims, whose main
// kernels have different tile shapes).
TEST_P(SafetyEdgeCases, DeterministicBackwardIsBitwiseRepeatable) {
  FA_REQUIRE_GPU();
  if (!has_backward()) GTEST_SKIP() << step() << " has no backward pass";
  for (const int head_dim : {64, 128}) {
    if (fa_step_supports_head_dim(step().c_str(), head_dim) != 1) continue;
    const ProblemShape s = make_shape(2, 8, 2, 333, 517, head_dim, true);
    const uint64_t sd = seed();
    const HostProblem p = make_problem(s, InputSpec{sd});
    DeviceProblem dp(p, Layout::kContiguous, true);
    std::vector<float> runs[2][3];
    for (int run = 0; run < 2; ++run) {
      const CheckResult b =
          check_backward(step(), dp, p, sample_q_rows(s, 64, sd), sample_kv_rows(s, 64, sd), true);
      ASSERT_TRUE(b.ok) << s.describe() << ": " << b.summary();
      dp.download_backward(&runs[run][0], &runs[run][1], &runs[run][2]);
    }
    expect_same_bits(runs, s);
  }
}

// The same promise on problems of several waves of thread blocks (hundreds, more than a GPU
// holds at once: a kernel that orders its adds across thread blocks must never wait for one
// that cannot start), with and without the causal mask, seqlen_q below and above seqlen_k,
// GQA; inputs made on the GPU, the oracle on the last key/value head group.
TEST_P(SafetyEdgeCases, DeterministicBackwardIsBitwiseRepeatableOverSeveralWaves) {
  FA_REQUIRE_GPU();
  if (!has_backward()) GTEST_SKIP() << step() << " has no backward pass";
  for (const int head_dim : {64, 128}) {
    if (fa_step_supports_head_dim(step().c_str(), head_dim) != 1) continue;
    for (bool causal : {false, true}) {
      for (const auto& [seqlen_q, seqlen_k] : {std::pair{1000, 4100}, std::pair{4100, 1000}}) {
        const ProblemShape s = make_shape(6, 8, 4, seqlen_q, seqlen_k, head_dim, causal);
        InputSpec spec;
        spec.seed = seed();
        DeviceProblem dp(s, spec, Layout::kContiguous, true);
        std::vector<float> runs[2][3];
        for (int run = 0; run < 2; ++run) {
          const CheckResult b = check_backward_sampled(step(), dp, 24, spec.seed, true);
          ASSERT_TRUE(b.ok) << s.describe() << " seed " << spec.seed << ": " << b.summary();
          dp.download_backward(&runs[run][0], &runs[run][1], &runs[run][2]);
        }
        expect_same_bits(runs, s);
      }
    }
  }
}

// A causal grid of many (batch, head) pairs, as the bench's: a step that orders its thread
// blocks (06's groups, and on a GPU whose L2 cannot hold a group's K and V, 06's two phases:
// at d = 128 on an H200 these shapes take them) must still give every Q block of every pair
// exactly one thread block. Every element of O and lse must be written (the outputs start as
// NaN), and the sampled rows must match the oracle. N = 1000 has a ragged last Q block.
TEST_P(SafetyEdgeCases, CausalGridOfManyPairsWritesEveryRow) {
  FA_REQUIRE_GPU();
  for (const int head_dim : {64, 128}) {
    if (fa_step_supports_head_dim(step().c_str(), head_dim) != 1) continue;
    for (const int seqlen : {1000, 2048}) {
      const ProblemShape s = make_shape(16, 16, 16, seqlen, seqlen, head_dim, true);
      InputSpec spec;
      spec.seed = seed();
      DeviceProblem dp(s, spec, Layout::kContiguous, false);
      const CheckResult f = check_forward_sampled(step(), dp, 24, spec.seed);
      ASSERT_TRUE(f.ok) << s.describe() << " seed " << spec.seed << ": " << f.summary();
      std::vector<float> o, lse;
      dp.download_forward(&o, &lse);
      size_t unwritten = 0;
      for (const float x : o) unwritten += !std::isfinite(x);
      for (const float x : lse) unwritten += !std::isfinite(x);  // every row sees a key
      EXPECT_EQ(unwritten, 0u) << "elements of O or lse left NaN (or not finite), " << s.describe();
    }
  }
}

// A backward whose kernels overlap (07's programmatic dependent launches on sm_90) must make each
// kernel wait for what the kernel before it wrote. Here (causal, N_q >> N_k: only the last N_k
// query rows see a key) the main kernel is one thread block, and the rows it reads are the
// preprocess's last ones: lse, D and the zeroed dq_accum. FA_BWD_LATE_PREPROCESS (07's test
// knob) has the preprocess's thread blocks of those rows sleep about a millisecond before they
// write, so a main kernel that does not wait for them reads them first, every run (without the
// knob, 07 without that wait failed this test only by chance: 07_backward/NOTES.md, change 14).
// The problems run in a row, so that the scratch a missing wait reads holds the last one's values.
TEST_P(SafetyEdgeCases, BackwardReadsWhatItsPreprocessWroteLast) {
  FA_REQUIRE_GPU();
  if (!has_backward()) GTEST_SKIP() << step() << " has no backward";
  struct LatePreprocess {  // the knob for this test only; a value the caller set comes back
    const char* name = "FA_BWD_LATE_PREPROCESS";
    const bool was_set = std::getenv(name) != nullptr;
    const std::string before = was_set ? std::getenv(name) : "";
    LatePreprocess() { setenv(name, "2000000", 1); }
    ~LatePreprocess() {
      if (was_set)
        setenv(name, before.c_str(), 1);
      else
        unsetenv(name);
    }
  } late;
  for (const int head_dim : {64, 128}) {
    if (fa_step_supports_head_dim(step().c_str(), head_dim) != 1) continue;
    for (int run = 0; run < 3; ++run) {
      const ProblemShape s = make_shape(1, 1, 1, 65536, 128, head_dim, true);
      InputSpec spec;
      spec.seed = seed() + 2 * run + (head_dim == 128);
      DeviceProblem dp(s, spec, Layout::kContiguous, true);
      const CheckResult b = check_backward_sampled(step(), dp, 24, spec.seed, false);
      EXPECT_TRUE(b.ok) << "backward " << s.describe() << " seed " << spec.seed << ": "
                        << b.summary();
    }
  }
}

// The path of the runners, the bench and the large tests: inputs made on the GPU, the oracle on
// the first and the last key/value head group only (read back from the device), here on a
// problem small enough to be quick, in the head-major layout.
TEST_P(SafetyEdgeCases, SampledCheckOfInputsMadeOnTheGpu) {
  FA_REQUIRE_GPU();
  for (bool causal : {false, true}) {
    const ProblemShape s = make_shape(3, 6, 2, 130, 257, 128, causal, FA_BF16);
    InputSpec spec;
    spec.seed = seed();
    DeviceProblem dp(s, spec, Layout::kHeadMajor, has_backward());
    const CheckResult f = check_forward_sampled(step(), dp, 24, spec.seed);
    EXPECT_TRUE(f.ok) << s.describe() << " seed " << spec.seed << ": " << f.summary();
    if (!has_backward()) continue;
    for (bool det : {false, true}) {
      const CheckResult b = check_backward_sampled(step(), dp, 24, spec.seed, det);
      EXPECT_TRUE(b.ok) << "backward " << s.describe() << " seed " << spec.seed << ": "
                        << b.summary();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Steps, SafetyEdgeCases, testing::ValuesIn(registered_steps()),
                         [](const testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace fa
