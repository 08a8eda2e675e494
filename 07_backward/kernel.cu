/// \file 07_backward/kernel.cu
/// \brief Step 07: the FlashAttention-2 backward pass (FlashAttention-2, Algorithm 2).
///
/// What this step adds to step 06 (whose forward stays as it is: it stores O and the
/// logsumexp \f$L_i = \log \sum_j e^{S_{ij}}\f$), below the "backward pass" banner:
/// - Preprocess: \f$D_i = \mathrm{rowsum}(dO_i \circ O_i)\f$, the lse in base 2, and a
///   zeroed fp32 dQ accumulator (dq_accum).
/// - The main kernel, one thread block per (kv_block, kv head, batch): the loop order flips
///   back to FlashAttention-1's, K/V blocks outside and Q blocks inside, so that \f$dK_j\f$
///   and \f$dV_j\f$ are summed on chip over every q_block (and every query head of a GQA
///   group). \f$S\f$ and \f$P = e^{S - L}\f$ are recomputed from Q, K and the stored lse,
///   never read back: \f$dV_j \mathrel{+}= P^T dO_i\f$, \f$dP = dO_i V_j^T\f$,
///   \f$dS = P \circ (dP - D_i)\f$, \f$dK_j \mathrel{+}= dS^T Q_i\f$, and
///   \f$dQ_i \mathrel{+}= dS K_j\f$, which every kv_block shares, by fp32 atomic adds into
///   dq_accum (stored in the threads' order; on sm_90 with the large shapes one TMA bulk
///   reduction per warp), converted to the output dtype by a last kernel. Under causal
///   masking the q_blocks above the diagonal are skipped (as 06 skips K/V blocks); only the
///   ones that cross it are masked.
/// - Deterministic mode (fa_bwd_args::deterministic): the same kernels, but the adds into
///   each part of dq_accum go in a fixed order, kv_block 0 first, passed on from thread block
///   to thread block through counters in device memory: bit-identical results run to run.
///
/// - The last-wave split (TailSplit, plan_tail_split): without the mask every kv_block takes
///   as long, so the grid's last partial wave would run on a few SMs while the others idle;
///   its kv_blocks run instead as several thread blocks each, over shares of the q_blocks, in
///   a kernel instance of their own launched after the main kernel's whole waves. In
///   deterministic mode too, where no part can wait for one that cannot start
///   (det_tail_max_parts): each part takes and passes the turns of its own q_blocks.
/// - Launches that overlap (sm_90, plan_overlap): the kernels after the preprocess are
///   programmatic dependent launches. A thread block starts while the kernel before it ends and
///   waits for it (grid_dependency_wait) only before reading what that kernel wrote; the split
///   tail, which reads nothing the main kernel writes, runs beside the main kernel's last wave.
///
/// Run: `./build/bin/07_backward --backward --seqlen 4096 --head-dim 128`
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <type_traits>
#include <utility>
#include <vector>

#include "fa/api.h"
#include "fa/check.cuh"
#include "fa/env.h"
#include "fa/mma.cuh"
#include "fa/step.h"

namespace {

// ------------------------------------------------------------------------------------------
// Tile configuration
// ------------------------------------------------------------------------------------------

// Tuning knobs: K/V rows per block for each head dimension. The defaults are FlashAttention-2's
// \f$B_c\f$; NOTES.md has what other values measured and what they cost in registers.
#ifndef FA_FWD_BLOCK_N_D64
#define FA_FWD_BLOCK_N_D64 128
#endif
#ifndef FA_FWD_BLOCK_N_D128
#define FA_FWD_BLOCK_N_D128 64
#endif

/// Tile shape per head dimension: \f$B_r\f$ (kBlockM) query rows, \f$B_c\f$ (kBlockN) key
/// rows, kNumWarps warps. As in FlashAttention-2, 4 warps share a 128-row Q block, 32 rows
/// each. The registers of a thread hold its rows' o_acc (\f$32 d / 32\f$ floats) and S tile
/// (\f$32 B_c / 32\f$ floats), so \f$B_c\f$ shrinks as d grows. Shared memory is Q plus
/// one K and one V tile, \f$(B_r + 2 B_c)\, d \cdot 2\f$ bytes: 48 KiB (d = 64) and 64 KiB
/// (d = 128). That fits every sm_80+ GPU (at most 99 KiB per thread block on sm_86/sm_89);
/// two thread blocks share an SM on the A100, H100 and H200 at both.
template <int kHeadDim>
struct TileShape;
template <>
struct TileShape<64> {
  static constexpr int kBlockM = 128, kBlockN = FA_FWD_BLOCK_N_D64, kNumWarps = 4;
};
template <>
struct TileShape<128> {
  static constexpr int kBlockM = 128, kBlockN = FA_FWD_BLOCK_N_D128, kNumWarps = 4;
};

/// Every size the kernel derives from the tile shape, in one place.
template <int kHeadDim_>
struct Traits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = TileShape<kHeadDim>::kBlockM;  ///< \f$B_r\f$, Q rows
  static constexpr int kBlockN = TileShape<kHeadDim>::kBlockN;  ///< \f$B_c\f$, K/V rows
  static constexpr int kNumWarps = TileShape<kHeadDim>::kNumWarps;
  static constexpr int kNumThreads = 32 * kNumWarps;
  static constexpr int kWarpRows = kBlockM / kNumWarps;  ///< Q rows owned by one warp
  static constexpr int kMTiles = kWarpRows / 16;         ///< m16 mma tiles per warp
  static constexpr int kNTilesS = kBlockN / 8;           ///< n8 tiles of S (keys)
  static constexpr int kNTilesO = kHeadDim / 8;          ///< n8 tiles of O (head dim)
  static constexpr int kRowBytes = kHeadDim * 2;         ///< one row of Q/K/V/O, 2-byte types
  static constexpr int kChunksPerRow = kHeadDim / 8;     ///< 16-byte chunks in one row
  static constexpr int kQBytes = kBlockM * kRowBytes;
  static constexpr int kKBytes = kBlockN * kRowBytes;
  static constexpr int kVBytes = kBlockN * kRowBytes;
  static constexpr int kSmemBytes = kQBytes + kKBytes + kVBytes;

  static_assert(kWarpRows % 16 == 0, "each warp owns whole m16 tiles");
  static_assert(kBlockN % 16 == 0 && kHeadDim % 16 == 0, "k16 steps must tile S and P V");
  static_assert(kChunksPerRow >= 8, "the XOR swizzle permutes 8 chunks of a row");
  static_assert(kNumThreads % kChunksPerRow == 0, "a thread copies one column of chunks");
};

// ------------------------------------------------------------------------------------------
// Shared memory: swizzled row-major tiles
// ------------------------------------------------------------------------------------------

/// Byte offset of 16-byte chunk `chunk` of row `row` in a row-major shared-memory tile with
/// rows of kRowBytes bytes. The chunk index is XORed with \f$row \bmod 8\f$: the 8 rows that
/// one ldmatrix phase reads at the same logical column land in 8 different 16-byte bank
/// groups, and so do the 8 consecutive chunks that 8 threads write with cp.async. Both sides
/// are therefore free of bank conflicts without any padding.
template <int kRowBytes>
__device__ __forceinline__ uint32_t swizzle(int row, int chunk) {
  return row * kRowBytes + ((chunk ^ (row & 7)) << 4);
}

// ------------------------------------------------------------------------------------------
// Global -> shared tile loads (cp.async, 16 bytes per instruction)
// ------------------------------------------------------------------------------------------

/// Starts the asynchronous copy of rows [row0, row0 + kRows) of one head of a tensor (row r at
/// `gmem + r * row_stride`, kHeadDim contiguous elements) into the swizzled shared tile
/// `smem_tile`. Rows at or past `seqlen` are zero-filled and not read, so a ragged last block
/// holds zeros (a zero V row times a zero probability stays zero, never NaN). Each thread
/// copies one 16-byte column chunk of every kRowsPerPass-th row. The caller commits the group.
template <class Tr, int kRows, typename T>
__device__ __forceinline__ void load_tile_async(char* smem_tile, const T* gmem, int64_t row_stride,
                                                int row0, int seqlen, int tid) {
  constexpr int kRowsPerPass = Tr::kNumThreads / Tr::kChunksPerRow;
  static_assert(kRows % kRowsPerPass == 0, "the threads cover the tile in whole passes");
  static_assert(kRowsPerPass % 8 == 0, "every pass starts on a whole swizzle atom");
  const int chunk = tid % Tr::kChunksPerRow;  // the same column in every pass
  const int tile_row = tid / Tr::kChunksPerRow;
  const int row = row0 + tile_row;
  char* const dst = smem_tile + swizzle<Tr::kRowBytes>(tile_row, chunk);
  const T* src = gmem + row * row_stride + chunk * 8;
#pragma unroll
  for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
    const bool valid = row + pass * kRowsPerPass < seqlen;
    // An invalid row reads nothing; it still gets an address inside the tensor (row 0).
    fa::cp_async_16(dst + pass * kRowsPerPass * Tr::kRowBytes, valid ? src : gmem, valid);
    src += kRowsPerPass * row_stride;
  }
}

// ------------------------------------------------------------------------------------------
// Shared -> register fragment loads (ldmatrix), layouts as in fa/mma.cuh
// ------------------------------------------------------------------------------------------

/// Byte offset of `swizzle(row0 + r, chunk0 + c)` from a lane's precomputed
/// `lane_offset = swizzle(r, c)`, for row0 a multiple of 8 and chunk0 even with c in {0, 1}.
/// The XOR of the swizzle only touches the low 3 bits of the chunk, so it distributes over
/// the tile position: one XOR with a compile-time constant plus an immediate offset. Each
/// lane thus keeps one offset per access pattern instead of one address per fragment.
template <class Tr>
__device__ __forceinline__ uint32_t fragment_offset(uint32_t lane_offset, int row0, int chunk0) {
  return (lane_offset ^ ((chunk0 & 7) << 4)) + row0 * Tr::kRowBytes + ((chunk0 & ~7) << 4);
}

/// The lane's offset for ldmatrix.x4 reads of a 16x16 block as an mma A operand (also used
/// for V as the transposed B operand, which has the same pattern): lanes 0-7 address the 8x8
/// matrix of rows 0-7 / columns 0-7, lanes 8-15 rows 8-15, lanes 16-23 columns 8-15 of
/// rows 0-7, lanes 24-31 rows 8-15 / columns 8-15.
template <class Tr>
__device__ __forceinline__ uint32_t a_lane_offset(int lane) {
  return swizzle<Tr::kRowBytes>((lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);
}

/// The lane's offset for ldmatrix.x4 reads of two n8 B operands of \f$Q K^T\f$ from K: lanes
/// 0-7 rows 0-7 / columns 0-7, lanes 8-15 rows 0-7 / columns 8-15, lanes 16-23 rows 8-15 /
/// columns 0-7, lanes 24-31 rows 8-15 / columns 8-15.
template <class Tr>
__device__ __forceinline__ uint32_t b_lane_offset(int lane) {
  return swizzle<Tr::kRowBytes>((lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
}

/// A operand of one m16n8k16 mma: rows [row0, row0 + 16) and columns
/// [16 k_step, 16 k_step + 16) of a row-major tile (Q), in one ldmatrix.x4. The four 8x8
/// matrices land in a[0..3] exactly as the A fragment wants them (see fa/mma.cuh).
template <class Tr>
__device__ __forceinline__ void load_a_fragment(uint32_t (&a)[4], const char* tile,
                                                uint32_t a_offset, int row0, int k_step) {
  fa::ldmatrix_x4(a, tile + fragment_offset<Tr>(a_offset, row0, 2 * k_step));
}

/// B operands of two neighbouring n8 mma tiles of \f$S = Q K^T\f$: keys [n0, n0 + 16) and
/// head-dim columns [16 k_step, 16 k_step + 16) of the row-major K tile, in one
/// ldmatrix.x4. B is \f$K^T\f$, so a row of K is a column of B, which is exactly what the
/// non-transposing ldmatrix hands each lane. b[t] is the fragment of keys n0 + 8t ... + 7.
template <class Tr>
__device__ __forceinline__ void load_b_fragments(uint32_t (&b)[2][2], const char* tile,
                                                 uint32_t b_offset, int n0, int k_step) {
  uint32_t r[4];
  fa::ldmatrix_x4(r, tile + fragment_offset<Tr>(b_offset, n0, 2 * k_step));
  b[0][0] = r[0];
  b[0][1] = r[1];
  b[1][0] = r[2];
  b[1][1] = r[3];
}

/// B operands of two neighbouring n8 mma tiles of \f$O \mathrel{+}= P V\f$: keys
/// [16 k_step, 16 k_step + 16) and head-dim columns [n0, n0 + 16) of the row-major V tile.
/// Here the k index of B runs along V's rows, so ldmatrix.x4.trans transposes each 8x8
/// matrix on the way and V never needs a transposed copy. b[t] covers columns n0 + 8t ... + 7.
template <class Tr>
__device__ __forceinline__ void load_b_fragments_trans(uint32_t (&b)[2][2], const char* tile,
                                                       uint32_t a_offset, int k_step, int n0) {
  uint32_t r[4];
  fa::ldmatrix_x4_trans(r, tile + fragment_offset<Tr>(a_offset, 16 * k_step, n0 / 8));
  b[0][0] = r[0];
  b[0][1] = r[1];
  b[1][0] = r[2];
  b[1][1] = r[3];
}

// ------------------------------------------------------------------------------------------
// The algorithm: S = Q K^T, mask, online softmax, O += P V (all per warp)
// ------------------------------------------------------------------------------------------

/// \f$S_w = Q_w K_j^T\f$ for this warp's kWarpRows query rows (starting at tile row
/// `warp_row0`) and all kBlockN keys of the K tile, unscaled, in fp32 accumulator fragments:
/// s[mi][nj] is the m16n8 tile of rows warp_row0 + 16 mi and keys 8 nj.
template <class Tr, typename T>
__device__ __forceinline__ void compute_scores(float (&s)[Tr::kMTiles][Tr::kNTilesS][4],
                                               const char* q_tile, const char* k_tile,
                                               int warp_row0, int lane) {
  const uint32_t a_offset = a_lane_offset<Tr>(lane);
  const uint32_t b_offset = b_lane_offset<Tr>(lane);
#pragma unroll
  for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
    for (int nj = 0; nj < Tr::kNTilesS; ++nj)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mi][nj][e] = 0.f;

#pragma unroll
  for (int k_step = 0; k_step < Tr::kHeadDim / 16; ++k_step) {
    uint32_t q_frag[Tr::kMTiles][4];
#pragma unroll
    for (int mi = 0; mi < Tr::kMTiles; ++mi)
      load_a_fragment<Tr>(q_frag[mi], q_tile, a_offset, warp_row0 + 16 * mi, k_step);
#pragma unroll
    for (int nj = 0; nj < Tr::kNTilesS; nj += 2) {
      uint32_t k_frag[2][2];
      load_b_fragments<Tr>(k_frag, k_tile, b_offset, 8 * nj, k_step);
#pragma unroll
      for (int mi = 0; mi < Tr::kMTiles; ++mi) {
        fa::mma_m16n8k16<T>(s[mi][nj], q_frag[mi], k_frag[0]);
        fa::mma_m16n8k16<T>(s[mi][nj + 1], q_frag[mi], k_frag[1]);
      }
    }
  }
}

/// Sets \f$S_{ij} = -\infty\f$ where key j does not exist (\f$j \ge N_k\f$, the ragged last
/// block) or, under causal masking, where \f$j > i + N_k - N_q\f$ (bottom-right aligned).
/// `q_row0` is the sequence position of the first row this thread holds (row `group` of its
/// warp's rows); it holds rows q_row0 + 16 mi + 8 h, and keys kv_start + 8 nj + 2 quad + {0, 1}.
template <class Tr>
__device__ __forceinline__ void apply_mask(float (&s)[Tr::kMTiles][Tr::kNTilesS][4], int q_row0,
                                           int kv_start, int seqlen_q, int seqlen_k, bool causal,
                                           int lane) {
  const int first_key = kv_start + 2 * (lane & 3);
#pragma unroll
  for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = q_row0 + 16 * mi + 8 * h;
      // Row `row` sees keys [0, key_end).
      const int key_end = causal ? min(seqlen_k, row + seqlen_k - seqlen_q + 1) : seqlen_k;
#pragma unroll
      for (int nj = 0; nj < Tr::kNTilesS; ++nj)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          if (first_key + 8 * nj + e >= key_end) s[mi][nj][2 * h + e] = -INFINITY;
    }
}

/// The K/V blocks the Q block of rows [q_start, q_start + kBlockM) computes: all, or under
/// causal masking those up to the one that holds its last row's last key, \f$i + N_k - N_q\f$
/// (the rest are entirely masked). None (<= 0) if it sees no key at all (N_q > N_k).
template <class Tr>
__device__ __forceinline__ int kv_blocks_seen(const fa_fwd_args& args, int q_start) {
  const int n_blocks = (args.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN;
  if (!args.causal) return n_blocks;
  const int last_key =
      min(q_start + Tr::kBlockM, args.seqlen_q) - 1 + args.seqlen_k - args.seqlen_q;
  return min(n_blocks, (last_key + Tr::kBlockN) / Tr::kBlockN);
}

/// The online softmax of FlashAttention-2 for one K/V block, per row i of this warp:
/// \f[ m_i^{new} = \max(m_i, \max_j S_{ij}),\quad
///     \ell_i \leftarrow e^{c (m_i - m_i^{new})} \ell_i + \sum_j P_{ij},\quad
///     O_i \leftarrow e^{c (m_i - m_i^{new})} O_i,\quad P_{ij} = e^{c (S_{ij} - m_i^{new})} \f]
/// with c the softmax scale. In base 2, \f$e^{c x} = 2^{x c \log_2 e}\f$, so with
/// `scale_log2` \f$= c \log_2 e\f$ each probability is one FFMA and one ex2. The row max is
/// reduced across the 4 lanes (a quad) that share a row; row_sum stays a per-lane partial
/// sum until the epilogue. The rescale factor is exactly 1 for a row whose max did not grow,
/// so the warp skips the o_acc multiplications when none of its rows' max grew (one vote,
/// a warp-uniform branch), which is most blocks once a row has seen a few of them. A row
/// with no visible key yet has \f$m = -\infty\f$: the subtracted max is then taken as 0
/// so that no \f$-\infty - (-\infty)\f$ makes a NaN. On return s holds \f$P\f$
/// (unnormalized, fp32).
template <class Tr>
__device__ __forceinline__ void online_softmax(float (&s)[Tr::kMTiles][Tr::kNTilesS][4],
                                               float (&row_max)[Tr::kMTiles][2],
                                               float (&row_sum)[Tr::kMTiles][2],
                                               float (&o_acc)[Tr::kMTiles][Tr::kNTilesO][4],
                                               float scale_log2) {
  float m_new[Tr::kMTiles][2];
  bool max_grew = false;
#pragma unroll
  for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m = row_max[mi][h];
#pragma unroll
      for (int nj = 0; nj < Tr::kNTilesS; ++nj)
        m = fmaxf(m, fmaxf(s[mi][nj][2 * h], s[mi][nj][2 * h + 1]));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      max_grew |= m > row_max[mi][h];
      m_new[mi][h] = m;
    }
  if (__any_sync(0xffffffffu, max_grew)) {
#pragma unroll
    for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // exp(c (m_old - m_new)) from the difference of the maxima: exactly 1 where the max did
        // not change (m_old c - m_new c would not be: an FMA keeps the rounding of one product);
        // 0 when the row had no visible key before (m_old = -inf) or still has none.
        const float rescale = m_new[mi][h] == -INFINITY
                                  ? 0.f
                                  : fa::exp2_approx((row_max[mi][h] - m_new[mi][h]) * scale_log2);
        row_sum[mi][h] *= rescale;
#pragma unroll
        for (int nd = 0; nd < Tr::kNTilesO; ++nd) {
          o_acc[mi][nd][2 * h] *= rescale;
          o_acc[mi][nd][2 * h + 1] *= rescale;
        }
      }
  }
#pragma unroll
  for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_max[mi][h] = m_new[mi][h];
      const float m_scaled = (m_new[mi][h] == -INFINITY) ? 0.f : m_new[mi][h] * scale_log2;
      float block_sum = 0.f;
#pragma unroll
      for (int nj = 0; nj < Tr::kNTilesS; ++nj)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float p = fa::exp2_approx(fmaf(s[mi][nj][2 * h + e], scale_log2, -m_scaled));
          s[mi][nj][2 * h + e] = p;
          block_sum += p;
        }
      row_sum[mi][h] += block_sum;
    }
}

