/// \file metrics.h
/// \brief Error metrics against the oracle, and the per-dtype bounds they must meet.
#ifndef FA_METRICS_H_
#define FA_METRICS_H_

#include <cstddef>
#include <string>

#include "fa/api.h"

namespace fa {

/// How far an output is from its reference.
struct ErrorStats {
  double max_abs = 0;  ///< \f$\max_i |out_i - ref_i|\f$ (infinite if any NaN/inf)
  double rel_l2 = 0;   ///< \f$\|out - ref\|_2 / \|ref\|_2\f$
  double ref_max = 0;  ///< \f$\max_i |ref_i|\f$
  /// The scale absolute errors are measured against:
  /// \f$\max(\max_i |ref_i|,\ \max_i mag_i / 16,\ 1)\f$ (see compare()).
  double abs_scale = 1;
  size_t worst = 0;       ///< index of the largest error
  size_t non_finite = 0;  ///< outputs that are NaN or infinite where the reference is finite
  size_t count = 0;       ///< elements compared
};

/// A gradient that is a cancellation of terms this many times larger than itself is measured
/// against 1/kCancellationFloor of the terms' magnitude instead of its own (see compare()).
constexpr double kCancellationFloor = 16.0;

/// Compares `n` outputs with their fp64 reference.
/// With `mag` (the magnitude of the terms each reference value is summed from, see
/// BackwardRef::dq_mag), the relative error's denominator is
/// \f$\max(\|ref\|_2, \|mag\|_2 / 16)\f$, and the absolute error's scale likewise includes
/// \f$\max_i mag_i / 16\f$: both unchanged unless the reference is a cancellation
/// of much larger terms (a one-hot softmax makes \f$dP - D\f$ vanish, a single key makes dQ and
/// dK exactly 0), where rounding of those terms, which no kernel can avoid, sets the error. Pairs
/// where both are the same infinity (the +inf logsumexp of a row that sees no key) count as exact.
/// Any other pair with a NaN or an infinity (a poisoned, unwritten output, an overflow, or a finite
/// output where the reference is infinite) counts in `non_finite` and makes `max_abs` and `rel_l2`
/// infinite; `worst` is then the first such element.
ErrorStats compare(const float* out, const double* ref, size_t n, const double* mag = nullptr);

/// What is being checked; the backward's gradients get looser bounds than the forward.
enum class Quantity {
  kOutput,   ///< the forward output O (in the dtype)
  kLse,      ///< the logsumexp L (fp32)
  kGradient  ///< dQ, dK, dV (in the dtype)
};

/// Bounds an output must meet: `max_abs <= max_abs_rel * abs_scale` and
/// `rel_l2 <= rel_l2`, and no non-finite values. See tolerance() for the numbers and why.
struct Tolerance {
  double max_abs_rel;  ///< bound on max_abs, relative to \f$\max(\mathrm{ref\_max}, 1)\f$
  double rel_l2;       ///< bound on rel_l2
};

/// The one place the bounds are written, per dtype and quantity. With
/// \f$\epsilon = 2^{-10}\f$ for fp16 and \f$2^{-7}\f$ for bf16 (the spacing of the values in
/// \f$[1, 2)\f$, i.e. twice the unit roundoff):
///
/// - **kOutput** (O): max_abs_rel \f$= 4\epsilon\f$, rel_l2 \f$= \epsilon\f$. Storing O in
///   the dtype alone costs up to \f$\epsilon/2\f$ relative (\f$2^{-11}\f$ for fp16). The kernels
///   also round \f$P\f$ (values in [0, 1]) to the dtype before the tensor-core product
///   \f$P V\f$, an error of up to \f$\epsilon/2\f$ per weight, which averages out over the
///   keys in the L2 norm but not always in the worst element. Scores and accumulation are fp32
///   (\f$2^{-24}\f$), negligible here. Four roundings of headroom for the worst element, one
///   for the norm.
/// - **kLse** (L): \f$10^{-4}\f$ for both, independent of the dtype: L is written in fp32 and
///   computed from fp32 scores of exactly representable inputs, so only fp32 rounding of the
///   \f$d\f$-term dot products, the exponentials and the row sum enter (\f$\sim\sqrt{d}\,
///   2^{-24}\f$ relative to \f$|S|\f$). The bound is relative to \f$\max(|L|, 1)\f$, so it also
///   holds for the large scores of large-magnitude inputs.
/// - **kGradient** (dQ, dK, dV): max_abs_rel \f$= 16\epsilon\f$, rel_l2 \f$= 4\epsilon\f$. The
///   backward recomputes \f$P\f$, rounds it and \f$dS = P \circ (dP - D)\f$ to the dtype
///   before the products \f$dS\,K\f$, \f$dS^T Q\f$ and \f$P^T dO\f$, and \f$dP - D\f$ cancels:
///   both terms are \f$O(1)\f$ while their difference is often much smaller, so the relative
///   error of \f$dS\f$ grows beyond one rounding. Sums over many keys (dQ) or query rows of a
///   whole group (dK, dV) add more terms. Hence four times the output's bounds.
///
/// bf16 gets bounds \f$8\times\f$ looser than fp16 because its \f$\epsilon\f$ is.
Tolerance tolerance(fa_dtype dtype, Quantity what);

/// True if `e` is within `t`.
bool within(const ErrorStats& e, const Tolerance& t);

/// "max|out-ref| 1.2e-03 (bound 3.9e-03)  rel_l2 3.1e-04 (bound 9.8e-04)".
std::string describe(const ErrorStats& e, const Tolerance& t);

}  // namespace fa

#endif  // FA_METRICS_H_
