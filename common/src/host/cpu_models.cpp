/// \file cpu_models.cpp
/// \brief Standard attention, FlashAttention-1 forward and FlashAttention-2 forward and
/// backward as plain fp32 loops over tiles. Comments "Line n" cite the paper's algorithm.
///
/// Conventions shared by every model (and by the GPU kernels):
/// - S is scaled, \f$S = \tau Q K^T\f$ with \f$\tau\f$ = shape.effective_scale() (the papers
///   write \f$\tau\f$ in FlashAttention Algorithm 2 and leave it out of the others).
/// - Causal masking is bottom-right aligned: query row i sees key j iff j <= i + Nk - Nq.
///   Masked scores are \f$-\infty\f$.
/// - A row that has seen no key yet has row_max \f$= -\infty\f$; exp_shifted() turns the
///   \f$e^{-\infty - (-\infty)}\f$ this would produce into 0 instead of NaN. A row that sees no
///   key at all ends with row_sum = 0: it gets O = 0 and L = \f$+\infty\f$.
/// - GQA: query head h reads key/value head h / (H / Hkv). Models with a K/V outer loop run the
///   inner loop over the Q blocks of every query head of the group, so each K/V block is read
///   once per key/value head, as if the group's queries were one longer Q.
#include "fa/cpu_models.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace fa {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kPosInf = std::numeric_limits<float>::infinity();

/// The sizes every model uses, read once from the problem.
struct Dims {
  int batch, heads, heads_kv, group, seqlen_q, seqlen_k, d;
  float scale;
  bool causal;

  explicit Dims(const ProblemShape& s)
      : batch(s.batch),
        heads(s.heads),
        heads_kv(s.heads_kv),
        group(s.heads / s.heads_kv),
        seqlen_q(s.seqlen_q),
        seqlen_k(s.seqlen_k),
        d(s.head_dim),
        scale(s.effective_scale()),
        causal(s.causal) {}

  /// Query row i sees key j (bottom-right aligned causal mask).
  bool visible(int i, int j) const { return !causal || j <= i + seqlen_k - seqlen_q; }
  /// Some row of q_block [q0, q0 + q_rows) sees some key of kv_block [kv0, ...): its last row
  /// sees the block's first key. Blocks where this fails are skipped by the FA-2 models
  /// (FlashAttention-2 paper, Section 3.1.1).
  bool block_visible(int q0, int q_rows, int kv0) const {
    return !causal || kv0 <= q0 + q_rows - 1 + seqlen_k - seqlen_q;
  }
};

/// \f$e^{x - m}\f$, but 0 when x is \f$-\infty\f$ (a masked score, or the row_max of a row that
/// has seen no key yet), where the formula would give \f$e^{-\infty + \infty}\f$ = NaN.
float exp_shifted(float x, float m) {
  return x == kNegInf ? 0.f : std::exp(x - m);
}

int ceil_div(int a, int b) {
  return (a + b - 1) / b;
}

void check_blocks(int block_r, int block_c) {
  if (block_r <= 0 || block_c <= 0) {
    throw std::invalid_argument("cpu model: block sizes must be positive");
  }
}

/// Copies rows [row0, row0 + rows) of one head of a BSHD tensor into a dense rows x d tile
/// ("load from HBM to on-chip SRAM") and returns the number of elements moved.
int64_t load_tile(const std::vector<float>& src, int row0, int rows, int seqlen, int heads, int b,
                  int h, int d, std::vector<float>& tile) {
  tile.resize(static_cast<size_t>(rows) * d);
  for (int r = 0; r < rows; ++r) {
    const size_t at = ((static_cast<size_t>(b) * seqlen + row0 + r) * heads + h) * d;
    std::copy_n(&src[at], d, &tile[static_cast<size_t>(r) * d]);
  }
  return static_cast<int64_t>(rows) * d;
}

/// The inverse of load_tile ("write to HBM"); returns the number of elements moved.
int64_t store_tile(const std::vector<float>& tile, int row0, int rows, int seqlen, int heads, int b,
                   int h, int d, std::vector<float>& dst) {
  for (int r = 0; r < rows; ++r) {
    const size_t at = ((static_cast<size_t>(b) * seqlen + row0 + r) * heads + h) * d;
    std::copy_n(&tile[static_cast<size_t>(r) * d], d, &dst[at]);
  }
  return static_cast<int64_t>(rows) * d;
}