/// \f$O_w \mathrel{+}= P_w V_j\f$. P stays in registers: the accumulator fragments of the S
/// tiles 2 kk and 2 kk + 1 (keys 16 kk ... 16 kk + 15), rounded to T and packed in pairs, are
/// the A fragment of the k16 step kk (a0 = rows 0-7 keys 0-7, a1 = rows 8-15 keys 0-7,
/// a2 = rows 0-7 keys 8-15, a3 = rows 8-15 keys 8-15). V's fragments come from shared memory
/// through ldmatrix.trans.
template <class Tr, typename T>
__device__ __forceinline__ void accumulate_pv(float (&o_acc)[Tr::kMTiles][Tr::kNTilesO][4],
                                              const float (&p)[Tr::kMTiles][Tr::kNTilesS][4],
                                              const char* v_tile, int lane) {
  const uint32_t a_offset = a_lane_offset<Tr>(lane);
#pragma unroll
  for (int kk = 0; kk < Tr::kBlockN / 16; ++kk) {
    uint32_t p_frag[Tr::kMTiles][4];
#pragma unroll
    for (int mi = 0; mi < Tr::kMTiles; ++mi) {
      p_frag[mi][0] = fa::pack2<T>(p[mi][2 * kk][0], p[mi][2 * kk][1]);
      p_frag[mi][1] = fa::pack2<T>(p[mi][2 * kk][2], p[mi][2 * kk][3]);
      p_frag[mi][2] = fa::pack2<T>(p[mi][2 * kk + 1][0], p[mi][2 * kk + 1][1]);
      p_frag[mi][3] = fa::pack2<T>(p[mi][2 * kk + 1][2], p[mi][2 * kk + 1][3]);
    }
#pragma unroll
    for (int nd = 0; nd < Tr::kNTilesO; nd += 2) {
      uint32_t v_frag[2][2];
      load_b_fragments_trans<Tr>(v_frag, v_tile, a_offset, kk, 8 * nd);
#pragma unroll
      for (int mi = 0; mi < Tr::kMTiles; ++mi) {
        fa::mma_m16n8k16<T>(o_acc[mi][nd], p_frag[mi], v_frag[0]);
        fa::mma_m16n8k16<T>(o_acc[mi][nd + 1], p_frag[mi], v_frag[1]);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------
// Epilogue: O = o_acc / row_sum and L = m + log(row_sum)
// ------------------------------------------------------------------------------------------

/// Finishes the Q block of rows [row0, row0 + kBlockM) of (batch, head): reduces each row's
/// partial row_sum over its quad, writes \f$O_i = o_i / \ell_i\f$ and, when args.lse is not
/// null, \f$L_i = c\, m_i + \ln \ell_i\f$ (natural log of the scaled scores, c = args.scale).
/// A row that saw no key (\f$\ell_i = 0\f$) gets \f$O_i = 0\f$ and \f$L_i = +\infty\f$.
/// O goes through the swizzled shared tile `o_stage` (the Q tile, no longer needed) so that
/// the global stores are whole, coalesced 16-byte chunks; rows at or past \f$N_q\f$ (a ragged
/// last Q block) are not stored.
template <class Tr, typename T>
__device__ __forceinline__ void store_o_and_lse(float (&o_acc)[Tr::kMTiles][Tr::kNTilesO][4],
                                                float (&row_max)[Tr::kMTiles][2],
                                                float (&row_sum)[Tr::kMTiles][2], char* o_stage,
                                                const fa_fwd_args& args, int batch, int head,
                                                int row0, int warp_row0, int tid) {
  const int seqlen = args.seqlen_q;
  T* const o =
      static_cast<T*>(args.o.ptr) + batch * args.o.batch_stride + head * args.o.head_stride;
  float* const lse = args.lse == nullptr
                         ? nullptr
                         : args.lse + (static_cast<int64_t>(batch) * args.heads + head) * seqlen;
  const int lane = tid % 32;
  const int group = lane / 4, quad = lane % 4;
  __syncthreads();  // every warp is done reading the Q tile that now stages O
#pragma unroll
  for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = row_sum[mi][h];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float inv_sum = sum > 0.f ? __fdividef(1.f, sum) : 0.f;  // sum >= 1 (2^0 at the max)
      const int tile_row = warp_row0 + 16 * mi + 8 * h + group;
      const float l = sum > 0.f ? row_max[mi][h] * args.scale + logf(sum + 1e-30f) : INFINITY;
      if (lse != nullptr && quad == 0 && row0 + tile_row < seqlen) lse[row0 + tile_row] = l;
#pragma unroll
      for (int nd = 0; nd < Tr::kNTilesO; ++nd) {
        const uint32_t packed =
            fa::pack2<T>(o_acc[mi][nd][2 * h] * inv_sum, o_acc[mi][nd][2 * h + 1] * inv_sum);
        *reinterpret_cast<uint32_t*>(o_stage + swizzle<Tr::kRowBytes>(tile_row, nd) + 4 * quad) =
            packed;
      }
    }
  __syncthreads();  // the whole O tile is staged
  constexpr int kRowsPerPass = Tr::kNumThreads / Tr::kChunksPerRow;
  const int chunk = tid % Tr::kChunksPerRow;
  const int tile_row = tid / Tr::kChunksPerRow;
  const int row = row0 + tile_row;
  const char* const src = o_stage + swizzle<Tr::kRowBytes>(tile_row, chunk);
  T* dst = o + row * args.o.row_stride + chunk * 8;
#pragma unroll
  for (int pass = 0; pass < Tr::kBlockM / kRowsPerPass; ++pass) {
    if (row + pass * kRowsPerPass < seqlen)
      *reinterpret_cast<uint4*>(dst) =
          *reinterpret_cast<const uint4*>(src + pass * kRowsPerPass * Tr::kRowBytes);
    dst += kRowsPerPass * args.o.row_stride;
  }
}

// ------------------------------------------------------------------------------------------
// The kernel
// ------------------------------------------------------------------------------------------

/// FlashAttention-2 forward, warps split Q. One thread block per (Q block, head, batch);
/// warp w owns Q rows [32 w, 32 w + 32) of the block. Per K/V block j, each warp computes
/// \f$S = Q_w K_j^T\f$, masks, updates its online softmax and \f$O_w \mathrel{+}= P V_j\f$,
/// all in registers.
/// K and V have one shared-memory stage each, loaded in turn: after the barrier at the top of
/// block j the thread block starts loading \f$V_j\f$ (it lands during \f$S_j\f$), after a
/// second barrier \f$K_{j+1}\f$ (it lands during the softmax and \f$P_j V_j\f$).
/// `group_pairs` and `tail_rows` set the order of the thread blocks (see launch()).
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(Traits<kHeadDim>::kNumThreads)
    flash_forward_kernel(const fa_fwd_args args, const float scale_log2, const int group_pairs,
                         const int tail_rows) {
  using Tr = Traits<kHeadDim>;
  extern __shared__ __align__(128) char smem[];
  char* const q_tile = smem;
  char* const k_tile = smem + Tr::kQBytes;
  char* const v_tile = k_tile + Tr::kKBytes;

  // Which (q_block, head, batch) this thread block computes, in the order launch() explains.
  const int num_q_blocks = (args.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  const int num_pairs = args.batch * args.heads;
  const int tail_start = (num_q_blocks - tail_rows) * num_pairs;  // then Q blocks [0, tail_rows)
  const bool tail = blockIdx.x >= tail_start;                     // of all pairs in one group
  const int idx = blockIdx.x - (tail ? tail_start : 0), gp = tail ? num_pairs : group_pairs;
  const int rows = tail ? tail_rows : num_q_blocks - tail_rows;  // Q blocks of a pair in a group
  const int group = idx / (gp * rows);
  const int in_group = idx - group * gp * rows;
  const int pairs_in_group = min(gp, num_pairs - group * gp);
  const int q_block = (tail ? tail_rows : num_q_blocks) - 1 - in_group / pairs_in_group;
  const int pair = group * gp + in_group % pairs_in_group;
  const int head = pair % args.heads;
  const int batch = pair / args.heads;
  const int head_kv = head / (args.heads / args.heads_kv);
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp_row0 = (tid / 32) * Tr::kWarpRows;  // this warp's first row in the Q tile
  const int seqlen_q = args.seqlen_q;
  const int seqlen_k = args.seqlen_k;
  const int q_start = q_block * Tr::kBlockM;

  const T* const q =
      static_cast<const T*>(args.q.ptr) + batch * args.q.batch_stride + head * args.q.head_stride;
  const T* const k = static_cast<const T*>(args.k.ptr) + batch * args.k.batch_stride +
                     head_kv * args.k.head_stride;
  const T* const v = static_cast<const T*>(args.v.ptr) + batch * args.v.batch_stride +
                     head_kv * args.v.head_stride;

  // On-chip state of this warp's rows for the whole K/V loop.
  float o_acc[Tr::kMTiles][Tr::kNTilesO][4];
  float row_max[Tr::kMTiles][2];
  float row_sum[Tr::kMTiles][2];
#pragma unroll
  for (int mi = 0; mi < Tr::kMTiles; ++mi) {
#pragma unroll
    for (int nd = 0; nd < Tr::kNTilesO; ++nd)
#pragma unroll
      for (int e = 0; e < 4; ++e) o_acc[mi][nd][e] = 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_max[mi][h] = -INFINITY;
      row_sum[mi][h] = 0.f;
    }
  }

  const int n_blocks = kv_blocks_seen<Tr>(args, q_start);
  const int first_masked_key = q_start + seqlen_k - seqlen_q + 1;  // first row's key_end
  if (n_blocks <= 0) {  // sees no key at all (N_q > N_k): O = 0, L = +inf, nothing loaded
    store_o_and_lse<Tr, T>(o_acc, row_max, row_sum, q_tile, args, batch, head, q_start, warp_row0,
                           tid);
    return;
  }

  // Prologue: Q and K_0 in one cp.async group.
  load_tile_async<Tr, Tr::kBlockM>(q_tile, q, args.q.row_stride, q_start, seqlen_q, tid);
  load_tile_async<Tr, Tr::kBlockN>(k_tile, k, args.k.row_stride, 0, seqlen_k, tid);
  fa::cp_async_commit();

  for (int kv_block = 0; kv_block < n_blocks; ++kv_block) {
    const int kv_start = kv_block * Tr::kBlockN;
    fa::cp_async_wait<0>();
    __syncthreads();  // K_j has landed; every warp is done with V_{j-1}
    load_tile_async<Tr, Tr::kBlockN>(v_tile, v, args.v.row_stride, kv_start, seqlen_k, tid);
    fa::cp_async_commit();  // V_j lands while S_j is computed

    float s[Tr::kMTiles][Tr::kNTilesS][4];
    compute_scores<Tr, T>(s, q_tile, k_tile, warp_row0, lane);
    // Only the blocks that cross the diagonal (some key past the first row's key_end) and
    // the ragged last block need the mask; all others take the mask-free path.
    const bool needs_mask = (args.causal && kv_start + Tr::kBlockN > first_masked_key) ||
                            kv_start + Tr::kBlockN > seqlen_k;
    if (needs_mask)
      apply_mask<Tr>(s, q_start + warp_row0 + lane / 4, kv_start, seqlen_q, seqlen_k, args.causal,
                     lane);

    fa::cp_async_wait<0>();
    __syncthreads();                // V_j has landed; every warp is done with K_j
    if (kv_block + 1 < n_blocks) {  // K_{j+1} lands during the softmax and P_j V_j
      load_tile_async<Tr, Tr::kBlockN>(k_tile, k, args.k.row_stride, kv_start + Tr::kBlockN,
                                       seqlen_k, tid);
      fa::cp_async_commit();
    }
    online_softmax<Tr>(s, row_max, row_sum, o_acc, scale_log2);
    accumulate_pv<Tr, T>(o_acc, s, v_tile, lane);
  }

  store_o_and_lse<Tr, T>(o_acc, row_max, row_sum, q_tile, args, batch, head, q_start, warp_row0,
                         tid);
}

// ------------------------------------------------------------------------------------------
// Launcher
// ------------------------------------------------------------------------------------------

/// Launches the kernel for one dtype and head dimension: one thread block per (Q block, head,
/// batch), in a one-dimensional grid whose order the kernel decodes. The (batch, head) pairs
/// are taken in groups; inside a group the thread blocks start with the last Q block of every
/// pair, then the one before it, and so on. Under causal masking the last Q blocks do the
/// most work, so the longest thread blocks start first and the short ones fill the tail of
/// the grid. A group holds at least 4 waves of resident thread blocks, enough for that order
/// to balance the SMs, and no more pairs than that, so that the thread blocks that read the
/// same K and V run at the same time and share them in L2. Without causal masking every
/// thread block has the same work and a group is one pair: one head's Q blocks run together.
/// Where a group's K and V overflow the L2 and fewer than 4 Q blocks of a pair are resident at
/// once (README.md), a group holds only the pairs whose K and V fit in half the L2, and the
/// first `tail_rows` Q blocks of every pair (2 waves or more) run last, in one group.
template <typename T, int kHeadDim>
fa_status launch(const fa_fwd_args& args, cudaStream_t stream) {
  using Tr = Traits<kHeadDim>;
  const auto kernel = flash_forward_kernel<T, kHeadDim>;
  // More than 48 KiB of dynamic shared memory must be asked for explicitly.
  if (Tr::kSmemBytes > 48 * 1024)
    FA_CUDA_TRY(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes));
  const int64_t num_q_blocks = (args.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  const int64_t num_pairs = static_cast<int64_t>(args.batch) * args.heads;
  if (num_q_blocks * num_pairs > INT32_MAX)
    return fa::set_error(FA_ERR_UNSUPPORTED, "%s: more than 2^31 - 1 thread blocks", FA_STEP_NAME);
  int64_t group_pairs = 1, tail_rows = 0;
  if (args.causal) {
    int device = 0, num_sms = 0, blocks_per_sm = 0, l2_bytes = 0;
    FA_CUDA_TRY(cudaGetDevice(&device));
    FA_CUDA_TRY(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
    FA_CUDA_TRY(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
    FA_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel,
                                                              Tr::kNumThreads, Tr::kSmemBytes));
    const int64_t resident = static_cast<int64_t>(num_sms) * std::max(blocks_per_sm, 1);
    const int64_t num_groups = std::max<int64_t>(1, num_q_blocks * num_pairs / (4 * resident));
    group_pairs = (num_pairs + num_groups - 1) / num_groups;
    const int64_t kv_bytes = int64_t{4} * args.seqlen_k * args.head_dim;  // K and V of a pair
    if (4 * group_pairs > resident && group_pairs * kv_bytes > l2_bytes) {
      tail_rows = std::min(num_q_blocks, (2 * resident + num_pairs - 1) / num_pairs);
      group_pairs = std::max<int64_t>(1, std::min(group_pairs, l2_bytes / (2 * kv_bytes)));
    }
  }
  const dim3 grid(static_cast<unsigned>(num_q_blocks * num_pairs));
  constexpr double kLog2e = 1.4426950408889634;
  const float scale_log2 = static_cast<float>(args.scale * kLog2e);
  kernel<<<grid, Tr::kNumThreads, Tr::kSmemBytes, stream>>>(
      args, scale_log2, static_cast<int>(group_pairs), static_cast<int>(tail_rows));
  FA_LAUNCH_TRY();
  return FA_OK;
}

/// The step's forward pass: picks the kernel for the dtype and head dimension.
fa_status forward(const fa_fwd_args& args, cudaStream_t stream) {
  const bool bf16 = args.dtype == FA_BF16;
  switch (args.head_dim) {
    case 64:
      return bf16 ? launch<__nv_bfloat16, 64>(args, stream) : launch<__half, 64>(args, stream);
    case 128:
      return bf16 ? launch<__nv_bfloat16, 128>(args, stream) : launch<__half, 128>(args, stream);
    default:
      return fa::set_error(FA_ERR_UNSUPPORTED, "%s: head_dim %d is not supported", FA_STEP_NAME,
                           args.head_dim);
  }
}

/// Head dimensions this step was built for.
bool supports_head_dim(int d) {
  return d == 64 || d == 128;
}

// ==========================================================================================
// The backward pass (this step): FlashAttention-2, Algorithm 2
// ==========================================================================================
//
// Per kv_block j (one thread block), for every q_block i that sees one of its keys:
//   line 11  S    = Q_i K_j^T                       (recomputed, transposed: S^T = K_j Q_i^T)
//   line 12  P    = exp(S - L_i)                    (from the forward's logsumexp)
//   line 13  dV_j += P^T dO_i
//   line 14  dP   = dO_i V_j^T                      (transposed: dP^T = V_j dO_i^T)
//   line 15  dS   = P o (dP - D_i)
//   line 16  dQ_i += dS K_j                         (shared by every kv_block: fp32 adds)
//   line 17  dK_j += dS^T Q_i
// Each product is one call of warp_gemm (below); each line one function of "Kernel 2".

// ------------------------------------------------------------------------------------------
// Backward tile configuration
// ------------------------------------------------------------------------------------------

/// \f$\log_2 e\f$ for the backward: \f$e^x = 2^{x \log_2 e}\f$, so every exponential is one FFMA
/// and one ex2 (the forward above keeps its own copy, as step 06 wrote it).
constexpr double kLog2e = 1.4426950408889634;

// Tuning knob: unroll of the k loop of S^T and dP^T (NOTES.md: registers).
#ifndef FA_BWD_ABT_UNROLL
#define FA_BWD_ABT_UNROLL 8  // fully unrolled: the first mma takes C = 0 (NOTES.md, change 10)
#endif
constexpr int kAbtUnroll = FA_BWD_ABT_UNROLL;

// Variant switch, measured in NOTES.md (change 5): under causal masking the thread blocks
// that meet the most q_blocks start first, as step 06 orders its forward (1), or the
// kv_blocks of a head simply run in order (0).
#ifndef FA_BWD_LONGEST_FIRST
#define FA_BWD_LONGEST_FIRST 1
#endif
constexpr bool kLongestFirst = FA_BWD_LONGEST_FIRST != 0;

// Variant switch, measured in NOTES.md (change 14): on sm_90 each kernel after the preprocess is
// a programmatic dependent launch, whose thread blocks start while the kernel before it ends and
// wait for it (grid_dependency_wait) only where they need its results (1); or plain launches,
// each kernel starting once the one before has ended (0).
#ifndef FA_BWD_PDL
#define FA_BWD_PDL 1
#endif
constexpr bool kOverlapLaunches = FA_BWD_PDL != 0;

// Variant switch, measured in NOTES.md (change 7): how the thread blocks hand the dQ adds of a
// q_block on to each other in deterministic mode, and how many gpu-scope fences that costs.
//   0: every warp takes turns on its own counter, with two fences per q_block: one to take
//      the turn, one to pass it on once its adds have landed (change 6);
//   1: every warp takes turns on its own counter, and the fence that takes the next turn also
//      passes the last one on: one fence per q_block (the default: the fastest, change 8);
//   2: one counter per q_block and one thread that takes the turns for the whole thread block,
//      one fence per q_block; 2-5% slower than 1, and its named barrier (bar.arrive) is where
//      compute-sanitizer's racecheck reports hazards.
#ifndef FA_BWD_DQ_HANDOFF
#define FA_BWD_DQ_HANDOFF 1
#endif
constexpr int kDqHandoff = FA_BWD_DQ_HANDOFF;
static_assert(kDqHandoff >= 0 && kDqHandoff <= 2, "FA_BWD_DQ_HANDOFF is 0, 1 or 2");
constexpr bool kDqTurnPerBlock = kDqHandoff == 2;  ///< one turn per thread block, not per warp
constexpr bool kDqPassLater = kDqHandoff != 0;     ///< the next turn's fence passes a turn on

// Variant switch, measured in NOTES.md (change 7): in deterministic mode the thread blocks of
// all (batch, kv head) pairs form one group in the longest-first order (0), or groups of at
// least this many waves, as without the mask (4: change 6).
#ifndef FA_BWD_DET_GROUP_WAVES
#define FA_BWD_DET_GROUP_WAVES 0
#endif
constexpr int kDetGroupWaves = FA_BWD_DET_GROUP_WAVES;

/// Rows of the padded per-row scratch (lse in base 2, D): seqlen_q rounded up to a multiple of
/// every backward q_block, so that a q_block's rows of it load without bounds checks.
constexpr int kRowPad = 128;

/// Tile shape of the main backward kernel per head dimension: \f$B_c\f$ (kBlockN) keys of the
/// kv_block a thread block owns, \f$B_r\f$ (kBlockM) query rows per q_block, 8 warps,
/// kStagesDo dO buffers. `kLargeSmem` is the shape for GPUs with more shared memory per block
/// (H100, H200: 193 KiB at d = 128, 194 KiB at d = 64, each with its 32 KiB dQ stage; an A100
/// has 163 KiB); the other fits the 99 KB of every sm_80+ GPU and is picked at run time where
/// the large one does not fit. Two ways to reach \f$P^T dO\f$ and \f$dS^T Q\f$ (kPtInSmem,
/// README "Variants"; measured in NOTES.md: at the large tiles P through shared memory wins
/// at both head dims, changes 2 and 4):
/// - P in registers (small shapes): warps kWarpsN (keys, 16 each) x kWarpsM (queries); a warp
///   walks its queries in slices of kSliceCols, and its packed \f$S^T\f$/\f$dP^T\f$ fragments
///   are the A operands of \f$dV\f$, \f$dK\f$ for its 16 keys over all of d.
/// - P through shared memory (large shapes, FlashAttention-2's layout): warps 4 (keys, 32
///   each) x 2 (queries) compute \f$S^T\f$, \f$dP^T\f$ and store \f$P^T\f$, \f$dS^T\f$; then
///   warps 4 (keys, 32 each) x 2 (head-dim halves) read them back for \f$dV\f$, \f$dK\f$. Every
///   fragment a warp loads then feeds two or more mmas (less shared-memory traffic per FLOP).
template <int kHeadDim, bool kLargeSmem>
struct BwdTileShape;
template <>
struct BwdTileShape<64, false> {
  static constexpr int kBlockM = 64, kBlockN = 128, kWarpsN = 8, kSliceCols = 64, kStagesDo = 2;
  static constexpr bool kPtInSmem = false;
};
template <>
struct BwdTileShape<64, true> {
  static constexpr int kBlockM = 128, kBlockN = 128, kWarpsN = 4, kSliceCols = 64, kStagesDo = 2;
  static constexpr bool kPtInSmem = true;
};
template <>
struct BwdTileShape<128, false> {
  static constexpr int kBlockM = 64, kBlockN = 64, kWarpsN = 4, kSliceCols = 32, kStagesDo = 1;
  static constexpr bool kPtInSmem = false;
};
template <>
struct BwdTileShape<128, true> {
  static constexpr int kBlockM = 64, kBlockN = 128, kWarpsN = 4, kSliceCols = 32, kStagesDo = 2;
  static constexpr bool kPtInSmem = true;
};

/// Every size the main backward kernel derives from its tile shape. Shared memory: K_j, V_j,
/// two Q buffers, kStagesDo dO buffers, \f$dS^T\f$ (\f$B_c \times B_r\f$), \f$P^T\f$ (same,
/// kPtInSmem only), per Q buffer the q_block's lse and D, and (kDqStage: the large shapes)
/// the fp32 dQ stage of \f$B_r \times d\f$. The epilogue reuses it to stage dK and dV in fp32.
template <int kHeadDim_, bool kLargeSmem_>
struct BwdTraits {
  using Shape = BwdTileShape<kHeadDim_, kLargeSmem_>;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kLargeSmem = kLargeSmem_;
  static constexpr bool kPtInSmem = Shape::kPtInSmem;
  static constexpr int kBlockM = Shape::kBlockM;  ///< \f$B_r\f$, query rows
  static constexpr int kBlockN = Shape::kBlockN;  ///< \f$B_c\f$, key rows
  static constexpr int kStagesDo = Shape::kStagesDo;
  static constexpr int kNumWarps = 8;
  static constexpr int kNumThreads = 32 * kNumWarps;
  // S^T and dP^T: warps kWarpsN (keys) x kWarpsM (queries), kSMTiles m16 tiles of keys each.
  static constexpr int kWarpsN = Shape::kWarpsN;             ///< warps along the keys
  static constexpr int kWarpsM = kNumWarps / kWarpsN;        ///< warps along the queries
  static constexpr int kSMTiles = kBlockN / (16 * kWarpsN);  ///< m16 tiles (keys) of a warp
  static constexpr int kWarpCols = kBlockM / kWarpsM;        ///< queries of one warp per q_block
  static constexpr int kSliceCols = kPtInSmem ? kWarpCols : Shape::kSliceCols;
  static constexpr int kSlices = kWarpCols / kSliceCols;
  static constexpr int kNTilesS = kSliceCols / 8;  ///< n8 tiles of an S^T slice (queries)
  static constexpr int kNTilesD = kHeadDim / 8;    ///< n8 tiles of dK, dV (head dim)
  // dV, dK accumulators of a warp: kKvMTiles m16 tiles of keys x kKvNTiles n8 tiles of the
  // head dim; kKvParts warps hold partial sums of the same elements (over their queries).
  static constexpr int kKvMTiles = kPtInSmem ? 2 : 1;
  static constexpr int kKvWarpsD = kPtInSmem ? kNumWarps / (kBlockN / 32) : 1;
  static constexpr int kKvNTiles = kNTilesD / kKvWarpsD;
  static constexpr int kKvParts = kPtInSmem ? 1 : kWarpsM;
  static constexpr int kRowBytes = kHeadDim * 2;
  static constexpr int kChunksPerRow = kHeadDim / 8;
  static constexpr int kQBytes = kBlockM * kRowBytes;  ///< one Q or dO tile
  static constexpr int kKBytes = kBlockN * kRowBytes;  ///< one K or V tile
  static constexpr int kDsBytes = kBlockN * kBlockM * 2;
  static constexpr int kStatBytes = kBlockM * 4;  ///< lse or D of one q_block
  static constexpr int kOffV = kKBytes;
  static constexpr int kOffQ = 2 * kKBytes;
  static constexpr int kOffDo = kOffQ + 2 * kQBytes;
  static constexpr int kOffDs = kOffDo + kStagesDo * kQBytes;
  static constexpr int kOffPt = kOffDs + kDsBytes;
  static constexpr int kOffLse = kOffPt + (kPtInSmem ? kDsBytes : 0);
  static constexpr int kOffD = kOffLse + 2 * kStatBytes;
  static constexpr int kStageStride = kHeadDim + 8;  ///< fp32 staging row, padded
  // dQ staging (large shapes): each warp's dQ fragments, fp32, in the dq_accum layout, for
  // the bulk reduction into dq_accum (sm_90, see accumulate_dq).
  static constexpr bool kDqStage = kLargeSmem && kPtInSmem;  // measured: NOTES.md, change 3
  static constexpr int kOffDqStage = kOffD + 2 * kStatBytes;
  static constexpr int kSmemMain = kOffDqStage + (kDqStage ? kBlockM * kHeadDim * 4 : 0);
  static constexpr int kSmemEpilogue = 4 * kKvParts * kBlockN * kStageStride;
  static constexpr int kSmemBytes = kSmemMain > kSmemEpilogue ? kSmemMain : kSmemEpilogue;
  // dQ = dS K_j: warp w computes query rows 32 (w % kDqWarpsM) + [0, 32) (two m16 tiles) and
  // kDqCols head-dim columns, so that each ldmatrix of K feeds two mmas.
  static constexpr int kDqWarpsM = kBlockM / 32;
  static constexpr int kDqCols = kHeadDim / (kNumWarps / kDqWarpsM);
  static constexpr int kDqNTiles = kDqCols / 8;  ///< n8 tiles of a warp's dQ tile
  static constexpr int kDqWarpFloats = kBlockM * kHeadDim / kNumWarps;  ///< one warp's dQ

  static_assert(kSMTiles == (kPtInSmem ? 2 : 1), "16 keys per warp, or 32 with P in smem");
  static_assert(kDqWarpFloats == 2 * kDqNTiles * 32 * 4, "a warp's dQ tile is its stretch");
  static_assert(!kPtInSmem || kStagesDo == 2, "dO_i is read until the end of the q_block");
  static_assert(!kPtInSmem || kSlices == 1,
                "with P in shared memory a warp's queries are one tile");
  static_assert(kWarpCols % kSliceCols == 0 && kSliceCols % 16 == 0,
                "a warp's queries are whole slices of whole k16 steps of P^T dO");
  static_assert(kKvNTiles % 2 == 0 && kDqCols % 16 == 0, "n8 tiles come in pairs");
  static_assert(kNumThreads % kChunksPerRow == 0, "a thread copies one column of chunks");
  static_assert(kRowPad % kBlockM == 0, "the padded scratch covers whole q_blocks");
  static_assert(kSmemBytes <= (kLargeSmem ? 227 : 99) * 1024, "fits the GPUs it is built for");
  // A warp's first chunk (col0 / 8) and its n8 tiles add without carry (SmemA).
  static_assert((kNTilesS & (kNTilesS - 1)) == 0 && (kKvNTiles & (kKvNTiles - 1)) == 0 &&
                    (kDqNTiles & (kDqNTiles - 1)) == 0,
                "n8 tile counts are powers of 2");
  static_assert(kOffQ % 128 == 0 && kOffDo % 128 == 0 && kQBytes % 128 == 0,
                "the Q and dO buffers start on whole swizzle atoms");
};

/// The large shape where it differs from the small one and the GPU has the shared memory.
template <int kHeadDim>
constexpr bool kHasLargeBwdShape =
    BwdTraits<kHeadDim, true>::kBlockM != BwdTraits<kHeadDim, false>::kBlockM ||
    BwdTraits<kHeadDim, true>::kBlockN != BwdTraits<kHeadDim, false>::kBlockN ||
    BwdTraits<kHeadDim, true>::kStagesDo != BwdTraits<kHeadDim, false>::kStagesDo ||
    BwdTraits<kHeadDim, true>::kWarpsN != BwdTraits<kHeadDim, false>::kWarpsN ||
    BwdTraits<kHeadDim, true>::kSliceCols != BwdTraits<kHeadDim, false>::kSliceCols ||
    BwdTraits<kHeadDim, true>::kPtInSmem != BwdTraits<kHeadDim, false>::kPtInSmem;

/// Row layout of the \f$P^T\f$ and \f$dS^T\f$ tiles ([kBlockN keys][kBlockM queries], 2-byte
/// elements) for the swizzle and fragment helpers above.
template <int kBlockM>
struct DsLayout {
  static constexpr int kRowBytes = kBlockM * 2;
  static_assert(kRowBytes % 128 == 0, "whole swizzle atoms per row");
};

// ------------------------------------------------------------------------------------------
// The warp-level GEMM: every product of Algorithm 2 is one call
// ------------------------------------------------------------------------------------------

// A warp tile \f$C \mathrel{+}= A B\f$ of kMTiles x kNTiles m16n8 tiles and kKSteps k16 steps
// needs, per k step, one A fragment per m16 tile and one B fragment per n8 tile. Where they
// come from is the only thing that differs between the products, so each source is a small
// struct with one `load` (fragment layouts in fa/mma.cuh):
//   SmemA  A row-major in shared memory (rows m, columns k): K, V in S^T, dP^T; P^T, dS^T
//   SmemAt A stored transposed (rows k, columns m): dS read from the dS^T tile
//   RegA   A in registers, packed by pack_fragments from an earlier product (P^T, dS^T)
//   SmemBt B stored transposed (rows n, columns k): Q, dO in S^T, dP^T
//   SmemB  B row-major (rows k, columns n): dO, Q in dV, dK; K in dQ (as V in the forward)

// Addressing (NOTES.md, change 10): each source folds its run-time tile position (r0, and a first
// column chunk c0) into the lane's offset once, `fragment_offset(lane_offset, r0, c0)`, and a
// fragment then is `fragment_offset(that, r, n)` with r, n compile-time (the unrolled mt, nt,
// k): one XOR with a constant (CSEd over the fragments that share n & 7) and an immediate.
// fragment_offset(fragment_offset(x, R, c0), r, n) == fragment_offset(x, R + r, c0 + n) holds
// when R, r are multiples of 8 and c0 + n has no carry (c0 a multiple of a power of 2 above
// every n, the lane's own chunk bit below every n): the XOR only touches the chunk's low 3
// bits, and the rows and the high chunk bits only add multiples of 128 bytes.

/// A operand from a swizzled row-major tile whose rows are the m index: rows
/// r0 + 16 mt + [0, 16), columns 16 k + [0, 16), one ldmatrix.x4.
template <class Layout>
struct SmemA {
  const char* tile;
  uint32_t lane_offset;  ///< the lane's offset of (r0, column 0)
  __device__ __forceinline__ SmemA(const char* t, int r0, int lane)
      : tile(t), lane_offset(fragment_offset<Layout>(a_lane_offset<Layout>(lane), r0, 0)) {}
  /// The tile at `base + tile_off` (tile_off a run-time multiple of 128, the double buffers):
  /// tile_off is folded into the lane's offset, so fragments stay `base + offset + immediate`.
  __device__ __forceinline__ SmemA(const char* base, uint32_t tile_off, int r0, int lane)
      : tile(base),
        lane_offset(fragment_offset<Layout>(a_lane_offset<Layout>(lane), r0, 0) + tile_off) {}
  __device__ __forceinline__ void load(uint32_t (&a)[4], int mt, int k) const {
    fa::ldmatrix_x4(a, tile + fragment_offset<Layout>(lane_offset, 16 * mt, 2 * k));
  }
};

/// A operand whose tile holds \f$A^T\f$ (rows k, columns m): rows 16 k + [0, 16), columns
/// r0 + 16 mt + [0, 16), one ldmatrix.x4.trans (each 8x8 matrix transposed on the way).
/// r0 is a multiple of 32 and kMTiles <= 2 (dQ's two m16 tiles): chunk r0 / 8 + 2 mt
/// has no carry.
template <class Layout>
struct SmemAt {
  const char* tile;
  uint32_t lane_offset;  ///< the lane's offset of (row 0, column r0)
  __device__ __forceinline__ SmemAt(const char* t, int r0, int lane)
      : tile(t), lane_offset(fragment_offset<Layout>(b_lane_offset<Layout>(lane), 0, r0 / 8)) {}
  __device__ __forceinline__ void load(uint32_t (&a)[4], int mt, int k) const {
    fa::ldmatrix_x4_trans(a, tile + fragment_offset<Layout>(lane_offset, 16 * k, 2 * mt));
  }
};

/// A operand in registers: `frag[mt][2k]` and `frag[mt][2k + 1]` (pack_fragments of an
/// accumulator) are the A fragment of k step k; nothing is loaded.
template <int kMTiles, int kTiles>
struct RegA {
  const uint32_t (&frag)[kMTiles][kTiles][2];
  __device__ __forceinline__ void load(uint32_t (&a)[4], int mt, int k) const {
    a[0] = frag[mt][2 * k][0];
    a[1] = frag[mt][2 * k][1];
    a[2] = frag[mt][2 * k + 1][0];
    a[3] = frag[mt][2 * k + 1][1];
  }
};

/// B operand whose tile holds \f$B^T\f$ (rows n, columns k, as K in \f$Q K^T\f$): n8 tiles nt
/// and nt + 1 = rows r0 + 8 nt + [0, 16), columns 16 k + [0, 16), one ldmatrix.x4.
template <class Layout>
struct SmemBt {
  const char* tile;
  uint32_t lane_offset;  ///< the lane's offset of (r0, column 0)
  __device__ __forceinline__ SmemBt(const char* t, int r0, int lane)
      : tile(t), lane_offset(fragment_offset<Layout>(b_lane_offset<Layout>(lane), r0, 0)) {}
  /// As SmemA's: the tile at `base + tile_off`, tile_off a multiple of 128.
  __device__ __forceinline__ SmemBt(const char* base, uint32_t tile_off, int r0, int lane)
      : tile(base),
        lane_offset(fragment_offset<Layout>(b_lane_offset<Layout>(lane), r0, 0) + tile_off) {}
  __device__ __forceinline__ void load(uint32_t (&b)[2][2], int nt, int k) const {
    uint32_t r[4];
    fa::ldmatrix_x4(r, tile + fragment_offset<Layout>(lane_offset, 8 * nt, 2 * k));
    b[0][0] = r[0];
    b[0][1] = r[1];
    b[1][0] = r[2];
    b[1][1] = r[3];
  }
};

/// B operand from a row-major tile (rows k, columns n, as V in \f$P V\f$): rows
/// kr0 + 16 k + [0, 16), columns c0 + 8 nt + [0, 16), one ldmatrix.x4.trans. kr0 is a
/// multiple of 16; c0 / 8 a multiple of the power of 2 at or above the warp's n8 tiles
/// (dK, dV: kKvNTiles; dQ: kDqNTiles), so chunk c0 / 8 + nt has no carry.
template <class Layout>
struct SmemB {
  const char* tile;
  uint32_t lane_offset;  ///< the lane's offset of (kr0, c0)
  __device__ __forceinline__ SmemB(const char* t, int kr0, int c0, int lane)
      : tile(t), lane_offset(fragment_offset<Layout>(a_lane_offset<Layout>(lane), kr0, c0 / 8)) {}
  /// As SmemA's: the tile at `base + tile_off`, tile_off a multiple of 128.
  __device__ __forceinline__ SmemB(const char* base, uint32_t tile_off, int kr0, int c0, int lane)
      : tile(base),
        lane_offset(fragment_offset<Layout>(a_lane_offset<Layout>(lane), kr0, c0 / 8) + tile_off) {}
  __device__ __forceinline__ void load(uint32_t (&b)[2][2], int nt, int k) const {
    uint32_t r[4];
    fa::ldmatrix_x4_trans(r, tile + fragment_offset<Layout>(lane_offset, 16 * k, nt));
    b[0][0] = r[0];
    b[0][1] = r[1];
    b[1][0] = r[2];
    b[1][1] = r[3];
  }
};

/// \f$C \mathrel{+}= A B\f$ for one warp: `acc[mt][nt]` is the m16n8 tile (mt, nt), A and B
/// are operand sources (above), k runs over kKSteps k16 steps, unrolled kUnroll at a time.
/// Per k step every A fragment feeds kNTiles mmas and every B fragment kMTiles.
template <typename T, int kKSteps, int kUnroll = kKSteps, int kMTiles, int kNTiles, class A,
          class B>
__device__ __forceinline__ void warp_gemm(float (&acc)[kMTiles][kNTiles][4], const A& a,
                                          const B& b) {
#pragma unroll(kUnroll)
  for (int k = 0; k < kKSteps; ++k) {
    uint32_t a_frag[kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) a.load(a_frag[mt], mt, k);
#pragma unroll
    for (int nt = 0; nt < kNTiles; nt += 2) {
      uint32_t b_frag[2][2];
      b.load(b_frag, nt, k);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int j = 0; j < 2; ++j) fa::mma_m16n8k16<T>(acc[mt][nt + j], a_frag[mt], b_frag[j]);
    }
  }
}

/// Two products of warp_gemm's form in one k loop, \f$C_0 \mathrel{+}= A_0 B_0\f$ and
/// \f$C_1 \mathrel{+}= A_1 B_1\f$ (one m16 tile each): each k step issues 2 kNTiles independent
/// mmas, so that the two chains hide each other's latency (the 99 KB shapes' \f$S^T\f$ and
/// \f$dP^T\f$).
template <typename T, int kKSteps, int kUnroll, int kNTiles, class A, class B>
__device__ __forceinline__ void warp_gemm_pair(float (&acc0)[1][kNTiles][4], const A& a0,
                                               const B& b0, float (&acc1)[1][kNTiles][4],
                                               const A& a1, const B& b1) {
#pragma unroll(kUnroll)
  for (int k = 0; k < kKSteps; ++k) {
    uint32_t a_frag[2][4];
    a0.load(a_frag[0], 0, k);
    a1.load(a_frag[1], 0, k);
#pragma unroll
    for (int nt = 0; nt < kNTiles; nt += 2) {
      uint32_t b_frag[2][2][2];
      b0.load(b_frag[0], nt, k);
      b1.load(b_frag[1], nt, k);
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int p = 0; p < 2; ++p)
          fa::mma_m16n8k16<T>(p == 0 ? acc0[0][nt + j] : acc1[0][nt + j], a_frag[p], b_frag[p][j]);
    }
  }
}

/// Sets every element of an accumulator (any shape of floats) to zero.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void zero(float (&acc)[kMTiles][kNTiles][4]) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
}

