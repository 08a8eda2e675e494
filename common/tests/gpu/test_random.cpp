/// \file test_random.cpp
/// \brief Randomized conformance: seeded random problems for every registered step, forward
/// and (where the step has one) backward, each checked against the fp64 oracle.
///
/// One test per (step, direction): `Random/RandomConformance.Problems/<step>_fwd` and
/// `.../<step>_bwd`, so the per-step ctest entry `gpu.conformance.<step>` runs them. Each test
/// loops over its problems and reports every failing one (not only the first), then prints a
/// one-line summary: how many problems ran and what they covered.
///
/// A problem is drawn from one 64-bit seed: batch 1..3; heads_kv 1..4 with 1..8 query heads
/// per key/value head (MQA and GQA); seqlen_q and seqlen_k from 1 to several thousand, often
/// 1-3, primes, or a block size (16, 32, 64, 128, 256, and small multiples) +-1, seqlen_q ==
/// seqlen_k a third of the time; head dim 64 or 128 mostly, else one of 16 .. 256 the step
/// supports (fa_step_supports_head_dim); fp16 or bf16; causal or not; sometimes a custom
/// softmax scale, sometimes inputs of magnitude 50; contiguous, padded or head-major layout;
/// the backward in deterministic mode half of the time. Sizes are capped so that the fp64
/// oracle stays cheap: every row is checked on small problems, 48 query rows (and 48 key
/// rows for the backward) on large ones.
///
/// Environment:
/// - `FA_RANDOM_PROBLEMS=n`  problems per (step, direction), default 200.
/// - `FA_RANDOM_SEED=s`      seed of the first problem; problem i uses seed s + i. Without it
///                           the seeds derive from the run's base seed (FA_TEST_SEED, printed
///                           at start-up) and the test's name.
/// - `FA_RANDOM_MAX_SEQLEN=n` cap on seqlen_q and seqlen_k (default 4224); the sanitizer
///                           script lowers it.
/// - `FA_RANDOM_SECONDS=t`   each test starts no new problem after t seconds (a wall-clock
///                           cap for a long run; the summary line says how many ran).
///
/// A failure prints the problem's full description, its seed, the first quantity out of
/// bounds with where its largest error is, and the command that reruns exactly that problem:
///
///     FA_RANDOM_SEED=<seed> FA_RANDOM_PROBLEMS=1 ./build/bin/fa_gpu_tests \
///         --gtest_filter='Random/RandomConformance.Problems/05_split_q_fwd'
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "fa/harness.h"
#include "gpu_test_util.h"

namespace fa {
namespace {

/// Problems per (step, direction): FA_RANDOM_PROBLEMS, default 200.
int problem_count() {
  if (const char* env = std::getenv("FA_RANDOM_PROBLEMS")) {
    const int n = std::atoi(env);
    if (n >= 0) return n;
  }
  return 200;
}

/// Largest seqlen_q / seqlen_k drawn: FA_RANDOM_MAX_SEQLEN, default 4224 (4096 + 128).
int max_seqlen() {
  if (const char* env = std::getenv("FA_RANDOM_MAX_SEQLEN")) {
    const int n = std::atoi(env);
    if (n >= 1) return n;
  }
  return 4224;
}

/// FA_RANDOM_SECONDS: a test starts no new problem after this many seconds (0: no limit).
double time_budget_seconds() {
  if (const char* env = std::getenv("FA_RANDOM_SECONDS")) return std::atof(env);
  return 0;
}

/// Seed of problem 0 of a test: FA_RANDOM_SEED if set, else derived from the base seed.
uint64_t first_seed(const std::string& test_name) {
  if (const char* env = std::getenv("FA_RANDOM_SEED")) return std::strtoull(env, nullptr, 10);
  return test_seed("random/" + test_name);
}

/// splitmix64: consecutive seeds give unrelated problems.
struct Rng {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  /// Uniform in [0, n).
  int below(int n) { return static_cast<int>(next() % static_cast<uint64_t>(n)); }
  /// Uniform in [0, 1).
  double unit() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  /// True with probability p.
  bool chance(double p) { return unit() < p; }
  /// One element of a list.
  template <typename T>
  T pick(const std::vector<T>& v) {
    return v[below(static_cast<int>(v.size()))];
  }
};

const std::vector<int> kPrimes = {2,    3,    5,    7,    11,   13,   17,   31,  61,  67,
                                  97,   127,  131,  193,  251,  257,  383,  509, 521, 769,
                                  1021, 1031, 1543, 2039, 2053, 3067, 4093, 4099};

/// A sequence length in [1, cap]: tiny, a block size +-1, a prime, or log-uniform.
int draw_seqlen(Rng& rng, int cap) {
  int n = 1;
  const int kind = rng.below(20);
  if (kind < 2) {
    n = 1 + rng.below(3);  // 1, 2, 3: decoding-like
  } else if (kind < 8) {
    const int block = rng.pick(std::vector<int>{16, 32, 64, 128, 256});
    const int multiple = rng.chance(0.5) ? 1 : 1 + rng.below(16);
    n = block * multiple + rng.below(3) - 1;  // k * block - 1, + 0, + 1
  } else if (kind < 12) {
    n = rng.pick(kPrimes);
  } else if (kind < 19) {
    n = static_cast<int>(std::exp(rng.unit() * std::log(static_cast<double>(cap) + 1.0)));
  } else {
    n = cap / 2 + rng.below(cap / 2 + 1);  // long: several thousand
  }
  return std::clamp(n, 1, cap);
}

/// One random problem and how to check it.
struct RandomProblem {
  uint64_t seed = 0;
  ProblemShape shape;
  InputSpec spec;
  Layout layout = Layout::kContiguous;
  bool deterministic = false;  ///< backward mode
  bool all_rows = true;        ///< check every row, else a sample of kSampledRows

