/// \file cpu_models.h
/// \brief The algorithms as plain C++ loops over tiles, mirroring the papers line by line.
///
/// These run anywhere (CI included) and are the first thing to step through in a debugger.
/// Each model computes in fp32 like the GPU kernels and counts the elements it reads from and
/// writes to "device memory" (its inputs and outputs; anything held in a tile is on chip), so
/// the IO argument of the papers shows as numbers:
/// standard attention moves \f$\Theta(Nd + N^2)\f$ elements, FlashAttention
/// \f$\Theta(N^2 d^2 / M)\f$ for on-chip memory of M elements.
///
/// Block sizes are parameters (positive, else std::invalid_argument) and need not divide the
/// sequence lengths; causal masking, GQA, \f$N_q \ne N_k\f$ and rows that see no key
/// (O = 0, L = \f$+\infty\f$) are handled as by the GPU kernels.
#ifndef FA_CPU_MODELS_H_
#define FA_CPU_MODELS_H_

#include <cstdint>
#include <vector>

#include "fa/problem.h"

namespace fa {

/// Elements read from and written to device memory.
struct IoCount {
  int64_t reads = 0;   ///< elements loaded from device memory
  int64_t writes = 0;  ///< elements stored to device memory
  /// Elements moved either way: reads + writes.
  int64_t total() const { return reads + writes; }
};

/// Outputs of a forward model, contiguous: o [B, Nq, H, d], lse [B, H, Nq].
struct ForwardResult {
  std::vector<float> o;    ///< [B, Nq, H, d]
  std::vector<float> lse;  ///< [B, H, Nq]; \f$+\infty\f$ for a row that sees no key
  IoCount io;              ///< elements the algorithm moved to and from device memory
};

/// Standard attention (FlashAttention paper, Algorithm 0): S = scale Q K^T, P = softmax(S)
/// and O = P V, with S and P written to and read back from device memory. Per query head it
/// reads \f$N_q d + 2 N_k d + 2 N_q N_k\f$ elements (Q, K; S; P, V) and writes
/// \f$2 N_q N_k + N_q d + N_q\f$ (S; P and L; O): times \f$B H\f$ in all, with or without
/// causal masking (masked scores are still written, as \f$-\infty\f$).
ForwardResult standard_forward(const HostProblem& p);

/// FlashAttention-1 forward (FlashAttention paper, Algorithm 1): outer loop over K/V blocks of
/// `block_c` rows, inner loop over Q blocks of `block_r` rows; O, m and l live in device
/// memory and are read, rescaled (divided by the new l) and written back at every step.
/// With \f$T_c = \lceil N_k / B_c \rceil\f$ it reads
/// \f$2 B H_{kv} N_k d + T_c B H N_q (2d + 2)\f$ elements (K_j, V_j once per outer step;
/// Q_i, O_i, l_i, m_i per inner step) and writes \f$(T_c + 1) B H N_q (d + 2)\f$ (O, l, m
/// initialized once, then written per inner step). Causal masking masks but skips nothing, so
/// the count does not change. Under GQA the inner loop runs over the Q blocks of all query
/// heads that share the K/V head.
ForwardResult fa1_forward(const HostProblem& p, int block_r, int block_c);

/// FlashAttention-2 forward (FlashAttention-2 paper, Algorithm 1): outer loop over Q blocks,
/// inner loop over K/V blocks, unnormalized O kept on chip, one division at the end, only
/// L = m + log(l) written. Without causal masking it reads
/// \f$B H (N_q d + 2 T_r N_k d)\f$ elements (Q_i once, K_j and V_j per inner step;
/// \f$T_r = \lceil N_q / B_r \rceil\f$) and writes \f$B H N_q (d + 1)\f$ (O and L). With
/// causal masking, K/V blocks that no row of the Q block sees are skipped (paper, Section
/// 3.1.1): Q block i, whose last row is \f$r_i = \min((i+1) B_r, N_q) - 1\f$, reads
/// \f$2 d \min(N_k, B_c (\lfloor (r_i + N_k - N_q) / B_c \rfloor + 1))\f$ elements of K and V
/// (none if \f$r_i + N_k - N_q < 0\f$) instead of \f$2 N_k d\f$.
ForwardResult fa2_forward(const HostProblem& p, int block_r, int block_c);

/// Gradients of a backward model, contiguous: dq [B, Nq, H, d], dk and dv [B, Nk, Hkv, d].
struct BackwardResult {
  std::vector<float> dq;  ///< [B, Nq, H, d]
  std::vector<float> dk;  ///< [B, Nk, Hkv, d], summed over the query heads of a group
  std::vector<float> dv;  ///< [B, Nk, Hkv, d], summed over the query heads of a group
  IoCount io;             ///< elements the algorithm moved to and from device memory
};

/// FlashAttention-2 backward (FlashAttention-2 paper, Algorithm 2) given the forward's O and
/// L: D = rowsum(dO * O); outer loop over K/V blocks, inner loop over Q blocks; P recomputed
/// from L; dQ accumulated in device memory. Without causal masking it reads
/// \f$2 B H N_q d + 2 B H_{kv} N_k d + T_c B H N_q (4d + 2)\f$ elements (dO and O for D;
/// K_j, V_j once; Q_i, O_i, dO_i, dQ_i, L_i, D_i per inner step) and writes
/// \f$B H N_q (d + 1) + T_c B H N_q d + 2 B H_{kv} N_k d\f$ (dQ zeroed and D; dQ_i per inner
/// step; dK, dV). With causal masking the inner steps whose Q block sees nothing of the K/V
/// block (\f$\min((i+1) B_r, N_q) - 1 + N_k - N_q < j B_c\f$) are skipped and not counted.
/// Under GQA the inner loop runs over the Q blocks of all query heads of the group, so dK_j
/// and dV_j come out summed and are written once.
BackwardResult fa2_backward(const HostProblem& p, const ForwardResult& fwd, int block_r,
                            int block_c);

}  // namespace fa

#endif  // FA_CPU_MODELS_H_