// ------------------------------------------------------------------------------------------
// Fragments: fp32 accumulators to 16-bit operands and to shared memory
// ------------------------------------------------------------------------------------------

/// Element of T widened to fp32.
template <typename T>
__device__ __forceinline__ float to_float(T x) {
  return static_cast<float>(x);
}

/// Element `hi` (0 low, 1 high) of a pair packed by fa::pack2, widened to fp32.
template <typename T>
__device__ __forceinline__ float unpack_half(uint32_t pair, int hi);
template <>
__device__ __forceinline__ float unpack_half<__half>(uint32_t pair, int hi) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(hi ? pair >> 16 : pair)));
}
template <>
__device__ __forceinline__ float unpack_half<__nv_bfloat16>(uint32_t pair, int hi) {
  return __uint_as_float(hi ? pair & 0xffff0000u : pair << 16);
}

/// Packs an fp32 accumulator (m16n8 C layout, `acc[mt][n8 tile][4]`) into 16-bit pairs:
/// `out[mt][tile][0]` holds row lane/4, `out[mt][tile][1]` row lane/4 + 8, columns
/// 2 (lane % 4) + {0, 1}. Tiles 2t and 2t + 1 of the result are the A fragment of k16 step t
/// of a following mma (RegA).
template <typename T, int kMTiles, int kTiles>
__device__ __forceinline__ void pack_fragments(uint32_t (&out)[kMTiles][kTiles][2],
                                               const float (&acc)[kMTiles][kTiles][4]) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kTiles; ++nt) {
      out[mt][nt][0] = fa::pack2<T>(acc[mt][nt][0], acc[mt][nt][1]);
      out[mt][nt][1] = fa::pack2<T>(acc[mt][nt][2], acc[mt][nt][3]);
    }
}