  std::string describe() const {
    std::ostringstream out;
    out << shape.describe() << " scale=" << shape.effective_scale()
        << " magnitude=" << spec.magnitude << " layout="
        << (layout == Layout::kContiguous ? "contiguous"
            : layout == Layout::kPadded   ? "padded"
                                          : "head-major");
    out << (all_rows ? " rows=all" : " rows=sampled");
    return out.str();
  }
};

constexpr int kSampledRows = 48;
/// Caps keep the host side bounded: elements of the largest tensor, B*H*Nq*Nk*d (the GPU's
/// work, and 01_naive's N^2 buffers), and for the backward group*Nq*Nk*d (the oracle computes
/// L and D on every query row of the key/value head group it checks).
constexpr double kMaxElements = 8.0 * 1024 * 1024;
constexpr double kMaxWork = 8.0 * 1024 * 1024 * 1024;
constexpr double kMaxGroupWorkBackward = 2.0 * 1024 * 1024 * 1024;
/// Every row is checked below this B*H*Nq*Nk*d (half of it for the backward).
constexpr double kAllRowsWork = 64.0 * 1024 * 1024;

double work_of(const ProblemShape& s) {
  return static_cast<double>(s.batch) * s.heads * s.seqlen_q * s.seqlen_k * s.head_dim;
}
double group_work_of(const ProblemShape& s) {
  return static_cast<double>(s.heads / s.heads_kv) * s.seqlen_q * s.seqlen_k * s.head_dim;
}
double elements_of(const ProblemShape& s) {
  return static_cast<double>(s.batch) * std::max(s.seqlen_q, s.seqlen_k) * s.heads * s.head_dim;
}

/// Draws the problem of `seed` for `step` (the step only decides which head dims to draw).
RandomProblem draw_problem(uint64_t seed, const std::string& step, bool backward) {
  Rng rng{seed};
  RandomProblem p;
  p.seed = seed;
  ProblemShape& s = p.shape;
  const int cap = max_seqlen();

  // Head dim: 64 or 128 three times in four, else any other one the step supports.
  std::vector<int> main_dims, other_dims;
  for (int d : {64, 128})
    if (fa_step_supports_head_dim(step.c_str(), d) == 1) main_dims.push_back(d);
  for (int d : {16, 32, 40, 48, 80, 96, 160, 192, 256})
    if (fa_step_supports_head_dim(step.c_str(), d) == 1) other_dims.push_back(d);
  if (main_dims.empty()) main_dims = other_dims;
  if (main_dims.empty()) main_dims = {64};  // the API will say why; the test reports it
  s.head_dim =
      (other_dims.empty() || rng.chance(0.75)) ? rng.pick(main_dims) : rng.pick(other_dims);

  s.dtype = rng.chance(0.5) ? FA_FP16 : FA_BF16;
  s.causal = rng.chance(0.5);
  s.batch = rng.pick(std::vector<int>{1, 1, 1, 2, 3});
  s.heads_kv = rng.pick(std::vector<int>{1, 1, 2, 2, 3, 4});
  const int group = rng.pick(std::vector<int>{1, 1, 2, 3, 4, 8});  // heads_kv 1, group > 1: MQA
  s.heads = s.heads_kv * group;
  s.seqlen_k = draw_seqlen(rng, cap);
  s.seqlen_q = rng.chance(0.33) ? s.seqlen_k : draw_seqlen(rng, cap);

  auto too_big = [&] {
    return work_of(s) > kMaxWork || elements_of(s) > kMaxElements ||
           (backward && group_work_of(s) > kMaxGroupWorkBackward);
  };
  // Too big: fewer batches, then fewer heads, then other lengths, and at last shorter ones.
  for (int attempt = 0; too_big() && attempt < 40; ++attempt) {
    if (s.batch > 1) {
      --s.batch;
    } else if (s.heads > s.heads_kv) {
      s.heads -= s.heads_kv;
    } else if (s.heads_kv > 1) {
      s.heads = --s.heads_kv;
    } else if (attempt < 30) {
      s.seqlen_k = draw_seqlen(rng, cap);
      s.seqlen_q = rng.chance(0.33) ? s.seqlen_k : draw_seqlen(rng, cap);
    } else {
      s.seqlen_q = std::max(1, s.seqlen_q / 2);
      s.seqlen_k = std::max(1, s.seqlen_k / 2);
    }
  }

  p.spec.seed = seed;
  p.spec.magnitude = rng.chance(0.12) ? 50.f : 1.f;
  // A custom scale (log-uniform in [0.03, 1]) on ordinary inputs; large inputs keep 1/sqrt(d).
  if (p.spec.magnitude == 1.f && rng.chance(0.2))
    s.scale = static_cast<float>(std::exp(std::log(0.03) * rng.unit()));
  const int layout = rng.below(20);
  p.layout = layout < 14 ? Layout::kContiguous : layout < 17 ? Layout::kPadded : Layout::kHeadMajor;
  p.deterministic = rng.chance(0.5);
  p.all_rows = work_of(s) <= (backward ? kAllRowsWork / 2 : kAllRowsWork);
  return p;
}

/// Backward rows of a large problem: kSampledRows query rows and key rows of one key/value
/// head group of one batch (chosen by `seed`). The oracle computes L and D on every query row
/// of each head a requested row touches, so one group keeps its cost to one group's.
void sample_group_rows(const ProblemShape& s, uint64_t seed, std::vector<RowId>* q_rows,
                       std::vector<RowId>* kv_rows) {
  Rng rng{seed ^ 0x6a09e667f3bcc909ull};
  const int group = s.heads / s.heads_kv;
  const int b0 = rng.below(s.batch);
  const int kv0 = rng.below(s.heads_kv);
  ProblemShape one = s;  // that group alone
  one.batch = 1;
  one.heads = group;
  one.heads_kv = 1;
  *q_rows = sample_q_rows(one, kSampledRows, seed);
  *kv_rows = sample_kv_rows(one, kSampledRows, seed);
  for (RowId& r : *q_rows) r = {b0, kv0 * group + r.h, r.s};
  for (RowId& r : *kv_rows) r = {b0, kv0, r.s};
}

/// What the summary line says about the problems that ran.
struct Coverage {
  int ran = 0, failed = 0, causal = 0, bf16 = 0, mqa = 0, gqa = 0, padded = 0, head_major = 0;
  int large = 0, scaled = 0, sampled = 0, deterministic = 0, no_key_rows = 0;
  int min_q = 1 << 30, max_q = 0, min_k = 1 << 30, max_k = 0;
  std::set<int> dims;
  std::string first_failure;

