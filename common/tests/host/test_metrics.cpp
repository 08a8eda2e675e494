// Host tests of fa/metrics.h: error statistics and the per-dtype bounds.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "fa/metrics.h"

namespace fa {
namespace {

constexpr float kInfF = std::numeric_limits<float>::infinity();
constexpr double kInf = std::numeric_limits<double>::infinity();

TEST(Compare, HandCase) {
  const float out[] = {1.f, 2.f, 3.f};
  const double ref[] = {1.0, 2.5, 2.0};
  const ErrorStats e = compare(out, ref, 3);
  EXPECT_EQ(e.count, 3u);
  EXPECT_EQ(e.non_finite, 0u);
  EXPECT_DOUBLE_EQ(e.max_abs, 1.0);
  EXPECT_EQ(e.worst, 2u);
  EXPECT_DOUBLE_EQ(e.ref_max, 2.5);
  // ||(0, -0.5, 1)|| / ||(1, 2.5, 2)|| = sqrt(1.25 / 11.25) = 1/3.
  EXPECT_NEAR(e.rel_l2, 1.0 / 3.0, 1e-15);
}

TEST(Compare, ExactMatchIsZero) {
  const float out[] = {0.25f, -4.f};
  const double ref[] = {0.25, -4.0};
  const ErrorStats e = compare(out, ref, 2);
  EXPECT_EQ(e.max_abs, 0.0);
  EXPECT_EQ(e.rel_l2, 0.0);
  EXPECT_TRUE(within(e, tolerance(FA_FP16, Quantity::kOutput)));
}

TEST(Compare, NanIsDetected) {
  const float out[] = {1.f, std::numeric_limits<float>::quiet_NaN(), 3.f};
  const double ref[] = {1.0, 2.0, 3.0};
  const ErrorStats e = compare(out, ref, 3);
  EXPECT_EQ(e.non_finite, 1u);
  EXPECT_EQ(e.worst, 1u);
  EXPECT_EQ(e.max_abs, kInf);
  EXPECT_FALSE(within(e, Tolerance{1e9, 1e9}));  // no bound lets a NaN through
}

TEST(Compare, InfinitiesMatchOnlyTheSameInfinity) {
  const double ref[] = {kInf, 1.0};
  const float same[] = {kInfF, 1.f};
  const ErrorStats ok = compare(same, ref, 2);
  EXPECT_EQ(ok.non_finite, 0u);
  EXPECT_EQ(ok.max_abs, 0.0);
  EXPECT_EQ(ok.rel_l2, 0.0);
  EXPECT_TRUE(within(ok, tolerance(FA_FP16, Quantity::kLse)));

  const float negated[] = {-kInfF, 1.f};
  EXPECT_EQ(compare(negated, ref, 2).non_finite, 1u);
  const float finite[] = {1e30f, 1.f};  // a finite lse where the row sees no key
  EXPECT_EQ(compare(finite, ref, 2).non_finite, 1u);
  const double finite_ref[] = {5.0, 1.0};
  const ErrorStats overflow = compare(same, finite_ref, 2);  // inf where ref is finite
  EXPECT_EQ(overflow.non_finite, 1u);
  EXPECT_EQ(overflow.worst, 0u);
  EXPECT_FALSE(within(overflow, Tolerance{1e9, 1e9}));
}

TEST(Within, BoundsScaleWithReferenceMaximum) {
  const Tolerance t{0.01, 1.0};
  ErrorStats e;
  e.ref_max = 0.5;  // below 1: the bound is 0.01 absolute
  e.max_excess = 0.01;
  EXPECT_TRUE(within(e, t));
  e.max_excess = 0.0101;
  EXPECT_FALSE(within(e, t));
  e.ref_max = e.abs_scale = 10;  // the bound is 0.1 (compare() sets abs_scale)
  e.max_excess = 0.09;
  EXPECT_TRUE(within(e, t));
  e.rel_l2 = 1.5;
  EXPECT_FALSE(within(e, t));
  e.rel_l2 = std::nan("");
  EXPECT_FALSE(within(e, t));
}

TEST(Tolerance, ValuesAndOrdering) {
  const double fp16_eps = std::ldexp(1.0, -10), bf16_eps = std::ldexp(1.0, -7);
  EXPECT_EQ(tolerance(FA_FP16, Quantity::kOutput).max_abs_rel, 4 * fp16_eps);
  EXPECT_EQ(tolerance(FA_FP16, Quantity::kOutput).rel_l2, fp16_eps);
  EXPECT_EQ(tolerance(FA_BF16, Quantity::kGradient).max_abs_rel, 16 * bf16_eps);
  EXPECT_EQ(tolerance(FA_BF16, Quantity::kGradient).rel_l2, 4 * bf16_eps);
  EXPECT_EQ(tolerance(FA_FP16, Quantity::kLse).max_abs_rel, 1e-4);
  for (Quantity q : {Quantity::kOutput, Quantity::kGradient}) {
    EXPECT_GT(tolerance(FA_BF16, q).max_abs_rel, tolerance(FA_FP16, q).max_abs_rel);
    EXPECT_GT(tolerance(FA_BF16, q).rel_l2, tolerance(FA_FP16, q).rel_l2);
  }
  for (fa_dtype d : {FA_FP16, FA_BF16}) {
    const Tolerance out = tolerance(d, Quantity::kOutput), grad = tolerance(d, Quantity::kGradient);
    EXPECT_GT(grad.max_abs_rel, out.max_abs_rel);
    EXPECT_GT(grad.rel_l2, out.rel_l2);
    EXPECT_LE(out.rel_l2, out.max_abs_rel);
    // A dtype's own rounding of the output (half an ulp) must pass its output bound.
    EXPECT_GT(out.rel_l2, (d == FA_BF16 ? bf16_eps : fp16_eps) / 2);
  }
  // L is fp32: far tighter than any 16-bit output bound.
  EXPECT_LT(tolerance(FA_FP16, Quantity::kLse).max_abs_rel,
            tolerance(FA_FP16, Quantity::kOutput).max_abs_rel);
}

TEST(Describe, MentionsValuesAndBounds) {
  const float out[] = {1.f, 2.f};
  const double ref[] = {1.0, 2.5};
  const ErrorStats e = compare(out, ref, 2);
  const std::string text = describe(e, Tolerance{0.01, 0.002});
  EXPECT_NE(text.find("max|out-ref| 5.0e-01 (bound 2.5e-02)"), std::string::npos) << text;
  EXPECT_NE(text.find("rel_l2"), std::string::npos) << text;
  EXPECT_NE(text.find("(bound 2.0e-03)"), std::string::npos) << text;
  const float nan_out[] = {std::numeric_limits<float>::quiet_NaN(), 2.f};
  EXPECT_NE(describe(compare(nan_out, ref, 2), Tolerance{0.01, 0.002}).find("non-finite 1"),
            std::string::npos);
}

}  // namespace
}  // namespace fa