/// Byte offset, in a swizzled row-major tile of 2-byte elements, of the packed pair that
/// pack_fragments puts in `out[.][.][h]` for the m16n8 tile at (row0, col0): row
/// row0 + 8 h + lane / 4, columns col0 + 2 (lane % 4) + {0, 1}.
template <class Layout>
__device__ __forceinline__ uint32_t tile_fragment_offset(int row0, int col0, int h, int lane) {
  return swizzle<Layout::kRowBytes>(row0 + 8 * h + lane / 4, col0 / 8) + 4 * (lane % 4);
}

/// Stores packed 16-bit accumulator fragments `frag[mt][nt]` (pack_fragments layout) into a
/// swizzled row-major tile: rows row0 + 16 mt + [0, 16), columns col0 + 8 nt + [0, 8).
/// col0 / 8 is a multiple of kNTiles, a power of 2 (the run-time part is folded once, see
/// SmemA).
template <class Layout, int kMTiles, int kNTiles>
__device__ __forceinline__ void store_tile_fragments(char* tile,
                                                     const uint32_t (&frag)[kMTiles][kNTiles][2],
                                                     int row0, int col0, int lane) {
  static_assert((kNTiles & (kNTiles - 1)) == 0, "col0 / 8 + nt has no carry");
  const uint32_t base = tile_fragment_offset<Layout>(row0, col0, 0, lane);
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<uint32_t*>(tile + fragment_offset<Layout>(base, 16 * mt + 8 * h, nt)) =
            frag[mt][nt][h];
}

// ------------------------------------------------------------------------------------------
// dQ accumulation: fp32 adds in device memory
// ------------------------------------------------------------------------------------------

/// Adds four floats to fp32 device memory (`dst` 16-byte aligned): one vector
/// `red.global.add.v4.f32` on sm_90, four scalar atomics before.
__device__ __forceinline__ void atomic_add4(float* dst, const float (&v)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float4*>(dst), make_float4(v[0], v[1], v[2], v[3]));
#else
#pragma unroll
  for (int e = 0; e < 4; ++e) atomicAdd(dst + e, v[e]);
#endif
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
/// The bulk reduction below exists (sm_90: the Tensor Memory Accelerator, TMA).
constexpr bool kHasBulkReduce = true;
#else
constexpr bool kHasBulkReduce = false;
#endif

/// \f$dst_i \mathrel{+}= src_i\f$ for `bytes` bytes of fp32 (a multiple of 16, both 16-byte
/// aligned), `src` in shared memory: one `cp.reduce.async.bulk ... .add.f32` issued by one
/// thread; the TMA unit reads shared memory and adds in L2 while the warp goes on, without
/// the registers or load/store queue that `red.global` needs. Committed as one bulk group.
[[maybe_unused]] __device__ __forceinline__ void bulk_reduce_add(float* dst, const float* src,
                                                                 int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
      "cp.async.bulk.commit_group;\n" ::"l"(dst),
      "r"(static_cast<uint32_t>(__cvta_generic_to_shared(src))), "r"(bytes)
      : "memory");
#endif
}

/// Waits until this thread's bulk groups have read their shared-memory source (kReadOnly)
/// or have completed.
template <bool kReadOnly>
__device__ __forceinline__ void bulk_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kReadOnly)
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
  else
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}

/// Programmatic dependent launch (sm_90): waits until the kernel launched before this one on
/// the stream has ended and its writes are visible. Returns at once after a plain launch.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

/// Programmatic dependent launch (sm_90): the next kernel on the stream, if launched so, may
/// start its thread blocks once every thread block of this one has been here (or has exited).
__device__ __forceinline__ void grid_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

/// Makes this thread's earlier shared-memory stores visible to the async proxy (the TMA).
__device__ __forceinline__ void fence_proxy_async_shared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

/// The dq_accum layout. The main kernel adds each thread's dQ fragments where the thread holds
/// them: in the \f$B_r \times d\f$ slice of dq_accum that belongs to a q_block, the m16n8
/// fragment (mt, nd) of thread tid (its 4 accumulator floats) is the float4 at index
/// dq_fragment_index(): each warp owns one contiguous stretch of kDqWarpFloats floats, lanes
/// side by side. A warp's atomic add then covers 512 contiguous bytes (4 cache lines) instead
/// of 8 rows of the row-major tile, and on sm_90 the warp's whole stretch goes as one bulk
/// reduction (FlashAttention-2 stores dQaccum in its threads' order too). The convert kernel
/// reads it back with the same mapping. Warp w computes query rows dq_warp_row0(w) + [0, 32) and
/// head-dim columns dq_warp_col0(w) + [0, kDqCols) of the q_block (see accumulate_dq).
template <class Tr>
__device__ __forceinline__ int dq_fragment_index(int mt, int nd, int tid) {
  return ((tid / 32) * 2 * Tr::kDqNTiles + mt * Tr::kDqNTiles + nd) * 32 + tid % 32;
}
/// First query row (in the q_block) of warp `warp`'s dQ tile.
template <class Tr>
__device__ __forceinline__ int dq_warp_row0(int warp) {
  return 32 * (warp % Tr::kDqWarpsM);
}
/// First head-dim column of warp `warp`'s dQ tile.
template <class Tr>
__device__ __forceinline__ int dq_warp_col0(int warp) {
  return Tr::kDqCols * (warp / Tr::kDqWarpsM);
}

// ------------------------------------------------------------------------------------------
// Deterministic mode: the dQ adds of a q_block in a fixed order
// ------------------------------------------------------------------------------------------

// Every kv_block adds its dS K_j into the q_block's slice of dq_accum, and fp32 addition is not
// associative: the order of the adds decides the last bits. In deterministic mode the slice
// receives its adds in kv_block order 0, 1, 2, ...: a counter per (batch, head, q_block) in
// device memory, zeroed by the preprocess, counts the kv_blocks whose adds have landed. One
// thread of the thread block of kv_block j (the hand-off thread) waits until it reads j: the
// block's turn. The block adds, and the turn is passed on (the counter incremented) once the
// adds have landed. Taking a turn and passing one on each need a gpu-scope fence
// (`MEMBAR.ALL.GPU` in SASS), which costs about a round trip to L2 on the critical path, so
// one fence does both: the one that takes the turn of the next q_block passes this one on.
// (Variants 0 and 1 of FA_BWD_DQ_HANDOFF: a counter per warp, with two fences or one.)
// README "Deterministic mode" has the diagram, why no wait can deadlock and why the thread
// blocks walk their q_blocks backwards.

/// The hand-off thread traps after waiting this long: a broken ordering fails, never hangs.
constexpr unsigned long long kDqTurnTimeoutNs = 10'000'000'000ull;

/// A turn in the order of the adds into one q_block's dQ (deterministic mode): its counter and
/// what the hand-off thread read from it early. Counters are indices into `dq_counters` (one
/// `int` per row of the per-row scratch, fewer than 2^31: its dq_accum has d floats per row).
struct DqTurn {
  int counter;  ///< the (batch, head, q_block) counter (per warp: its stretch's)
  int seen;     ///< the counter as last read
};

/// What the hand-off thread carries from one q_block to the next (kDqPassLater): the counter
/// of the last turn it took and has not passed on yet, -1 if none.
struct DqOrder {
  int pending = -1;  ///< the counter of the turn to pass on at the next fence
};

/// The thread that takes and passes the turns: thread 0 of the thread block
/// (kDqTurnPerBlock), or lane 0 of every warp.
__device__ __forceinline__ bool is_dq_handoff_thread(int tid) {
  return kDqTurnPerBlock ? tid == 0 : tid % 32 == 0;
}

/// The counter of a turn in the order of the q_block whose slice of the per-row scratch starts
/// at row `row0`: the slice's first row serves the thread block, or its first rows the warps.
__device__ __forceinline__ int dq_turn_counter(int64_t row0, int warp) {
  return static_cast<int>(row0) + (kDqTurnPerBlock ? 0 : warp);
}

/// Starts a turn: the hand-off thread reads the counter without waiting for the value
/// (`ld.relaxed`, no ordering), so that the load's latency hides behind the work before
/// take_dq_turn.
__device__ __forceinline__ DqTurn look_at_dq_turn(int* counters, int counter, bool handoff) {
  DqTurn turn{counter, -1};
  if (handoff)
    asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];"
                 : "=r"(turn.seen)
                 : "l"(counters + counter)
                 : "memory");
  return turn;
}

/// Takes the turn (the hand-off thread; the caller makes the others wait for it): reads the
/// counter until it equals `rank` (its kv_block index: every kv_block before it has added),
/// then `fence.acq_rel.gpu`, after which this thread's adds happen after the ones it waited
/// for (acquire) and, before the TMA's bulk reduction (kBulk), `fence.proxy.async.global`.
/// With kDqPassLater the same fence passes the pending turn on: the relaxed increment after
/// it is a release of the adds that completed before the fence (the callers see to that:
/// wait_dq_adds_landed, or a barrier after `red` adds). A counter past the rank, or a wait
/// longer than kDqTurnTimeoutNs, traps.
template <bool kBulk>
__device__ __forceinline__ void take_dq_turn(int* counters, DqTurn& turn, int rank,
                                             DqOrder& order) {
  if (turn.seen != rank) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
      asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];"
                   : "=r"(turn.seen)
                   : "l"(counters + turn.counter)
                   : "memory");
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      if (turn.seen > rank || now - start > kDqTurnTimeoutNs) __trap();
    } while (turn.seen != rank);
  }
  asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
  if (kDqPassLater && order.pending >= 0)
    asm volatile("red.relaxed.gpu.global.add.s32 [%0], 1;\n" ::"l"(counters + order.pending)
                 : "memory");
  if constexpr (kBulk) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
#endif
  }
  order.pending = kDqPassLater ? turn.counter : -1;
}

/// Passes a turn on by itself (`red.release.gpu`: a fence, then the increment; nothing if
/// `counter` is -1): every turn in variant 0, the last one of a thread block otherwise. Its
/// adds must have completed: a bulk reduction waited for by the thread that issued it
/// (`cp.async.bulk.wait_group 0`, which makes its writes visible to that thread), `red` adds
/// followed by a barrier of the threads that issued them.
__device__ __forceinline__ void pass_dq_turn(int* counters, int counter) {
  if (counter >= 0)
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(counters + counter) : "memory");
}

/// Named barrier `id` of `count` threads: waits for the others (sync) or only signals (arrive).
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
/// See named_barrier_sync.
__device__ __forceinline__ void named_barrier_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
/// The named barrier of the dQ stage (barrier 0 is __syncthreads').
constexpr int kDqStageBarrier = 1;

// ------------------------------------------------------------------------------------------
// The order of the thread blocks
// ------------------------------------------------------------------------------------------

/// Decodes a one-dimensional grid of `num_blocks` thread blocks per (batch, head) pair into
/// (`block`, `pair`), in the order of step 06's forward: the pairs are taken in groups of
/// `group_pairs`; inside a group every pair's block 0 comes first, then every pair's block 1,
/// and so on. The launcher numbers the blocks so that block 0 has the most work (the longest
/// thread blocks start first and the short ones fill the tail of the grid); with
/// `group_pairs` = 1 a pair's blocks simply run in order. `index`: the place in that order.
/// (On the host too: det_tail_max_parts reads the order.)
__host__ __device__ __forceinline__ void decode_block_order(unsigned index, int num_blocks,
                                                            int num_pairs, int group_pairs,
                                                            int& block, int& pair) {
  const int group = index / (group_pairs * num_blocks);
  const int in_group = index - group * group_pairs * num_blocks;
  const int pairs_in_group = min(group_pairs, num_pairs - group * group_pairs);
  block = in_group / pairs_in_group;
  pair = group * group_pairs + in_group % pairs_in_group;
}

/// The most thread blocks one kv_block of the tail split takes (TailSplit).
constexpr int kMaxTailParts = 8;

/// The split of the grid's last partial wave (no causal mask, large shapes: plan_tail_split;
/// in deterministic mode where det_tail_max_parts allows it). Without the mask every kv_block
/// takes as long, so the last `count` kv_blocks of the order (total % resident) would run on a
/// few SMs while the others idle. The main kernel runs the `first` kv_blocks before them (whole
/// waves); a second launch, the kTailSplit instance, runs each of the `count` as `parts` thread
/// blocks side by side: part p walks a contiguous share of the (query head, q_block)
/// iterations, stores its fp32 dV and scale * dK, and the last part to finish sums the parts'
/// in part order (finish_tail_parts). In deterministic mode part p takes and passes the dQ
/// turns of kv_block j on the q_blocks of its share, as the unsplit kv_block would. Only that
/// instance reads it: the main kernel's parameters stay 07's.
struct TailSplit {
  int first;        ///< the kv_blocks of the main kernel, in order; the split ones follow
  int count;        ///< the split kv_blocks
  int parts;        ///< thread blocks per split kv_block
  float* partials;  ///< [split kv_block][part][dV, scale * dK][kBlockN][d], fp32
  int* counters;    ///< [split kv_block]: its parts done, zeroed before the preprocess
};

// ------------------------------------------------------------------------------------------
// Kernel 1: preprocess
// ------------------------------------------------------------------------------------------

/// Preprocess, 8 threads per query row (i, head, batch): \f$D_i = \sum_c dO_{ic} O_{ic}\f$ in
/// fp32, the lse in base 2 (\f$L_i \log_2 e\f$, for the exp2 trick), a zeroed fp32 dQ
/// accumulator row and, when `dq_counters` is not null (deterministic mode), a zeroed counter
/// (one int per row: those of a q_block's first rows serve its warps, see DqTurn). Padding
/// rows \f$N_q \le i < N_{q,pad}\f$ get \f$D_i = 0\f$ and \f$L_i = +\infty\f$, so that they
/// contribute \f$P = 0\f$. `late_cycles` > 0 (FA_BWD_LATE_PREPROCESS, a test's knob): the
/// thread blocks of every head's last kRowPad rows sleep that many SM cycles before they write,
/// so that a kernel that overlaps this one without waiting for it reads those rows too early.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(256)
    bwd_preprocess_kernel(const fa_bwd_args args, int seqlen_q_pad, float* lse_log2, float* d_row,
                          float* dq_accum, int* dq_counters, long long late_cycles) {
  constexpr int kLanesPerRow = 8, kChunksPerLane = kHeadDim / 8 / kLanesPerRow;
  grid_launch_dependents();  // the main kernel may start loading K_j and V_j
  if (late_cycles > 0 && blockIdx.x >= gridDim.x - kRowPad / 32)  // 32 rows a block
    for (const long long t0 = clock64(); clock64() - t0 < late_cycles;) __nanosleep(1000);
  const fa_fwd_args& f = args.fwd;
  const int row = blockIdx.x * (256 / kLanesPerRow) + threadIdx.x / kLanesPerRow;
  const int sub = threadIdx.x % kLanesPerRow, head = blockIdx.y, batch = blockIdx.z;
  const int64_t bh = static_cast<int64_t>(batch) * f.heads + head;
  float dot = 0.f;
  if (row < f.seqlen_q) {
    const T* o = static_cast<const T*>(f.o.ptr) + batch * f.o.batch_stride + row * f.o.row_stride +
                 head * f.o.head_stride;
    const T* d_o = static_cast<const T*>(args.d_o.ptr) + batch * args.d_o.batch_stride +
                   row * args.d_o.row_stride + head * args.d_o.head_stride;
#pragma unroll
    for (int i = 0; i < kChunksPerLane; ++i) {
      const int chunk = sub + i * kLanesPerRow;
      const uint4 o_vec = *reinterpret_cast<const uint4*>(o + chunk * 8);
      const uint4 do_vec = *reinterpret_cast<const uint4*>(d_o + chunk * 8);
      const T* o_el = reinterpret_cast<const T*>(&o_vec);
      const T* do_el = reinterpret_cast<const T*>(&do_vec);
#pragma unroll
      for (int e = 0; e < 8; ++e) dot += to_float(o_el[e]) * to_float(do_el[e]);
    }
  }
  // Every row of the padded slice (dq_accum layout: whole q_blocks).
  float4* dq_row = reinterpret_cast<float4*>(dq_accum + (bh * seqlen_q_pad + row) * kHeadDim);
  for (int i = sub; i < kHeadDim / 4; i += kLanesPerRow) dq_row[i] = make_float4(0, 0, 0, 0);
  for (int offset = kLanesPerRow / 2; offset > 0; offset /= 2)
    dot += __shfl_xor_sync(0xffffffffu, dot, offset);
  if (sub == 0) {
    const int64_t idx = bh * seqlen_q_pad + row;
    d_row[idx] = dot;
    lse_log2[idx] =
        row < f.seqlen_q ? f.lse[bh * f.seqlen_q + row] * static_cast<float>(kLog2e) : INFINITY;
    if (dq_counters != nullptr) dq_counters[idx] = 0;
  }
}

