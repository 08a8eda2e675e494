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
/// - `FA_RANDOM_PROBLEMS=n`  problems per (step, direction), default 24 (kDefaultRandomProblems);
///                           at least the number of coverage classes (9 forward, 10 backward).
/// - `FA_RANDOM_SEED=s`      a reproduction: problem i uses seed s + i, no coverage promised.
///                           Without it the first seed derives from the run's base seed
///                           (FA_TEST_SEED, printed at start-up) and the test's name, and the
///                           next ones are chosen to cover every class (plan_seeds()).
/// - `FA_RANDOM_MAX_SEQLEN=n` cap on seqlen_q and seqlen_k (default 4224); the sanitizer
///                           script lowers it.
/// - `FA_RANDOM_SECONDS=t`   each test starts no new problem after t seconds (a wall-clock
///                           cap for a long run; the summary line says how many ran), but
///                           never before the problems that cover the classes.
/// All are read strictly at start-up (gpu_main.cpp): a value that is set but not valid stops
/// the run. A test fails unless the requested number of problems ran and, outside a
/// reproduction, every coverage class (coverage_classes()) was among them.
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

/// Largest seqlen_q / seqlen_k drawn: FA_RANDOM_MAX_SEQLEN, default 4224 (4096 + 128).
int max_seqlen() {
  return settings().random_max_seqlen;
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
        << " magnitude=" << spec.magnitude << " layout=" << layout_name(layout);
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
/// head group of one batch (chosen by `seed`), and the keys those query rows attend to most.
void sample_backward_rows(const HostProblem& p, uint64_t seed, std::vector<RowId>* q_rows,
                          std::vector<RowId>* kv_rows) {
  Rng rng{seed ^ 0x6a09e667f3bcc909ull};
  const int b0 = rng.below(p.shape.batch);
  const int kv0 = rng.below(p.shape.heads_kv);
  sample_group_rows(p.shape, b0, kv0, kSampledRows, seed, q_rows, kv_rows);
  add_attended_keys(p, *q_rows, kSampledRows, kv_rows);
}

/// A kind of problem every run must contain at least once (per step and direction).
struct CoverageClass {
  const char* name;
  bool backward_only;
  bool (*holds)(const RandomProblem& p);
};

/// The promised coverage: every run of RandomConformance contains each class at least once.
const std::vector<CoverageClass>& coverage_classes() {
  static const std::vector<CoverageClass> classes = {
      {"causal", false, [](const RandomProblem& p) { return p.shape.causal; }},
      {"rows without keys", false,
       [](const RandomProblem& p) {
         return p.shape.causal && p.shape.seqlen_q > p.shape.seqlen_k;
       }},
      {"GQA", false,
       [](const RandomProblem& p) {
         return p.shape.heads_kv > 1 && p.shape.heads > p.shape.heads_kv;
       }},
      {"MQA", false,
       [](const RandomProblem& p) { return p.shape.heads_kv == 1 && p.shape.heads > 1; }},
      {"bf16", false, [](const RandomProblem& p) { return p.shape.dtype == FA_BF16; }},
      {"padded", false, [](const RandomProblem& p) { return p.layout == Layout::kPadded; }},
      {"head-major", false, [](const RandomProblem& p) { return p.layout == Layout::kHeadMajor; }},
      {"magnitude 50", false, [](const RandomProblem& p) { return p.spec.magnitude > 1.f; }},
      {"custom scale", false, [](const RandomProblem& p) { return p.shape.scale != 0.f; }},
      {"deterministic", true, [](const RandomProblem& p) { return p.deterministic; }},
  };
  return classes;
}

/// How many coverage classes a test of this direction promises.
int class_count(bool backward) {
  int n = 0;
  for (const CoverageClass& c : coverage_classes()) n += backward || !c.backward_only;
  return n;
}

/// Candidate seeds searched for a coverage class before giving up.
constexpr uint64_t kCoverageSearch = 100000;

/// The seeds a run checks, and whether the coverage could be guaranteed.
struct SeedPlan {
  std::vector<uint64_t> seeds;
  int covering = 0;     ///< the first `covering` seeds were chosen for the coverage classes
  std::string problem;  ///< why the coverage cannot be guaranteed ("" if it is)
};

/// With FA_RANDOM_SEED (a reproduction): exactly seed0, seed0 + 1, ... Otherwise seed0 first,
/// then, in order, the first later seed that draws each class not yet covered, then the
/// consecutive seeds after seed0 not yet used. Every problem is still a function of its seed
/// alone, so a failure reproduces with FA_RANDOM_SEED=<its seed> FA_RANDOM_PROBLEMS=1.
SeedPlan plan_seeds(uint64_t seed0, int count, const std::string& step, bool backward,
                    bool reproduce) {
  SeedPlan plan;
  if (reproduce) {
    for (int i = 0; i < count; ++i) plan.seeds.push_back(seed0 + i);
    return plan;
  }
  const int needed = class_count(backward);
  if (count < needed) {
    plan.problem = "FA_RANDOM_PROBLEMS=" + std::to_string(count) + " is fewer than the " +
                   std::to_string(needed) +
                   " coverage classes a run promises; ask for at least that many (or set "
                   "FA_RANDOM_SEED to run given seeds only)";
    return plan;
  }
  std::vector<char> covered(coverage_classes().size(), 0);
  auto mark = [&](const RandomProblem& p) {
    bool added = false;
    for (size_t c = 0; c < covered.size(); ++c) {
      const CoverageClass& k = coverage_classes()[c];
      if ((backward || !k.backward_only) && !covered[c] && k.holds(p)) covered[c] = added = true;
    }
    return added;
  };
  std::set<uint64_t> used = {seed0};
  plan.seeds.push_back(seed0);
  mark(draw_problem(seed0, step, backward));
  for (uint64_t seed = seed0 + 1; seed <= seed0 + kCoverageSearch; ++seed) {
    if (std::count(covered.begin(), covered.end(), 1) == needed) break;
    if (mark(draw_problem(seed, step, backward))) {
      plan.seeds.push_back(seed);
      used.insert(seed);
    }
  }
  plan.covering = static_cast<int>(plan.seeds.size());
  for (size_t c = 0; c < covered.size(); ++c) {
    const CoverageClass& k = coverage_classes()[c];
    if ((backward || !k.backward_only) && !covered[c]) {
      plan.problem = std::string("no seed of ") + std::to_string(seed0) + " .. " +
                     std::to_string(seed0 + kCoverageSearch) + " draws a problem with " + k.name +
                     " (FA_RANDOM_MAX_SEQLEN=" + std::to_string(max_seqlen()) + ")";
      return plan;
    }
  }
  for (uint64_t seed = seed0 + 1; static_cast<int>(plan.seeds.size()) < count; ++seed)
    if (!used.count(seed)) plan.seeds.push_back(seed);
  return plan;
}

/// What the summary line says about the problems that ran.
struct Coverage {
  int ran = 0, failed = 0, causal = 0, bf16 = 0, mqa = 0, gqa = 0, padded = 0, head_major = 0;
  int large = 0, scaled = 0, sampled = 0, deterministic = 0, no_key_rows = 0;
  int min_q = 1 << 30, max_q = 0, min_k = 1 << 30, max_k = 0;
  std::set<int> dims;
  std::string first_failure;
  std::vector<int> per_class = std::vector<int>(coverage_classes().size(), 0);

  void add(const RandomProblem& p, bool backward) {
    const ProblemShape& s = p.shape;
    ++ran;
    for (size_t c = 0; c < per_class.size(); ++c) per_class[c] += coverage_classes()[c].holds(p);
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
  const int count = settings().random_problems;
  const bool reproduce = settings().random_seed_set;
  const uint64_t seed0 = reproduce ? settings().random_seed : test_seed("random/" + name);
  const SeedPlan plan = plan_seeds(seed0, count, c.step, c.backward, reproduce);
  ASSERT_EQ(plan.problem, "") << c.step << (c.backward ? " backward" : " forward");
  Coverage cov;
  const double budget = settings().random_seconds;
  const auto start = std::chrono::steady_clock::now();
  bool out_of_time = false;
  for (int i = 0; i < count; ++i) {
    // FA_RANDOM_SECONDS may cut a run short, but not before the coverage problems ran.
    if (budget > 0 && i >= plan.covering &&
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > budget) {
      out_of_time = true;  // not a failure: the summary says how many ran
      break;
    }
    const RandomProblem rp = draw_problem(plan.seeds[i], c.step, c.backward);
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
          sample_backward_rows(p, rp.seed, &q_rows, &kv_rows);
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
  std::printf("[ random   ] %s %s: %s; seeds %llu%s%s\n", c.step.c_str(),
              c.backward ? "bwd" : "fwd", cov.describe(c.backward).c_str(),
              static_cast<unsigned long long>(seed0),
              reproduce ? " and on" : " and the next ones, the first that cover each class",
              out_of_time ? "; stopped by FA_RANDOM_SECONDS before the rest" : "");
  std::fflush(stdout);

  // A run that checked less than it promises fails: every problem asked for ran (unless
  // FA_RANDOM_SECONDS stopped it), and, unless FA_RANDOM_SEED names the seeds, every coverage
  // class is among them.
  if (!out_of_time)
    EXPECT_EQ(cov.ran, count) << "FA_RANDOM_PROBLEMS asked for " << count << " problems";
  EXPECT_GE(cov.ran, 1) << "no random problem ran";
  if (!reproduce)
    for (size_t k = 0; k < coverage_classes().size(); ++k)
      if (c.backward || !coverage_classes()[k].backward_only)
        EXPECT_GE(cov.per_class[k], 1) << "no problem of class '" << coverage_classes()[k].name
                                       << "' ran (seeds from " << seed0 << ")";
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

// Every run covers every class it promises, through seeds that draw them on their own.
TEST(RandomGenerator, EveryRunCoversEveryClass) {
  for (const std::string& step : registered_steps())
    for (bool backward : {false, true}) {
      if (backward && fa_step_has_backward(step.c_str()) != 1) continue;
      const int needed = class_count(backward);
      for (uint64_t seed0 : {1ull, 258115526ull, 999999999ull}) {
        const SeedPlan plan = plan_seeds(seed0, needed, step, backward, false);
        ASSERT_EQ(plan.problem, "") << step;
        ASSERT_EQ(static_cast<int>(plan.seeds.size()), needed);
        EXPECT_EQ(plan.seeds.front(), seed0) << "the first seed is always the run's own";
        EXPECT_EQ(std::set<uint64_t>(plan.seeds.begin(), plan.seeds.end()).size(),
                  plan.seeds.size());
        for (const CoverageClass& k : coverage_classes()) {
          if (k.backward_only && !backward) continue;
          bool found = false;
          for (uint64_t seed : plan.seeds)
            found = found || k.holds(draw_problem(seed, step, backward));
          EXPECT_TRUE(found) << step << ": class '" << k.name << "' not covered from " << seed0;
        }
        // More problems than classes: the rest follow seed0 in order.
        const SeedPlan more = plan_seeds(seed0, needed + 30, step, backward, false);
        EXPECT_EQ(static_cast<int>(more.seeds.size()), needed + 30);
        EXPECT_TRUE(
            std::equal(plan.seeds.begin(), plan.seeds.begin() + plan.covering, more.seeds.begin()));
      }
    }
}

TEST(RandomGenerator, TooFewProblemsCannotPromiseCoverage) {
  const std::string step = registered_steps().front();
  const SeedPlan plan = plan_seeds(5, 3, step, false, false);
  EXPECT_NE(plan.problem.find("FA_RANDOM_PROBLEMS=3 is fewer than the"), std::string::npos)
      << plan.problem;
}

// FA_RANDOM_SEED reproduces: exactly the seeds asked for, so the command a failure prints
// (FA_RANDOM_SEED=<seed> FA_RANDOM_PROBLEMS=1) draws that same problem.
TEST(RandomGenerator, ReproductionRunsTheGivenSeeds) {
  const std::string step = registered_steps().front();
  const SeedPlan plan = plan_seeds(258115526, 3, step, true, true);
  EXPECT_EQ(plan.problem, "");
  EXPECT_EQ(plan.seeds, (std::vector<uint64_t>{258115526, 258115527, 258115528}));
}

// The problem of issue 17 is still what its seed draws (its numbers are reproduced on the host
// in common/tests/host/test_tolerance.cpp).
TEST(RandomGenerator, IssueSeedStillDrawsTheIssueProblem) {
  if (fa_step_supports_head_dim("01_naive", 64) != 1) GTEST_SKIP() << "01_naive not built";
  EXPECT_EQ(draw_problem(258115526, "01_naive", true).describe(),
            "B=3 H=2/2 Nq=61 Nk=1031 d=128 fp16 causal scale=0.0883883 magnitude=50 "
            "layout=head-major rows=sampled");
}

}  // namespace
}  // namespace fa
