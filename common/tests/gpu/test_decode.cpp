/// \file test_decode.cpp
/// \brief Decode-shaped problems for every registered step: few query rows (seqlen_q 1..16)
/// against long key sequences, MHA, GQA and MQA, causal bottom-right, fp16 and bf16, head
/// dims 64 and 128, checked against the fp64 oracle like the rest of the GPU suite.
///
/// These are the shapes of text generation, where a step that splits the keys across thread
/// blocks (08_split_kv) merges partial results and packs the query heads of a K/V head into
/// one tile: the cases below cross its tile and split boundaries (one and two tiles of packed
/// rows, chunks that a causal row partly or wholly cannot see, rows that see no key at all).
///
/// - `Decode/DecodeConformance.MatchesOracle/<step>_<dtype>_d<d>_<mask>_<shape>`: a fixed
///   matrix, every query row checked.
/// - `Decode/DecodeRandom.Problems/<step>`: FA_DECODE_PROBLEMS (default 24) random decode
///   problems per step (seqlen_q 1..16, seqlen_k up to FA_DECODE_MAX_SEQLEN_K, default
///   65536), seeded from the run's base seed (FA_TEST_SEED); each failure prints its seed, and
///   FA_DECODE_SEED=<that seed> runs only that problem, printing each selected step's error.
/// - `Decode/DecodeStreams.TwoStreamsAtOnce/<step>`: two decode problems launched on two
///   streams at the same time, interleaved, both checked: a step that keeps scratch memory
///   between calls must not share it between streams.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "fa/harness.h"
#include "gpu_test_util.h"

namespace fa {
namespace {

/// Sizes of one decode problem (dtype, head dim and mask vary around it).
struct DecodeDims {
  int batch, heads, heads_kv, seqlen_q, seqlen_k;
  const char* label;
};

const DecodeDims kDecodeDims[] = {
    {1, 8, 2, 1, 16411, "q1_gqa4"},    // one token, 4 query heads per K/V head, odd Nk
    {2, 32, 1, 1, 9001, "q1_mqa32"},   // MQA: 32 query heads on one K/V head
    {3, 4, 4, 7, 2049, "q7_mha"},      // no grouping, a block + 1 keys
    {1, 8, 2, 16, 8191, "q16_gqa4"},   // 16 x 4 = 64 packed rows: one full 64-row tile
    {1, 16, 2, 16, 4097, "q16_gqa8"},  // 16 x 8 = 128 packed rows: two tiles
    {2, 6, 3, 13, 100, "q13_short"},   // causal: the first rows miss the last keys
    {1, 4, 1, 16, 9, "q16_gt_k_mqa"},  // Nq > Nk: under causal, rows 0..6 see no key
};

struct DecodeCase {
  std::string step;
  fa_dtype dtype;
  int head_dim;
  bool causal;
  DecodeDims dims;
};

std::string decode_case_name(const testing::TestParamInfo<DecodeCase>& info) {
  const DecodeCase& c = info.param;
  return c.step + "_" + dtype_name(c.dtype) + "_d" + std::to_string(c.head_dim) +
         (c.causal ? "_causal_" : "_full_") + c.dims.label;
}

std::vector<DecodeCase> make_decode_cases() {
  std::vector<DecodeCase> cases;
  for (const std::string& step : registered_steps())
    for (fa_dtype dt : {FA_FP16, FA_BF16})
      for (int d : {64, 128})
        for (bool causal : {false, true})
          for (const DecodeDims& dims : kDecodeDims) cases.push_back({step, dt, d, causal, dims});
  return cases;
}

class DecodeConformance : public testing::TestWithParam<DecodeCase> {};

TEST_P(DecodeConformance, MatchesOracle) {
  FA_REQUIRE_GPU();
  const DecodeCase& c = GetParam();
  const DecodeDims& m = c.dims;
  const ProblemShape s = make_shape(m.batch, m.heads, m.heads_kv, m.seqlen_q, m.seqlen_k,
                                    c.head_dim, c.causal, c.dtype);
  const uint64_t seed = test_seed("decode/" + decode_case_name({c, 0}));
  const HostProblem p = make_problem(s, InputSpec{seed});
  DeviceProblem dp(p, Layout::kContiguous, false);
  const CheckResult r = check_forward(c.step, dp, p, all_q_rows(s));
  EXPECT_TRUE(r.ok) << s.describe() << " seed " << seed << ": " << r.summary();
}

INSTANTIATE_TEST_SUITE_P(Decode, DecodeConformance, testing::ValuesIn(make_decode_cases()),
                         decode_case_name);

// ---------------------------------------------------------------------------------------
// Random decode problems.

/// One random decode problem: seqlen_q 1..16, seqlen_k log-uniform in [1, max_k], batch 1..4,
/// heads_kv 1..8 with 1..8 query heads each, a head dim the step supports (64 or 128), fp16
/// or bf16, causal half of the time, a custom scale or inputs of magnitude 50 sometimes,
/// contiguous, padded or head-major layout.
struct DecodeProblem {
  ProblemShape shape;
  InputSpec spec;
  Layout layout = Layout::kContiguous;