// ------------------------------------------------------------------------------------------
// Kernel 2: dK, dV (and dQ by atomics), K/V outer loop
// ------------------------------------------------------------------------------------------

/// What the phases of the main kernel read: the thread block's kv_block, its shared-memory
/// tiles, this warp's place in them, and the q_block of the current iteration (the fields
/// under "this q_block", set at the top of each iteration).
template <class Tr>
struct BwdBlock {
  const fa_fwd_args& f;  ///< the problem (sizes, causal) as the kernel received it
  char* smem;
  int batch, head_kv, kv_start;  ///< this thread block's kv_block: keys kv_start...
  int diag;                      ///< causal: row i sees key j iff j <= i + diag
  float scale_log2;              ///< softmax scale times \f$\log_2 e\f$
  int tid, warp, lane;
  int key0;     ///< this warp's first key (S^T, dP^T, dK, dV) in the kv_block
  int query0;   ///< its first query in the q_block (S^T, dP^T)
  int kv_col0;  ///< its first head-dim column of dK, dV
  const char* k_tile;
  const char* v_tile;
  char* pt_tile;     ///< \f$P^T\f$, [key][query] (P through shared memory only)
  char* ds_tile;     ///< \f$dS^T\f$, [key][query]
  float* dq_stage;   ///< sm_90 large shapes: the warps' dQ tiles, for the bulk reduction
  float* dq_accum;   ///< the fp32 dQ accumulator ([batch][head][seqlen_q_pad][d])
  int* dq_counters;  ///< deterministic mode: DqTurn's counters ([batch][head][seqlen_q_pad])
  int seqlen_q_pad;
  // this q_block
  int q_start;
  const char* q_tile;
  const char* do_tile;
  const float* lse_tile;  ///< the q_block's lse in base 2
  const float* d_tile;    ///< the q_block's \f$D_i\f$
  int head;               ///< the query head of the q_block
};

/// load_tile_async (above, the forward's) for the backward's Q and dO tiles: the same copies,
/// but a tile whose rows all exist (every q_block but a ragged last one) takes a copy of the
/// loop without the per-row bounds test and source select (NOTES.md, change 10).
template <class Tr, int kRows, typename T>
__device__ __forceinline__ void load_q_tile_async(char* smem_tile, const T* gmem,
                                                  int64_t row_stride, int row0, int seqlen,
                                                  int tid) {
  constexpr int kRowsPerPass = Tr::kNumThreads / Tr::kChunksPerRow;
  static_assert(kRows % kRowsPerPass == 0, "the threads cover the tile in whole passes");
  static_assert(kRowsPerPass % 8 == 0, "every pass starts on a whole swizzle atom");
  if (row0 + kRows > seqlen) {
    load_tile_async<Tr, kRows>(smem_tile, gmem, row_stride, row0, seqlen, tid);
    return;
  }
  const int chunk = tid % Tr::kChunksPerRow;
  const int tile_row = tid / Tr::kChunksPerRow;
  char* const dst = smem_tile + swizzle<Tr::kRowBytes>(tile_row, chunk);
  const T* src = gmem + (row0 + tile_row) * row_stride + chunk * 8;
#pragma unroll
  for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
    fa::cp_async_16(dst + pass * kRowsPerPass * Tr::kRowBytes, src, true);
    src += kRowsPerPass * row_stride;
  }
}

/// Starts loading q_block `q_block` of query head `head` into buffer `buf`: Q with its lse and
/// D (`with_q`), and/or dO (`with_do`). The caller commits the cp.async group.
template <class Tr, typename T>
__device__ __forceinline__ void load_q_block(const fa_bwd_args& args, const BwdBlock<Tr>& b,
                                             const float* lse_log2, const float* d_row,
                                             int seqlen_q_pad, int head, int q_block, int buf,
                                             bool with_q, bool with_do) {
  const fa_fwd_args& f = args.fwd;
  const int q_start = q_block * Tr::kBlockM;
  if (with_q) {
    const T* q =
        static_cast<const T*>(f.q.ptr) + b.batch * f.q.batch_stride + head * f.q.head_stride;
    load_q_tile_async<Tr, Tr::kBlockM>(b.smem + Tr::kOffQ + buf * Tr::kQBytes, q, f.q.row_stride,
                                       q_start, b.f.seqlen_q, b.tid);
    const int64_t row0 = (static_cast<int64_t>(b.batch) * f.heads + head) * seqlen_q_pad + q_start;
    constexpr int kChunks = Tr::kStatBytes / 16;
    if (b.tid < kChunks)
      fa::cp_async_16(b.smem + Tr::kOffLse + buf * Tr::kStatBytes + 16 * b.tid,
                      lse_log2 + row0 + 4 * b.tid, true);
    else if (b.tid < 2 * kChunks)
      fa::cp_async_16(b.smem + Tr::kOffD + buf * Tr::kStatBytes + 16 * (b.tid - kChunks),
                      d_row + row0 + 4 * (b.tid - kChunks), true);
  }
  if (with_do) {
    const T* d_o = static_cast<const T*>(args.d_o.ptr) + b.batch * args.d_o.batch_stride +
                   head * args.d_o.head_stride;
    load_q_tile_async<Tr, Tr::kBlockM>(
        b.smem + Tr::kOffDo + (Tr::kStagesDo == 2 ? buf : 0) * Tr::kQBytes, d_o,
        args.d_o.row_stride, q_start, b.f.seqlen_q, b.tid);
  }
}

/// The byte offsets of this q_block's Q and dO buffers in shared memory (multiples of 128):
/// the operand sources fold them into their lane offsets (SmemA).
template <class Tr>
__device__ __forceinline__ uint32_t q_tile_off(const BwdBlock<Tr>& b) {
  return static_cast<uint32_t>(b.q_tile - b.smem);
}
template <class Tr>
__device__ __forceinline__ uint32_t do_tile_off(const BwdBlock<Tr>& b) {
  return static_cast<uint32_t>(b.do_tile - b.smem);
}

/// Algorithm 2, line 11, transposed: \f$S^T = K_j Q_i^T\f$ for this warp's keys (A rows
/// key0...) and the queries col0 + [0, 8 kNTiles) of the q_block, unscaled.
template <class Tr, typename T, int kMTiles, int kNTiles>
__device__ __forceinline__ void compute_s_t(float (&s)[kMTiles][kNTiles][4], const BwdBlock<Tr>& b,
                                            int col0) {
  zero(s);
  warp_gemm<T, Tr::kHeadDim / 16, kAbtUnroll>(s, SmemA<Tr>(b.k_tile, b.key0, b.lane),
                                              SmemBt<Tr>(b.smem, q_tile_off(b), col0, b.lane));
}

/// Algorithm 2, line 12: \f$P^T = 2^{S^T c \log_2 e - L \log_2 e}\f$ (c the softmax scale,
/// the lse of the column's query), in place. With kMask, \f$P = 0\f$ where the key does not
/// exist or, under causal masking, lies past the query's diagonal; only the q_blocks that
/// cross the diagonal or the end of the keys take that copy (3-4 integer instructions per
/// element saved on all the others).
template <bool kMask, class Tr, int kMTiles, int kNTiles>
__device__ __forceinline__ void compute_p_t(float (&s)[kMTiles][kNTiles][4], const BwdBlock<Tr>& b,
                                            int col0) {
  const int group = b.lane / 4, quad = b.lane % 4;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      const int col = col0 + 8 * nt + 2 * quad;  // S^T columns are queries
      const float2 lse = *reinterpret_cast<const float2*>(b.lse_tile + col);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float p = fa::exp2_approx(fmaf(s[mt][nt][e], b.scale_log2, (e & 1) ? -lse.y : -lse.x));
        if constexpr (kMask) {
          const int key = b.kv_start + b.key0 + 16 * mt + group + 8 * (e >> 1);
          const int row = b.q_start + col + (e & 1);
          if (key >= b.f.seqlen_k || (b.f.causal && key > row + b.diag)) p = 0.f;
        }
        s[mt][nt][e] = p;
      }
    }
}

/// Algorithm 2, line 13: \f$dV_j \mathrel{+}= P^T dO_i\f$ for this warp's keys and head-dim
/// columns kv_col0..., over the kKSteps x 16 queries from q0: \f$P^T\f$ from `pt` (the
/// \f$P^T\f$ tile, or registers), dO by ldmatrix.trans.
template <class Tr, typename T, int kKSteps, class PtSource, int kMTiles, int kNTiles>
__device__ __forceinline__ void accumulate_dv(float (&dv_acc)[kMTiles][kNTiles][4],
                                              const PtSource& pt, const BwdBlock<Tr>& b, int q0) {
  warp_gemm<T, kKSteps>(dv_acc, pt, SmemB<Tr>(b.smem, do_tile_off(b), q0, b.kv_col0, b.lane));
}

/// Algorithm 2, line 14, transposed: \f$dP^T = V_j dO_i^T\f$ (as compute_s_t, with V and dO).
template <class Tr, typename T, int kMTiles, int kNTiles>
__device__ __forceinline__ void compute_dp_t(float (&dp)[kMTiles][kNTiles][4],
                                             const BwdBlock<Tr>& b, int col0) {
  zero(dp);
  warp_gemm<T, Tr::kHeadDim / 16, kAbtUnroll>(dp, SmemA<Tr>(b.v_tile, b.key0, b.lane),
                                              SmemBt<Tr>(b.smem, do_tile_off(b), col0, b.lane));
}

/// Algorithm 2, line 15: \f$dS^T = P^T \circ (dP^T - D)\f$ in place of dP^T, with the fp32
/// \f$P^T\f$ in registers.
template <class Tr, int kMTiles, int kNTiles>
__device__ __forceinline__ void compute_ds_t(float (&dp)[kMTiles][kNTiles][4],
                                             const float (&p)[kMTiles][kNTiles][4],
                                             const BwdBlock<Tr>& b, int col0) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      const float2 d =
          *reinterpret_cast<const float2*>(b.d_tile + col0 + 8 * nt + 2 * (b.lane % 4));
#pragma unroll
      for (int e = 0; e < 4; ++e)
        dp[mt][nt][e] = p[mt][nt][e] * (dp[mt][nt][e] - ((e & 1) ? d.y : d.x));
    }
}

/// Algorithm 2, line 15, with \f$P^T\f$ read back from the \f$P^T\f$ tile (the elements this
/// thread stored there): P then holds no registers during the \f$dP^T\f$ product.
template <class Tr, typename T, int kMTiles, int kNTiles>
__device__ __forceinline__ void compute_ds_t_from_smem(float (&dp)[kMTiles][kNTiles][4],
                                                       const BwdBlock<Tr>& b, int col0) {
  using Ds = DsLayout<Tr::kBlockM>;
  static_assert((kNTiles & (kNTiles - 1)) == 0, "col0 / 8 + nt has no carry");
  const uint32_t base = tile_fragment_offset<Ds>(b.key0, col0, 0, b.lane);  // as stored
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      const float2 d =
          *reinterpret_cast<const float2*>(b.d_tile + col0 + 8 * nt + 2 * (b.lane % 4));
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint32_t p2 = *reinterpret_cast<const uint32_t*>(
            b.pt_tile + fragment_offset<Ds>(base, 16 * mt + 8 * (e >> 1), nt));
        dp[mt][nt][e] = unpack_half<T>(p2, e & 1) * (dp[mt][nt][e] - ((e & 1) ? d.y : d.x));
      }
    }
}

/// Line 12's mask applied to the \f$P^T\f$ fragments this thread has stored to the \f$P^T\f$
/// tile (store_tile_fragments of pack_fragments: element e of tile (mt, nt) is half e & 1 of
/// the pair at row 16 mt + 8 (e >> 1)): the elements that compute_p_t<true> sets to 0 get a
/// 16-bit +0, which is what pack2 makes of 0.f. Same thread, so program order; the pair is
/// read and rewritten as the uint32_t it was stored as (no type-punned 16-bit store that
/// alias analysis could move).
template <class Tr, int kMTiles, int kNTiles>
__device__ __forceinline__ void mask_stored_p_t(const BwdBlock<Tr>& b, int col0) {
  using Ds = DsLayout<Tr::kBlockM>;
  static_assert((kNTiles & (kNTiles - 1)) == 0, "col0 / 8 + nt has no carry");
  const int group = b.lane / 4, quad = b.lane % 4;
  const uint32_t base = tile_fragment_offset<Ds>(b.key0, col0, 0, b.lane);  // as stored
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      const int col = col0 + 8 * nt + 2 * quad;  // S^T columns are queries
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t keep = 0xffffffffu;  // the halves of the pair that stay
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {  // element e = 2 h + hi
          const int key = b.kv_start + b.key0 + 16 * mt + group + 8 * h;
          const int row = b.q_start + col + hi;
          if (key >= b.f.seqlen_k || (b.f.causal && key > row + b.diag))
            keep &= hi ? 0x0000ffffu : 0xffff0000u;
        }
        if (keep != 0xffffffffu) {
          uint32_t* const pair = reinterpret_cast<uint32_t*>(
              b.pt_tile + fragment_offset<Ds>(base, 16 * mt + 8 * h, nt));
          *pair &= keep;
        }
      }
    }
}

/// This thread block's place in the order of the dQ adds (deterministic mode): kv_block j adds
/// after the j kv_blocks before it.
template <class Tr>
__device__ __forceinline__ int dq_rank(const BwdBlock<Tr>& b) {
  return b.kv_start / Tr::kBlockN;
}

/// What accumulate_dq leaves to issue_dq and release_dq: where the warp's staged dQ goes (null:
/// nothing staged) and, in deterministic mode, its turn in the order of the adds.
struct DqHandoff {
  float* dst;
  DqTurn turn;
};

/// Algorithm 2, line 16: \f$dQ_i \mathrel{+}= dS\,K_j\f$. Warp w computes query rows
/// dq_warp_row0(w) + [0, 32) and kDqCols head-dim columns, A = dS read from the \f$dS^T\f$
/// tile transposed, then adds each m16n8 fragment with one 16-byte atomic in the dq_accum
/// layout (dq_fragment_index). Rows that see no key of this kv_block (causal, above the
/// diagonal) or do not exist are skipped. With a dQ stage (sm_90, large shapes) the fragments
/// are only staged in shared memory, in the dq_accum layout, for issue_dq: the registers are
/// free as soon as the stores are issued, no red.global queue. In deterministic mode
/// (kOrderedDq) the adds wait for the turn (DqTurn, taken here before `red` adds, in issue_dq
/// before a bulk reduction), whose counter the hand-off thread reads early. A thread block
/// with one turn (kDqTurnPerBlock) takes it at every q_block of its walk (each has a row that
/// sees one of its keys), and its warps without rows stage zeros (+0 leaves dq_accum's bits
/// as they are). A warp with its own turn and nothing to add takes no turn: under causal
/// masking those are the last kv_blocks of the q_block's order (the empty rows of kv_block j
/// are empty for every later kv_block too), so no warp waits for them.
template <class Tr, typename T, bool kOrderedDq>
__device__ __forceinline__ DqHandoff accumulate_dq(const BwdBlock<Tr>& b, DqOrder& order) {
  using Ds = DsLayout<Tr::kBlockM>;
  constexpr bool kStaged = Tr::kDqStage && kHasBulkReduce;
  constexpr bool kBlockTurn = kOrderedDq && kDqTurnPerBlock;  // every warp takes part
  DqHandoff h{nullptr, {-1, -1}};
  const int64_t row0 =  // the q_block's first row in the per-row scratch
      (static_cast<int64_t>(b.batch) * b.f.heads + b.head) * b.seqlen_q_pad + b.q_start;
  float* const dst = b.dq_accum + row0 * Tr::kHeadDim;  // the q_block's slice of dq_accum
  const int dq_row0 = dq_warp_row0<Tr>(b.warp), dq_col0 = dq_warp_col0<Tr>(b.warp);
  const bool rows_empty = b.q_start + dq_row0 >= b.f.seqlen_q ||
                          (b.f.causal && b.q_start + dq_row0 + 31 + b.diag < b.kv_start);
  if (rows_empty && !kBlockTurn) return h;
  const bool handoff = is_dq_handoff_thread(b.tid);
  const int counter = dq_turn_counter(row0, b.warp);
  if constexpr (kOrderedDq && !kStaged) h.turn = look_at_dq_turn(b.dq_counters, counter, handoff);
  float dq[2][Tr::kDqNTiles][4];
  zero(dq);
  if (!rows_empty)
    warp_gemm<T, Tr::kBlockN / 16>(dq, SmemAt<Ds>(b.ds_tile, dq_row0, b.lane),
                                   SmemB<Tr>(b.k_tile, 0, dq_col0, b.lane));
  if constexpr (kStaged) {
    if (b.lane == 0) bulk_wait<true>();  // the previous reduction has read the stage
    __syncwarp();
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nd = 0; nd < Tr::kDqNTiles; ++nd)
        *reinterpret_cast<float4*>(b.dq_stage + 4 * dq_fragment_index<Tr>(mt, nd, b.tid)) =
            make_float4(dq[mt][nd][0], dq[mt][nd][1], dq[mt][nd][2], dq[mt][nd][3]);
    h.dst = dst;
    if constexpr (kOrderedDq)
      h.turn = look_at_dq_turn(b.dq_counters, counter, handoff);  // after dV
  } else {
    if constexpr (kOrderedDq) {  // the others wait for the hand-off thread's turn
      if (handoff) take_dq_turn<false>(b.dq_counters, h.turn, dq_rank<Tr>(b), order);
      if constexpr (kDqTurnPerBlock)
        __syncthreads();
      else
        __syncwarp();
    }
    if (!rows_empty) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nd = 0; nd < Tr::kDqNTiles; ++nd)
          atomic_add4(dst + 4 * dq_fragment_index<Tr>(mt, nd, b.tid), dq[mt][nd]);
    }
    if constexpr (kOrderedDq && !kDqPassLater) {  // variant 0: pass the turn on at once
      __syncwarp();
      if (handoff) pass_dq_turn(b.dq_counters, counter);
    }
  }
  return h;
}