/// On chip: s_tile = scale * q_tile k_tile^T (q_rows x kv_rows), masked scores set to -inf.
void scores(const Dims& m, const std::vector<float>& q_tile, int q0, int q_rows,
            const std::vector<float>& k_tile, int kv0, int kv_rows, std::vector<float>& s_tile) {
  s_tile.resize(static_cast<size_t>(q_rows) * kv_rows);
  for (int r = 0; r < q_rows; ++r) {
    for (int c = 0; c < kv_rows; ++c) {
      float dot = 0.f;
      for (int e = 0; e < m.d; ++e) dot += q_tile[r * m.d + e] * k_tile[c * m.d + e];
      s_tile[r * kv_rows + c] = m.visible(q0 + r, kv0 + c) ? m.scale * dot : kNegInf;
    }
  }
}

}  // namespace

ForwardResult standard_forward(const HostProblem& p) {
  const Dims m(p.shape);
  const int n_q = m.seqlen_q, n_k = m.seqlen_k, d = m.d;
  ForwardResult res;
  res.o.assign(static_cast<size_t>(m.batch) * n_q * m.heads * d, 0.f);
  res.lse.assign(static_cast<size_t>(m.batch) * m.heads * n_q, 0.f);
  std::vector<float> q_all, k_all, v_all, o_all;
  std::vector<float> s_hbm(static_cast<size_t>(n_q) * n_k);  // S and P live in device memory
  std::vector<float> p_hbm(s_hbm.size());
  for (int b = 0; b < m.batch; ++b) {
    for (int h = 0; h < m.heads; ++h) {
      const int kv_head = h / m.group;
      // Line 1: load Q, K by blocks from HBM, compute S = QK^T, write S to HBM.
      res.io.reads += load_tile(p.q, 0, n_q, n_q, m.heads, b, h, d, q_all);
      res.io.reads += load_tile(p.k, 0, n_k, n_k, m.heads_kv, b, kv_head, d, k_all);
      scores(m, q_all, 0, n_q, k_all, 0, n_k, s_hbm);
      res.io.writes += static_cast<int64_t>(n_q) * n_k;
      // Line 2: read S from HBM, compute P = softmax(S), write P to HBM. We also write the
      // logsumexp L (Nq values) here, so that the model's L can be checked like the others'.
      res.io.reads += static_cast<int64_t>(n_q) * n_k;
      for (int i = 0; i < n_q; ++i) {
        const float* s_row = &s_hbm[static_cast<size_t>(i) * n_k];
        float* p_row = &p_hbm[static_cast<size_t>(i) * n_k];
        float row_max = kNegInf;
        for (int j = 0; j < n_k; ++j) row_max = std::max(row_max, s_row[j]);
        float row_sum = 0.f;
        for (int j = 0; j < n_k; ++j) row_sum += p_row[j] = exp_shifted(s_row[j], row_max);
        for (int j = 0; j < n_k; ++j) p_row[j] = row_sum > 0.f ? p_row[j] / row_sum : 0.f;
        res.lse[p.lse_index(b, h, i)] = row_sum > 0.f ? row_max + std::log(row_sum) : kPosInf;
      }
      res.io.writes += static_cast<int64_t>(n_q) * n_k + n_q;
      // Line 3: load P and V by blocks from HBM, compute O = PV, write O to HBM.
      res.io.reads += static_cast<int64_t>(n_q) * n_k;
      res.io.reads += load_tile(p.v, 0, n_k, n_k, m.heads_kv, b, kv_head, d, v_all);
      o_all.assign(static_cast<size_t>(n_q) * d, 0.f);
      for (int i = 0; i < n_q; ++i)
        for (int j = 0; j < n_k; ++j)
          for (int c = 0; c < d; ++c) o_all[i * d + c] += p_hbm[i * n_k + j] * v_all[j * d + c];
      res.io.writes += store_tile(o_all, 0, n_q, n_q, m.heads, b, h, d, res.o);
    }
  }
  return res;
}

