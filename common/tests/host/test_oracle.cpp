// Host tests of fa/oracle.h: the fp64 reference checked by hand and by finite differences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <tuple>

#include "fa/oracle.h"

namespace fa {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// With every key row equal, every visible score of a row is equal: O is the plain mean of the
// visible V rows, and L = S + log(#visible).
TEST(ReferenceForward, UniformKeysAverageVisibleValues) {
  for (bool causal : {false, true}) {
    HostProblem p = make_problem(make_shape(1, 1, 1, 6, 6, 4, causal), InputSpec{});
    for (int j = 1; j < 6; ++j)
      for (int c = 0; c < 4; ++c) p.k[p.kv_index(0, j, 0, c)] = p.k[p.kv_index(0, 0, 0, c)];
    const ForwardRef ref = reference_forward(p, all_q_rows(p.shape));
    for (int i = 0; i < 6; ++i) {
      const int visible = causal ? i + 1 : 6;
      double score = 0;
      for (int c = 0; c < 4; ++c)
        score += double(p.q[p.q_index(0, i, 0, c)]) * p.k[p.kv_index(0, 0, 0, c)];
      score *= p.shape.effective_scale();
      EXPECT_NEAR(ref.lse[i], score + std::log(visible), 1e-12) << i;
      for (int c = 0; c < 4; ++c) {
        double mean = 0;
        for (int j = 0; j < visible; ++j) mean += p.v[p.kv_index(0, j, 0, c)];
        EXPECT_NEAR(ref.o[i * 4 + c], mean / visible, 1e-12) << "row " << i << " causal " << causal;
      }
    }
  }
}

// One key with a huge score takes all the weight: O is that key's V row.
TEST(ReferenceForward, OneHotScorePicksThatValue) {
  HostProblem p = make_problem(make_shape(1, 1, 1, 1, 5, 4, false), InputSpec{});
  std::fill(p.q.begin(), p.q.end(), 0.f);
  std::fill(p.k.begin(), p.k.end(), 0.f);
  p.q[0] = 1.f;
  p.k[p.kv_index(0, 3, 0, 0)] = 400.f;  // S = 400 * 0.5 = 200 vs 0 for the others
  const ForwardRef ref = reference_forward(p, all_q_rows(p.shape));
  for (int c = 0; c < 4; ++c) EXPECT_NEAR(ref.o[c], p.v[p.kv_index(0, 3, 0, c)], 1e-15);
  EXPECT_NEAR(ref.lse[0], 200.0, 1e-12);
}

TEST(ReferenceForward, CausalFirstRowSeesOnlyFirstKey) {
  const HostProblem p = make_problem(make_shape(1, 2, 2, 5, 5, 8, true), InputSpec{});
  const ForwardRef ref = reference_forward(p, {{0, 1, 0}});
  double s00 = 0;
  for (int c = 0; c < 8; ++c)
    s00 += double(p.q[p.q_index(0, 0, 1, c)]) * p.k[p.kv_index(0, 0, 1, c)];
  s00 *= p.shape.effective_scale();
  EXPECT_NEAR(ref.lse[0], s00, 1e-12);
  for (int c = 0; c < 8; ++c) EXPECT_DOUBLE_EQ(ref.o[c], p.v[p.kv_index(0, 0, 1, c)]);
}

// Nq > Nk, bottom-right aligned: the first Nq - Nk rows see no key.
TEST(ReferenceForward, CausalRowsWithoutKeysGetZeroAndInfinity) {
  const HostProblem p = make_problem(make_shape(1, 1, 1, 5, 3, 4, true), InputSpec{});
  const ForwardRef ref = reference_forward(p, all_q_rows(p.shape));
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(ref.lse[i], kInf) << i;
    for (int c = 0; c < 4; ++c) EXPECT_EQ(ref.o[i * 4 + c], 0.0);
  }
  // Row 2 sees key 0 only, row 4 sees all three.
  for (int c = 0; c < 4; ++c) EXPECT_DOUBLE_EQ(ref.o[2 * 4 + c], p.v[p.kv_index(0, 0, 0, c)]);
  EXPECT_TRUE(std::isfinite(ref.lse[4]));
  // Nq < Nk: row 0 sees Nk - Nq + 1 keys.
  HostProblem wide = make_problem(make_shape(1, 1, 1, 2, 5, 4, true), InputSpec{});
  for (int j = 1; j < 5; ++j)
    for (int c = 0; c < 4; ++c)
      wide.k[wide.kv_index(0, j, 0, c)] = wide.k[wide.kv_index(0, 0, 0, c)];
  const ForwardRef wide_ref = reference_forward(wide, {{0, 0, 0}});
  double mean = 0;
  for (int j = 0; j < 4; ++j) mean += wide.v[wide.kv_index(0, j, 0, 0)];
  EXPECT_NEAR(wide_ref.o[0], mean / 4, 1e-12);
}

