// Host tests of fa/cpu_models.h: every model against the fp64 oracle, and the IO counts
// against the closed forms documented in the header.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "fa/cpu_models.h"
#include "fa/metrics.h"
#include "fa/oracle.h"

namespace fa {
namespace {

// The reference's rows are ordered (b, h, s); gathers a BSHD tensor in that order.
std::vector<float> gather_rows(const std::vector<float>& tensor, const std::vector<RowId>& rows,
                               int seqlen, int heads, int d) {
  std::vector<float> out;
  out.reserve(rows.size() * d);
  for (const RowId& r : rows) {
    const size_t at = ((static_cast<size_t>(r.b) * seqlen + r.s) * heads + r.h) * d;
    out.insert(out.end(), tensor.begin() + at, tensor.begin() + at + d);
  }
  return out;
}

// fp32 models against fp64: a few fp32 roundings per accumulated term.
constexpr double kFp32RelL2 = 1e-5;
constexpr double kFp32MaxAbs = 1e-5;

::testing::AssertionResult close_to(const std::vector<float>& out, const std::vector<double>& ref,
                                    double rel_l2 = kFp32RelL2, double max_abs = kFp32MaxAbs) {
  if (out.size() != ref.size()) return ::testing::AssertionFailure() << "size mismatch";
  const ErrorStats e = compare(out.data(), ref.data(), out.size());
  const Tolerance t{max_abs, rel_l2};
  if (within(e, t)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << describe(e, t) << " worst at " << e.worst;
}

struct Case {
  const char* name;
  ProblemShape shape;
};

std::vector<Case> model_cases() {
  return {
      {"mha", make_shape(1, 2, 2, 37, 37, 16, false)},
      {"mha_causal", make_shape(1, 2, 2, 37, 37, 16, true)},
      {"gqa_wide", make_shape(2, 4, 2, 20, 33, 8, false)},
      {"gqa_wide_causal", make_shape(2, 4, 2, 20, 33, 8, true)},
      {"mqa_tall_causal", make_shape(1, 3, 1, 29, 11, 8, true)},  // 18 rows see no key
      {"single", make_shape(1, 1, 1, 1, 1, 4, true)},
  };
}

constexpr int kBlocks[][2] = {{16, 16}, {7, 5}, {64, 64}};

TEST(CpuModels, ForwardModelsMatchOracle) {
  for (const Case& c : model_cases()) {
    const HostProblem p = make_problem(c.shape, InputSpec{31});
    const std::vector<RowId> rows = all_q_rows(p.shape);
    const ForwardRef ref = reference_forward(p, rows);
    const int n_q = c.shape.seqlen_q, h = c.shape.heads, d = c.shape.head_dim;
    auto check = [&](const ForwardResult& r, const std::string& what) {
      SCOPED_TRACE(std::string(c.name) + " " + what);
      EXPECT_TRUE(close_to(gather_rows(r.o, rows, n_q, h, d), ref.o));
      EXPECT_TRUE(close_to(r.lse, ref.lse));  // includes +inf == +inf for rows without keys
    };
    check(standard_forward(p), "standard");
    for (const auto& blocks : kBlocks) {
      const std::string tag = std::to_string(blocks[0]) + "x" + std::to_string(blocks[1]);
      check(fa1_forward(p, blocks[0], blocks[1]), "fa1 " + tag);
      check(fa2_forward(p, blocks[0], blocks[1]), "fa2 " + tag);
    }
  }
}

// Large inputs (scores in the thousands) must not overflow: the running max does its job.
TEST(CpuModels, LargeMagnitudeIsStable) {
  const HostProblem p = make_problem(make_shape(1, 2, 1, 24, 19, 16, true), InputSpec{4, 30.f});
  const std::vector<RowId> rows = all_q_rows(p.shape);
  const ForwardRef ref = reference_forward(p, rows);
  for (const ForwardResult& r : {standard_forward(p), fa1_forward(p, 7, 5), fa2_forward(p, 7, 5)}) {
    // fp32 scores of size ~10^3 carry absolute errors ~10^-4, which move the softmax weights.
    EXPECT_TRUE(close_to(gather_rows(r.o, rows, 24, 2, 16), ref.o, 1e-3, 1e-3));
    EXPECT_TRUE(close_to(r.lse, ref.lse, 1e-6, 1e-5));
  }
}

TEST(CpuModels, Fa2BackwardMatchesOracle) {
  for (const Case& c : model_cases()) {
    const HostProblem p = make_problem(c.shape, InputSpec{37});
    const std::vector<RowId> q_rows = all_q_rows(p.shape), kv_rows = all_kv_rows(p.shape);
    const BackwardRef ref = reference_backward(p, q_rows, kv_rows);
    const int n_q = c.shape.seqlen_q, n_k = c.shape.seqlen_k, d = c.shape.head_dim;
    for (const auto& blocks : kBlocks) {
      SCOPED_TRACE(std::string(c.name) + " " + std::to_string(blocks[0]) + "x" +
                   std::to_string(blocks[1]));
      const ForwardResult fwd = fa2_forward(p, blocks[0], blocks[1]);
      const BackwardResult r = fa2_backward(p, fwd, blocks[0], blocks[1]);
      EXPECT_TRUE(close_to(gather_rows(r.dq, q_rows, n_q, c.shape.heads, d), ref.dq));
      EXPECT_TRUE(close_to(gather_rows(r.dk, kv_rows, n_k, c.shape.heads_kv, d), ref.dk));
      EXPECT_TRUE(close_to(gather_rows(r.dv, kv_rows, n_k, c.shape.heads_kv, d), ref.dv));
    }
  }
}

TEST(CpuModels, RowsWithoutKeysGetZeroAndInfinity) {
  const HostProblem p = make_problem(make_shape(1, 1, 1, 9, 4, 8, true), InputSpec{2});
  for (const ForwardResult& r : {standard_forward(p), fa1_forward(p, 3, 2), fa2_forward(p, 3, 2)}) {
    for (int i = 0; i < 5; ++i) {
      EXPECT_EQ(r.lse[i], INFINITY) << i;
      for (int c = 0; c < 8; ++c) EXPECT_EQ(r.o[p.q_index(0, i, 0, c)], 0.f);
    }
    for (int i = 5; i < 9; ++i) EXPECT_TRUE(std::isfinite(r.lse[i])) << i;
    for (float x : r.o) EXPECT_FALSE(std::isnan(x));
  }
  const BackwardResult g = fa2_backward(p, fa2_forward(p, 3, 2), 3, 2);
  for (int i = 0; i < 5; ++i)
    for (int c = 0; c < 8; ++c) EXPECT_EQ(g.dq[p.q_index(0, i, 0, c)], 0.f);
  for (float x : g.dk) EXPECT_FALSE(std::isnan(x));
}

TEST(CpuModels, RejectsBadBlocks) {
  const HostProblem p = make_problem(make_shape(1, 1, 1, 4, 4, 4, false), InputSpec{});
  EXPECT_THROW(fa1_forward(p, 0, 4), std::invalid_argument);
  EXPECT_THROW(fa2_forward(p, 4, -1), std::invalid_argument);
}

// ---- IO counts: the closed forms of cpu_models.h ----

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

IoCount standard_io(const ProblemShape& s) {
  const int64_t bh = int64_t{s.batch} * s.heads, nq = s.seqlen_q, nk = s.seqlen_k, d = s.head_dim;
  return {bh * (nq * d + 2 * nk * d + 2 * nq * nk), bh * (2 * nq * nk + nq * d + nq)};
}

IoCount fa1_io(const ProblemShape& s, int br, int bc) {
  (void)br;
  const int64_t bh = int64_t{s.batch} * s.heads, bhkv = int64_t{s.batch} * s.heads_kv;
  const int64_t nq = s.seqlen_q, nk = s.seqlen_k, d = s.head_dim, tc = ceil_div(nk, bc);
  return {2 * bhkv * nk * d + tc * bh * nq * (2 * d + 2), (tc + 1) * bh * nq * (d + 2)};
}

// Keys of the K/V blocks Q block i visits (all of them without causal masking).
int64_t fa2_keys_visited(const ProblemShape& s, int br, int bc, int64_t i) {
  const int64_t nk = s.seqlen_k;
  if (!s.causal) return nk;
  const int64_t last_row = std::min<int64_t>((i + 1) * br, s.seqlen_q) - 1;
  const int64_t last_key = last_row + nk - s.seqlen_q;
  if (last_key < 0) return 0;
  return std::min(nk, bc * (last_key / bc + 1));
}

IoCount fa2_forward_io(const ProblemShape& s, int br, int bc) {
  const int64_t bh = int64_t{s.batch} * s.heads, nq = s.seqlen_q, d = s.head_dim;
  int64_t kv_reads = 0;
  for (int64_t i = 0; i < ceil_div(nq, br); ++i) kv_reads += 2 * d * fa2_keys_visited(s, br, bc, i);
  return {bh * (nq * d + kv_reads), bh * nq * (d + 1)};
}

IoCount fa2_backward_io(const ProblemShape& s, int br, int bc) {
  const int64_t bh = int64_t{s.batch} * s.heads, bhkv = int64_t{s.batch} * s.heads_kv;
  const int64_t nq = s.seqlen_q, nk = s.seqlen_k, d = s.head_dim;
  // Query rows of the inner steps taken, summed over K/V blocks (T_c N_q without causal).
  int64_t inner_rows = 0;
  for (int64_t j = 0; j < ceil_div(nk, bc); ++j)
    for (int64_t i = 0; i < ceil_div(nq, br); ++i) {
      const int64_t rows = std::min<int64_t>(br, nq - i * br);
      if (!s.causal || j * bc <= i * br + rows - 1 + nk - nq) inner_rows += rows;
    }
  if (!s.causal) {
    EXPECT_EQ(inner_rows, ceil_div(nk, bc) * nq);
  }
  return {2 * bh * nq * d + 2 * bhkv * nk * d + bh * inner_rows * (4 * d + 2),
          bh * nq * (d + 1) + bh * inner_rows * d + 2 * bhkv * nk * d};
}

void expect_io(const IoCount& got, const IoCount& want, const std::string& what) {
  EXPECT_EQ(got.reads, want.reads) << what;
  EXPECT_EQ(got.writes, want.writes) << what;
}

TEST(IoCount, ModelsMatchClosedForms) {
  for (const Case& c : model_cases()) {
    const HostProblem p = make_problem(c.shape, InputSpec{});
    expect_io(standard_forward(p).io, standard_io(c.shape), std::string(c.name) + " standard");
    for (const auto& blocks : kBlocks) {
      const int br = blocks[0], bc = blocks[1];
      const std::string tag =
          std::string(c.name) + " " + std::to_string(br) + "x" + std::to_string(bc);
      expect_io(fa1_forward(p, br, bc).io, fa1_io(c.shape, br, bc), tag + " fa1");
      const ForwardResult fwd = fa2_forward(p, br, bc);
      expect_io(fwd.io, fa2_forward_io(c.shape, br, bc), tag + " fa2 forward");
      expect_io(fa2_backward(p, fwd, br, bc).io, fa2_backward_io(c.shape, br, bc),
                tag + " fa2 backward");
    }
  }
}

// Hand check of one closed form: B=H=1, Nq=Nk=8, d=2, B_r=B_c=4, no mask.
TEST(IoCount, HandCountedFa2Forward) {
  const HostProblem p = make_problem(make_shape(1, 1, 1, 8, 8, 2, false), InputSpec{});
  const IoCount io = fa2_forward(p, 4, 4).io;
  EXPECT_EQ(io.reads, 8 * 2 + 2 * (2 * 8 * 2));  // Q once; K and V once per Q block (2 blocks)
  EXPECT_EQ(io.writes, 8 * 2 + 8);               // O and L
  EXPECT_EQ(io.total(), io.reads + io.writes);
}

// Causal skipping: the FA-2 models move fewer elements with the mask than without.
TEST(IoCount, CausalSkipsBlocksInFa2) {
  const ProblemShape dense = make_shape(1, 1, 1, 64, 64, 8, false);
  ProblemShape causal = dense;
  causal.causal = true;
  const HostProblem pd = make_problem(dense, InputSpec{}), pc = make_problem(causal, InputSpec{});
  EXPECT_LT(fa2_forward(pc, 16, 16).io.reads, fa2_forward(pd, 16, 16).io.reads);
  EXPECT_LT(fa2_backward(pc, fa2_forward(pc, 16, 16), 16, 16).io.total(),
            fa2_backward(pd, fa2_forward(pd, 16, 16), 16, 16).io.total());
  EXPECT_EQ(fa1_forward(pc, 16, 16).io.total(), fa1_forward(pd, 16, 16).io.total());
}

// Standard attention's IO grows with N^2 (S and P); FA-2's with N^2 d / B_r, far less.
TEST(IoCount, StandardGrowsQuadratically) {
  const HostProblem small = make_problem(make_shape(1, 1, 1, 128, 128, 16, false), InputSpec{});
  const HostProblem large = make_problem(make_shape(1, 1, 1, 256, 256, 16, false), InputSpec{});
  const double ratio = static_cast<double>(standard_forward(large).io.total()) /
                       static_cast<double>(standard_forward(small).io.total());
  EXPECT_GT(ratio, 3.5);
  EXPECT_LE(ratio, 4.0);
}

// The papers' point, in numbers: N = 1024, d = 64 with realistic blocks (FA-1: B_c = B_r = 64,
// what Algorithm 1 line 1 gives for ~64 KB of SRAM; FA-2: 128 x 64).
TEST(IoCount, FlashAttentionMovesLessThanStandard) {
  const HostProblem p = make_problem(make_shape(1, 1, 1, 1024, 1024, 64, false), InputSpec{});
  const int64_t standard = standard_forward(p).io.total();
  const int64_t fa1 = fa1_forward(p, 64, 64).io.total();
  const int64_t fa2 = fa2_forward(p, 128, 64).io.total();
  EXPECT_LT(fa1, standard);
  EXPECT_LT(fa2, fa1);
  EXPECT_LT(2 * fa2, fa1);  // FA-2 no longer re-reads and re-writes O, l and m
  RecordProperty("standard", std::to_string(standard));
  RecordProperty("fa1", std::to_string(fa1));
  RecordProperty("fa2", std::to_string(fa2));
}

}  // namespace
}  // namespace fa