/// Hands the staged dQ (accumulate_dq's result) to the TMA: one lane issues a bulk reduction of
/// the warp's stretch or, with one turn per thread block (kDqTurnPerBlock, deterministic
/// mode), once every warp has staged its stretch, thread 0 issues one of the whole slice; in
/// deterministic mode once it is the turn. The fence (MEMBAR + FENCE.VIEW.ASYNC in SASS)
/// waits until this thread's stores to the stage have completed, so it goes one product after
/// the stores, not right behind them (NOTES.md, change 4).
template <class Tr, bool kOrderedDq>
__device__ __forceinline__ void issue_dq(const BwdBlock<Tr>& b, DqHandoff& h, DqOrder& order) {
  if constexpr (Tr::kDqStage && kHasBulkReduce) {
    fence_proxy_async_shared();
    if constexpr (kOrderedDq && kDqTurnPerBlock) {
      if (b.warp == 0) {  // the turn's fence overlaps the other warps' last work
        if (b.lane == 0) take_dq_turn<true>(b.dq_counters, h.turn, dq_rank<Tr>(b), order);
        __syncwarp();
        named_barrier_sync(kDqStageBarrier, Tr::kNumThreads);  // the whole slice is staged
        if (b.lane == 0) bulk_reduce_add(h.dst, b.dq_stage, Tr::kBlockM * Tr::kHeadDim * 4);
      } else {
        named_barrier_arrive(kDqStageBarrier, Tr::kNumThreads);
      }
    } else {
      __syncwarp();
      if (h.dst != nullptr) {
        const int part = b.warp * Tr::kDqWarpFloats;  // this warp's stretch of the dQ slice
        if (b.lane == 0) {
          if constexpr (kOrderedDq)
            take_dq_turn<true>(b.dq_counters, h.turn, dq_rank<Tr>(b), order);
          bulk_reduce_add(h.dst + part, b.dq_stage + part, Tr::kDqWarpFloats * 4);
        }
      }
    }
  }
}

/// Deterministic mode, variant 0 (FA_BWD_DQ_HANDOFF): after issue_dq, passes the warp's turn
/// on once its bulk reduction has completed (one product later, so that the TMA adds while
/// the warp computes \f$dK\f$).
template <class Tr, bool kOrderedDq>
__device__ __forceinline__ void release_dq(const BwdBlock<Tr>& b, const DqHandoff& h) {
  if constexpr (kOrderedDq && !kDqPassLater && Tr::kDqStage && kHasBulkReduce) {
    if (h.dst != nullptr && b.lane == 0) {
      bulk_wait<false>();
      pass_dq_turn(b.dq_counters, h.turn.counter);
    }
  }
}

/// Deterministic mode (kDqPassLater), at the top of a q_block, before its first barrier: the
/// hand-off threads wait until the bulk reductions they issued in the previous q_block have
/// completed, so that the next fence may pass their turn on (and, with one turn per thread
/// block, every warp may rewrite the stage after that barrier).
template <class Tr>
__device__ __forceinline__ void wait_dq_adds_landed(const BwdBlock<Tr>& b) {
  if constexpr (kDqPassLater && Tr::kDqStage && kHasBulkReduce)
    if (is_dq_handoff_thread(b.tid)) bulk_wait<false>();
}

/// Deterministic mode, after the last q_block (kDqPassLater): passes the pending turn on once
/// its adds have completed (the bulk reduction waited for by the caller; `red` adds: a barrier).
template <class Tr, bool kOrderedDq>
__device__ __forceinline__ void pass_last_dq_turn(const BwdBlock<Tr>& b, const DqOrder& order) {
  if constexpr (kOrderedDq && kDqPassLater) {
    if constexpr (!(Tr::kDqStage && kHasBulkReduce)) __syncthreads();
    if (is_dq_handoff_thread(b.tid)) pass_dq_turn(b.dq_counters, order.pending);
  }
}

/// Algorithm 2, line 17: \f$dK_j \mathrel{+}= dS^T Q_i\f$ (the softmax scale is applied once,
/// in the epilogue), as accumulate_dv with \f$dS^T\f$ and Q.
template <class Tr, typename T, int kKSteps, class DstSource, int kMTiles, int kNTiles>
__device__ __forceinline__ void accumulate_dk(float (&dk_acc)[kMTiles][kNTiles][4],
                                              const DstSource& ds_t, const BwdBlock<Tr>& b,
                                              int q0) {
  warp_gemm<T, kKSteps>(dk_acc, ds_t, SmemB<Tr>(b.smem, q_tile_off(b), q0, b.kv_col0, b.lane));
}

/// One q_block with P through shared memory (large shapes, FlashAttention-2's layout). Warp
/// (n, m) computes \f$S^T\f$ and \f$dP^T\f$ for its 32 keys and kWarpCols queries and stores
/// \f$P^T\f$ and \f$dS^T\f$ (0 where masked; a warp tile that sees none of its keys, causal
/// above the diagonal or keys past \f$N_k\f$, stores zeros). After one barrier, warp (n, c)
/// computes dV and dK for its 32 keys and half of the head dimension over all queries, and
/// dQ for its rows. Line 13 (dV) moves after line 15: it reads \f$P^T\f$ of every warp. dQ
/// goes first and its bulk reduction (sm_90) after dV, so that the TMA adds during dK; in
/// deterministic mode the turn is taken before the reduction (and, in variant 0 of
/// FA_BWD_DQ_HANDOFF, passed on after dK; else by the next q_block's fence, `order`).
template <class Tr, typename T, bool kOrderedDq>
__device__ __forceinline__ void q_block_p_in_smem(const BwdBlock<Tr>& b,
                                                  float (&dv_acc)[Tr::kKvMTiles][Tr::kKvNTiles][4],
                                                  float (&dk_acc)[Tr::kKvMTiles][Tr::kKvNTiles][4],
                                                  DqOrder& order) {
  using Ds = DsLayout<Tr::kBlockM>;
  // Elements need the mask only where the key does not exist (ragged last kv_block) or,
  // under causal masking, j > i + diag: only q_blocks that cross the diagonal test them.
  const bool needs_mask = b.kv_start + Tr::kBlockN > b.f.seqlen_k ||
                          (b.f.causal && b.kv_start + Tr::kBlockN - 1 > b.q_start + b.diag);
  const bool tile_empty =
      b.kv_start + b.key0 >= b.f.seqlen_k ||
      (b.f.causal && b.kv_start + b.key0 > b.q_start + b.query0 + Tr::kWarpCols - 1 + b.diag);
  if (!tile_empty) {
    float s[2][Tr::kNTilesS][4], dp[2][Tr::kNTilesS][4];
    uint32_t frag[2][Tr::kNTilesS][2];
    compute_s_t<Tr, T>(s, b, b.query0);  // line 11
    // Line 12 without the mask, then line 14, in one basic block, so that ptxas spreads the
    // exponentials over the mmas around them; the mask then zeroes the masked elements of the
    // stored P^T before anything reads it (NOTES.md, changes 10 and 11: 3.5-4.4% faster at
    // d = 64, 1.6-1.8% at d = 128, than masking before line 14).
    compute_p_t<false>(s, b, b.query0);
    pack_fragments<T>(frag, s);
    store_tile_fragments<Ds>(b.pt_tile, frag, b.key0, b.query0, b.lane);
    compute_dp_t<Tr, T>(dp, b, b.query0);  // line 14
    if (needs_mask) mask_stored_p_t<Tr, Tr::kSMTiles, Tr::kNTilesS>(b, b.query0);
    compute_ds_t_from_smem<Tr, T>(dp, b, b.query0);  // line 15
    pack_fragments<T>(frag, dp);
    store_tile_fragments<Ds>(b.ds_tile, frag, b.key0, b.query0, b.lane);
  } else {
    uint32_t zero_frag[2][Tr::kNTilesS][2] = {};
    store_tile_fragments<Ds>(b.pt_tile, zero_frag, b.key0, b.query0, b.lane);
    store_tile_fragments<Ds>(b.ds_tile, zero_frag, b.key0, b.query0, b.lane);
  }
  __syncthreads();  // P^T, dS^T of the whole block are in
  DqHandoff dq_add = accumulate_dq<Tr, T, kOrderedDq>(b, order);  // line 16 (staged on sm_90)
  // Warp (n, c) owns keys key0 + [0, 32) and head-dim columns kv_col0 + [0, d / 2), all
  // queries of the q_block. Keys that see no query are skipped.
  const bool keys_empty =
      b.kv_start + b.key0 >= b.f.seqlen_k ||
      (b.f.causal && b.kv_start + b.key0 > b.q_start + Tr::kBlockM - 1 + b.diag);
  if (!keys_empty)  // line 13
    accumulate_dv<Tr, T, Tr::kBlockM / 16>(dv_acc, SmemA<Ds>(b.pt_tile, b.key0, b.lane), b, 0);
  issue_dq<Tr, kOrderedDq>(b, dq_add, order);
  if (!keys_empty)  // line 17
    accumulate_dk<Tr, T, Tr::kBlockM / 16>(dk_acc, SmemA<Ds>(b.ds_tile, b.key0, b.lane), b, 0);
  release_dq<Tr, kOrderedDq>(b, dq_add);
}

/// One q_block with P in registers (99 KB shapes). Warp (n, m) owns 16 keys and walks its
/// kWarpCols queries in slices of kSliceCols: \f$S^T\f$ and \f$dP^T\f$ in one k loop, then P
/// and dS from the fp32 accumulators, whose packed fragments are directly the A operands of
/// dV and dK (as P in the forward's \f$P V\f$). \f$dS^T\f$ goes through shared memory once,
/// for dQ, which sums over all keys of the block. A slice whose queries see none of the
/// warp's keys has P = 0 and dS = 0: only its zero dS^T is stored. With one dO buffer the
/// next dO is loaded during dQ.
template <class Tr, typename T>
__device__ __forceinline__ void q_block_p_in_registers(
    const BwdBlock<Tr>& b, float (&dv_acc)[Tr::kKvMTiles][Tr::kKvNTiles][4],
    float (&dk_acc)[Tr::kKvMTiles][Tr::kKvNTiles][4]) {
  using Ds = DsLayout<Tr::kBlockM>;
  const bool needs_mask = b.kv_start + Tr::kBlockN > b.f.seqlen_k ||
                          (b.f.causal && b.kv_start + Tr::kBlockN - 1 > b.q_start + b.diag);
#pragma unroll 1
  for (int slice = 0; slice < Tr::kSlices; ++slice) {
    const int col0 = b.query0 + Tr::kSliceCols * slice;  // the slice's first query
    const bool slice_empty =
        b.kv_start + b.key0 >= b.f.seqlen_k ||
        (b.f.causal && b.kv_start + b.key0 > b.q_start + col0 + Tr::kSliceCols - 1 + b.diag);
    uint32_t ds_frag[1][Tr::kNTilesS][2] = {};
    if (!slice_empty) {
      uint32_t p_frag[1][Tr::kNTilesS][2];
      {
        float s[1][Tr::kNTilesS][4], dp[1][Tr::kNTilesS][4];
        zero(s);  // lines 11 and 14 in one k loop
        zero(dp);
        warp_gemm_pair<T, Tr::kHeadDim / 16, kAbtUnroll>(
            s, SmemA<Tr>(b.k_tile, b.key0, b.lane), SmemBt<Tr>(b.smem, q_tile_off(b), col0, b.lane),
            dp, SmemA<Tr>(b.v_tile, b.key0, b.lane),
            SmemBt<Tr>(b.smem, do_tile_off(b), col0, b.lane));
        if (needs_mask)  // line 12
          compute_p_t<true>(s, b, col0);
        else
          compute_p_t<false>(s, b, col0);
        compute_ds_t(dp, s, b, col0);  // line 15
        pack_fragments<T>(p_frag, s);
        pack_fragments<T>(ds_frag, dp);
      }
      accumulate_dv<Tr, T, Tr::kNTilesS / 2>(dv_acc, RegA<1, Tr::kNTilesS>{p_frag}, b, col0);
      accumulate_dk<Tr, T, Tr::kNTilesS / 2>(dk_acc, RegA<1, Tr::kNTilesS>{ds_frag}, b, col0);
    }
    // dS^T to shared memory: dQ_i needs all keys of the block.
    store_tile_fragments<Ds>(b.ds_tile, ds_frag, b.key0, col0, b.lane);
  }
}

/// Writes one kv_block's dV or dK: `mult` times the sum of the kKvParts warps' fp32 partials
/// (warps that split the queries hold partial sums over their queries). A warp's fragments
/// `acc[mt][nd]` cover keys key0 + 16 mt + [0, 16) and head-dim columns col0 + 8 nd + [0, 8)
/// of partial `part`. They go to an fp32 staging tile in shared memory (rows padded by 8
/// floats: conflict-free), are summed there, and leave as 16-byte stores; rows at or past
/// `valid_rows` are not stored. A part of a split kv_block (kToPartial, TailSplit) stores the
/// fp32 sums to `partial` ([kBlockN][d]) instead, for finish_tail_parts.
template <class Tr, typename T, bool kToPartial = false>
__device__ __forceinline__ void store_kv_grad(const float (&acc)[Tr::kKvMTiles][Tr::kKvNTiles][4],
                                              float mult, float* staging, T* gmem,
                                              int64_t row_stride, int valid_rows, int part,
                                              int key0, int col0, int tid,
                                              float* partial = nullptr) {
  const int lane = tid % 32;
  __syncthreads();  // the staging area is free
  float* mine =
      staging + (part * Tr::kBlockN + key0 + lane / 4) * Tr::kStageStride + col0 + 2 * (lane % 4);
#pragma unroll
  for (int mt = 0; mt < Tr::kKvMTiles; ++mt)
#pragma unroll
    for (int nd = 0; nd < Tr::kKvNTiles; ++nd)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<float2*>(mine + (16 * mt + 8 * h) * Tr::kStageStride + 8 * nd) =
            make_float2(acc[mt][nd][2 * h], acc[mt][nd][2 * h + 1]);
  __syncthreads();
#pragma unroll
  for (int idx = tid; idx < Tr::kBlockN * Tr::kChunksPerRow; idx += Tr::kNumThreads) {
    const int row = idx / Tr::kChunksPerRow, chunk = idx % Tr::kChunksPerRow;
    float sum[8] = {};
#pragma unroll
    for (int wm = 0; wm < Tr::kKvParts; ++wm) {
      const float4* src = reinterpret_cast<const float4*>(
          staging + (wm * Tr::kBlockN + row) * Tr::kStageStride + 8 * chunk);
      const float4 lo = src[0], hi = src[1];
      sum[0] += lo.x, sum[1] += lo.y, sum[2] += lo.z, sum[3] += lo.w;
      sum[4] += hi.x, sum[5] += hi.y, sum[6] += hi.z, sum[7] += hi.w;
    }
    if constexpr (kToPartial) {
      if (row < valid_rows) {
        float4* const dst = reinterpret_cast<float4*>(partial + row * Tr::kHeadDim + 8 * chunk);
        dst[0] = make_float4(sum[0] * mult, sum[1] * mult, sum[2] * mult, sum[3] * mult);
        dst[1] = make_float4(sum[4] * mult, sum[5] * mult, sum[6] * mult, sum[7] * mult);
      }
    } else if (row < valid_rows) {
      uint4 out;
      out.x = fa::pack2<T>(sum[0] * mult, sum[1] * mult);
      out.y = fa::pack2<T>(sum[2] * mult, sum[3] * mult);
      out.z = fa::pack2<T>(sum[4] * mult, sum[5] * mult);
      out.w = fa::pack2<T>(sum[6] * mult, sum[7] * mult);
      *reinterpret_cast<uint4*>(gmem + row * row_stride + 8 * chunk) = out;
    }
  }
}

/// The end of a part of a split kv_block (TailSplit) once store_kv_grad has written its fp32
/// dV and scale * dK to `partials` (the kv_block's: [part][dV, dK][kBlockN][d]): the part that
/// finishes last sums every part's, in part order (the same bits whichever part that is), and
/// stores dV and dK as store_kv_grad does; the others return. Every thread's fence before the
/// count makes its partials visible to the other SMs, the last part's fence after the count
/// orders its reads after the other parts' writes; the reads bypass L1 (`__ldcg`).
template <class Tr, typename T>
__device__ __forceinline__ void finish_tail_parts(const float* partials, int* counter, int parts,
                                                  T* dv, int64_t dv_stride, T* dk,
                                                  int64_t dk_stride, int valid_rows, int tid) {
  constexpr int kGradFloats = Tr::kBlockN * Tr::kHeadDim, kGradChunks = kGradFloats / 8;
  __threadfence();  // this thread's partials, before the count
  __syncthreads();  // every thread's
  if (!__syncthreads_or(tid == 0 && atomicAdd(counter, 1) == parts - 1)) return;
  __threadfence();  // the other parts' partials, after the count
  for (int idx = tid; idx < 2 * kGradChunks; idx += Tr::kNumThreads) {
    const int grad = idx / kGradChunks;  // 0: dV, 1: dK
    const int row = idx % kGradChunks / Tr::kChunksPerRow, chunk = idx % Tr::kChunksPerRow;
    if (row >= valid_rows) continue;
    float sum[8] = {};
    for (int p = 0; p < parts; ++p) {
      const float4* src = reinterpret_cast<const float4*>(partials + (2 * p + grad) * kGradFloats +
                                                          row * Tr::kHeadDim + 8 * chunk);
      const float4 lo = __ldcg(src), hi = __ldcg(src + 1);
      sum[0] += lo.x, sum[1] += lo.y, sum[2] += lo.z, sum[3] += lo.w;
      sum[4] += hi.x, sum[5] += hi.y, sum[6] += hi.z, sum[7] += hi.w;
    }
    uint4 out;
    out.x = fa::pack2<T>(sum[0], sum[1]);
    out.y = fa::pack2<T>(sum[2], sum[3]);
    out.z = fa::pack2<T>(sum[4], sum[5]);
    out.w = fa::pack2<T>(sum[6], sum[7]);
    *reinterpret_cast<uint4*>((grad ? dk + row * dk_stride : dv + row * dv_stride) + 8 * chunk) =
        out;
  }
}

/// The epilogue of a part of a split kv_block (TailSplit): its fp32 dV and scale * dK
/// (store_kv_grad) to its slot, blockIdx.x (split kv_block, part); the last part of the
/// kv_block to get here sums the kv_block's slots (finish_tail_parts).
template <class Tr, typename T>
__device__ __forceinline__ void store_tail_part(
    const float (&dv_acc)[Tr::kKvMTiles][Tr::kKvNTiles][4],
    const float (&dk_acc)[Tr::kKvMTiles][Tr::kKvNTiles][4], float scale, float* staging,
    const TailSplit& tail, T* dv, int64_t dv_stride, T* dk, int64_t dk_stride, int valid_rows,
    int part, int key0, int col0, int tid) {
  constexpr int kGradFloats = Tr::kBlockN * Tr::kHeadDim;
  const int split_block = blockIdx.x / tail.parts;
  float* const partials =  // the kv_block's
      tail.partials + static_cast<int64_t>(split_block) * tail.parts * 2 * kGradFloats;
  float* const partial = partials + (blockIdx.x - split_block * tail.parts) * 2 * kGradFloats;
  store_kv_grad<Tr, T, true>(dv_acc, 1.f, staging, dv, dv_stride, valid_rows, part, key0, col0, tid,
                             partial);
  store_kv_grad<Tr, T, true>(dk_acc, scale, staging, dk, dk_stride, valid_rows, part, key0, col0,
                             tid, partial + kGradFloats);
  finish_tail_parts<Tr, T>(partials, tail.counters + split_block, tail.parts, dv, dv_stride, dk,
                           dk_stride, valid_rows, tid);
}