// L by hand on B=1, H=1, Nq=2, Nk=3, d=2 with scale 0.5.
TEST(ReferenceForward, LogSumExpByHand) {
  for (bool causal : {false, true}) {
    ProblemShape s = make_shape(1, 1, 1, 2, 3, 2, causal);
    s.scale = 0.5f;
    HostProblem p = make_problem(s, InputSpec{});
    p.q = {1, 0, /**/ 0, 2};
    p.k = {1, 1, /**/ 0, 1, /**/ -1, 0};
    p.v = {1, 0, /**/ 0, 1, /**/ 1, 1};
    // S = 0.5 * Q K^T = [[0.5, 0, -0.5], [1, 1, 0]]; causal: row 0 sees keys 0 and 1.
    const ForwardRef ref = reference_forward(p, all_q_rows(s));
    const double e = std::exp(1.0), r = std::exp(0.5);
    const double sum0 = causal ? r + 1 : r + 1 + 1 / r;
    EXPECT_NEAR(ref.lse[0], std::log(sum0), 1e-14);
    EXPECT_NEAR(ref.lse[1], std::log(2 * e + 1), 1e-14);
    EXPECT_NEAR(ref.o[0], (causal ? r : r + 1 / r) / sum0, 1e-14);
    EXPECT_NEAR(ref.o[1], (causal ? 1 : 1 + 1 / r) / sum0, 1e-14);
    EXPECT_NEAR(ref.o[2], (e + 1) / (2 * e + 1), 1e-14);
    EXPECT_NEAR(ref.o[3], (e + 1) / (2 * e + 1), 1e-14);
  }
}

