// Host tests of fa/problem.h: fp16/bf16 rounding, seeded inputs, indexing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "fa/problem.h"

namespace fa {
namespace {

float bits_to_float(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

TEST(RoundTo, Fp16KnownBitPatterns) {
  EXPECT_EQ(to_bits(FA_FP16, 1.0f), 0x3c00);
  EXPECT_EQ(to_bits(FA_FP16, -2.0f), 0xc000);
  EXPECT_EQ(to_bits(FA_FP16, 0.0f), 0x0000);
  EXPECT_EQ(to_bits(FA_FP16, -0.0f), 0x8000);
  EXPECT_EQ(to_bits(FA_FP16, 0.1f), 0x2e66);
  EXPECT_EQ(to_bits(FA_FP16, 65504.f), 0x7bff);  // largest finite
  EXPECT_EQ(to_bits(FA_FP16, 65519.f), 0x7bff);  // below the tie: stays finite
  EXPECT_EQ(to_bits(FA_FP16, 65520.f), 0x7c00);  // the tie rounds to even = inf
  EXPECT_EQ(to_bits(FA_FP16, -1e6f), 0xfc00);    // overflow to -inf
  EXPECT_EQ(to_bits(FA_FP16, std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(to_bits(FA_FP16, std::ldexp(1.f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(to_bits(FA_FP16, std::ldexp(1.f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(to_bits(FA_FP16, std::ldexp(1023.f, -24)), 0x03ff);
  EXPECT_EQ(to_bits(FA_FP16, std::ldexp(1.f, -25)), 0x0000);          // tie to even: 0
  EXPECT_EQ(to_bits(FA_FP16, std::ldexp(1.5f, -25)), 0x0001);         // above the tie
  EXPECT_EQ(to_bits(FA_FP16, std::ldexp(3.f, -25)), 0x0002);          // 1.5 ulp: tie to even 2
  EXPECT_EQ(to_bits(FA_FP16, std::ldexp(2047.f, -25)), 0x0400);       // rounds up into normals
  EXPECT_EQ(to_bits(FA_FP16, 1.f + std::ldexp(1.f, -11)), 0x3c00);    // tie, even down
  EXPECT_EQ(to_bits(FA_FP16, 1.f + std::ldexp(3.f, -11)), 0x3c02);    // tie, even up
  EXPECT_EQ(to_bits(FA_FP16, 1.f + std::ldexp(1.01f, -11)), 0x3c01);  // above the tie
  const uint16_t nan = to_bits(FA_FP16, std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(nan & 0x7c00, 0x7c00);
  EXPECT_NE(nan & 0x03ff, 0);
  EXPECT_TRUE(std::isnan(round_to(FA_FP16, std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(std::isnan(from_bits(FA_FP16, to_bits(FA_FP16, bits_to_float(0x7f800001u)))));
  EXPECT_EQ(from_bits(FA_FP16, 0x0001), std::ldexp(1.f, -24));
  EXPECT_EQ(from_bits(FA_FP16, 0x7bff), 65504.f);
  EXPECT_EQ(from_bits(FA_FP16, 0xfc00), -std::numeric_limits<float>::infinity());
}

TEST(RoundTo, Bf16KnownBitPatterns) {
  EXPECT_EQ(to_bits(FA_BF16, 1.0f), 0x3f80);
  EXPECT_EQ(to_bits(FA_BF16, 3.0f), 0x4040);
  EXPECT_EQ(to_bits(FA_BF16, -0.0f), 0x8000);
  EXPECT_EQ(to_bits(FA_BF16, 1.f + std::ldexp(1.f, -8)), 0x3f80);  // tie, even down
  EXPECT_EQ(to_bits(FA_BF16, 1.f + std::ldexp(3.f, -8)), 0x3f82);  // tie, even up
  EXPECT_EQ(to_bits(FA_BF16, 1.f + std::ldexp(1.f, -8) + std::ldexp(1.f, -20)), 0x3f81);
  EXPECT_EQ(to_bits(FA_BF16, std::numeric_limits<float>::max()), 0x7f80);  // overflow to inf
  EXPECT_EQ(to_bits(FA_BF16, bits_to_float(0x7f7f7fffu)), 0x7f7f);         // largest finite
  EXPECT_EQ(to_bits(FA_BF16, bits_to_float(0x00010000u)), 0x0001);         // subnormal kept
  const uint16_t nan = to_bits(FA_BF16, bits_to_float(0x7f800001u));       // signalling NaN
  EXPECT_EQ(nan & 0x7f80, 0x7f80);
  EXPECT_NE(nan & 0x007f, 0);  // still a NaN, not rounded into infinity
  EXPECT_EQ(from_bits(FA_BF16, 0xbf80), -1.f);
}

// Every non-NaN 16-bit pattern converts to float and back to itself.
TEST(RoundTo, AllPatternsRoundTrip) {
  for (fa_dtype dtype : {FA_FP16, FA_BF16}) {
    for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
      const float value = from_bits(dtype, static_cast<uint16_t>(bits));
      if (std::isnan(value)) continue;
      ASSERT_EQ(to_bits(dtype, value), bits) << dtype_name(dtype) << " " << bits;
    }
  }
}

// round_to is the nearest representable value: no neighbour of the result is closer.
TEST(RoundTo, IsNearest) {
  uint32_t state = 12345;
  for (fa_dtype dtype : {FA_FP16, FA_BF16}) {
    for (int n = 0; n < 20000; ++n) {
      state = state * 1664525u + 1013904223u;
      // Exponents around fp16's range, both signs.
      const float x = std::ldexp(static_cast<float>(state >> 8) / (1 << 24), (n % 44) - 27) *
                      (n % 2 ? -1.f : 1.f);
      const float r = round_to(dtype, x);
      const uint16_t bits = to_bits(dtype, x);
      for (int step : {-1, 1}) {
        const float neighbour = from_bits(dtype, static_cast<uint16_t>(bits + step));
        if (std::isnan(neighbour) || std::isinf(neighbour)) continue;
        if ((bits & 0x7fff) == 0 && step == -1) continue;  // below +-0 lies the other sign
        ASSERT_LE(std::abs(static_cast<double>(x) - r),
                  std::abs(static_cast<double>(x) - neighbour))
            << dtype_name(dtype) << " x=" << x;
      }
    }
  }
}

TEST(Dtype, NamesAndParsing) {
  EXPECT_STREQ(dtype_name(FA_FP16), "fp16");
  EXPECT_STREQ(dtype_name(FA_BF16), "bf16");
  fa_dtype d = FA_FP16;
  EXPECT_TRUE(parse_dtype("bf16", &d));
  EXPECT_EQ(d, FA_BF16);
  EXPECT_TRUE(parse_dtype("half", &d));
  EXPECT_EQ(d, FA_FP16);
  EXPECT_TRUE(parse_dtype("BFloat16", &d));
  EXPECT_EQ(d, FA_BF16);
  EXPECT_FALSE(parse_dtype("fp32", &d));
  EXPECT_EQ(d, FA_BF16);  // unchanged on failure
}

TEST(ProblemShape, ScaleAndDescribe) {
  ProblemShape s;
  s.head_dim = 64;
  EXPECT_FLOAT_EQ(s.effective_scale(), 0.125f);
  s.scale = 0.3f;
  EXPECT_FLOAT_EQ(s.effective_scale(), 0.3f);
  s = make_shape(1, 16, 16, 4096, 4096, 128, true);
  EXPECT_EQ(s.describe(), "B=1 H=16/16 Nq=4096 Nk=4096 d=128 fp16 causal");
  s.causal = false;
  s.dtype = FA_BF16;
  EXPECT_EQ(s.describe(), "B=1 H=16/16 Nq=4096 Nk=4096 d=128 bf16");
}

TEST(ProblemShape, MakeShapeSetsEveryField) {
  const ProblemShape s = make_shape(2, 12, 4, 100, 77, 64, true, FA_BF16);
  EXPECT_EQ(s.batch, 2);
  EXPECT_EQ(s.heads, 12);
  EXPECT_EQ(s.heads_kv, 4);
  EXPECT_EQ(s.seqlen_q, 100);
  EXPECT_EQ(s.seqlen_k, 77);
  EXPECT_EQ(s.head_dim, 64);
  EXPECT_TRUE(s.causal);
  EXPECT_EQ(s.dtype, FA_BF16);
  EXPECT_EQ(s.scale, 0.f);  // the usual 1/sqrt(d)
  const ProblemShape plain = make_shape(1, 2, 2, 3, 3, 8);
  EXPECT_FALSE(plain.causal);
  EXPECT_EQ(plain.dtype, FA_FP16);
}

ProblemShape small_shape(fa_dtype dtype = FA_FP16) {
  return make_shape(2, 4, 2, 7, 9, 16, false, dtype);
}

TEST(HostProblem, Indexing) {
  const HostProblem p = make_problem(small_shape(), InputSpec{});
  // BSHD: ((b * N + s) * H + h) * d + c.
  EXPECT_EQ(p.q_index(1, 2, 3, 4), ((1u * 7 + 2) * 4 + 3) * 16 + 4);
  EXPECT_EQ(p.kv_index(1, 8, 1, 15), ((1u * 9 + 8) * 2 + 1) * 16 + 15);
  EXPECT_EQ(p.lse_index(1, 3, 6), (1u * 4 + 3) * 7 + 6);
  EXPECT_EQ(p.q.size(), 2u * 7 * 4 * 16);
  EXPECT_EQ(p.k.size(), 2u * 9 * 2 * 16);
  EXPECT_EQ(p.v.size(), p.k.size());
  EXPECT_EQ(p.d_o.size(), p.q.size());
  EXPECT_EQ(p.q_index(1, 6, 3, 15) + 1, p.q.size());
  EXPECT_EQ(p.kv_index(1, 8, 1, 15) + 1, p.k.size());
}

TEST(MakeProblem, DeterministicAndSeedDependent) {
  InputSpec spec;
  spec.seed = 42;
  const HostProblem a = make_problem(small_shape(), spec);
  const HostProblem b = make_problem(small_shape(), spec);
  EXPECT_EQ(a.q, b.q);
  EXPECT_EQ(a.k, b.k);
  EXPECT_EQ(a.v, b.v);
  EXPECT_EQ(a.d_o, b.d_o);
  spec.seed = 43;
  const HostProblem c = make_problem(small_shape(), spec);
  EXPECT_NE(a.q, c.q);
  EXPECT_NE(a.k, c.k);
  EXPECT_NE(a.v, c.v);
  EXPECT_NE(a.d_o, c.d_o);
  // The four tensors are different streams, not copies of one another.
  EXPECT_NE(std::vector<float>(a.q.begin(), a.q.begin() + 16),
            std::vector<float>(a.d_o.begin(), a.d_o.begin() + 16));
}

// The generator is part of the "same seed, same inputs everywhere" promise: pin a few values
// so that a change to it is a visible, deliberate decision.
TEST(MakeProblem, PinnedValues) {
  ProblemShape s = small_shape(FA_FP16);
  InputSpec spec;
  spec.seed = 7;
  const HostProblem p = make_problem(s, spec);
  double checksum = 0;
  for (size_t i = 0; i < p.q.size(); ++i) checksum += p.q[i] * static_cast<double>(i % 13 + 1);
  for (size_t i = 0; i < p.v.size(); ++i) checksum += p.v[i] * static_cast<double>(i % 7 + 1);
  EXPECT_EQ(checksum, 0x1.4e97f2978p+10);  // exact: fp16 values times small integers
  EXPECT_EQ(p.q[0], 0x1.ff4p-4f);
  EXPECT_EQ(p.k[5], 0x1.ccp-2f);
  EXPECT_EQ(p.v[0], 0x1.364p-1f);
  EXPECT_EQ(p.d_o.back(), 0x1.19cp-1f);
}

TEST(MakeProblem, ValuesRepresentableAndInRange) {
  for (fa_dtype dtype : {FA_FP16, FA_BF16}) {
    InputSpec spec;
    spec.seed = 3;
    spec.magnitude = 60.f;
    spec.v_offset = 0.5f;
    const HostProblem p = make_problem(small_shape(dtype), spec);
    auto check = [&](const std::vector<float>& t, float lo, float hi, const char* name) {
      size_t bad = 0, nonzero = 0;
      double sum = 0;
      for (float x : t) {
        bad += round_to(dtype, x) != x || !(x >= lo && x <= hi);
        nonzero += x != 0.f;
        sum += x;
      }
      EXPECT_EQ(bad, 0u) << name << " values not representable or out of range";
      EXPECT_GT(nonzero, t.size() / 2) << name;
      return sum / t.size();
    };
    const double q_mean = check(p.q, -60.f, 60.f, "q");
    check(p.k, -60.f, 60.f, "k");
    const double v_mean = check(p.v, -0.5f, 1.5f, "v");
    const double do_mean = check(p.d_o, -0.5f, 1.5f, "d_o");
    EXPECT_NEAR(q_mean, 0.0, 10.0);  // 896 draws of sd ~35
    EXPECT_NEAR(v_mean, 0.5, 0.15);
    EXPECT_NEAR(do_mean, 0.5, 0.15);
    // Uses the whole range, not a sliver of it.
    float q_max = 0;
    for (float x : p.q) q_max = std::max(q_max, std::abs(x));
    EXPECT_GT(q_max, 50.f);
  }
}

TEST(MakeProblem, RejectsBadShapes) {
  ProblemShape s = small_shape();
  s.heads_kv = 3;  // does not divide 4
  EXPECT_THROW(make_problem(s, InputSpec{}), std::invalid_argument);
  s = small_shape();
  s.seqlen_k = 0;
  EXPECT_THROW(make_problem(s, InputSpec{}), std::invalid_argument);
}

}  // namespace
}  // namespace fa
