/// \file metrics.cpp
/// \brief Error statistics against the fp64 oracle, and the per-dtype bounds.
#include "fa/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

namespace fa {

double underflow_unit(fa_dtype dtype) {
  return dtype == FA_BF16 ? 0x1.0p-126 : 0x1.0p-25;
}

double underflow_threshold(fa_dtype dtype) {
  return dtype == FA_BF16 ? 0x1.0p-125 : 0x1.0p-13;
}

ErrorStats compare(const float* out, const double* ref, size_t n, const double* mag,
                   const double* floor) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  ErrorStats e;
  e.count = n;
  double err_sq = 0, ref_sq = 0, mag_sq = 0, mag_max = 0, worst_err = -1, worst_raw = -1,
         max_abs = 0;
  for (size_t i = 0; i < n; ++i) {
    const double o = out[i];
    const double r = ref[i];
    if (std::isinf(r) && o == r) continue;  // the same infinity (lse of a row with no key)
    if (!std::isfinite(o) || !std::isfinite(r)) {
      // NaN or inf where the reference is finite (or a finite value where it is infinite):
      // an unwritten (poisoned) element or an overflow. Always a failure.
      if (e.non_finite == 0) e.worst = i;
      ++e.non_finite;
      continue;
    }
    const double raw = std::abs(o - r);
    max_abs = std::max(max_abs, raw);
    // The part of the error that underflowing terms cannot explain (all of it without a floor).
    const double err = floor != nullptr ? std::max(raw - floor[i], 0.0) : raw;
    if (floor != nullptr) e.floor_max = std::max(e.floor_max, floor[i]);
    err_sq += err * err;
    ref_sq += r * r;
    if (mag != nullptr) {
      mag_sq += mag[i] * mag[i];
      mag_max = std::max(mag_max, std::abs(mag[i]));
    }
    e.ref_max = std::max(e.ref_max, std::abs(r));
    // The worst element: the largest error beyond the floor, then the largest raw error.
    if (e.non_finite == 0 && (err > worst_err || (err == worst_err && raw > worst_raw))) {
      worst_err = err;
      worst_raw = raw;
      e.worst = i;
    }
  }
  e.abs_scale = std::max({e.ref_max, mag_max / kCancellationFloor, 1.0});
  if (e.non_finite > 0) {
    e.max_abs = e.max_excess = kInf;
    e.rel_l2 = kInf;
    return e;
  }
  e.max_abs = max_abs;
  e.max_excess = std::max(worst_err, 0.0);
  const double denominator = std::max(std::sqrt(ref_sq), std::sqrt(mag_sq) / kCancellationFloor);
  if (denominator > 0) {
    e.rel_l2 = std::sqrt(err_sq) / denominator;
  } else {
    e.rel_l2 = err_sq > 0 ? kInf : 0.0;  // a zero reference must be matched exactly
  }
  return e;
}

// The numbers and their reasoning are documented on the declaration (metrics.h).
Tolerance tolerance(fa_dtype dtype, Quantity what) {
  const double eps = dtype == FA_BF16 ? 0x1.0p-7 : 0x1.0p-10;
  switch (what) {
    case Quantity::kOutput:
      return {4 * eps, eps};
    case Quantity::kLse:
      return {1e-4, 1e-4};
    case Quantity::kGradient:
      return {16 * eps, 4 * eps};
  }
  return {0, 0};
}

bool within(const ErrorStats& e, const Tolerance& t) {
  // Written as "<=" so that a NaN anywhere fails.
  return e.non_finite == 0 && e.max_excess <= t.max_abs_rel * e.abs_scale && e.rel_l2 <= t.rel_l2;
}

std::string describe(const ErrorStats& e, const Tolerance& t) {
  char text[200], floor[64] = "";
  if (e.floor_max > 0)
    std::snprintf(floor, sizeof floor, " + underflow floor <= %.1e", e.floor_max);
  std::snprintf(text, sizeof text, "max|out-ref| %.1e (bound %.1e%s)  rel_l2 %.1e (bound %.1e)",
                e.max_abs, t.max_abs_rel * e.abs_scale, floor, e.rel_l2, t.rel_l2);
  std::string out(text);
  if (e.non_finite > 0) {
    std::snprintf(text, sizeof text, "  non-finite %zu (first at %zu)", e.non_finite, e.worst);
    out += text;
  }
  return out;
}

}  // namespace fa