  void add(const RandomProblem& p, bool backward) {
    const ProblemShape& s = p.shape;
    ++ran;
    causal += s.causal;
    bf16 += s.dtype == FA_BF16;
    mqa += s.heads_kv == 1 && s.heads > 1;
    gqa += s.heads_kv > 1 && s.heads > s.heads_kv;
    padded += p.layout == Layout::kPadded;
    head_major += p.layout == Layout::kHeadMajor;
    large += p.spec.magnitude > 1.f;
    scaled += s.scale != 0.f;
    sampled += !p.all_rows;
    deterministic += backward && p.deterministic;
    no_key_rows += s.causal && s.seqlen_q > s.seqlen_k;
    min_q = std::min(min_q, s.seqlen_q);
    max_q = std::max(max_q, s.seqlen_q);
    min_k = std::min(min_k, s.seqlen_k);
    max_k = std::max(max_k, s.seqlen_k);
    dims.insert(s.head_dim);
  }

  std::string describe(bool backward) const {
    std::ostringstream out;
    out << ran << " problems, " << ran - failed << " passed, " << failed << " failed";
    if (ran == 0) return out.str();
    out << " (Nq " << min_q << ".." << max_q << ", Nk " << min_k << ".." << max_k << ", d {";
    bool first = true;
    for (int d : dims) {
      out << (first ? "" : ",") << d;
      first = false;
    }
    out << "}, causal " << causal << " (rows without keys " << no_key_rows << "), bf16 " << bf16
        << ", MQA " << mqa << ", GQA " << gqa << ", padded " << padded << ", head-major "
        << head_major << ", magnitude 50 " << large << ", custom scale " << scaled
        << ", sampled rows " << sampled;
    if (backward) out << ", deterministic " << deterministic;
    out << ")";
    return out.str();
  }
};

struct RandomCase {
  std::string step;
  bool backward;
};

/// How gtest prints a RandomCase (in listings and the JSON report).
void PrintTo(const RandomCase& c, std::ostream* os) {
  *os << c.step << (c.backward ? " backward" : " forward");
}

std::string random_case_name(const testing::TestParamInfo<RandomCase>& info) {
  return info.param.step + (info.param.backward ? "_bwd" : "_fwd");
}

std::vector<RandomCase> make_random_cases() {
  std::vector<RandomCase> cases;
  for (const std::string& step : registered_steps()) {
    cases.push_back({step, false});
    if (fa_step_has_backward(step.c_str()) == 1) cases.push_back({step, true});
  }
  return cases;
}

class RandomConformance : public testing::TestWithParam<RandomCase> {};

TEST_P(RandomConformance, Problems) {
  FA_REQUIRE_GPU();
  const RandomCase& c = GetParam();
  const std::string name = random_case_name(testing::TestParamInfo<RandomCase>(c, 0));
  const std::string full_name = std::string("Random/RandomConformance.Problems/") + name;
  const int count = problem_count();
  const uint64_t seed0 = first_seed(name);
  Coverage cov;
  const double budget = time_budget_seconds();
  const auto start = std::chrono::steady_clock::now();
  bool out_of_time = false;
  for (int i = 0; i < count; ++i) {
    if (budget > 0 &&
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > budget) {
      out_of_time = true;  // not a failure: the summary says how many ran
      break;
    }
    const RandomProblem rp = draw_problem(seed0 + i, c.step, c.backward);
    cov.add(rp, c.backward);
    CheckResult r;
    std::string thrown;
    try {
      const HostProblem p = make_problem(rp.shape, rp.spec);
      DeviceProblem dp(p, rp.layout, c.backward);
      if (c.backward) {
        std::vector<RowId> q_rows, kv_rows;
        if (rp.all_rows) {
          q_rows = all_q_rows(rp.shape);
          kv_rows = all_kv_rows(rp.shape);
        } else {
          sample_group_rows(rp.shape, rp.seed, &q_rows, &kv_rows);
        }
        r = check_backward(c.step, dp, p, q_rows, kv_rows, rp.deterministic);
      } else {
        r = check_forward(
            c.step, dp, p,
            rp.all_rows ? all_q_rows(rp.shape) : sample_q_rows(rp.shape, kSampledRows, rp.seed));
      }
    } catch (const std::exception& e) {
      thrown = e.what();
    }
    if (thrown.empty() && r.ok) continue;

    ++cov.failed;
    const std::string what = thrown.empty() ? r.first_failure() : "exception: " + thrown;
    if (cov.first_failure.empty())
      cov.first_failure = "seed " + std::to_string(rp.seed) + ": " + rp.describe() + ": " + what;
    ADD_FAILURE() << c.step << (c.backward ? " backward" : " forward") << ", problem " << i + 1
                  << " of " << count << ", seed " << rp.seed << ":\n  " << rp.describe()
                  << (c.backward ? (rp.deterministic ? " deterministic" : " atomic") : "") << "\n  "
                  << what << (thrown.empty() ? "\n  all: " + r.summary() : "")
                  << "\n  reproduce: FA_RANDOM_SEED=" << rp.seed
                  << " FA_RANDOM_PROBLEMS=1 ./build/bin/fa_gpu_tests --gtest_filter='" << full_name
                  << "'";
    // A kernel fault leaves the CUDA context unusable: every later problem would fail too.
    const cudaError_t sticky = cudaDeviceSynchronize();
    if (sticky != cudaSuccess) {
      ADD_FAILURE() << "the CUDA context is broken after problem " << i + 1 << " ("
                    << cudaGetErrorString(sticky) << "); the remaining " << count - i - 1
                    << " problems were not run";
      break;
    }
  }
  RecordProperty("problems", cov.ran);
  if (out_of_time) RecordProperty("stopped_by_time", count - cov.ran);
  RecordProperty("failed", cov.failed);
  RecordProperty("first_seed", std::to_string(seed0));
  if (!cov.first_failure.empty()) RecordProperty("first_failure", cov.first_failure);
  std::printf("[ random   ] %s %s: %s; seeds %llu..%llu%s\n", c.step.c_str(),
              c.backward ? "bwd" : "fwd", cov.describe(c.backward).c_str(),
              static_cast<unsigned long long>(seed0),
              static_cast<unsigned long long>(seed0 + (cov.ran > 0 ? cov.ran - 1 : 0)),
              out_of_time ? "; stopped by FA_RANDOM_SECONDS before the rest" : "");
  std::fflush(stdout);
}

INSTANTIATE_TEST_SUITE_P(Random, RandomConformance, testing::ValuesIn(make_random_cases()),
                         random_case_name);

// The generator itself (no GPU): reproducible, within its caps, and covering what it claims.
TEST(RandomGenerator, SameSeedSameProblemAndCapsHold) {
  const std::string step = registered_steps().empty() ? "" : registered_steps().front();
  if (step.empty()) GTEST_SKIP() << "no registered step";
  std::set<int> lengths;
  int causal = 0, mqa = 0, large = 0;
  for (uint64_t seed = 1; seed <= 2000; ++seed)
    for (bool backward : {false, true}) {
      const RandomProblem a = draw_problem(seed, step, backward);
      const RandomProblem b = draw_problem(seed, step, backward);
      ASSERT_EQ(a.describe(), b.describe());
      const ProblemShape& s = a.shape;
      ASSERT_GE(s.seqlen_q, 1);
      ASSERT_GE(s.seqlen_k, 1);
      ASSERT_LE(std::max(s.seqlen_q, s.seqlen_k), max_seqlen());
      ASSERT_EQ(s.heads % s.heads_kv, 0);
      ASSERT_EQ(fa_step_supports_head_dim(step.c_str(), s.head_dim), 1) << s.head_dim;
      ASSERT_LE(elements_of(s), kMaxElements) << a.describe();
      ASSERT_LE(work_of(s), kMaxWork) << a.describe();
      if (backward) ASSERT_LE(group_work_of(s), kMaxGroupWorkBackward) << a.describe();
      lengths.insert(s.seqlen_q);
      lengths.insert(s.seqlen_k);
      causal += s.causal;
      mqa += s.heads_kv == 1 && s.heads > 1;
      large += a.spec.magnitude > 1.f;
    }
  for (int n : {1, 2, 3, 15, 16, 17, 31, 33, 63, 65, 127, 129, 257, 4093})
    EXPECT_TRUE(lengths.count(n)) << "length " << n << " never drawn";
  EXPECT_GT(*lengths.rbegin(), 2000);
  EXPECT_GT(causal, 1000);
  EXPECT_GT(mqa, 200);
  EXPECT_GT(large, 200);
}

}  // namespace
}  // namespace fa