namespace fa {
namespace {

TEST(CancellationFloor, ZeroReferenceIsMeasuredAgainstTheTermsMagnitude) {
  const std::vector<double> ref(64, 0.0), mag(64, 1.0);
  std::vector<float> out(64, 1e-6f);  // rounding noise around an exact cancellation
  EXPECT_TRUE(std::isinf(compare(out.data(), ref.data(), out.size()).rel_l2));
  const ErrorStats e = compare(out.data(), ref.data(), out.size(), mag.data());
  EXPECT_NEAR(e.rel_l2, 1e-6 * kCancellationFloor, 1e-9);
  EXPECT_TRUE(within(e, tolerance(FA_FP16, Quantity::kGradient)));
  // A wrong kernel still fails: an error as large as the terms themselves.
  std::fill(out.begin(), out.end(), 0.5f);
  EXPECT_FALSE(within(compare(out.data(), ref.data(), out.size(), mag.data()),
                      tolerance(FA_BF16, Quantity::kGradient)));
}

TEST(CancellationFloor, AbsoluteScaleIsTheLargestOfRefMagAndOne) {
  const std::vector<double> ref = {0.5, -0.25}, small_mag = {0.5, 0.3}, big_mag = {64.0, 1.0};
  const std::vector<float> out = {0.5f, -0.25f};
  EXPECT_DOUBLE_EQ(compare(out.data(), ref.data(), 2).abs_scale, 1.0);
  EXPECT_DOUBLE_EQ(compare(out.data(), ref.data(), 2, small_mag.data()).abs_scale, 1.0);
  EXPECT_DOUBLE_EQ(compare(out.data(), ref.data(), 2, big_mag.data()).abs_scale,
                   64.0 / kCancellationFloor);
  const std::vector<double> big_ref = {8.0, 1.0};
  EXPECT_DOUBLE_EQ(compare(out.data(), big_ref.data(), 2).abs_scale, 8.0);
}

TEST(CancellationFloor, NoEffectWithoutCancellation) {
  const std::vector<double> ref = {1.0, -2.0, 3.0}, mag = {1.0, 2.0, 3.0};
  const std::vector<float> out = {1.01f, -2.0f, 3.0f};
  EXPECT_DOUBLE_EQ(compare(out.data(), ref.data(), 3, mag.data()).rel_l2,
                   compare(out.data(), ref.data(), 3).rel_l2);
}

}  // namespace
}  // namespace fa

