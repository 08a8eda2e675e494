/// \file oracle.h
/// \brief The fp64 CPU reference: forward O and logsumexp L, backward dQ, dK, dV.
///
/// Everything is computed in double from the problem's (already rounded) inputs, on the
/// rows asked for, so large problems can be checked on a sample of rows. Work is spread over
/// the machine's cores.
#ifndef FA_ORACLE_H_
#define FA_ORACLE_H_

#include <vector>

#include "fa/problem.h"

namespace fa {

/// One row of one head: batch b, head h (a query head for Q rows, a key/value head for K
/// rows), position s in the sequence.
struct RowId {
  int b;  ///< batch
  int h;  ///< head (query head or key/value head)
  int s;  ///< position in the sequence
};

/// Every query row of the problem (for small problems).
std::vector<RowId> all_q_rows(const ProblemShape& shape);
/// Every key row of the problem, over key/value heads.
std::vector<RowId> all_kv_rows(const ProblemShape& shape);
/// `count` query rows drawn with `seed`, always including the first and last row of the
/// sequence; all rows if there are fewer than `count`.
std::vector<RowId> sample_q_rows(const ProblemShape& shape, int count, uint64_t seed);
/// `count` key rows drawn with `seed` (as sample_q_rows, over key/value heads).
std::vector<RowId> sample_kv_rows(const ProblemShape& shape, int count, uint64_t seed);

/// Rows for a sampled backward check of one key/value head group (batch `b`, key/value head
/// `kv_head`): `count` of its query rows (over the group's query heads) and `count` of its key
/// rows, drawn with `seed` as sample_q_rows() does. The oracle computes L and D on every query
/// row of each head a requested row touches, so one group keeps its cost to one group's.
void sample_group_rows(const ProblemShape& shape, int b, int kv_head, int count, uint64_t seed,
                       std::vector<RowId>* q_rows, std::vector<RowId>* kv_rows);

/// Adds to `kv_rows` (key rows, over key/value heads) the key each of `q_rows` attends to most
/// (its largest visible score), at most `max_added` new ones, and keeps `kv_rows` sorted by
/// (b, h, s) without duplicates. A sample of key rows drawn at random may hold none of the keys
/// a one-hot softmax (inputs of magnitude 50) puts its weight on, and there dK and dV are
/// nearly 0 whatever a kernel does; these keys carry the gradient a wrong kernel gets wrong.
void add_attended_keys(const HostProblem& p, const std::vector<RowId>& q_rows, int max_added,
                       std::vector<RowId>* kv_rows);

/// Result of reference_forward(): O and L of each requested query row, in order.
struct ForwardRef {
  std::vector<RowId> rows;  ///< the query rows, as requested
  std::vector<double> o;    ///< rows.size() x d
  std::vector<double> lse;  ///< rows.size()
};
/// Forward reference on the given query rows, in fp64:
/// \f$ O_i = \sum_j P_{ij} V_j,\ P_{ij} = e^{S_{ij} - L_i},\ L_i = \log\sum_j e^{S_{ij}} \f$
/// over the keys row i may see. A row that sees no key gets \f$O_i = 0\f$, \f$L_i = +\infty\f$.
ForwardRef reference_forward(const HostProblem& p, const std::vector<RowId>& rows);

/// Result of reference_backward(): dQ of each requested query row, dK and dV of each
/// requested key row, in order.
struct BackwardRef {
  std::vector<RowId> q_rows;   ///< the query rows of dq, as requested
  std::vector<RowId> kv_rows;  ///< the key rows of dk and dv, as requested
  std::vector<double> dq;      ///< q_rows.size() x d
  std::vector<double> dk;      ///< kv_rows.size() x d
  std::vector<double> dv;      ///< kv_rows.size() x d
  /// The magnitude of the terms each gradient is summed from, elementwise (same shapes):
  /// \f$ s \sum_j m_{ij}\,|K_j| \f$ for dQ, \f$ s \sum_i m_{ij}\,|Q_i| \f$ for dK and
  /// \f$ \sum_i P_{ij} |dO_i| \f$ for dV, where \f$m_{ij}\f$ is the size of what
  /// \f$dS_{ij}\f$ is computed from. With the forward's outputs given (GivenForward):
  /// \f$ m_{ij} = P_{ij}(|dP_{ij} - D_i| + \kappa R_i) \f$, \f$R_i = \sum_c |dO_{ic} O_{ic}|\f$,
  /// \f$\kappa = d \cdot\f$ kGivenForwardKappaPerDim. Without them,
  /// \f$ m_{ij} = P_{ij}(|dP_{ij}| + |D_i|) \f$: the oracle's D then comes from the exact O,
  /// and the kernel's from the 16-bit O it is given, an error of the size of
  /// \f$\epsilon |D_i|\f$. Where \f$dP - D\f$ cancels (a one-hot softmax, a single key) the
  /// gradient is far smaller than these terms, and their rounding sets the error (see
  /// compare()).
  std::vector<double> dq_mag;
  std::vector<double> dk_mag;  ///< see dq_mag
  std::vector<double> dv_mag;  ///< see dq_mag
  /// The underflow floor of each gradient element (same shapes): the largest error that a
  /// correct kernel's rounding of terms below the dtype's normal range can add up to. With
  /// \f$u\f$ = underflow_unit() and \f$[x]\f$ = 1 if \f$|x|\f$ < underflow_threshold() else 0,
  /// over the visible pairs (i, j):
  /// \f$ dS^{floor}_{ij} = u\,[P_{ij}]\,|dP_{ij} - D_i| + u\,[dS_{ij}] \f$ (P rounded before
  /// \f$dS = P(dP - D)\f$ is formed, then dS rounded), and
  /// \f$ s \sum_j dS^{floor}_{ij} |K_j| \f$ for dQ,
  /// \f$ s \sum_i dS^{floor}_{ij} |Q_i| \f$ for dK,
  /// \f$ \sum_i u\,[P_{ij}]\,|dO_i| \f$ for dV. It is 0 where no term underflows; with
  /// inputs of magnitude 50 (a one-hot softmax) a key that no query row attends to has
  /// \f$dV_j \approx 10^{-10}\f$, summed from probabilities below fp16's smallest subnormal,
  /// and a correct kernel writes 0 there (see compare()).
  std::vector<double> dq_floor;
  std::vector<double> dk_floor;  ///< see dq_floor
  std::vector<double> dv_floor;  ///< see dq_floor
};
/// The forward's outputs a backward pass was given, as it read them: O in the layout of
/// HostProblem::q_index ([B, Nq, H, d]) and L in that of lse_index ([B, H, Nq]).
/// reference_backward() then computes the exact backward of those inputs: \f$L_i\f$ as given,
/// \f$D_i = dO_i \cdot O_i\f$ from the given O. A kernel computes \f$D_i\f$ and every
/// \f$dP_{ij}\f$ as fp32 sums of d exact products, so where they should cancel (one key, a
/// one-hot softmax: O = V) their difference can still be about \f$d\,2^{-24} R_i\f$, with
/// \f$R_i = \sum_c |dO_{ic} O_{ic}|\f$. The cancellation floor lets that pass at fp16's
/// gradient bound (\f$4 \cdot 2^{-10}\f$ of 1/kCancellationFloor of the magnitude) when
/// \f$\kappa R_i\f$ joins \f$|dP_{ij} - D_i|\f$ with \f$\kappa = d \cdot 2^{-12}\f$: that
/// is \f$16 \cdot d\,2^{-24} / 2^{-8}\f$.
struct GivenForward {
  const std::vector<float>* o = nullptr;    ///< [B, Nq, H, d]
  const std::vector<float>* lse = nullptr;  ///< [B, H, Nq], +inf for a row that sees no key
};

/// \f$\kappa / d\f$ of GivenForward's floor: \f$2^{-12}\f$.
constexpr double kGivenForwardKappaPerDim = 1.0 / 4096;

/// Backward reference in fp64: dQ on `q_rows`, dK and dV on `kv_rows` (summed over the query
/// heads that share each key/value head), with \f$s\f$ the softmax scale:
/// \f$ dV_j = \sum_i P_{ij} dO_i,\ dP_{ij} = dO_i \cdot V_j,\ D_i = dO_i \cdot O_i,\f$
/// \f$ dS_{ij} = P_{ij}(dP_{ij} - D_i),\ dQ_i = s \sum_j dS_{ij} K_j,
/// \ dK_j = s \sum_i dS_{ij} Q_i \f$. L and D are computed for every query row of the heads
/// involved (a dK/dV row needs all query rows of its group), then only the requested rows:
/// exactly from the inputs, or, with `given`, from the forward outputs the kernel was handed
/// (the GPU checks pass them, so that the floor of dQ and dK can be tight).
BackwardRef reference_backward(const HostProblem& p, const std::vector<RowId>& q_rows,
                               const std::vector<RowId>& kv_rows,
                               const GivenForward* given = nullptr);

}  // namespace fa

#endif  // FA_ORACLE_H_