// GQA: query head h reads key/value head h / (H / Hkv). A problem with H=4, Hkv=2 equals the
// MHA problem whose kv heads are (0, 0, 1, 1) copies, and its dK, dV are the group sums.
TEST(ReferenceForwardBackward, GroupedQueryHeadMapping) {
  const HostProblem gqa = make_problem(make_shape(2, 4, 2, 5, 6, 4, true), InputSpec{9});
  HostProblem mha = gqa;
  mha.shape.heads_kv = 4;
  mha.k.assign(gqa.k.size() * 2, 0.f);
  mha.v.assign(gqa.v.size() * 2, 0.f);
  for (int b = 0; b < 2; ++b)
    for (int s = 0; s < 6; ++s)
      for (int h = 0; h < 4; ++h)
        for (int c = 0; c < 4; ++c) {
          mha.k[mha.kv_index(b, s, h, c)] = gqa.k[gqa.kv_index(b, s, h / 2, c)];
          mha.v[mha.kv_index(b, s, h, c)] = gqa.v[gqa.kv_index(b, s, h / 2, c)];
        }
  const ForwardRef a = reference_forward(gqa, all_q_rows(gqa.shape));
  const ForwardRef b = reference_forward(mha, all_q_rows(mha.shape));
  EXPECT_EQ(a.o, b.o);
  EXPECT_EQ(a.lse, b.lse);
  // Head 1 and head 2 read different kv heads, so their outputs differ.
  const ForwardRef h1 = reference_forward(gqa, {{0, 1, 4}}),
                   h2 = reference_forward(gqa, {{0, 2, 4}});
  EXPECT_NE(h1.o, h2.o);

  const BackwardRef ga = reference_backward(gqa, all_q_rows(gqa.shape), all_kv_rows(gqa.shape));
  const BackwardRef mb = reference_backward(mha, all_q_rows(mha.shape), all_kv_rows(mha.shape));
  for (size_t i = 0; i < ga.dq.size(); ++i) EXPECT_NEAR(ga.dq[i], mb.dq[i], 1e-14);
  // kv rows are ordered (b, h, s): GQA head g collects MHA heads 2g and 2g+1.
  for (int b = 0; b < 2; ++b)
    for (int g = 0; g < 2; ++g)
      for (int s = 0; s < 6; ++s)
        for (int c = 0; c < 4; ++c) {
          const size_t at = ((b * 2 + g) * 6 + s) * 4 + c;
          const size_t m0 = ((b * 4 + 2 * g) * 6 + s) * 4 + c, m1 = m0 + 6 * 4;
          EXPECT_NEAR(ga.dk[at], mb.dk[m0] + mb.dk[m1], 1e-14);
          EXPECT_NEAR(ga.dv[at], mb.dv[m0] + mb.dv[m1], 1e-14);
        }
}

TEST(ReferenceForward, SampledRowsMatchAllRows) {
  const HostProblem p = make_problem(make_shape(2, 3, 1, 40, 30, 8, true), InputSpec{5, 4.f});
  const ForwardRef all = reference_forward(p, all_q_rows(p.shape));
  const std::vector<RowId> rows = sample_q_rows(p.shape, 25, 11);
  const ForwardRef some = reference_forward(p, rows);
  for (size_t r = 0; r < rows.size(); ++r) {
    const size_t at = (static_cast<size_t>(rows[r].b) * 3 + rows[r].h) * 40 + rows[r].s;
    EXPECT_EQ(some.lse[r], all.lse[at]);
    for (int c = 0; c < 8; ++c) EXPECT_EQ(some.o[r * 8 + c], all.o[at * 8 + c]);
  }
}

// Large scores (magnitude 100 inputs) must not overflow the fp64 exponentials.
TEST(ReferenceForward, LargeMagnitudeStaysFinite) {
  const HostProblem p = make_problem(make_shape(1, 2, 2, 16, 16, 32, false), InputSpec{3, 100.f});
  const ForwardRef ref = reference_forward(p, all_q_rows(p.shape));
  for (double x : ref.o) ASSERT_TRUE(std::isfinite(x));
  for (double x : ref.lse) ASSERT_TRUE(std::isfinite(x));
}

// sum(O * dO) over all rows, in double: the backward's dQ, dK, dV are its gradient.
double objective(const HostProblem& p) {
  const ForwardRef ref = reference_forward(p, all_q_rows(p.shape));
  double sum = 0;
  for (size_t r = 0; r < ref.rows.size(); ++r)
    for (int c = 0; c < p.shape.head_dim; ++c)
      sum += ref.o[r * p.shape.head_dim + c] *
             p.d_o[p.q_index(ref.rows[r].b, ref.rows[r].s, ref.rows[r].h, c)];
  return sum;
}

// Central difference of objective() along element `at` of `tensor`.
double numeric_gradient(HostProblem& p, std::vector<float>& tensor, size_t at) {
  const float saved = tensor[at];
  const double step = std::ldexp(1.0, -13);
  tensor[at] = static_cast<float>(saved + step);
  const double up = tensor[at], f_up = objective(p);
  tensor[at] = static_cast<float>(saved - step);
  const double down = tensor[at], f_down = objective(p);
  tensor[at] = saved;
  return (f_up - f_down) / (up - down);  // the steps actually taken, in case of rounding
}