ForwardResult fa1_forward(const HostProblem& p, int block_r, int block_c) {
  check_blocks(block_r, block_c);
  const Dims m(p.shape);
  const int d = m.d;
  // Line 3: T_r = ceil(Nq / B_r) Q blocks, T_c = ceil(Nk / B_c) K/V blocks. (Line 1 derives
  // the block sizes from the SRAM size M; here they are parameters.)
  const int t_r = ceil_div(m.seqlen_q, block_r), t_c = ceil_div(m.seqlen_k, block_c);
  ForwardResult res;
  // Line 2: O = 0, l = 0, m = -inf in HBM (O is res.o; l and m are [B, H, Nq] like L).
  res.o.assign(static_cast<size_t>(m.batch) * m.seqlen_q * m.heads * d, 0.f);
  std::vector<float> row_sum_hbm(static_cast<size_t>(m.batch) * m.heads * m.seqlen_q, 0.f);
  std::vector<float> row_max_hbm(row_sum_hbm.size(), kNegInf);
  res.io.writes += static_cast<int64_t>(res.o.size() + row_sum_hbm.size() + row_max_hbm.size());

  std::vector<float> k_tile, v_tile, q_tile, o_tile, s_tile, p_tile, pv;
  std::vector<float> row_sum(block_r), row_max(block_r);
  for (int b = 0; b < m.batch; ++b) {
    for (int kv_head = 0; kv_head < m.heads_kv; ++kv_head) {
      for (int j = 0; j < t_c; ++j) {  // Line 5
        const int kv0 = j * block_c, kv_rows = std::min(block_c, m.seqlen_k - kv0);
        // Line 6: load K_j, V_j from HBM to on-chip SRAM.
        res.io.reads += load_tile(p.k, kv0, kv_rows, m.seqlen_k, m.heads_kv, b, kv_head, d, k_tile);
        res.io.reads += load_tile(p.v, kv0, kv_rows, m.seqlen_k, m.heads_kv, b, kv_head, d, v_tile);
        for (int h = kv_head * m.group; h < (kv_head + 1) * m.group; ++h) {
          for (int i = 0; i < t_r; ++i) {  // Line 7
            const int q0 = i * block_r, q_rows = std::min(block_r, m.seqlen_q - q0);
            // Line 8: load Q_i, O_i, l_i, m_i from HBM to on-chip SRAM.
            res.io.reads += load_tile(p.q, q0, q_rows, m.seqlen_q, m.heads, b, h, d, q_tile);
            res.io.reads += load_tile(res.o, q0, q_rows, m.seqlen_q, m.heads, b, h, d, o_tile);
            const size_t stat0 = p.lse_index(b, h, q0);
            std::copy_n(&row_sum_hbm[stat0], q_rows, row_sum.begin());
            std::copy_n(&row_max_hbm[stat0], q_rows, row_max.begin());
            res.io.reads += 2 * q_rows;
            // Line 9: S_ij = tau Q_i K_j^T (with the causal mask of Algorithm 2, line 10).
            scores(m, q_tile, q0, q_rows, k_tile, kv0, kv_rows, s_tile);
            // Line 10: m~_ij = rowmax(S_ij), P~_ij = exp(S_ij - m~_ij), l~_ij = rowsum(P~_ij).
            p_tile.resize(s_tile.size());
            pv.assign(static_cast<size_t>(q_rows) * d, 0.f);
            for (int r = 0; r < q_rows; ++r) {
              const float* s_row = &s_tile[r * kv_rows];
              float* p_row = &p_tile[r * kv_rows];
              float block_max = kNegInf;
              for (int c = 0; c < kv_rows; ++c) block_max = std::max(block_max, s_row[c]);
              float block_sum = 0.f;
              for (int c = 0; c < kv_rows; ++c)
                block_sum += p_row[c] = exp_shifted(s_row[c], block_max);
              // Line 11: m_new = max(m_i, m~_ij),
              //          l_new = e^{m_i - m_new} l_i + e^{m~_ij - m_new} l~_ij.
              const float new_max = std::max(row_max[r], block_max);
              const float old_factor = exp_shifted(row_max[r], new_max);
              const float block_factor = exp_shifted(block_max, new_max);
              const float new_sum = old_factor * row_sum[r] + block_factor * block_sum;
              // Line 12: O_i = diag(l_new)^-1 (diag(l_i) e^{m_i - m_new} O_i
              //                                 + e^{m~_ij - m_new} P~_ij V_j).
              for (int c = 0; c < kv_rows; ++c)
                for (int e = 0; e < d; ++e) pv[r * d + e] += p_row[c] * v_tile[c * d + e];
              for (int e = 0; e < d; ++e) {
                float& o = o_tile[r * d + e];
                const float unnormalized =
                    row_sum[r] * old_factor * o + block_factor * pv[r * d + e];
                o = new_sum > 0.f ? unnormalized / new_sum : 0.f;  // no key seen yet: O stays 0
              }
              row_sum[r] = new_sum;
              row_max[r] = new_max;
            }
            // Line 12 (cont.): write O_i to HBM. Line 13: write l_i = l_new, m_i = m_new.
            res.io.writes += store_tile(o_tile, q0, q_rows, m.seqlen_q, m.heads, b, h, d, res.o);
            std::copy_n(row_sum.begin(), q_rows, &row_sum_hbm[stat0]);
            std::copy_n(row_max.begin(), q_rows, &row_max_hbm[stat0]);
            res.io.writes += 2 * q_rows;
          }  // Line 14
        }
      }  // Line 15
    }
  }
  // Line 16 returns O (Algorithm 2 also returns l and m, for the backward). L = m + log(l) is
  // that same information in the form the other models return; not counted as IO.
  res.lse.resize(row_sum_hbm.size());
  for (size_t i = 0; i < res.lse.size(); ++i) {
    res.lse[i] = row_sum_hbm[i] > 0.f ? row_max_hbm[i] + std::log(row_sum_hbm[i]) : kPosInf;
  }
  return res;
}

