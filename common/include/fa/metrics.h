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
  /// \f$\max_i \max(|out_i - ref_i| - floor_i, 0)\f$: the error the underflow floor does not
  /// explain (equal to max_abs without a floor, see compare()). This is what the bound checks.
  double max_excess = 0;
  /// \f$\|e\|_2 / \|ref\|_2\f$ with \f$e_i = \max(|out_i - ref_i| - floor_i, 0)\f$, i.e.
  /// \f$\|out - ref\|_2 / \|ref\|_2\f$ without a floor (denominator: see compare())
  double rel_l2 = 0;
  double ref_max = 0;    ///< \f$\max_i |ref_i|\f$
  double floor_max = 0;  ///< \f$\max_i floor_i\f$ (0 without a floor)
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

/// The largest absolute error a correct kernel makes when it rounds one value that lies below
/// the dtype's normal range (a probability \f$P_{ij}\f$ or a \f$dS_{ij}\f$ near 0): half the
/// spacing of fp16's subnormals, \f$2^{-25}\f$; for bf16 \f$2^{-126}\f$, the fp32 flush to
/// zero of the exponential (\f$2^{x}\f$ computed with ex2.approx.ftz), which is larger than
/// bf16's own subnormal spacing. Above the normal threshold rounding is relative
/// (\f$\epsilon/2\f$) and the relative bounds cover it.
double underflow_unit(fa_dtype dtype);

/// Values below this magnitude are rounded with the absolute error underflow_unit() rather than a
/// relative one: twice the dtype's smallest normal (\f$2^{-13}\f$ for fp16, \f$2^{-125}\f$
/// for bf16), the factor 2 covering the kernel's own small difference from the exact value.
double underflow_threshold(fa_dtype dtype);

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
///
/// With `floor` (the underflow floor of each element, see BackwardRef::dq_floor: the sum of
/// the absolute errors that rounding every underflowing term of it can make), each element's
/// error is first reduced by its floor, \f$e_i = \max(|out_i - ref_i| - floor_i, 0)\f$, and
/// max_excess and rel_l2 measure \f$e\f$. The floor is a worst case, not a tolerance: it is 0
/// wherever no term underflows, and an error beyond it still has to meet the relative bounds.
ErrorStats compare(const float* out, const double* ref, size_t n, const double* mag = nullptr,
                   const double* floor = nullptr);

/// What is being checked; the backward's gradients get looser bounds than the forward.
enum class Quantity {
  kOutput,   ///< the forward output O (in the dtype)
  kLse,      ///< the logsumexp L (fp32)
  kGradient  ///< dQ, dK, dV (in the dtype)
};

/// Bounds an output must meet: `max_excess <= max_abs_rel * abs_scale` and
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
///
/// Two refinements, both computed by the oracle for the gradients (compare()):
/// - the cancellation floor (kCancellationFloor): a gradient that is a cancellation of much
///   larger terms is measured against 1/16 of those terms' magnitude;
/// - the underflow floor: where a probability \f$P_{ij}\f$ or a \f$dS_{ij}\f$ lies below the
///   dtype's normal range (underflow_threshold()), rounding it is an absolute error of up to
///   underflow_unit() (\f$2^{-25}\f$ in fp16), not a relative one, and a gradient summed only
///   from such terms (a key that no query row attends to when the softmax is one-hot) can be
///   rounded to 0 by a correct kernel. Each element's error is reduced by the sum of those
///   worst cases before the bounds above are applied.
/// The forward's O needs neither: V has an offset (InputSpec::v_offset), so \f$\|O\|_2\f$ is
/// never small against its terms, and a probability's underflow error (\f$2^{-25}\f$ per key)
/// stays far below \f$\epsilon\,\|O\|\f$.
Tolerance tolerance(fa_dtype dtype, Quantity what);

/// True if `e` is within `t`.
bool within(const ErrorStats& e, const Tolerance& t);

/// "max|out-ref| 1.2e-03 (bound 3.9e-03)  rel_l2 3.1e-04 (bound 9.8e-04)"; with an underflow
/// floor, "max|out-ref| 4.0e-10 (bound 1.6e-02 + underflow floor <= 2.0e-06)  rel_l2 ...".
std::string describe(const ErrorStats& e, const Tolerance& t);

}  // namespace fa

#endif  // FA_METRICS_H_