  std::string describe() const {
    std::ostringstream out;
    out << shape.describe() << " scale=" << shape.effective_scale()
        << " magnitude=" << spec.magnitude << " layout=" << layout_name(layout);
    return out.str();
  }
};

DecodeProblem draw_decode_problem(uint64_t seed, const std::string& step, int max_k) {
  std::mt19937_64 rng(seed);
  auto below = [&](int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); };
  auto unit = [&] { return static_cast<double>(rng() >> 11) * 0x1.0p-53; };
  DecodeProblem p;
  ProblemShape& s = p.shape;
  std::vector<int> dims;
  for (int d : {64, 128})
    if (fa_step_supports_head_dim(step.c_str(), d) == 1) dims.push_back(d);
  if (dims.empty()) dims = {64};  // the API will say why; the test reports it
  s.head_dim = dims[below(static_cast<int>(dims.size()))];
  s.dtype = below(2) ? FA_BF16 : FA_FP16;
  s.causal = below(2) == 1;
  s.batch = 1 + below(4);
  s.heads_kv = 1 + below(8);
  s.heads = s.heads_kv * (1 + below(8));
  s.seqlen_q = 1 + below(16);
  s.seqlen_k = std::clamp(
      static_cast<int>(std::exp(unit() * std::log(static_cast<double>(max_k) + 1.0))), 1, max_k);
  // Keep the K/V tensors (and the oracle's work) bounded: at most 8M elements each, which
  // still allows 64K keys of one K/V head at d = 128.
  while (static_cast<double>(s.batch) * s.seqlen_k * s.heads_kv * s.head_dim > 8.0 * (1 << 20)) {
    if (s.batch > 1)
      --s.batch;
    else if (s.heads_kv > 1)
      s.heads = (s.heads / s.heads_kv) * --s.heads_kv;
    else
      s.seqlen_k /= 2;
  }
  p.spec.seed = seed;
  p.spec.magnitude = below(8) == 0 ? 50.f : 1.f;
  if (p.spec.magnitude == 1.f && below(5) == 0)
    s.scale = static_cast<float>(std::exp(std::log(0.03) * unit()));
  const int layout = below(10);
  p.layout = layout < 7 ? Layout::kContiguous : layout < 9 ? Layout::kPadded : Layout::kHeadMajor;
  return p;
}

class DecodeRandom : public testing::TestWithParam<std::string> {};

TEST_P(DecodeRandom, Problems) {
  FA_REQUIRE_GPU();
  const std::string& step = GetParam();
  const int count = settings().decode_problems;  // read strictly at start (gpu_main.cpp)
  const int max_k = settings().decode_max_seqlen_k;
  uint64_t seed0 = test_seed("decode_random/" + step);
  // FA_DECODE_SEED: only the problem of that seed (each failure prints it), on every step the
  // filter selects, each step's error printed: is a failure one step's or every step's?
  const bool only = settings().decode_seed_set;
  if (only) seed0 = settings().decode_seed;
  const int runs = only ? 1 : count;
  int failed = 0, causal = 0, grouped = 0, longest = 0;
  for (int i = 0; i < runs; ++i) {
    const DecodeProblem rp = draw_decode_problem(seed0 + i, step, max_k);
    causal += rp.shape.causal;
    grouped += rp.shape.heads > rp.shape.heads_kv;
    longest = std::max(longest, rp.shape.seqlen_k);
    const HostProblem p = make_problem(rp.shape, rp.spec);
    DeviceProblem dp(p, rp.layout, false);
    const CheckResult r = check_forward(step, dp, p, all_q_rows(rp.shape));
    if (only) {
      std::printf("[ decode   ] %s, seed %llu: %s\n  %s\n", step.c_str(),
                  static_cast<unsigned long long>(seed0), rp.describe().c_str(),
                  r.summary().c_str());
      for (const RowId& row : all_q_rows(rp.shape)) {  // the rows whose L is off by 1e-3 or more
        const CheckResult one = compare_forward(dp, p, {row});
        if (one.stats.size() > 1 && one.stats[1].second.max_abs >= 1e-3)
          std::printf("    row (b %d, h %d, s %d): O %.2e, lse %.2e\n", row.b, row.h, row.s,
                      one.stats[0].second.max_abs, one.stats[1].second.max_abs);
      }
    }
    if (r.ok) continue;
    ++failed;
    ADD_FAILURE() << step << ", decode problem " << i + 1 << " of " << runs << ", seed "
                  << seed0 + i << ":\n  " << rp.describe() << "\n  " << r.first_failure()
                  << "\n  reproduce: FA_TEST_SEED=" << base_seed()
                  << " ./build/bin/fa_gpu_tests --gtest_filter='Decode/DecodeRandom.Problems/"
                  << step << "'";
    if (cudaDeviceSynchronize() != cudaSuccess) break;  // a broken context fails the rest
  }
  std::printf(
      "[ decode   ] %s: %d problems, %d failed (causal %d, GQA/MQA %d, Nk up to %d); "
      "seeds %llu..%llu\n",
      step.c_str(), runs, failed, causal, grouped, longest, static_cast<unsigned long long>(seed0),
      static_cast<unsigned long long>(seed0 + std::max(runs, 1) - 1));
}

INSTANTIATE_TEST_SUITE_P(Decode, DecodeRandom, testing::ValuesIn(registered_steps()),
                         [](const testing::TestParamInfo<std::string>& i) { return i.param; });

// ---------------------------------------------------------------------------------------
// Two streams at once.

class DecodeStreams : public testing::TestWithParam<std::string> {};

TEST_P(DecodeStreams, TwoStreamsAtOnce) {
  FA_REQUIRE_GPU();
  const std::string& step = GetParam();
  // Two different decode problems (different splits and workspace sizes), each launched
  // several times on its own stream, the launches interleaved on the host.
  const ProblemShape a = make_shape(2, 16, 4, 1, 20000, 128);
  const ProblemShape b = make_shape(1, 8, 1, 5, 31001, 64, /*causal=*/true, FA_BF16);
  const HostProblem pa = make_problem(a, InputSpec{test_seed("streams/a/" + step)});
  const HostProblem pb = make_problem(b, InputSpec{test_seed("streams/b/" + step)});
  DeviceProblem da(pa, Layout::kContiguous, false), db(pb, Layout::kContiguous, false);
  da.poison_outputs();
  db.poison_outputs();
  cudaStream_t sa = nullptr, sb = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&sb, cudaStreamNonBlocking), cudaSuccess);
  const fa_fwd_args args_a = da.forward_args(), args_b = db.forward_args();
  for (int i = 0; i < 4; ++i) {
    ASSERT_EQ(fa_forward(step.c_str(), &args_a, sa), FA_OK) << fa_last_error();
    ASSERT_EQ(fa_forward(step.c_str(), &args_b, sb), FA_OK) << fa_last_error();
  }
  ASSERT_EQ(cudaStreamSynchronize(sa), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(sb), cudaSuccess);
  cudaStreamDestroy(sa);
  cudaStreamDestroy(sb);
  const CheckResult ra = compare_forward(da, pa, all_q_rows(a));
  const CheckResult rb = compare_forward(db, pb, all_q_rows(b));
  EXPECT_TRUE(ra.ok) << "stream A, " << a.describe() << ": " << ra.summary();
  EXPECT_TRUE(rb.ok) << "stream B, " << b.describe() << ": " << rb.summary();
}

INSTANTIATE_TEST_SUITE_P(Decode, DecodeStreams, testing::ValuesIn(registered_steps()),
                         [](const testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace fa