namespace fa {
namespace {

TEST(UnderflowFloorCompare, OnlyTheErrorBeyondTheFloorCounts) {
  const std::vector<double> ref = {1e-10, 2e-10, 1.0}, floor = {2e-6, 2e-6, 0.0};
  const std::vector<float> zero_out = {0.f, 0.f, 1.f};  // the tiny ones rounded to 0
  const ErrorStats without = compare(zero_out.data(), ref.data(), 3);
  EXPECT_GT(without.rel_l2, 0.0);
  const ErrorStats e = compare(zero_out.data(), ref.data(), 3, nullptr, floor.data());
  EXPECT_EQ(e.max_excess, 0.0);
  EXPECT_EQ(e.rel_l2, 0.0);
  EXPECT_DOUBLE_EQ(e.max_abs, 2e-10);  // the raw error is still reported
  EXPECT_DOUBLE_EQ(e.floor_max, 2e-6);
  EXPECT_EQ(e.worst, 1u);
  // An error beyond the floor counts by what exceeds it.
  const std::vector<float> off = {5e-6f, 0.f, 1.f};
  const ErrorStats f = compare(off.data(), ref.data(), 3, nullptr, floor.data());
  EXPECT_NEAR(f.max_excess, 5e-6 - 1e-10 - 2e-6, 1e-12);
  EXPECT_EQ(f.worst, 0u);
  // No floor on an element: its whole error counts, however small the others' are.
  const std::vector<float> wrong = {0.f, 0.f, 1.5f};
  EXPECT_FALSE(within(compare(wrong.data(), ref.data(), 3, nullptr, floor.data()),
                      tolerance(FA_BF16, Quantity::kGradient)));
}

TEST(UnderflowFloorCompare, DescribeNamesTheFloor) {
  const std::vector<double> ref = {1e-10}, floor = {1.5e-6};
  const std::vector<float> out = {0.f};
  const std::string text =
      describe(compare(out.data(), ref.data(), 1, nullptr, floor.data()), Tolerance{0.01, 0.1});
  EXPECT_NE(text.find("+ underflow floor <= 1.5e-06"), std::string::npos) << text;
  EXPECT_EQ(describe(compare(out.data(), ref.data(), 1), Tolerance{0.01, 0.1}).find("floor"),
            std::string::npos);
}

}  // namespace
}  // namespace fa