ForwardResult fa2_forward(const HostProblem& p, int block_r, int block_c) {
  check_blocks(block_r, block_c);
  const Dims m(p.shape);
  const int d = m.d;
  // Lines 1-2: T_r = ceil(Nq / B_r) blocks of Q, O and L; T_c = ceil(Nk / B_c) of K and V.
  const int t_r = ceil_div(m.seqlen_q, block_r), t_c = ceil_div(m.seqlen_k, block_c);
  ForwardResult res;
  res.o.assign(static_cast<size_t>(m.batch) * m.seqlen_q * m.heads * d, 0.f);
  res.lse.assign(static_cast<size_t>(m.batch) * m.heads * m.seqlen_q, 0.f);
  std::vector<float> q_tile, k_tile, v_tile, s_tile, o_acc;
  std::vector<float> row_max(block_r), row_sum(block_r);
  for (int b = 0; b < m.batch; ++b) {
    for (int h = 0; h < m.heads; ++h) {
      const int kv_head = h / m.group;
      for (int i = 0; i < t_r; ++i) {  // Line 3 (on the GPU: one thread block per Q block)
        const int q0 = i * block_r, q_rows = std::min(block_r, m.seqlen_q - q0);
        // Line 4: load Q_i from HBM to on-chip SRAM.
        res.io.reads += load_tile(p.q, q0, q_rows, m.seqlen_q, m.heads, b, h, d, q_tile);
        // Line 5: on chip, O_i = 0, l_i = 0, m_i = -inf.
        o_acc.assign(static_cast<size_t>(q_rows) * d, 0.f);
        std::fill(row_sum.begin(), row_sum.end(), 0.f);
        std::fill(row_max.begin(), row_max.end(), kNegInf);
        for (int j = 0; j < t_c; ++j) {  // Line 6
          const int kv0 = j * block_c, kv_rows = std::min(block_c, m.seqlen_k - kv0);
          // Causal: a K/V block no row of this Q block sees is skipped (Section 3.1.1); the
          // blocks after it are masked too.
          if (!m.block_visible(q0, q_rows, kv0)) break;
          // Line 7: load K_j, V_j from HBM to on-chip SRAM.
          res.io.reads +=
              load_tile(p.k, kv0, kv_rows, m.seqlen_k, m.heads_kv, b, kv_head, d, k_tile);
          res.io.reads +=
              load_tile(p.v, kv0, kv_rows, m.seqlen_k, m.heads_kv, b, kv_head, d, v_tile);
          // Line 8: S_i^(j) = tau Q_i K_j^T, masked.
          scores(m, q_tile, q0, q_rows, k_tile, kv0, kv_rows, s_tile);
          for (int r = 0; r < q_rows; ++r) {
            float* s_row = &s_tile[r * kv_rows];
            // Line 9: m^(j) = max(m^(j-1), rowmax(S)), P~ = exp(S - m^(j)),
            //         l^(j) = e^{m^(j-1) - m^(j)} l^(j-1) + rowsum(P~).
            float new_max = row_max[r];
            for (int c = 0; c < kv_rows; ++c) new_max = std::max(new_max, s_row[c]);
            const float correction = exp_shifted(row_max[r], new_max);
            float block_sum = 0.f;
            for (int c = 0; c < kv_rows; ++c)
              block_sum += s_row[c] = exp_shifted(s_row[c], new_max);
            row_sum[r] = correction * row_sum[r] + block_sum;
            row_max[r] = new_max;
            // Line 10: O^(j) = diag(e^{m^(j-1) - m^(j)}) O^(j-1) + P~ V_j (the paper prints
            // diag(...)^-1 here; the factor multiplies, as Section 3.1.1 derives). Unnormalized.
            for (int e = 0; e < d; ++e) {
              float acc = correction * o_acc[r * d + e];
              for (int c = 0; c < kv_rows; ++c) acc += s_row[c] * v_tile[c * d + e];
              o_acc[r * d + e] = acc;
            }
          }
        }  // Line 11
        for (int r = 0; r < q_rows; ++r) {
          // Line 12: O_i = diag(l^(Tc))^-1 O^(Tc), the one division. Line 13: L_i = m + log(l).
          // A row that saw no key (row_sum = 0) keeps O = 0 and gets L = +inf.
          const bool seen = row_sum[r] > 0.f;
          for (int e = 0; e < d; ++e) o_acc[r * d + e] = seen ? o_acc[r * d + e] / row_sum[r] : 0.f;
          res.lse[p.lse_index(b, h, q0 + r)] = seen ? row_max[r] + std::log(row_sum[r]) : kPosInf;
        }
        // Line 14: write O_i to HBM. Line 15: write L_i to HBM.
        res.io.writes += store_tile(o_acc, q0, q_rows, m.seqlen_q, m.heads, b, h, d, res.o);
        res.io.writes += q_rows;
      }  // Line 16
    }
  }
  return res;
}