/// The q_block of iteration `it` of a kv_block's walk without the mask (the split tail's
/// parts start there): query head it / n_q_blocks of the group, its q_blocks in order or, in
/// deterministic mode (kOrderedDq), from the last one down, as dk_dv_block walks them.
template <bool kOrderedDq>
__device__ __forceinline__ int tail_q_block(int it, int n_q_blocks) {
  return kOrderedDq ? n_q_blocks - 1 - it % n_q_blocks : it % n_q_blocks;
}

/// Main backward kernel: one thread block per (kv_block j, kv head, batch), in the order of
/// decode_block_order (under causal masking the kv_blocks that meet the most q_blocks first).
/// The loop order of the forward flips: K_j and V_j stay in shared memory and \f$dK_j\f$,
/// \f$dV_j\f$ in registers, while the inner loop walks the q_blocks i of every query head of
/// the GQA group (under causal masking only those with a row that sees a key of kv_block j).
/// With \f$P\f$ recomputed from the lse:
/// \f[ P_{ij} = 2^{\,S_{ij} \log_2 e - L_i \log_2 e},\quad dV_j \mathrel{+}= P_{ij}^T dO_i,\quad
///     dP_{ij} = dO_i V_j^T,\quad dS_{ij} = P_{ij} \circ (dP_{ij} - D_i), \f]
/// \f[ dK_j \mathrel{+}= \mathrm{scale}\; dS_{ij}^T Q_i,\qquad
///     \mathrm{dq\_accum}_i \mathrel{+}= dS_{ij} K_j \ \text{(fp32 adds)}. \f]
/// Each warp computes the transposed scores \f$S^T = K Q^T\f$ and \f$dP^T = V dO^T\f$ for its
/// keys; the q_block's lines run in q_block_p_in_smem (large shapes) or
/// q_block_p_in_registers (99 KB shapes). Per q_block: wait for Q_i, dO_i (loaded during the
/// previous one), start loading the next q_block's, then the lines. In deterministic mode
/// (kOrderedDq) the dQ adds of each q_block go in kv_block order (DqTurn, counters in
/// `dq_counters`) and each head's q_blocks are walked from the last one down, so that the
/// kv_blocks of a head, resident together, reach a q_block in that order too. The kernels
/// below (bwd_dk_dv_kernel, bwd_dk_dv_tail_kernel) are this body; with kTailSplit (no mask)
/// the thread block is part blockIdx.x % tail.parts of split kv_block
/// blockIdx.x / tail.parts (TailSplit), walks its share of the iterations (tail_q_block) and
/// ends in finish_tail_parts; with kOrderedDq too, it takes and passes the turns of the
/// q_blocks of its share only, each once, as the unsplit kv_block does (its first turn in
/// take_dq_turn, its last in pass_last_dq_turn). Every piece of the split is behind
/// `if constexpr`: without it the body is 07's, instruction for instruction.
template <typename T, int kHeadDim, bool kLargeSmem, bool kOrderedDq, bool kTailSplit>
__device__ __forceinline__ void dk_dv_block(const fa_bwd_args& args, float* dq_accum,
                                            int* dq_counters, const float* lse_log2,
                                            const float* d_row, int seqlen_q_pad, float scale_log2,
                                            int group_pairs, const TailSplit& tail) {
  using Tr = BwdTraits<kHeadDim, kLargeSmem>;
  extern __shared__ __align__(128) char smem[];
  const fa_fwd_args& f = args.fwd;
  int kv_block = 0, pair = 0;
  if constexpr (kTailSplit)  // the parts of a split kv_block are side by side in the grid
    decode_block_order(tail.first + blockIdx.x / tail.parts,
                       (f.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN, f.batch * f.heads_kv,
                       group_pairs, kv_block, pair);
  else
    decode_block_order(blockIdx.x, (f.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN,
                       f.batch * f.heads_kv, group_pairs, kv_block, pair);
  BwdBlock<Tr> b{f};
  b.smem = smem;
  b.head_kv = pair % f.heads_kv;
  b.batch = pair / f.heads_kv;
  b.kv_start = kv_block * Tr::kBlockN;
  b.diag = f.seqlen_k - f.seqlen_q;
  b.scale_log2 = scale_log2;
  b.tid = threadIdx.x;
  b.warp = b.tid / 32;
  b.lane = b.tid % 32;
  b.key0 = 16 * Tr::kSMTiles * (b.warp % Tr::kWarpsN);
  b.query0 = Tr::kWarpCols * (b.warp / Tr::kWarpsN);
  b.kv_col0 = 8 * Tr::kKvNTiles * (b.warp / (Tr::kNumWarps / Tr::kKvWarpsD));
  b.k_tile = smem;
  b.v_tile = smem + Tr::kOffV;
  b.pt_tile = smem + Tr::kOffPt;
  b.ds_tile = smem + Tr::kOffDs;
  b.dq_stage = reinterpret_cast<float*>(smem + Tr::kOffDqStage);
  b.dq_accum = dq_accum;
  b.dq_counters = dq_counters;
  b.seqlen_q_pad = seqlen_q_pad;
  const int group_size = f.heads / f.heads_kv;

  // The q_blocks this kv_block meets: all, or under causal masking those from the first one
  // holding a row i >= kv_start - diag (the rows before see none of its keys: skipped).
  const int n_q_blocks = (b.f.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  const int m_begin = b.f.causal ? min(n_q_blocks, max(0, b.kv_start - b.diag) / Tr::kBlockM) : 0;
  int n_iters = group_size * (n_q_blocks - m_begin);  // (query head, q_block) pairs
  // Each head's q_blocks in order, or from the last one down (deterministic mode).
  const int first_q_block = kOrderedDq ? n_q_blocks - 1 : m_begin;
  const int past_q_block = kOrderedDq ? m_begin - 1 : n_q_blocks;
  const int q_step = kOrderedDq ? -1 : 1;
  [[maybe_unused]] int it_begin = 0;  // the first iteration this thread block walks
  if constexpr (kTailSplit) {  // a part of a split kv_block (no mask: m_begin = 0): its share
    const int part = blockIdx.x % tail.parts;
    it_begin = static_cast<int64_t>(n_iters) * part / tail.parts;
    n_iters = static_cast<int64_t>(n_iters) * (part + 1) / tail.parts - it_begin;
  }

  // Prologue: K_j, V_j and the first q_block in one cp.async group.
  const T* const k =
      static_cast<const T*>(f.k.ptr) + b.batch * f.k.batch_stride + b.head_kv * f.k.head_stride;
  const T* const v =
      static_cast<const T*>(f.v.ptr) + b.batch * f.v.batch_stride + b.head_kv * f.v.head_stride;
  load_tile_async<Tr, Tr::kBlockN>(smem, k, f.k.row_stride, b.kv_start, b.f.seqlen_k, b.tid);
  load_tile_async<Tr, Tr::kBlockN>(smem + Tr::kOffV, v, f.v.row_stride, b.kv_start, b.f.seqlen_k,
                                   b.tid);
  if constexpr (!kTailSplit) {  // lse, D and the zeroed dq_accum are the preprocess's
    grid_dependency_wait();
    grid_launch_dependents();
  }
  if (n_iters > 0) {
    if constexpr (kTailSplit)
      load_q_block<Tr, T>(args, b, lse_log2, d_row, seqlen_q_pad,
                          b.head_kv * group_size + it_begin / n_q_blocks,
                          tail_q_block<kOrderedDq>(it_begin, n_q_blocks), 0, true, true);
    else
      load_q_block<Tr, T>(args, b, lse_log2, d_row, seqlen_q_pad, b.head_kv * group_size,
                          first_q_block, 0, true, true);
  }
  fa::cp_async_commit();

  // On-chip state for the whole loop: this warp's part of dV_j and (unscaled) dK_j.
  float dv_acc[Tr::kKvMTiles][Tr::kKvNTiles][4], dk_acc[Tr::kKvMTiles][Tr::kKvNTiles][4];
  zero(dv_acc);
  zero(dk_acc);
  DqOrder order;  // deterministic mode: the turn to pass on

  // Iteration it visits (query head, q_block) = (head, q_block): the q_blocks of one head,
  // then the next head of the group (counters, not it / m_count: no integer division).
  int head = b.head_kv * group_size, q_block = first_q_block;
  if constexpr (kTailSplit)
    head += it_begin / n_q_blocks, q_block = tail_q_block<kOrderedDq>(it_begin, n_q_blocks);
  for (int it = 0; it < n_iters; ++it) {
    const int buf = it & 1;
    int next_head = head, next_q_block = q_block + q_step;
    if (next_q_block == past_q_block) next_q_block = first_q_block, ++next_head;
    b.q_start = q_block * Tr::kBlockM;
    b.q_tile = smem + Tr::kOffQ + buf * Tr::kQBytes;
    b.do_tile = smem + Tr::kOffDo + (Tr::kStagesDo == 2 ? buf : 0) * Tr::kQBytes;
    b.lse_tile = reinterpret_cast<const float*>(smem + Tr::kOffLse) + buf * Tr::kBlockM;
    b.d_tile = reinterpret_cast<const float*>(smem + Tr::kOffD) + buf * Tr::kBlockM;
    b.head = head;

    fa::cp_async_wait<0>();
    if constexpr (kOrderedDq) wait_dq_adds_landed(b);
    __syncthreads();  // Q_i, dO_i, lse, D have landed; every warp is done with the other buffer
    if (it + 1 < n_iters)
      load_q_block<Tr, T>(args, b, lse_log2, d_row, seqlen_q_pad, next_head, next_q_block, buf ^ 1,
                          true, Tr::kStagesDo == 2);
    fa::cp_async_commit();

    if constexpr (Tr::kPtInSmem) {
      q_block_p_in_smem<Tr, T, kOrderedDq>(b, dv_acc, dk_acc, order);
    } else {
      q_block_p_in_registers<Tr, T>(b, dv_acc, dk_acc);
      __syncthreads();  // dS^T is in; dO_i has been read
      if constexpr (Tr::kStagesDo == 1) {
        if (it + 1 < n_iters)
          load_q_block<Tr, T>(args, b, lse_log2, d_row, seqlen_q_pad, next_head, next_q_block,
                              buf ^ 1, false, true);
        fa::cp_async_commit();
      }
      accumulate_dq<Tr, T, kOrderedDq>(b, order);  // line 16
    }
    head = next_head;
    q_block = next_q_block;
  }

  // Epilogue: dV_j and scale * dK_j, the partials of the query-splitting warps summed.
  fa::cp_async_wait<0>();
  if (b.lane == 0) bulk_wait<false>();  // the dQ reductions are done (the stage is reused)
  pass_last_dq_turn<Tr, kOrderedDq>(b, order);
  float* const staging = reinterpret_cast<float*>(smem);
  T* const dv = static_cast<T*>(args.dv.ptr) + b.batch * args.dv.batch_stride +
                b.head_kv * args.dv.head_stride + b.kv_start * args.dv.row_stride;
  T* const dk = static_cast<T*>(args.dk.ptr) + b.batch * args.dk.batch_stride +
                b.head_kv * args.dk.head_stride + b.kv_start * args.dk.row_stride;
  const int part = Tr::kKvParts > 1 ? b.warp / Tr::kWarpsN : 0;
  if constexpr (kTailSplit) {
    store_tail_part<Tr, T>(dv_acc, dk_acc, f.scale, staging, tail, dv, args.dv.row_stride, dk,
                           args.dk.row_stride, b.f.seqlen_k - b.kv_start, part, b.key0, b.kv_col0,
                           b.tid);
  } else {
    store_kv_grad<Tr, T>(dv_acc, 1.f, staging, dv, args.dv.row_stride, b.f.seqlen_k - b.kv_start,
                         part, b.key0, b.kv_col0, b.tid);
    store_kv_grad<Tr, T>(dk_acc, f.scale, staging, dk, args.dk.row_stride,
                         b.f.seqlen_k - b.kv_start, part, b.key0, b.kv_col0, b.tid);
  }
}

/// The main backward kernel (dk_dv_block): every grid but the split tail's.
template <typename T, int kHeadDim, bool kLargeSmem, bool kOrderedDq>
__global__ void __launch_bounds__(BwdTraits<kHeadDim, kLargeSmem>::kNumThreads, 1)
    bwd_dk_dv_kernel(const fa_bwd_args args, float* dq_accum, int* dq_counters,
                     const float* lse_log2, const float* d_row, int seqlen_q_pad, float scale_log2,
                     int group_pairs) {
  dk_dv_block<T, kHeadDim, kLargeSmem, kOrderedDq, false>(args, dq_accum, dq_counters, lse_log2,
                                                          d_row, seqlen_q_pad, scale_log2,
                                                          group_pairs, TailSplit{});
}

/// The split tail (TailSplit): tail.count x tail.parts thread blocks of dk_dv_block, launched
/// after the main kernel's tail.first kv_blocks (large shapes, no mask). In deterministic mode
/// (kOrderedDq) its parts take dQ turns on `dq_counters`, the last parameter (the default
/// instance does not read it: its parameters up to `tail` are x07_tail2's).
template <typename T, int kHeadDim, bool kOrderedDq>
__global__ void __launch_bounds__(BwdTraits<kHeadDim, true>::kNumThreads, 1)
    bwd_dk_dv_tail_kernel(const fa_bwd_args args, float* dq_accum, const float* lse_log2,
                          const float* d_row, int seqlen_q_pad, float scale_log2, int group_pairs,
                          const TailSplit tail, int* dq_counters) {
  grid_launch_dependents();
  dk_dv_block<T, kHeadDim, true, kOrderedDq, true>(
      args, dq_accum, kOrderedDq ? dq_counters : nullptr, lse_log2, d_row, seqlen_q_pad, scale_log2,
      group_pairs, tail);
  grid_dependency_wait();  // ends after the main kernel: the conversion waits for this kernel
}

// ------------------------------------------------------------------------------------------
// Kernel 3: dQ to the output dtype
// ------------------------------------------------------------------------------------------

/// \f$dQ = \mathrm{scale} \cdot \mathrm{dq\_accum}\f$ in the input dtype, one thread block
/// per q_block (the main kernel's Tr, whose dq_accum layout it reads): each thread reads its
/// fragments (dq_fragment_index, coalesced float4 loads), puts them in place in a swizzled
/// shared tile, and the block writes the rows that exist as 16-byte stores.
template <class Tr, typename T>
__global__ void __launch_bounds__(Tr::kNumThreads)
    bwd_convert_dq_kernel(const fa_bwd_args args, const float* dq_accum, int seqlen_q_pad) {
  __shared__ __align__(128) char tile[Tr::kQBytes];
  grid_dependency_wait();  // every dQ add has landed
  const fa_fwd_args& f = args.fwd;
  const int q_start = blockIdx.x * Tr::kBlockM, head = blockIdx.y, batch = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const float4* const src = reinterpret_cast<const float4*>(
      dq_accum +
      ((static_cast<int64_t>(batch) * f.heads + head) * seqlen_q_pad + q_start) * Tr::kHeadDim);
  const float c = f.scale;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nd = 0; nd < Tr::kDqNTiles; ++nd) {
      const float4 v = src[dq_fragment_index<Tr>(mt, nd, tid)];
      const int row = dq_warp_row0<Tr>(warp) + 16 * mt + lane / 4;
      const int chunk = (dq_warp_col0<Tr>(warp) + 8 * nd) / 8;
      *reinterpret_cast<uint32_t*>(tile + swizzle<Tr::kRowBytes>(row, chunk) + 4 * (lane % 4)) =
          fa::pack2<T>(v.x * c, v.y * c);
      *reinterpret_cast<uint32_t*>(tile + swizzle<Tr::kRowBytes>(row + 8, chunk) + 4 * (lane % 4)) =
          fa::pack2<T>(v.z * c, v.w * c);
    }
  __syncthreads();
  T* const dq =
      static_cast<T*>(args.dq.ptr) + batch * args.dq.batch_stride + head * args.dq.head_stride;
#pragma unroll
  for (int idx = tid; idx < Tr::kBlockM * Tr::kChunksPerRow; idx += Tr::kNumThreads) {
    const int row = idx / Tr::kChunksPerRow, chunk = idx % Tr::kChunksPerRow;
    if (q_start + row < f.seqlen_q)
      *reinterpret_cast<uint4*>(dq + (q_start + row) * args.dq.row_stride + 8 * chunk) =
          *reinterpret_cast<const uint4*>(tile + swizzle<Tr::kRowBytes>(row, chunk));
  }
}

// ------------------------------------------------------------------------------------------
// Backward launcher
// ------------------------------------------------------------------------------------------

/// Launches `kernel` on `stream`, with `overlap` as a programmatic dependent launch: its thread
/// blocks may start before the kernel ahead of it has ended (README, "Launches that overlap").
template <typename... Params, typename... Args>
fa_status launch_after(void (*kernel)(Params...), dim3 grid, int threads, int smem_bytes,
                       cudaStream_t stream, bool overlap, Args&&... args) {
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = overlap ? 1 : 0;
  FA_CUDA_TRY(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
  return FA_OK;
}

/// Whether the kernels after the preprocess overlap their launches: on sm_90 and later, with
/// FA_BWD_PDL on, and not in deterministic mode, whose hand-off argument (det_tail_max_parts)
/// wants each kernel to start once the one before has ended.
fa_status plan_overlap(bool deterministic, bool* overlap) {
  int device = 0, major = 0;
  FA_CUDA_TRY(cudaGetDevice(&device));
  FA_CUDA_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  *overlap = kOverlapLaunches && !deterministic && major >= 9;
  return FA_OK;
}

/// Sets a kernel's dynamic shared memory size, after checking that this GPU has that much.
template <typename Kernel>
fa_status set_smem(Kernel kernel, int bytes, const char* name) {
  int optin = 0;
  const fa_status limit = fa::smem_per_block_optin(&optin);
  if (limit != FA_OK) return limit;
  if (bytes > optin)
    return fa::set_error(FA_ERR_UNSUPPORTED,
                         "07_backward: %s needs %d bytes of shared memory per block, the GPU "
                         "allows %d%s",
                         name, bytes, optin,
                         std::getenv("FA_SMEM_LIMIT") ? " (FA_SMEM_LIMIT)" : "");
  FA_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  return FA_OK;
}

/// How many thread blocks of `kernel` the GPU holds at once: SMs x blocks per SM (at least 1).
template <typename Kernel>
fa_status resident_blocks(Kernel kernel, int threads, int smem_bytes, int64_t* resident) {
  int device = 0, num_sms = 0, blocks_per_sm = 0;
  FA_CUDA_TRY(cudaGetDevice(&device));
  FA_CUDA_TRY(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  FA_CUDA_TRY(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, threads, smem_bytes));
  *resident = static_cast<int64_t>(num_sms) * std::max(blocks_per_sm, 1);
  return FA_OK;
}

/// The one-dimensional grid of `num_blocks` thread blocks for each of `num_pairs` (batch,
/// head) pairs, and the group size decode_block_order reads. With `group_waves` > 0 a group
/// holds at least that many waves of resident thread blocks, enough for the longest-first
/// order to balance the SMs under causal masking, and no more pairs than that, so that the
/// thread blocks that read the same tensors run at the same time and share them in L2 (step
/// 06's rule, 4 waves); with 0 every pair is in one group (deterministic mode: a pair then has
/// few thread blocks resident at once, each one hand-off behind the one before, README
/// "Deterministic mode"); with -1 a group is one pair and its blocks run in order.
template <typename Kernel>
fa_status block_order(Kernel kernel, int threads, int smem_bytes, int64_t num_blocks,
                      int64_t num_pairs, int group_waves, dim3* grid, int* group_pairs) {
  if (num_blocks * num_pairs > INT32_MAX)
    return fa::set_error(FA_ERR_UNSUPPORTED, "07_backward: more than 2^31 - 1 thread blocks");
  int64_t pairs = group_waves == 0 ? num_pairs : 1;
  if (group_waves > 0) {
    int64_t resident = 0;
    const fa_status status = resident_blocks(kernel, threads, smem_bytes, &resident);
    if (status != FA_OK) return status;
    const int64_t num_groups =
        std::max<int64_t>(1, num_blocks * num_pairs / (group_waves * resident));
    pairs = (num_pairs + num_groups - 1) / num_groups;
  }
  *grid = dim3(static_cast<unsigned>(num_blocks * num_pairs));
  *group_pairs = static_cast<int>(pairs);
  return FA_OK;
}

/// The fp32 partials the tail split may write (TailSplit, tail * P * B_c * d * 2 * 4 bytes):
/// 32 MiB. The H200's L2 holds 50 MB; the partials are written and read back within one
/// part's time, so that they stay there next to the tail's Q, dO and dq_accum (at most 16 MB
/// at the benchmark shapes). x07_tail's 62 MB at d = 128 did not, and cost about 55 us at
/// every N (NOTES.md, change 11: -2.9% at N = 1024).
constexpr int64_t kMaxTailPartialBytes = int64_t{32} << 20;

/// What a part of a split kv_block costs beyond its share of the iterations, in iterations
/// (an estimate, not measured): its prologue (K_j, V_j), its fp32 partials and the last
/// part's sum of them.
constexpr int kTailPartCost = 1;

/// When to split (NOTES.md, change 12, lists the predictions per benchmark shape): the parts P of
/// each of the `tail` kv_blocks of the last partial wave (0 < tail < resident), each kv_block
/// `n_iters` (query head, q_block) iterations long, or 1: no split. The tail's time, in
/// iterations: unsplit, one thread block's, n_iters; in P parts, ceil(tail P / resident)
/// rounds of the longest part, ceil(n_iters / P) + kTailPartCost (for large n_iters the
/// ceil(tail P / resident) / P waves of change 11's x07_tail). P runs over [2, kMaxTailParts] with
/// at least 2 iterations per part and at most kMaxTailPartialBytes of partials
/// (`partial_bytes`: one part's); the shortest wins, the fewest parts on a tie, and only if it
/// saves a quarter of a wave or more (the second launch and the partials' traffic are not in
/// the model). `max_parts`: deterministic mode's bound (det_tail_max_parts).
int tail_split_parts(int64_t tail, int64_t resident, int64_t n_iters, int64_t partial_bytes,
                     int max_parts) {
  int best = 1;
  int64_t best_time = n_iters;
  for (int parts = 2; parts <= std::min(kMaxTailParts, max_parts) && 2 * parts <= n_iters;
       ++parts) {
    if (tail * parts * partial_bytes > kMaxTailPartialBytes) break;
    const int64_t rounds = (tail * parts + resident - 1) / resident;
    const int64_t time = rounds * ((n_iters + parts - 1) / parts + kTailPartCost);
    if (time < best_time) best = parts, best_time = time;
  }
  return 4 * (n_iters - best_time) >= n_iters ? best : 1;
}

/// Deterministic mode: the most parts each of the `count` kv_blocks of the tail (the last of
/// the order, [first, first + count)) may take so that no part waits for one that cannot run:
/// kMaxTailParts where no part waits at all.
/// - The tail kernel starts once the main kernel has completed (same stream): every turn of a
///   kv_block of the main kernel has been passed on.
/// - The order (decode_block_order) numbers a pair's kv_blocks in kv_block order, so the tail
///   holds a suffix of each pair's. The main kernel never waits for the tail, and a pair's
///   first kv_block in the tail finds every counter of its q_blocks at its rank: never waits.
/// - Part p of a later one, kv_block j, waits only for part p of kv_block j - 1 (the turns of
///   the same q_blocks: without the mask a pair's kv_blocks have the same iterations, cut at
///   the same places), which waits only for kv_block j - 2, and so on down to the first.
/// - With W = P x (tail kv_blocks that are not their pair's first) parts that may wait,
///   W < resident (the tail kernel's thread blocks at once) leaves a slot that no waiting part
///   holds: every part that never waits runs and ends, then every part left is resident, and
///   the one of the lowest kv_block waits for nobody. Independently, the main kernel's own
///   argument (README "Deterministic mode") holds: kv_block j - 1's parts come before kv_block
///   j's in the tail's grid, and the GPU starts thread blocks in blockIdx order.
/// So P <= (resident - 1) / w, w = W / P: any P with at most one tail kv_block per pair
/// (w = 0), or with every part resident at once (count P <= resident, as w <= count - 1), and
/// more.
template <typename T, int kHeadDim>
fa_status det_tail_max_parts(const fa_bwd_args& args, int64_t first, int64_t count,
                             int* max_parts) {
  using Tr = BwdTraits<kHeadDim, true>;
  const fa_fwd_args& f = args.fwd;
  const int num_blocks = (f.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN;
  const int num_pairs = f.batch * f.heads_kv;
  dim3 grid;
  int group_pairs = 1;  // as launch_dk_dv orders the ordered main kernel
  fa_status status =
      block_order(bwd_dk_dv_kernel<T, kHeadDim, true, true>, Tr::kNumThreads, Tr::kSmemBytes,
                  num_blocks, num_pairs, kDetGroupWaves, &grid, &group_pairs);
  if (status != FA_OK) return status;
  const auto tail_kernel = bwd_dk_dv_tail_kernel<T, kHeadDim, true>;
  status = set_smem(tail_kernel, Tr::kSmemBytes, "bwd_dk_dv_tail_kernel");  // its occupancy
  if (status != FA_OK) return status;
  int64_t resident = 0;
  status = resident_blocks(tail_kernel, Tr::kNumThreads, Tr::kSmemBytes, &resident);
  if (status != FA_OK) return status;
  std::vector<int> pairs;  // of the tail's kv_blocks
  for (int64_t index = first; index < first + count; ++index) {
    int block = 0, pair = 0;
    decode_block_order(static_cast<unsigned>(index), num_blocks, num_pairs, group_pairs, block,
                       pair);
    pairs.push_back(pair);
  }
  std::sort(pairs.begin(), pairs.end());
  const int64_t waiting = count - (std::unique(pairs.begin(), pairs.end()) - pairs.begin());
  *max_parts = waiting == 0
                   ? kMaxTailParts
                   : static_cast<int>(std::min<int64_t>(kMaxTailParts, (resident - 1) / waiting));
  return FA_OK;
}

/// The tail split (TailSplit, without its scratch) of the main kernel's grid: parts = 1 (no
/// split) under causal masking, on the 99 KB shapes, in deterministic mode where
/// det_tail_max_parts allows fewer than 2 parts, or where tail_split_parts says so.
/// FA_BWD_TAIL_SPLIT overrides the rule (a knob for measuring, and for the tests to reach the
/// split on small problems): 0 never splits, 2 to kMaxTailParts splits in that many parts (at
/// most the iterations of a kv_block and, in deterministic mode, det_tail_max_parts), the last
/// total % resident kv_blocks or, when every wave is whole, the last min(total, 4).
template <typename T, int kHeadDim>
fa_status plan_tail_split(const fa_bwd_args& args, TailSplit* tail) {
  const fa_fwd_args& f = args.fwd;
  long long forced = -1;
  const fa::EnvStatus env = fa::env_int("FA_BWD_TAIL_SPLIT", 0, kMaxTailParts, &forced, nullptr);
  if (env == fa::EnvStatus::kInvalid || forced == 1)
    return fa::set_error(FA_ERR_INVALID_ARGUMENT,
                         "%s: FA_BWD_TAIL_SPLIT=%s: expected 0 (no split) or 2 to %d parts",
                         FA_STEP_NAME, std::getenv("FA_BWD_TAIL_SPLIT"), kMaxTailParts);
  *tail = TailSplit{0, 0, 1, nullptr, nullptr};
  if constexpr (kHasLargeBwdShape<kHeadDim>) {
    using Tr = BwdTraits<kHeadDim, true>;
    if (f.causal || forced == 0) return FA_OK;
    int optin = 0;
    fa_status status = fa::smem_per_block_optin(&optin);
    if (status != FA_OK || optin < Tr::kSmemBytes) return status;  // the 99 KB shapes
    const auto kernel = args.deterministic ? bwd_dk_dv_kernel<T, kHeadDim, true, true>
                                           : bwd_dk_dv_kernel<T, kHeadDim, true, false>;
    status = set_smem(kernel, Tr::kSmemBytes, "bwd_dk_dv_kernel");  // for its occupancy
    if (status != FA_OK) return status;
    int64_t resident = 0;
    status = resident_blocks(kernel, Tr::kNumThreads, Tr::kSmemBytes, &resident);
    if (status != FA_OK) return status;
    const int64_t total =
        static_cast<int64_t>((f.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN) * f.batch * f.heads_kv;
    const int64_t n_iters =
        static_cast<int64_t>(f.heads / f.heads_kv) * ((f.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM);
    int64_t count = total % resident;
    if (forced > 0 && count == 0) count = std::min<int64_t>(total, 4);
    if (count == 0 || total > INT32_MAX) return FA_OK;
    int max_parts = kMaxTailParts;
    if (args.deterministic) {
      status = det_tail_max_parts<T, kHeadDim>(args, total - count, count, &max_parts);
      if (status != FA_OK) return status;
    }
    const int parts =
        forced > 0
            ? static_cast<int>(std::min<int64_t>(std::min<int64_t>(forced, max_parts), n_iters))
            : tail_split_parts(count, resident, n_iters,
                               int64_t{2} * Tr::kBlockN * kHeadDim * sizeof(float), max_parts);
    if (parts < 2) return FA_OK;
    *tail = TailSplit{static_cast<int>(total - count), static_cast<int>(count), parts, nullptr,
                      nullptr};
  }
  return FA_OK;
}

/// Launches the main kernel with the small or large tile shape (in deterministic mode its
/// ordered-dQ variant, `dq_counters` not null) and, where the tail splits (`tail.parts` > 1,
/// large shapes), the main kernel over the first tail.first kv_blocks and the split instance
/// over the rest; then the dQ conversion, which reads dq_accum in that shape's layout.
template <typename T, int kHeadDim, bool kLargeSmem>
fa_status launch_dk_dv(const fa_bwd_args& args, cudaStream_t stream, int seqlen_q_pad,
                       const float* lse_log2, const float* d_row, float* dq_accum, int* dq_counters,
                       float scale_log2, const TailSplit& tail) {
  using Tr = BwdTraits<kHeadDim, kLargeSmem>;
  const fa_fwd_args& f = args.fwd;
  const bool ordered = dq_counters != nullptr;
  const auto kernel = ordered ? bwd_dk_dv_kernel<T, kHeadDim, kLargeSmem, true>
                              : bwd_dk_dv_kernel<T, kHeadDim, kLargeSmem, false>;
  fa_status status = set_smem(kernel, Tr::kSmemBytes, "bwd_dk_dv_kernel");
  if (status != FA_OK) return status;
  dim3 grid;
  int group_pairs = 1;
  status = block_order(
      kernel, Tr::kNumThreads, Tr::kSmemBytes, (f.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN,
      static_cast<int64_t>(f.batch) * f.heads_kv,
      ordered ? kDetGroupWaves : (f.causal && kLongestFirst ? 4 : -1), &grid, &group_pairs);
  if (status != FA_OK) return status;
  const bool split = kLargeSmem && tail.parts > 1;
  bool overlap = false;
  status = plan_overlap(ordered, &overlap);
  if (status != FA_OK) return status;
  // Split: the whole waves (a forced split of a small grid may leave none), then the rest.
  if (split) grid.x = tail.first;
  const bool main_launched = !split || grid.x > 0;
  if (main_launched) {
    status =
        launch_after(kernel, grid, Tr::kNumThreads, Tr::kSmemBytes, stream, overlap, args, dq_accum,
                     dq_counters, lse_log2, d_row, seqlen_q_pad, scale_log2, group_pairs);
    if (status != FA_OK) return status;
  }
  if constexpr (kLargeSmem) {
    if (split) {
      const auto tail_kernel = ordered ? bwd_dk_dv_tail_kernel<T, kHeadDim, true>
                                       : bwd_dk_dv_tail_kernel<T, kHeadDim, false>;
      status = set_smem(tail_kernel, Tr::kSmemBytes, "bwd_dk_dv_tail_kernel");
      if (status != FA_OK) return status;
      // The tail reads lse and D without waiting: right after the preprocess, it must not
      // overlap it.
      status =
          launch_after(tail_kernel, dim3(tail.count * tail.parts), Tr::kNumThreads, Tr::kSmemBytes,
                       stream, overlap && main_launched, args, dq_accum, lse_log2, d_row,
                       seqlen_q_pad, scale_log2, group_pairs, tail, dq_counters);
      if (status != FA_OK) return status;
    }
  }
  const dim3 convert_grid((f.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM, f.heads, f.batch);
  return launch_after(bwd_convert_dq_kernel<Tr, T>, convert_grid, Tr::kNumThreads, 0, stream,
                      overlap, args, static_cast<const float*>(dq_accum), seqlen_q_pad);
}

/// Runs the backward kernels on the scratch buffers (`dq_counters` not null: deterministic
/// mode): preprocess, dK/dV with the dQ adds, the dQ conversion. The main kernel takes the
/// large tile shape where the GPU has the shared memory for it (H100, H200: about 194 KiB),
/// else the small one (every sm_80+ GPU, the A100 included).
template <typename T, int kHeadDim>
fa_status launch_backward_kernels(const fa_bwd_args& args, cudaStream_t stream, int seqlen_q_pad,
                                  float* lse_log2, float* d_row, float* dq_accum, int* dq_counters,
                                  const TailSplit& tail, long long late) {
  const fa_fwd_args& f = args.fwd;
  const float scale_log2 = static_cast<float>(static_cast<double>(f.scale) * kLog2e);

  if (tail.parts > 1)  // the split kv_blocks' counts of parts done
    FA_CUDA_TRY(cudaMemsetAsync(tail.counters, 0, tail.count * sizeof(int), stream));

  bwd_preprocess_kernel<T, kHeadDim><<<dim3(seqlen_q_pad / 32, f.heads, f.batch), 256, 0, stream>>>(
      args, seqlen_q_pad, lse_log2, d_row, dq_accum, dq_counters, late);
  FA_LAUNCH_TRY();

  int optin = 0;
  fa_status status = fa::smem_per_block_optin(&optin);
  if (status != FA_OK) return status;
  if constexpr (kHasLargeBwdShape<kHeadDim>) {
    if (optin >= BwdTraits<kHeadDim, true>::kSmemBytes)
      return launch_dk_dv<T, kHeadDim, true>(args, stream, seqlen_q_pad, lse_log2, d_row, dq_accum,
                                             dq_counters, scale_log2, tail);
  }
  return launch_dk_dv<T, kHeadDim, false>(args, stream, seqlen_q_pad, lse_log2, d_row, dq_accum,
                                          dq_counters, scale_log2, tail);
}

/// Backward pass for one dtype and head dimension: plans the tail split, reads the test knob
/// FA_BWD_LATE_PREPROCESS (bwd_preprocess_kernel's `late_cycles`), allocates the scratch
/// in stream order (dq_accum, lse in base 2, D, the split tail's partials and counters and, in
/// deterministic mode, the dQ counters), runs the kernels, frees the scratch.
template <typename T, int kHeadDim>
fa_status launch_backward(const fa_bwd_args& args, cudaStream_t stream) {
  const fa_fwd_args& f = args.fwd;
  TailSplit tail;
  fa_status status = plan_tail_split<T, kHeadDim>(args, &tail);
  if (status != FA_OK) return status;
  long long late = 0;  // a test's knob (bwd_preprocess_kernel)
  if (fa::env_int("FA_BWD_LATE_PREPROCESS", 0, INT32_MAX, &late, nullptr) ==
      fa::EnvStatus::kInvalid)
    return fa::set_error(FA_ERR_INVALID_ARGUMENT,
                         "%s: FA_BWD_LATE_PREPROCESS=%s: expected 0 to %d SM cycles", FA_STEP_NAME,
                         std::getenv("FA_BWD_LATE_PREPROCESS"), INT32_MAX);
  const int seqlen_q_pad = (f.seqlen_q + kRowPad - 1) / kRowPad * kRowPad;
  const size_t rows = static_cast<size_t>(f.batch) * f.heads * seqlen_q_pad;
  const size_t counters = args.deterministic ? rows : 0;
  if (counters > INT32_MAX)  // DqTurn indexes them with an int (dq_accum alone: > 512 GiB)
    return fa::set_error(FA_ERR_UNSUPPORTED, "07_backward: more than 2^31 - 1 rows");
  const size_t partials = tail.parts > 1 ? static_cast<size_t>(tail.count) * tail.parts * 2 *
                                               BwdTraits<kHeadDim, true>::kBlockN * kHeadDim
                                         : 0;
  const size_t tail_counters = tail.parts > 1 ? tail.count : 0;
  const size_t bytes = (rows * kHeadDim + 2 * rows + partials) * sizeof(float) +
                       (counters + tail_counters) * sizeof(int);
  float* scratch = nullptr;
  const cudaError_t alloc = cudaMallocAsync(&scratch, bytes, stream);
  if (alloc == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // not sticky: clear it
    return fa::set_error(FA_ERR_OUT_OF_MEMORY,
                         "07_backward: no device memory for %.1f MiB of scratch "
                         "(dq_accum, lse, D%s%s)",
                         bytes / 1048576.0, args.deterministic ? ", dQ counters" : "",
                         tail.parts > 1 ? ", tail partials" : "");
  }
  FA_CUDA_TRY(alloc);
  float* const dq_accum = scratch;
  float* const lse_log2 = dq_accum + rows * kHeadDim;
  float* const d_row = lse_log2 + rows;
  tail.partials = d_row + rows;  // float4 aligned: rows is a multiple of kRowPad
  int* const dq_counters =
      args.deterministic ? reinterpret_cast<int*>(tail.partials + partials) : nullptr;
  tail.counters = reinterpret_cast<int*>(tail.partials + partials) + counters;
  status = launch_backward_kernels<T, kHeadDim>(args, stream, seqlen_q_pad, lse_log2, d_row,
                                                dq_accum, dq_counters, tail, late);
  const cudaError_t freed = cudaFreeAsync(scratch, stream);  // after the kernels, in order
  if (status != FA_OK) return status;
  FA_CUDA_TRY(freed);
  return FA_OK;
}

/// The step's backward pass: picks the kernels for the dtype and head dimension.
fa_status backward(const fa_bwd_args& args, cudaStream_t stream) {
  const bool bf16 = args.fwd.dtype == FA_BF16;
  switch (args.fwd.head_dim) {
    case 64:
      return bf16 ? launch_backward<__nv_bfloat16, 64>(args, stream)
                  : launch_backward<__half, 64>(args, stream);
    case 128:
      return bf16 ? launch_backward<__nv_bfloat16, 128>(args, stream)
                  : launch_backward<__half, 128>(args, stream);
    default:
      return fa::set_error(FA_ERR_UNSUPPORTED, "07_backward: head_dim %d is not supported",
                           args.fwd.head_dim);
  }
}

}  // namespace

FA_REGISTER_STEP("FA2 backward: recompute P from L, K/V outer loop, dQ by fp32 atomics", forward,
                 backward, supports_head_dim);