TEST(ReferenceBackward, MatchesFiniteDifferences) {
  for (auto [n_q, n_k, causal] :
       {std::tuple{3, 5, false}, std::tuple{3, 5, true}, std::tuple{5, 3, true}}) {
    HostProblem p = make_problem(make_shape(1, 2, 1, n_q, n_k, 4, causal), InputSpec{17, 1.5f});
    const BackwardRef ref = reference_backward(p, all_q_rows(p.shape), all_kv_rows(p.shape));
    double max_grad = 0, max_err = 0;
    // q rows are ordered (b, h, s); kv rows (b, kv head, s).
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < n_q; ++i)
        for (int c = 0; c < 4; ++c) {
          const double analytic = ref.dq[(h * n_q + i) * 4 + c];
          const double numeric = numeric_gradient(p, p.q, p.q_index(0, i, h, c));
          max_grad = std::max(max_grad, std::abs(numeric));
          max_err = std::max(max_err, std::abs(analytic - numeric));
        }
    for (int j = 0; j < n_k; ++j)
      for (int c = 0; c < 4; ++c) {
        const size_t at = p.kv_index(0, j, 0, c);
        for (auto [tensor, grad] : {std::pair{&p.k, &ref.dk}, std::pair{&p.v, &ref.dv}}) {
          const double analytic = (*grad)[j * 4 + c];
          const double numeric = numeric_gradient(p, *tensor, at);
          max_grad = std::max(max_grad, std::abs(numeric));
          max_err = std::max(max_err, std::abs(analytic - numeric));
        }
      }
    EXPECT_GT(max_grad, 0.1);
    EXPECT_LT(max_err, 1e-7 * std::max(1.0, max_grad)) << n_q << "x" << n_k << " causal " << causal;
    if (n_q > n_k) {  // rows 0 .. Nq-Nk-1 see no key: their dQ is exactly 0
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < n_q - n_k; ++i)
          for (int c = 0; c < 4; ++c) EXPECT_EQ(ref.dq[(h * n_q + i) * 4 + c], 0.0);
    }
  }
}

// Backward on sampled rows equals the same rows of the full backward.
TEST(ReferenceBackward, SampledRowsMatchAllRows) {
  const HostProblem p = make_problem(make_shape(2, 4, 2, 13, 17, 8, true), InputSpec{23});
  const BackwardRef all = reference_backward(p, all_q_rows(p.shape), all_kv_rows(p.shape));
  const std::vector<RowId> q_rows = sample_q_rows(p.shape, 10, 1);
  const std::vector<RowId> kv_rows = sample_kv_rows(p.shape, 9, 2);
  const BackwardRef some = reference_backward(p, q_rows, kv_rows);
  for (size_t r = 0; r < q_rows.size(); ++r) {
    const size_t at = (static_cast<size_t>(q_rows[r].b) * 4 + q_rows[r].h) * 13 + q_rows[r].s;
    for (int c = 0; c < 8; ++c) EXPECT_EQ(some.dq[r * 8 + c], all.dq[at * 8 + c]);
  }
  for (size_t r = 0; r < kv_rows.size(); ++r) {
    const size_t at = (static_cast<size_t>(kv_rows[r].b) * 2 + kv_rows[r].h) * 17 + kv_rows[r].s;
    for (int c = 0; c < 8; ++c) {
      EXPECT_EQ(some.dk[r * 8 + c], all.dk[at * 8 + c]);
      EXPECT_EQ(some.dv[r * 8 + c], all.dv[at * 8 + c]);
    }
  }
}