BackwardResult fa2_backward(const HostProblem& p, const ForwardResult& fwd, int block_r,
                            int block_c) {
  check_blocks(block_r, block_c);
  const Dims m(p.shape);
  const int d = m.d;
  if (fwd.o.size() != p.q.size() ||
      fwd.lse.size() != static_cast<size_t>(m.batch) * m.heads * m.seqlen_q) {
    throw std::invalid_argument("fa2_backward: forward result does not match the problem");
  }
  // Lines 1-2: T_r Q blocks (of Q, O, dO, L, D, dQ), T_c K/V blocks (of K, V, dK, dV).
  const int t_r = ceil_div(m.seqlen_q, block_r), t_c = ceil_div(m.seqlen_k, block_c);
  BackwardResult res;
  // Line 3: dQ = 0 in HBM. dK and dV are written whole at line 18.
  res.dq.assign(p.q.size(), 0.f);
  res.io.writes += static_cast<int64_t>(res.dq.size());
  res.dk.assign(p.k.size(), 0.f);
  res.dv.assign(p.v.size(), 0.f);
  // Line 4: D = rowsum(dO o O), written to HBM ([B, H, Nq] like L). Reads dO and O.
  std::vector<float> delta(fwd.lse.size());
  for (int b = 0; b < m.batch; ++b)
    for (int h = 0; h < m.heads; ++h)
      for (int i = 0; i < m.seqlen_q; ++i) {
        const size_t at = p.q_index(b, i, h, 0);
        float sum = 0.f;
        for (int e = 0; e < d; ++e) sum += p.d_o[at + e] * fwd.o[at + e];
        delta[p.lse_index(b, h, i)] = sum;
      }
  res.io.reads += static_cast<int64_t>(p.d_o.size() + fwd.o.size());
  res.io.writes += static_cast<int64_t>(delta.size());

  std::vector<float> k_tile, v_tile, dk_tile, dv_tile, q_tile, o_tile, do_tile, dq_tile;
  std::vector<float> s_tile, dp_tile;
  for (int b = 0; b < m.batch; ++b) {
    for (int kv_head = 0; kv_head < m.heads_kv; ++kv_head) {
      for (int j = 0; j < t_c; ++j) {  // Line 5 (on the GPU: one thread block per K/V block)
        const int kv0 = j * block_c, kv_rows = std::min(block_c, m.seqlen_k - kv0);
        // Line 6: load K_j, V_j from HBM to on-chip SRAM.
        res.io.reads += load_tile(p.k, kv0, kv_rows, m.seqlen_k, m.heads_kv, b, kv_head, d, k_tile);
        res.io.reads += load_tile(p.v, kv0, kv_rows, m.seqlen_k, m.heads_kv, b, kv_head, d, v_tile);
        // Line 7: dK_j = 0, dV_j = 0 on chip.
        dk_tile.assign(static_cast<size_t>(kv_rows) * d, 0.f);
        dv_tile.assign(static_cast<size_t>(kv_rows) * d, 0.f);
        for (int h = kv_head * m.group; h < (kv_head + 1) * m.group; ++h) {
          for (int i = 0; i < t_r; ++i) {  // Line 8
            const int q0 = i * block_r, q_rows = std::min(block_r, m.seqlen_q - q0);
            // Causal: Q blocks that see nothing of this K/V block are skipped (Section 3.1.1).
            if (!m.block_visible(q0, q_rows, kv0)) continue;
            // Line 9: load Q_i, O_i, dO_i, dQ_i, L_i, D_i from HBM to on-chip SRAM. (O_i is in
            // the paper's list though D_i already carries what the backward needs of it.)
            res.io.reads += load_tile(p.q, q0, q_rows, m.seqlen_q, m.heads, b, h, d, q_tile);
            res.io.reads += load_tile(fwd.o, q0, q_rows, m.seqlen_q, m.heads, b, h, d, o_tile);
            res.io.reads += load_tile(p.d_o, q0, q_rows, m.seqlen_q, m.heads, b, h, d, do_tile);
            res.io.reads += load_tile(res.dq, q0, q_rows, m.seqlen_q, m.heads, b, h, d, dq_tile);
            const float* lse = &fwd.lse[p.lse_index(b, h, q0)];
            const float* delta_i = &delta[p.lse_index(b, h, q0)];
            res.io.reads += 2 * q_rows;
            // Line 10: S_i^(j) = tau Q_i K_j^T, masked.
            scores(m, q_tile, q0, q_rows, k_tile, kv0, kv_rows, s_tile);
            // Line 11: P_i^(j) = exp(S - L_i). Masked scores and rows with L = +inf give 0.
            for (int r = 0; r < q_rows; ++r)
              for (int c = 0; c < kv_rows; ++c) {
                float& s = s_tile[r * kv_rows + c];
                s = s == kNegInf ? 0.f : std::exp(s - lse[r]);  // s_tile now holds P
              }
            const std::vector<float>& p_tile = s_tile;
            // Line 12: dV_j += P^T dO_i.
            for (int c = 0; c < kv_rows; ++c)
              for (int r = 0; r < q_rows; ++r)
                for (int e = 0; e < d; ++e)
                  dv_tile[c * d + e] += p_tile[r * kv_rows + c] * do_tile[r * d + e];
            // Line 13: dP = dO_i V_j^T. Line 14: dS = P o (dP - D_i).
            dp_tile.resize(p_tile.size());
            for (int r = 0; r < q_rows; ++r)
              for (int c = 0; c < kv_rows; ++c) {
                float dp = 0.f;
                for (int e = 0; e < d; ++e) dp += do_tile[r * d + e] * v_tile[c * d + e];
                dp_tile[r * kv_rows + c] = p_tile[r * kv_rows + c] * (dp - delta_i[r]);
              }
            const std::vector<float>& ds_tile = dp_tile;
            // Line 15: dQ_i += tau dS K_j, written back to HBM.
            for (int r = 0; r < q_rows; ++r)
              for (int e = 0; e < d; ++e) {
                float acc = 0.f;
                for (int c = 0; c < kv_rows; ++c)
                  acc += ds_tile[r * kv_rows + c] * k_tile[c * d + e];
                dq_tile[r * d + e] += m.scale * acc;
              }
            res.io.writes += store_tile(dq_tile, q0, q_rows, m.seqlen_q, m.heads, b, h, d, res.dq);
            // Line 16: dK_j += tau dS^T Q_i.
            for (int c = 0; c < kv_rows; ++c)
              for (int e = 0; e < d; ++e) {
                float acc = 0.f;
                for (int r = 0; r < q_rows; ++r)
                  acc += ds_tile[r * kv_rows + c] * q_tile[r * d + e];
                dk_tile[c * d + e] += m.scale * acc;
              }
          }  // Line 17
        }
        // Line 18: write dK_j, dV_j to HBM (summed over the group's query heads already).
        res.io.writes +=
            store_tile(dk_tile, kv0, kv_rows, m.seqlen_k, m.heads_kv, b, kv_head, d, res.dk);
        res.io.writes +=
            store_tile(dv_tile, kv0, kv_rows, m.seqlen_k, m.heads_kv, b, kv_head, d, res.dv);
      }  // Line 19
    }
  }
  return res;
}

}  // namespace fa