TEST(SampleRows, IncludesEndsIsDeterministicAndSpread) {
  const ProblemShape s = make_shape(2, 8, 2, 1000, 700, 64, false);
  const std::vector<RowId> rows = sample_q_rows(s, 64, 5);
  ASSERT_EQ(rows.size(), 64u);
  std::set<std::tuple<int, int, int>> unique;
  std::set<std::pair<int, int>> heads;
  bool first = false, last = false;
  for (const RowId& r : rows) {
    ASSERT_TRUE(r.b >= 0 && r.b < 2 && r.h >= 0 && r.h < 8 && r.s >= 0 && r.s < 1000);
    unique.emplace(r.b, r.h, r.s);
    heads.emplace(r.b, r.h);
    first |= r.s == 0;
    last |= r.s == 999;
  }
  EXPECT_EQ(unique.size(), rows.size());
  EXPECT_TRUE(first);
  EXPECT_TRUE(last);
  EXPECT_GE(heads.size(), 10u);  // 16 (b, h) pairs; a spread sample touches most of them
  EXPECT_TRUE(unique.count({0, 0, 0}));
  EXPECT_TRUE(unique.count({1, 7, 999}));

  const std::vector<RowId> again = sample_q_rows(s, 64, 5);
  const std::vector<RowId> other = sample_q_rows(s, 64, 6);
  auto same = [](const std::vector<RowId>& a, const std::vector<RowId>& b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i)
      if (a[i].b != b[i].b || a[i].h != b[i].h || a[i].s != b[i].s) return false;
    return true;
  };
  EXPECT_TRUE(same(rows, again));
  EXPECT_FALSE(same(rows, other));

  const std::vector<RowId> kv = sample_kv_rows(s, 30, 5);
  ASSERT_EQ(kv.size(), 30u);
  bool kv_first = false, kv_last = false;
  for (const RowId& r : kv) {
    ASSERT_TRUE(r.h >= 0 && r.h < 2 && r.s >= 0 && r.s < 700);
    kv_first |= r.s == 0;
    kv_last |= r.s == 699;
  }
  EXPECT_TRUE(kv_first);
  EXPECT_TRUE(kv_last);
}

TEST(SampleRows, AllRowsWhenCountIsLarge) {
  const ProblemShape s = make_shape(2, 3, 1, 5, 4, 8, false);
  const std::vector<RowId> all = all_q_rows(s);
  ASSERT_EQ(all.size(), 30u);
  EXPECT_EQ(all.front().s, 0);
  EXPECT_EQ(all.back().b, 1);
  EXPECT_EQ(all.back().h, 2);
  EXPECT_EQ(all.back().s, 4);
  EXPECT_EQ(sample_q_rows(s, 30, 1).size(), 30u);
  EXPECT_EQ(sample_q_rows(s, 1000, 1).size(), 30u);
  EXPECT_EQ(sample_kv_rows(s, 1000, 1).size(), 8u);
  EXPECT_EQ(all_kv_rows(s).size(), 8u);
  EXPECT_EQ(sample_q_rows(s, 0, 1).size(), 0u);
}

}  // namespace
}  // namespace fa

namespace fa {
namespace {

TEST(OracleMagnitudes, BoundEveryGradientFromAbove) {
  const ProblemShape s = make_shape(1, 4, 2, 9, 13, 8, true);
  const HostProblem p = make_problem(s, InputSpec{5});
  const BackwardRef ref = reference_backward(p, all_q_rows(s), all_kv_rows(s));
  ASSERT_EQ(ref.dq_mag.size(), ref.dq.size());
  ASSERT_EQ(ref.dk_mag.size(), ref.dk.size());
  ASSERT_EQ(ref.dv_mag.size(), ref.dv.size());
  for (size_t i = 0; i < ref.dq.size(); ++i) EXPECT_GE(ref.dq_mag[i], std::abs(ref.dq[i]) - 1e-12);
  for (size_t i = 0; i < ref.dk.size(); ++i) EXPECT_GE(ref.dk_mag[i], std::abs(ref.dk[i]) - 1e-12);
  for (size_t i = 0; i < ref.dv.size(); ++i) EXPECT_GE(ref.dv_mag[i], std::abs(ref.dv[i]) - 1e-12);
}

}  // namespace
}  // namespace fa
