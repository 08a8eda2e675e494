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
///   dq_accum (stored in the threads' order; on sm_90 at d = 128 one TMA bulk reduction per
///   warp), converted to the output dtype by a last kernel. Under causal masking the
///   q_blocks above the diagonal are skipped (as 06 skips K/V blocks); only the ones that
///   cross it are masked.
/// - Deterministic mode (fa_bwd_args::deterministic): no float atomics. The main kernel leaves
///   dQ out and a dQ kernel in the forward's loop order, one thread block per q_block, walks
///   the kv_blocks in order and sums \f$dQ_i\f$ in registers, recomputing \f$P\f$ and
///   \f$dS\f$ (7 matmuls per block pair instead of 5): bit-identical results run to run.
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

#include "fa/api.h"
#include "fa/check.cuh"
#include "fa/mma.cuh"
#include "fa/step.h"

namespace {

// ------------------------------------------------------------------------------------------
// Tile configuration
// ------------------------------------------------------------------------------------------

// Tuning knobs: K/V rows per block for each head dimension (multiples of 16). The defaults
// are FlashAttention-2's tiles, the fastest measured on the H200 (see NOTES.md), although
// ptxas keeps a few loop-invariant registers in local memory with them; e.g.
// -DFA_FWD_BLOCK_N_D128=32 builds the largest d = 128 tile that spills nothing.
#ifndef FA_FWD_BLOCK_N_D64
#define FA_FWD_BLOCK_N_D64 128
#endif
#ifndef FA_FWD_BLOCK_N_D128
#define FA_FWD_BLOCK_N_D128 64
#endif

/// Tile shape per head dimension: \f$B_r\f$ (kBlockM) query rows, \f$B_c\f$ (kBlockN) key
/// rows, kNumWarps warps. As in FlashAttention-2, 4 warps share a 128-row Q block, 32 rows
/// each. The registers of a thread hold its rows' o_acc (\f$32 d / 32\f$ floats) and S tile
/// (\f$32 B_c / 32\f$ floats), so \f$B_c\f$ shrinks as d grows. Shared memory is Q plus two
/// stages of K and V, \f$(B_r + 4 B_c)\, d \cdot 2\f$ bytes: 80 KiB (d = 64) and 96 KiB
/// (d = 128). That fits every sm_80+ GPU (at most 99 KiB per thread block on sm_86/sm_89);
/// two thread blocks share an SM on the A100 at d = 64 and on the H100/H200 at both.
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
  static constexpr int kStageBytes = kKBytes + kVBytes;  ///< one K tile and one V tile
  static constexpr int kSmemBytes = kQBytes + 2 * kStageBytes;

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
/// `q_row0` is the sequence position of this thread's first row (tile row warp_row0 + group);
/// a thread holds rows q_row0 + 16 mi + 8 h, and keys kv_start + 8 nj + 2 quad + {0, 1}.
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
        const float m_scaled = (m_new[mi][h] == -INFINITY) ? 0.f : m_new[mi][h] * scale_log2;
        // exp(c (m_old - m_new)); 0 when the row had no visible key before (m_old = -inf).
        const float rescale = fa::exp2_approx(row_max[mi][h] * scale_log2 - m_scaled);
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
      const float inv_sum = sum > 0.f ? 1.f / sum : 0.f;
      const int tile_row = warp_row0 + 16 * mi + 8 * h + group;
      if (lse != nullptr && quad == 0 && row0 + tile_row < seqlen)
        lse[row0 + tile_row] = sum > 0.f ? row_max[mi][h] * args.scale + logf(sum) : INFINITY;
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
/// all in registers. K and V have two shared-memory stages: at the top of block j (one
/// barrier) the thread block starts loading \f$K_{j+1}, V_{j+1}\f$ into the stage that block
/// j - 1 just left, and they land while block j is computed. `group_pairs` sets the order of
/// the thread blocks (see launch()).
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(Traits<kHeadDim>::kNumThreads)
    flash_forward_kernel(const fa_fwd_args args, const float scale_log2, const int group_pairs) {
  using Tr = Traits<kHeadDim>;
  extern __shared__ __align__(128) char smem[];
  char* const q_tile = smem;
  char* const kv_stages = smem + Tr::kQBytes;  // stage s: K tile, then V tile

  // Which (q_block, head, batch) this thread block computes, in the order launch() explains.
  const int num_q_blocks = (args.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  const int num_pairs = args.batch * args.heads;
  const int group = blockIdx.x / (group_pairs * num_q_blocks);
  const int in_group = blockIdx.x - group * group_pairs * num_q_blocks;
  const int pairs_in_group = min(group_pairs, num_pairs - group * group_pairs);
  const int q_block = num_q_blocks - 1 - in_group / pairs_in_group;  // last Q blocks first
  const int pair = group * group_pairs + in_group % pairs_in_group;
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

  int n_blocks = (seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN;
  // Under causal masking the block's last row sees keys [0, last_key]: the blocks past the
  // one that holds last_key are entirely masked, so the loop stops there.
  const int first_masked_key = q_start + seqlen_k - seqlen_q + 1;  // first row's key_end
  if (args.causal) {
    const int last_key = min(q_start + Tr::kBlockM, seqlen_q) - 1 + seqlen_k - seqlen_q;
    n_blocks = min(n_blocks, (last_key + Tr::kBlockN) / Tr::kBlockN);  // <= 0: no key
  }
  if (n_blocks <= 0) {  // sees no key at all (N_q > N_k): O = 0, L = +inf, nothing loaded
    store_o_and_lse<Tr, T>(o_acc, row_max, row_sum, q_tile, args, batch, head, q_start, warp_row0,
                           tid);
    return;
  }

  // Prologue: Q, K_0 and V_0 in one cp.async group, into stage 0.
  load_tile_async<Tr, Tr::kBlockM>(q_tile, q, args.q.row_stride, q_start, seqlen_q, tid);
  load_tile_async<Tr, Tr::kBlockN>(kv_stages, k, args.k.row_stride, 0, seqlen_k, tid);
  load_tile_async<Tr, Tr::kBlockN>(kv_stages + Tr::kKBytes, v, args.v.row_stride, 0, seqlen_k, tid);
  fa::cp_async_commit();

  for (int kv_block = 0; kv_block < n_blocks; ++kv_block) {
    const int kv_start = kv_block * Tr::kBlockN;
    const char* const k_tile = kv_stages + (kv_block % 2) * Tr::kStageBytes;
    const char* const v_tile = k_tile + Tr::kKBytes;
    fa::cp_async_wait<0>();
    __syncthreads();  // K_j and V_j have landed; every warp is done with block j - 1's stage
    if (kv_block + 1 < n_blocks) {  // K_{j+1} and V_{j+1} into that stage
      char* const next = kv_stages + ((kv_block + 1) % 2) * Tr::kStageBytes;
      load_tile_async<Tr, Tr::kBlockN>(next, k, args.k.row_stride, kv_start + Tr::kBlockN, seqlen_k,
                                       tid);
      load_tile_async<Tr, Tr::kBlockN>(next + Tr::kKBytes, v, args.v.row_stride,
                                       kv_start + Tr::kBlockN, seqlen_k, tid);
      fa::cp_async_commit();
    }

    float s[Tr::kMTiles][Tr::kNTilesS][4];
    compute_scores<Tr, T>(s, q_tile, k_tile, warp_row0, lane);
    // Only the blocks that cross the diagonal (some key past the first row's key_end) and
    // the ragged last block need the mask; all others take the mask-free path.
    const bool needs_mask = (args.causal && kv_start + Tr::kBlockN > first_masked_key) ||
                            kv_start + Tr::kBlockN > seqlen_k;
    if (needs_mask)
      apply_mask<Tr>(s, q_start + warp_row0 + lane / 4, kv_start, seqlen_q, seqlen_k, args.causal,
                     lane);

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
  int64_t group_pairs = 1;
  if (args.causal) {
    int device = 0, num_sms = 0, blocks_per_sm = 0;
    FA_CUDA_TRY(cudaGetDevice(&device));
    FA_CUDA_TRY(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
    FA_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel,
                                                              Tr::kNumThreads, Tr::kSmemBytes));
    const int64_t resident = static_cast<int64_t>(num_sms) * std::max(blocks_per_sm, 1);
    const int64_t num_groups = std::max<int64_t>(1, num_q_blocks * num_pairs / (4 * resident));
    group_pairs = (num_pairs + num_groups - 1) / num_groups;
  }
  const dim3 grid(static_cast<unsigned>(num_q_blocks * num_pairs));
  constexpr double kLog2e = 1.4426950408889634;
  const float scale_log2 = static_cast<float>(args.scale * kLog2e);
  kernel<<<grid, Tr::kNumThreads, Tr::kSmemBytes, stream>>>(args, scale_log2,
                                                            static_cast<int>(group_pairs));
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

// ------------------------------------------------------------------------------------------
// Backward tile configuration
// ------------------------------------------------------------------------------------------

/// \f$\log_2 e\f$: \f$e^x = 2^{x \log_2 e}\f$, so every exponential is one FFMA and one ex2.
constexpr float kLog2e = 1.4426950408889634f;

// Tuning knob: unroll of the k loop of the fused S^T / dP^T product (NOTES.md: registers).
#ifndef FA_BWD_ABT_UNROLL
#define FA_BWD_ABT_UNROLL 4
#endif
constexpr int kAbtUnroll = FA_BWD_ABT_UNROLL;

/// Rows of the padded per-row scratch (lse in base 2, D): seqlen_q rounded up to a multiple of
/// every backward q_block, so that a q_block's rows of it load without bounds checks.
constexpr int kRowPad = 128;

/// Tile shape of the main backward kernel per head dimension: \f$B_c\f$ (kBlockN) keys of the
/// kv_block a thread block owns, \f$B_r\f$ (kBlockM) query rows per q_block, 8 warps,
/// kStagesDo dO buffers. `kLargeSmem` is the shape for GPUs with more shared memory per block
/// (H100, H200: 193 KiB at d = 128, 194 KiB at d = 64, each with its 32 KiB dQ stage; an A100
/// has 163 KiB); the other fits the 99 KB of every sm_80+ GPU and is picked at run time where
/// the large one does not fit. Two ways to reach \f$P^T dO\f$ and \f$dS^T Q\f$ (kPtInSmem,
/// see the kernel; measured in NOTES.md: at the large tiles P through shared memory wins at
/// both head dims, changes 2 and 4):
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
/// kPtInSmem only) and, per Q buffer, the q_block's lse and D. The epilogue reuses it to
/// stage dK and dV in fp32.
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
  static_assert(!kPtInSmem || kStagesDo == 2, "dO_i is read until the end of the q_block");
  static_assert(!kPtInSmem || kSlices == 1,
                "with P in shared memory a warp's queries are one tile");
  static_assert(kWarpCols % kSliceCols == 0 && kSliceCols % 16 == 0,
                "a warp's queries are whole slices of whole k16 steps of P^T dO");
  static_assert(kKvNTiles % 2 == 0 && kDqCols % 16 == 0, "n8 tiles come in pairs");
  static_assert(kNumThreads % kChunksPerRow == 0, "a thread copies one column of chunks");
  static_assert(kRowPad % kBlockM == 0, "the padded scratch covers whole q_blocks");
  static_assert(kSmemBytes <= (kLargeSmem ? 227 : 99) * 1024, "fits the GPUs it is built for");
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

/// Row layout of the \f$dS^T\f$ tile ([kBlockN keys][kBlockM queries], 2-byte elements) for
/// the swizzle and fragment helpers above.
template <int kBlockM>
struct DsLayout {
  static constexpr int kRowBytes = kBlockM * 2;
  static_assert(kRowBytes % 128 == 0, "whole swizzle atoms per row");
};

/// Tile shape of the deterministic dQ kernel: 4 warps of 16 query rows (\f$B_r = 64\f$),
/// kv_blocks of \f$B_c = 64\f$ keys. Shared memory: Q, dO, two K buffers and one V buffer,
/// 40 KB (d = 64) or 80 KB (d = 128).
template <int kHeadDim_>
struct DqTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 64, kBlockN = 64, kNumWarps = 4;
  static constexpr int kNumThreads = 32 * kNumWarps;
  static constexpr int kNTilesS = kBlockN / 8;  ///< n8 tiles of S (keys)
  static constexpr int kNTilesD = kHeadDim / 8;
  static constexpr int kRowBytes = kHeadDim * 2;
  static constexpr int kChunksPerRow = kHeadDim / 8;
  static constexpr int kQBytes = kBlockM * kRowBytes;
  static constexpr int kKBytes = kBlockN * kRowBytes;
  static constexpr int kOffDo = kQBytes;
  static constexpr int kOffK = 2 * kQBytes;
  static constexpr int kOffV = kOffK + 2 * kKBytes;
  static constexpr int kSmemBytes = kOffV + kKBytes;
  static_assert(kBlockM == 16 * kNumWarps, "each warp owns 16 query rows");
  static_assert(kBlockM % kRowPad == 0 || kRowPad % kBlockM == 0, "padded scratch covers it");
};

// ------------------------------------------------------------------------------------------
// Backward building blocks (per warp, on tensor cores)
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

/// Packs an fp32 accumulator (m16n8 C layout, `acc[n8 tile][4]`) into 16-bit pairs:
/// `out[tile][0]` holds row lane/4, `out[tile][1]` row lane/4 + 8, columns 2 (lane % 4) + {0, 1}.
/// Tiles 2t and 2t + 1 of the result are the A fragment of k16 step t of a following mma.
template <typename T, int kTiles>
__device__ __forceinline__ void pack_fragments(uint32_t (&out)[kTiles][2],
                                               const float (&acc)[kTiles][4]) {
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt) {
    out[nt][0] = fa::pack2<T>(acc[nt][0], acc[nt][1]);
    out[nt][1] = fa::pack2<T>(acc[nt][2], acc[nt][3]);
  }
}

/// \f$C = A B^T\f$ for one warp: \f$A\f$ is rows [a_row0, a_row0 + 16) and \f$B\f$ rows
/// [b_row0, b_row0 + 8 kNTiles) of two swizzled row-major tiles whose rows are head-dim
/// vectors (Q, K, V, dO), so both operands load with the non-transposing ldmatrix, as
/// \f$Q K^T\f$ does in the forward. Gives \f$S^T = K Q^T\f$, \f$dP^T = V dO^T\f$ (main kernel)
/// and \f$S = Q K^T\f$, \f$dP = dO V^T\f$ (dQ kernel); `acc` starts at zero.
template <class Tr, int kNTiles, typename T>
__device__ __forceinline__ void mma_abt(float (&acc)[kNTiles][4], const char* a_tile, int a_row0,
                                        const char* b_tile, int b_row0, int lane) {
  const uint32_t a_offset = a_lane_offset<Tr>(lane);
  const uint32_t b_offset = b_lane_offset<Tr>(lane);
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
#pragma unroll 4  // d = 128: two rounds of 4 k16 steps (a full unroll spills)
  for (int k_step = 0; k_step < Tr::kHeadDim / 16; ++k_step) {
    uint32_t a_frag[4];
    load_a_fragment<Tr>(a_frag, a_tile, a_offset, a_row0, k_step);
#pragma unroll
    for (int nt = 0; nt < kNTiles; nt += 2) {
      uint32_t b_frag[2][2];
      load_b_fragments<Tr>(b_frag, b_tile, b_offset, b_row0 + 8 * nt, k_step);
      fa::mma_m16n8k16<T>(acc[nt], a_frag, b_frag[0]);
      fa::mma_m16n8k16<T>(acc[nt + 1], a_frag, b_frag[1]);
    }
  }
}

/// Two products of mma_abt's form over the same rows in one k loop: \f$S^T = K Q^T\f$ and
/// \f$dP^T = V dO^T\f$ for the same keys (A rows a_row0..) and queries (B rows b_row0..). Each
/// k step then issues 2 kNTiles independent mmas (the two chains hide each other's latency)
/// and the four ldmatrix of a k step are in flight together. Both accumulators start at zero.
template <class Tr, int kNTiles, typename T>
__device__ __forceinline__ void mma_abt_pair(float (&acc0)[kNTiles][4], float (&acc1)[kNTiles][4],
                                             const char* a0_tile, const char* a1_tile, int a_row0,
                                             const char* b0_tile, const char* b1_tile, int b_row0,
                                             int lane) {
  const uint32_t a_offset = a_lane_offset<Tr>(lane);
  const uint32_t b_offset = b_lane_offset<Tr>(lane);
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc0[nt][e] = acc1[nt][e] = 0.f;
#pragma unroll(kAbtUnroll)
  for (int k_step = 0; k_step < Tr::kHeadDim / 16; ++k_step) {
    uint32_t a0_frag[4], a1_frag[4];
    load_a_fragment<Tr>(a0_frag, a0_tile, a_offset, a_row0, k_step);
    load_a_fragment<Tr>(a1_frag, a1_tile, a_offset, a_row0, k_step);
#pragma unroll
    for (int nt = 0; nt < kNTiles; nt += 2) {
      uint32_t b0_frag[2][2], b1_frag[2][2];
      load_b_fragments<Tr>(b0_frag, b0_tile, b_offset, b_row0 + 8 * nt, k_step);
      load_b_fragments<Tr>(b1_frag, b1_tile, b_offset, b_row0 + 8 * nt, k_step);
      fa::mma_m16n8k16<T>(acc0[nt], a0_frag, b0_frag[0]);
      fa::mma_m16n8k16<T>(acc1[nt], a1_frag, b1_frag[0]);
      fa::mma_m16n8k16<T>(acc0[nt + 1], a0_frag, b0_frag[1]);
      fa::mma_m16n8k16<T>(acc1[nt + 1], a1_frag, b1_frag[1]);
    }
  }
}

/// \f$C = A B^T\f$ as mma_abt, for a warp tile of kMTiles m16 tiles (A rows a_row0 + 16 mt)
/// by kNTiles n8 tiles (B rows b_row0 + 8 nt): every B fragment feeds kMTiles mmas and every
/// A fragment kNTiles. `acc` starts at zero.
template <class Tr, int kMTiles, int kNTiles, typename T>
__device__ __forceinline__ void mma_abt_tile(float (&acc)[kMTiles][kNTiles][4], const char* a_tile,
                                             int a_row0, const char* b_tile, int b_row0, int lane) {
  const uint32_t a_offset = a_lane_offset<Tr>(lane);
  const uint32_t b_offset = b_lane_offset<Tr>(lane);
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
#pragma unroll(kAbtUnroll)
  for (int k_step = 0; k_step < Tr::kHeadDim / 16; ++k_step) {
    uint32_t a_frag[kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
      load_a_fragment<Tr>(a_frag[mt], a_tile, a_offset, a_row0 + 16 * mt, k_step);
#pragma unroll
    for (int nt = 0; nt < kNTiles; nt += 2) {
      uint32_t b_frag[2][2];
      load_b_fragments<Tr>(b_frag, b_tile, b_offset, b_row0 + 8 * nt, k_step);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        fa::mma_m16n8k16<T>(acc[mt][nt], a_frag[mt], b_frag[0]);
        fa::mma_m16n8k16<T>(acc[mt][nt + 1], a_frag[mt], b_frag[1]);
      }
    }
  }
}

/// \f$C \mathrel{+}= A B\f$ for a warp tile of two m16 tiles, both operands from shared memory:
/// A = rows [a_row0, a_row0 + 32) of a [key][query] tile (\f$P^T\f$ or \f$dS^T\f$, layout Ds),
/// k running along its kBlockM queries (ldmatrix); B = the q_block's dO or Q tile, head-dim
/// columns [col0, col0 + 8 kNTiles), k down its rows (ldmatrix.trans, as V in the forward).
template <class Tr, class Ds, int kNTiles, typename T>
__device__ __forceinline__ void mma_smem_ab(float (&acc)[2][kNTiles][4], const char* a_tile,
                                            int a_row0, const char* b_tile, int col0, int lane) {
  const uint32_t a_offset = a_lane_offset<Ds>(lane);
  const uint32_t b_offset = a_lane_offset<Tr>(lane);  // the .trans B pattern is A's
#pragma unroll
  for (int kt = 0; kt < Tr::kBlockM / 16; ++kt) {
    uint32_t a_frag[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
      load_a_fragment<Ds>(a_frag[mt], a_tile, a_offset, a_row0 + 16 * mt, kt);
#pragma unroll
    for (int nd = 0; nd < kNTiles; nd += 2) {
      uint32_t b_frag[2][2];
      load_b_fragments_trans<Tr>(b_frag, b_tile, b_offset, kt, col0 + 8 * nd);
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        fa::mma_m16n8k16<T>(acc[mt][nd], a_frag[mt], b_frag[0]);
        fa::mma_m16n8k16<T>(acc[mt][nd + 1], a_frag[mt], b_frag[1]);
      }
    }
  }
}

/// \f$dQ_w = dS_w K_j\f$ for one warp: query rows [row0, row0 + 32) (two m16 tiles) and
/// head-dim columns [col0, col0 + 8 kNTiles), summed over the kBlockN keys of the kv_block.
/// A = dS, read from the \f$dS^T\f$ tile ([key][query]) with ldmatrix.trans; B = K_j, k down
/// its rows, with ldmatrix.trans as V in the forward. Each K fragment feeds both m16 tiles.
template <class Tr, class Ds, int kNTiles, typename T>
__device__ __forceinline__ void mma_ds_k(float (&acc)[2][kNTiles][4], const char* ds_tile, int row0,
                                         const char* k_tile, int col0, int lane) {
  const uint32_t ds_offset = b_lane_offset<Ds>(lane);  // 8x8 blocks (keys, queries), transposed
  const uint32_t k_offset = a_lane_offset<Tr>(lane);   // the .trans B pattern is A's
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nd = 0; nd < kNTiles; ++nd)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nd][e] = 0.f;
#pragma unroll
  for (int kt = 0; kt < Tr::kBlockN / 16; ++kt) {
    uint32_t a_frag[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
      fa::ldmatrix_x4_trans(
          a_frag[mt], ds_tile + fragment_offset<Ds>(ds_offset, 16 * kt, (row0 + 16 * mt) / 8));
#pragma unroll
    for (int nd = 0; nd < kNTiles; nd += 2) {
      uint32_t b_frag[2][2];
      load_b_fragments_trans<Tr>(b_frag, k_tile, k_offset, kt, col0 + 8 * nd);
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        fa::mma_m16n8k16<T>(acc[mt][nd], a_frag[mt], b_frag[0]);
        fa::mma_m16n8k16<T>(acc[mt][nd + 1], a_frag[mt], b_frag[1]);
      }
    }
  }
}

/// \f$C \mathrel{+}= A B\f$ for one warp with \f$A\f$ (16 x 16 kKSteps) in registers, packed by
/// pack_fragments from an earlier product (\f$P^T\f$, \f$dS^T\f$, or \f$dS\f$): the
/// accumulator never goes through shared memory, as P in the forward's \f$P V\f$. \f$B\f$ is
/// rows [b_row0, b_row0 + 16 kKSteps) and head-dim columns [col0, col0 + 8 kNTiles) of a
/// swizzled row-major tile (dO, Q or K); k runs down its rows, so it loads with
/// ldmatrix.trans, as V does in the forward.
template <class Tr, int kNTiles, int kKSteps, typename T>
__device__ __forceinline__ void mma_reg_ab(float (&acc)[kNTiles][4],
                                           const uint32_t (&a)[2 * kKSteps][2], const char* b_tile,
                                           int b_row0, int col0, int lane) {
  const uint32_t a_offset = a_lane_offset<Tr>(lane);  // the .trans B pattern is A's
#pragma unroll
  for (int t = 0; t < kKSteps; ++t) {
    const uint32_t a_frag[4] = {a[2 * t][0], a[2 * t][1], a[2 * t + 1][0], a[2 * t + 1][1]};
#pragma unroll
    for (int nd = 0; nd < kNTiles; nd += 2) {
      uint32_t b_frag[2][2];
      load_b_fragments_trans<Tr>(b_frag, b_tile, a_offset, b_row0 / 16 + t, col0 + 8 * nd);
      fa::mma_m16n8k16<T>(acc[nd], a_frag, b_frag[0]);
      fa::mma_m16n8k16<T>(acc[nd + 1], a_frag, b_frag[1]);
    }
  }
}

/// Byte offset, in a swizzled row-major tile of 2-byte elements, of the packed pair that
/// pack_fragments puts in `out[.][h]` for the m16n8 tile at (row0, col0): row
/// row0 + 8 h + lane / 4, columns col0 + 2 (lane % 4) + {0, 1}.
template <class Layout>
__device__ __forceinline__ uint32_t tile_fragment_offset(int row0, int col0, int h, int lane) {
  return swizzle<Layout::kRowBytes>(row0 + 8 * h + lane / 4, col0 / 8) + 4 * (lane % 4);
}

/// Stores packed 16-bit accumulator fragments `frag[mt][nt]` (pack_fragments layout) into a
/// swizzled row-major tile: rows row0 + 16 mt + [0, 16), columns col0 + 8 nt + [0, 8).
template <class Layout, int kMTiles, int kNTiles>
__device__ __forceinline__ void store_tile_fragments(char* tile,
                                                     const uint32_t (&frag)[kMTiles][kNTiles][2],
                                                     int row0, int col0, int lane) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<uint32_t*>(
            tile + tile_fragment_offset<Layout>(row0 + 16 * mt, col0 + 8 * nt, h, lane)) =
            frag[mt][nt][h];
}

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
/// head-dim columns dq_warp_col0(w) + [0, kDqCols) of the q_block (see mma_ds_k).
template <class Tr>
__device__ __forceinline__ int dq_fragment_index(int mt, int nd, int tid) {
  return ((tid / 32) * 2 * Tr::kDqNTiles + mt * Tr::kDqNTiles + nd) * 32 + tid % 32;
}
template <class Tr>
__device__ __forceinline__ int dq_warp_row0(int warp) {
  return 32 * (warp % Tr::kDqWarpsM);
}
template <class Tr>
__device__ __forceinline__ int dq_warp_col0(int warp) {
  return Tr::kDqCols * (warp / Tr::kDqWarpsM);
}

// ------------------------------------------------------------------------------------------
// Kernel 1: preprocess
// ------------------------------------------------------------------------------------------

/// Preprocess, 8 threads per query row (i, head, batch): \f$D_i = \sum_c dO_{ic} O_{ic}\f$ in
/// fp32, the lse in base 2 (\f$L_i \log_2 e\f$, for the exp2 trick) and, when `dq_accum` is
/// not null, a zeroed fp32 dQ accumulator row. Padding rows \f$N_q \le i < N_{q,pad}\f$ get
/// \f$D_i = 0\f$ and \f$L_i = +\infty\f$, so that they contribute \f$P = 0\f$.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(256)
    bwd_preprocess_kernel(const fa_bwd_args args, int seqlen_q_pad, float* lse_log2, float* d_row,
                          float* dq_accum) {
  constexpr int kLanesPerRow = 8, kChunksPerLane = kHeadDim / 8 / kLanesPerRow;
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
  if (dq_accum != nullptr) {  // every row of the padded slice (dq_accum layout: whole q_blocks)
    float4* dq_row = reinterpret_cast<float4*>(dq_accum + (bh * seqlen_q_pad + row) * kHeadDim);
    for (int i = sub; i < kHeadDim / 4; i += kLanesPerRow) dq_row[i] = make_float4(0, 0, 0, 0);
  }
  for (int offset = kLanesPerRow / 2; offset > 0; offset /= 2)
    dot += __shfl_xor_sync(0xffffffffu, dot, offset);
  if (sub == 0) {
    const int64_t idx = bh * seqlen_q_pad + row;
    d_row[idx] = dot;
    lse_log2[idx] = row < f.seqlen_q ? f.lse[bh * f.seqlen_q + row] * kLog2e : INFINITY;
  }
}

// ------------------------------------------------------------------------------------------
// Kernel 2: dK, dV (and dQ by atomics), K/V outer loop
// ------------------------------------------------------------------------------------------

/// Writes one kv_block's dV or dK: `mult` times the sum of the kKvParts warps' fp32 partials
/// (warps that split the queries hold partial sums over their queries). A warp's fragments
/// `acc[mt][nd]` cover keys key0 + 16 mt + [0, 16) and head-dim columns col0 + 8 nd + [0, 8)
/// of partial `part`. They go to an fp32 staging tile in shared memory (rows padded by 8
/// floats: conflict-free), are summed there, and leave as 16-byte stores; rows at or past
/// `valid_rows` are not stored.
template <class Tr, typename T>
__device__ __forceinline__ void store_kv_grad(const float (&acc)[Tr::kKvMTiles][Tr::kKvNTiles][4],
                                              float mult, float* staging, T* gmem,
                                              int64_t row_stride, int valid_rows, int part,
                                              int key0, int col0, int tid) {
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
    if (row < valid_rows) {
      uint4 out;
      out.x = fa::pack2<T>(sum[0] * mult, sum[1] * mult);
      out.y = fa::pack2<T>(sum[2] * mult, sum[3] * mult);
      out.z = fa::pack2<T>(sum[4] * mult, sum[5] * mult);
      out.w = fa::pack2<T>(sum[6] * mult, sum[7] * mult);
      *reinterpret_cast<uint4*>(gmem + row * row_stride + 8 * chunk) = out;
    }
  }
}

/// Main backward kernel: one thread block per (kv_block j, kv head, batch), grid
/// (\f$\lceil N_k / B_c \rceil\f$, \f$H_{kv}\f$, B). The loop order of the forward flips: K_j and
/// V_j stay in shared memory and \f$dK_j\f$, \f$dV_j\f$ in registers, while the inner loop
/// walks the q_blocks i of every query head of the GQA group (under causal masking only
/// those with a row that sees a key of kv_block j). With \f$P\f$ recomputed from the lse:
/// \f[ P_{ij} = 2^{\,S_{ij} \log_2 e - L_i \log_2 e},\quad dV_j \mathrel{+}= P_{ij}^T dO_i,\quad
///     dP_{ij} = dO_i V_j^T,\quad dS_{ij} = P_{ij} \circ (dP_{ij} - D_i), \f]
/// \f[ dK_j \mathrel{+}= \mathrm{scale}\; dS_{ij}^T Q_i,\qquad
///     \mathrm{dq\_accum}_i \mathrel{+}= dS_{ij} K_j \ \text{(fp32 atomics, kAtomicDq)}. \f]
/// Warp (n, m) computes the transposed scores \f$S^T = K Q^T\f$ and \f$dP^T = V dO^T\f$ for its
/// keys and kWarpCols queries. With P in registers (16 keys per warp, one slice of
/// kSliceCols queries at a time) their fragments, packed to 16 bits, are directly the A
/// operands of \f$P^T dO\f$ and \f$dS^T Q\f$; \f$dS^T\f$ goes through shared memory once, to
/// feed \f$dS K_j\f$, which sums over all keys of the block. With P through shared memory
/// (kPtInSmem, 32 keys per warp) \f$P^T\f$ and \f$dS^T\f$ are stored and read back by warps
/// that split the head dimension instead of the queries (FlashAttention-2's layout).
/// Per q_block: wait for Q_i, dO_i (loaded during the previous one), start loading Q_{i+1}
/// (and dO_{i+1} with two dO buffers), then the five products.
template <typename T, int kHeadDim, bool kLargeSmem, bool kAtomicDq>
__global__ void __launch_bounds__(BwdTraits<kHeadDim, kLargeSmem>::kNumThreads, 1)
    bwd_dk_dv_kernel(const fa_bwd_args args, float* dq_accum, const float* lse_log2,
                     const float* d_row, int seqlen_q_pad, float scale_log2) {
  using Tr = BwdTraits<kHeadDim, kLargeSmem>;
  using Ds = DsLayout<Tr::kBlockM>;
  extern __shared__ __align__(128) char smem[];
  char* const k_tile = smem;
  char* const v_tile = smem + Tr::kOffV;
  char* const ds_tile = smem + Tr::kOffDs;  // dS^T, [key][query]

  const fa_fwd_args& f = args.fwd;
  const int kv_block = blockIdx.x, head_kv = blockIdx.y, batch = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int group = lane / 4, quad = lane % 4;  // fragment row and column pair
  const int warp_n = warp % Tr::kWarpsN, warp_m = warp / Tr::kWarpsN;
  const int key0 = 16 * Tr::kSMTiles * warp_n;  // this warp's keys in the kv_block
  const int query0 = Tr::kWarpCols * warp_m;    // this warp's first query in the q_block
  // This warp's head-dim columns of dK, dV (all of them unless P goes through shared memory).
  const int kv_col0 = 8 * Tr::kKvNTiles * (warp / (Tr::kNumWarps / Tr::kKvWarpsD));
  const int group_size = f.heads / f.heads_kv;
  const int seqlen_q = f.seqlen_q, seqlen_k = f.seqlen_k;
  const int kv_start = kv_block * Tr::kBlockN;
  const int diag = seqlen_k - seqlen_q;  // causal: row i sees key j iff j <= i + diag

  // The q_blocks this kv_block meets: all, or under causal masking those from the first one
  // holding a row i >= kv_start - diag (the rows before see none of its keys: skipped).
  const int n_q_blocks = (seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  const int m_begin = f.causal ? min(n_q_blocks, max(0, kv_start - diag) / Tr::kBlockM) : 0;
  const int m_count = n_q_blocks - m_begin;
  const int n_iters = group_size * m_count;  // (query head of the group, q_block) pairs

  const T* const k =
      static_cast<const T*>(f.k.ptr) + batch * f.k.batch_stride + head_kv * f.k.head_stride;
  const T* const v =
      static_cast<const T*>(f.v.ptr) + batch * f.v.batch_stride + head_kv * f.v.head_stride;

  // Starts loading q_block `q_block` of query head `head` into buffer `buf`: Q with its lse
  // and D, and/or dO.
  auto load_q_block = [&](int head, int q_block, int buf, bool with_q, bool with_do) {
    const int q_start = q_block * Tr::kBlockM;
    if (with_q) {
      const T* q =
          static_cast<const T*>(f.q.ptr) + batch * f.q.batch_stride + head * f.q.head_stride;
      load_tile_async<Tr, Tr::kBlockM>(smem + Tr::kOffQ + buf * Tr::kQBytes, q, f.q.row_stride,
                                       q_start, seqlen_q, tid);
      const int64_t row0 = (static_cast<int64_t>(batch) * f.heads + head) * seqlen_q_pad + q_start;
      constexpr int kChunks = Tr::kStatBytes / 16;
      if (tid < kChunks)
        fa::cp_async_16(smem + Tr::kOffLse + buf * Tr::kStatBytes + 16 * tid,
                        lse_log2 + row0 + 4 * tid, true);
      else if (tid < 2 * kChunks)
        fa::cp_async_16(smem + Tr::kOffD + buf * Tr::kStatBytes + 16 * (tid - kChunks),
                        d_row + row0 + 4 * (tid - kChunks), true);
    }
    if (with_do) {
      const T* d_o = static_cast<const T*>(args.d_o.ptr) + batch * args.d_o.batch_stride +
                     head * args.d_o.head_stride;
      load_tile_async<Tr, Tr::kBlockM>(
          smem + Tr::kOffDo + (Tr::kStagesDo == 2 ? buf : 0) * Tr::kQBytes, d_o,
          args.d_o.row_stride, q_start, seqlen_q, tid);
    }
  };

  // Prologue: K_j, V_j and the first q_block in one cp.async group.
  load_tile_async<Tr, Tr::kBlockN>(k_tile, k, f.k.row_stride, kv_start, seqlen_k, tid);
  load_tile_async<Tr, Tr::kBlockN>(v_tile, v, f.v.row_stride, kv_start, seqlen_k, tid);
  if (n_iters > 0) load_q_block(head_kv * group_size, m_begin, 0, true, true);
  fa::cp_async_commit();

  // On-chip state for the whole loop: this warp's part of dV_j and (unscaled) dK_j.
  float dv_acc[Tr::kKvMTiles][Tr::kKvNTiles][4], dk_acc[Tr::kKvMTiles][Tr::kKvNTiles][4];
#pragma unroll
  for (int mt = 0; mt < Tr::kKvMTiles; ++mt)
#pragma unroll
    for (int nd = 0; nd < Tr::kKvNTiles; ++nd)
#pragma unroll
      for (int e = 0; e < 4; ++e) dv_acc[mt][nd][e] = dk_acc[mt][nd][e] = 0.f;

  // Iteration it visits (query head, q_block) = (head, q_block): the q_blocks of one head in
  // order, then the next head of the group (counters, not it / m_count: no integer division).
  int head = head_kv * group_size, q_block = m_begin;
  // sm_90, large shapes: each warp stages its dQ fragments here for the bulk reduction.
  float* const dq_stage = reinterpret_cast<float*>(smem + Tr::kOffDqStage);
  const int dq_warp_part = warp * Tr::kDqWarpFloats;  // this warp's stretch of a dQ slice
  for (int it = 0; it < n_iters; ++it) {
    const int q_start = q_block * Tr::kBlockM;
    const int buf = it & 1;
    int next_head = head, next_q_block = q_block + 1;
    if (next_q_block == n_q_blocks) next_q_block = m_begin, ++next_head;
    const char* const q_tile = smem + Tr::kOffQ + buf * Tr::kQBytes;
    const char* const do_tile = smem + Tr::kOffDo + (Tr::kStagesDo == 2 ? buf : 0) * Tr::kQBytes;
    const float* const lse_tile =
        reinterpret_cast<const float*>(smem + Tr::kOffLse) + buf * Tr::kBlockM;
    const float* const d_tile =
        reinterpret_cast<const float*>(smem + Tr::kOffD) + buf * Tr::kBlockM;

    fa::cp_async_wait<0>();
    __syncthreads();  // Q_i, dO_i, lse, D have landed; every warp is done with the other buffer
    if (it + 1 < n_iters) load_q_block(next_head, next_q_block, buf ^ 1, true, Tr::kStagesDo == 2);
    fa::cp_async_commit();

    // dq_accum_i += dS K_j (atomic mode): warp w takes query rows dq_warp_row0(w) + [0, 32)
    // and kDqCols head-dim columns, then adds each m16n8 fragment with one 16-byte atomic, in
    // the dq_accum layout (dq_fragment_index). Rows that see no key of this kv_block (causal,
    // above the diagonal) or do not exist are skipped. With a dQ stage (sm_90, large shapes)
    // the fragments are only staged: the result is where issue_dq sends them, else null.
    auto accumulate_dq = [&]() -> float* {
      if constexpr (kAtomicDq) {
        const int dq_row0 = dq_warp_row0<Tr>(warp), dq_col0 = dq_warp_col0<Tr>(warp);
        const bool rows_empty =
            q_start + dq_row0 >= seqlen_q || (f.causal && q_start + dq_row0 + 31 + diag < kv_start);
        if (!rows_empty) {
          float dq[2][Tr::kDqNTiles][4];
          mma_ds_k<Tr, Ds, Tr::kDqNTiles, T>(dq, ds_tile, dq_row0, k_tile, dq_col0, lane);
          float* const dst =
              dq_accum +
              ((static_cast<int64_t>(batch) * f.heads + head) * seqlen_q_pad + q_start) * kHeadDim;
          if constexpr (Tr::kDqStage && kHasBulkReduce) {
            // sm_90: the warp stages its fragments in shared memory (in the dq_accum layout)
            // and one lane hands the whole stretch to the TMA as one bulk reduction. The
            // registers are free as soon as the stores are issued; no red.global queue.
            if (lane == 0) bulk_wait<true>();  // the previous reduction has read the stage
            __syncwarp();
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
              for (int nd = 0; nd < Tr::kDqNTiles; ++nd)
                *reinterpret_cast<float4*>(dq_stage + 4 * dq_fragment_index<Tr>(mt, nd, tid)) =
                    make_float4(dq[mt][nd][0], dq[mt][nd][1], dq[mt][nd][2], dq[mt][nd][3]);
            return dst;
          } else {
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
              for (int nd = 0; nd < Tr::kDqNTiles; ++nd)
                atomic_add4(dst + 4 * dq_fragment_index<Tr>(mt, nd, tid), dq[mt][nd]);
          }
        }
      }
      return nullptr;
    };
    // Hands the warp's staged dQ (accumulate_dq's result) to the TMA: one lane issues a bulk
    // reduction of the warp's stretch. The fence (MEMBAR + FENCE.VIEW.ASYNC in SASS) waits
    // until this thread's stores to the stage have completed, so it goes one product after
    // the stores, not right behind them (NOTES.md, change 4).
    auto issue_dq = [&](float* dst) {
      if constexpr (kAtomicDq && Tr::kDqStage && kHasBulkReduce) {
        fence_proxy_async_shared();
        __syncwarp();
        if (dst != nullptr && lane == 0)
          bulk_reduce_add(dst + dq_warp_part, dq_stage + dq_warp_part, Tr::kDqWarpFloats * 4);
      }
    };

    // Elements need the mask only where the key does not exist (ragged last kv_block) or,
    // under causal masking, j > i + diag: only q_blocks that cross the diagonal test them.
    const bool needs_mask = kv_start + Tr::kBlockN > seqlen_k ||
                            (f.causal && kv_start + Tr::kBlockN - 1 > q_start + diag);
    if constexpr (Tr::kPtInSmem) {
      // FlashAttention-2's layout. Warp (n, m) computes S^T and dP^T for its 32 keys and
      // kWarpCols queries and stores P^T and dS^T (0 where masked); a warp tile that sees none
      // of its keys (causal, above the diagonal, or keys past N_k) stores zeros.
      char* const pt_tile = smem + Tr::kOffPt;  // P^T, [key][query]
      const bool tile_empty =
          kv_start + key0 >= seqlen_k ||
          (f.causal && kv_start + key0 > q_start + query0 + Tr::kWarpCols - 1 + diag);
      if (!tile_empty) {
        {
          uint32_t p_frag[2][Tr::kNTilesS][2];
          float s[2][Tr::kNTilesS][4];
          mma_abt_tile<Tr, 2, Tr::kNTilesS, T>(s, k_tile, key0, q_tile, query0, lane);
          // Two copies of this loop (kMask = needs_mask): most q_blocks need no mask, and a
          // runtime test per element would cost 3-4 integer instructions each.
          auto exp_scores = [&](auto mask) {
            constexpr bool kMask = decltype(mask)::value;
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
              for (int nt = 0; nt < Tr::kNTilesS; ++nt) {
                const int col = query0 + 8 * nt + 2 * quad;  // S^T columns are queries
                const float2 lse = *reinterpret_cast<const float2*>(lse_tile + col);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                  float p =
                      fa::exp2_approx(fmaf(s[mt][nt][e], scale_log2, (e & 1) ? -lse.y : -lse.x));
                  if constexpr (kMask) {
                    const int key = kv_start + key0 + 16 * mt + group + 8 * (e >> 1);
                    const int row = q_start + col + (e & 1);
                    if (key >= seqlen_k || (f.causal && key > row + diag)) p = 0.f;
                  }
                  s[mt][nt][e] = p;
                }
              }
          };
          if (needs_mask)
            exp_scores(std::true_type{});
          else
            exp_scores(std::false_type{});
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) pack_fragments<T>(p_frag[mt], s[mt]);
          store_tile_fragments<Ds>(pt_tile, p_frag, key0, query0, lane);
        }
        {
          // dS^T takes P^T back from shared memory (the elements this thread stored), which
          // frees its registers during the dP^T product.
          uint32_t ds_frag[2][Tr::kNTilesS][2];
          float dp[2][Tr::kNTilesS][4];
          mma_abt_tile<Tr, 2, Tr::kNTilesS, T>(dp, v_tile, key0, do_tile, query0, lane);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
            for (int nt = 0; nt < Tr::kNTilesS; ++nt) {
              const float2 d =
                  *reinterpret_cast<const float2*>(d_tile + query0 + 8 * nt + 2 * quad);
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const uint32_t p2 = *reinterpret_cast<const uint32_t*>(
                    pt_tile +
                    tile_fragment_offset<Ds>(key0 + 16 * mt, query0 + 8 * nt, e >> 1, lane));
                dp[mt][nt][e] = unpack_half<T>(p2, e & 1) * (dp[mt][nt][e] - ((e & 1) ? d.y : d.x));
              }
            }
            pack_fragments<T>(ds_frag[mt], dp[mt]);
          }
          store_tile_fragments<Ds>(ds_tile, ds_frag, key0, query0, lane);
        }
      } else {
        uint32_t zero[2][Tr::kNTilesS][2];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int nt = 0; nt < Tr::kNTilesS; ++nt) zero[mt][nt][0] = zero[mt][nt][1] = 0u;
        store_tile_fragments<Ds>(pt_tile, zero, key0, query0, lane);
        store_tile_fragments<Ds>(ds_tile, zero, key0, query0, lane);
      }
      __syncthreads();  // P^T, dS^T of the whole block are in
      // dQ first, then dV, then the dQ reduction goes (sm_90) and runs in the TMA while the
      // tensor cores do dK (with red.global, the atomics drain during dV and dK).
      float* const dq_dst = accumulate_dq();

      // dV_j += P^T dO_i and dK_j += dS^T Q_i: warp (n, c) owns keys key0 + [0, 32) and
      // head-dim columns kv_col0 + [0, d / 2), all queries of the q_block (the softmax scale
      // of dK is applied once, in the epilogue). Keys that see no query are skipped.
      const bool keys_empty = kv_start + key0 >= seqlen_k ||
                              (f.causal && kv_start + key0 > q_start + Tr::kBlockM - 1 + diag);
      if (!keys_empty)
        mma_smem_ab<Tr, Ds, Tr::kKvNTiles, T>(dv_acc, pt_tile, key0, do_tile, kv_col0, lane);
      issue_dq(dq_dst);
      if (!keys_empty)
        mma_smem_ab<Tr, Ds, Tr::kKvNTiles, T>(dk_acc, ds_tile, key0, q_tile, kv_col0, lane);
    } else {
#pragma unroll 1
      for (int slice = 0; slice < Tr::kSlices; ++slice) {
        const int col0 = query0 + Tr::kSliceCols * slice;  // the slice's first query
        // A slice whose queries see none of this warp's keys (causal, above the diagonal, or
        // keys past N_k) has P = 0 and dS = 0: only its zero dS^T is stored.
        const bool slice_empty =
            kv_start + key0 >= seqlen_k ||
            (f.causal && kv_start + key0 > q_start + col0 + Tr::kSliceCols - 1 + diag);
        uint32_t ds_frag[Tr::kNTilesS][2];
        if (!slice_empty) {
          // S^T = K_j Q_i^T and dP^T = V_j dO_i^T (recomputed) in one k loop; then
          // P^T = exp2(S^T scale log2e - L log2e) (0 where masked) and dS^T = P^T o (dP^T - D).
          uint32_t p_frag[Tr::kNTilesS][2];
          {
            float s[Tr::kNTilesS][4], dp[Tr::kNTilesS][4];
            mma_abt_pair<Tr, Tr::kNTilesS, T>(s, dp, k_tile, v_tile, key0, q_tile, do_tile, col0,
                                              lane);
            // Two copies of this loop, as in the other scheme (kMask = needs_mask).
            auto exp_scores = [&](auto mask) {
              constexpr bool kMask = decltype(mask)::value;
#pragma unroll
              for (int nt = 0; nt < Tr::kNTilesS; ++nt) {
                const int col = col0 + 8 * nt + 2 * quad;  // S^T columns are queries
                const float2 lse = *reinterpret_cast<const float2*>(lse_tile + col);
                const float2 d = *reinterpret_cast<const float2*>(d_tile + col);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                  float p = fa::exp2_approx(fmaf(s[nt][e], scale_log2, (e & 1) ? -lse.y : -lse.x));
                  if constexpr (kMask) {
                    const int key = kv_start + key0 + group + 8 * (e >> 1);
                    const int row = q_start + col + (e & 1);
                    if (key >= seqlen_k || (f.causal && key > row + diag)) p = 0.f;
                  }
                  s[nt][e] = p;
                  dp[nt][e] = p * (dp[nt][e] - ((e & 1) ? d.y : d.x));
                }
              }
            };
            if (needs_mask)
              exp_scores(std::true_type{});
            else
              exp_scores(std::false_type{});
            pack_fragments<T>(p_frag, s);
            pack_fragments<T>(ds_frag, dp);
          }
          // dV_j += P^T dO_i and dK_j += dS^T Q_i (the softmax scale is applied once, in the
          // epilogue).
          mma_reg_ab<Tr, Tr::kNTilesD, Tr::kNTilesS / 2, T>(dv_acc[0], p_frag, do_tile, col0, 0,
                                                            lane);
          mma_reg_ab<Tr, Tr::kNTilesD, Tr::kNTilesS / 2, T>(dk_acc[0], ds_frag, q_tile, col0, 0,
                                                            lane);
        } else {
#pragma unroll
          for (int nt = 0; nt < Tr::kNTilesS; ++nt) ds_frag[nt][0] = ds_frag[nt][1] = 0u;
        }
        if constexpr (kAtomicDq) {
          // dS^T to shared memory: dQ_i needs, for each of its rows, all keys of the block.
#pragma unroll
          for (int nt = 0; nt < Tr::kNTilesS; ++nt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
              *reinterpret_cast<uint32_t*>(
                  ds_tile + swizzle<Ds::kRowBytes>(key0 + group + 8 * h, col0 / 8 + nt) +
                  4 * quad) = ds_frag[nt][h];
        }
      }
      if constexpr (kAtomicDq || Tr::kStagesDo == 1) __syncthreads();  // dS^T in; dO_i read
      if constexpr (Tr::kStagesDo == 1) {
        if (it + 1 < n_iters) load_q_block(next_head, next_q_block, buf ^ 1, false, true);
        fa::cp_async_commit();
      }
    }

    if constexpr (!Tr::kPtInSmem && kAtomicDq) accumulate_dq();
    head = next_head;
    q_block = next_q_block;
  }

  // Epilogue: dV_j and scale * dK_j, the partials of the query-splitting warps summed.
  fa::cp_async_wait<0>();
  if (lane == 0) bulk_wait<false>();  // the dQ reductions are done (the stage is reused)
  float* const staging = reinterpret_cast<float*>(smem);
  T* const dv = static_cast<T*>(args.dv.ptr) + batch * args.dv.batch_stride +
                head_kv * args.dv.head_stride + kv_start * args.dv.row_stride;
  T* const dk = static_cast<T*>(args.dk.ptr) + batch * args.dk.batch_stride +
                head_kv * args.dk.head_stride + kv_start * args.dk.row_stride;
  const int part = Tr::kKvParts > 1 ? warp_m : 0;
  store_kv_grad<Tr, T>(dv_acc, 1.f, staging, dv, args.dv.row_stride, seqlen_k - kv_start, part,
                       key0, kv_col0, tid);
  store_kv_grad<Tr, T>(dk_acc, f.scale, staging, dk, args.dk.row_stride, seqlen_k - kv_start, part,
                       key0, kv_col0, tid);
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
// Deterministic mode: dQ with the forward's loop order, no atomics
// ------------------------------------------------------------------------------------------

/// Deterministic dQ, one thread block per (q_block i, query head, batch): the loop order of
/// the forward. The kv_blocks j that q_block i sees are visited in order and
/// \f[ dQ_i = \mathrm{scale} \sum_j \big(P_{ij} \circ (dO_i V_j^T - D_i)\big) K_j \f]
/// is summed in registers, with \f$P_{ij}\f$ recomputed from the lse. Each warp owns 16 query
/// rows, so \f$dS\f$ never leaves registers (as P in the forward's \f$P V\f$). The summation
/// order is fixed: results are bit-identical from run to run, at the cost of recomputing
/// \f$S\f$ and \f$dP\f$ (7 matmuls per block pair instead of 5 for the whole backward).
/// Per kv_block: wait for K_j, V_j; start loading K_{j+1}; \f$S\f$, \f$dP\f$; start loading
/// V_{j+1}; \f$dS\f$, \f$dQ \mathrel{+}= dS K_j\f$.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(DqTraits<kHeadDim>::kNumThreads)
    bwd_dq_kernel(const fa_bwd_args args, const float* lse_log2, const float* d_row,
                  int seqlen_q_pad, float scale_log2) {
  using Tr = DqTraits<kHeadDim>;
  extern __shared__ __align__(128) char smem[];
  char* const q_tile = smem;
  char* const do_tile = smem + Tr::kOffDo;
  char* const v_tile = smem + Tr::kOffV;

  const fa_fwd_args& f = args.fwd;
  const int q_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int group = lane / 4, quad = lane % 4;
  const int warp_row0 = 16 * warp;
  const int head_kv = head / (f.heads / f.heads_kv);
  const int seqlen_q = f.seqlen_q, seqlen_k = f.seqlen_k;
  const int q_start = q_block * Tr::kBlockM;
  const int diag = seqlen_k - seqlen_q;

  // kv_blocks this q_block sees: all, or under causal masking up to the one holding the last
  // key its last row sees (none when even that row sees no key).
  int n_blocks = (seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN;
  if (f.causal) {
    const int last_key = q_start + Tr::kBlockM - 1 + diag;
    n_blocks = min(n_blocks, last_key < 0 ? 0 : last_key / Tr::kBlockN + 1);
  }

  const T* const q =
      static_cast<const T*>(f.q.ptr) + batch * f.q.batch_stride + head * f.q.head_stride;
  const T* const d_o = static_cast<const T*>(args.d_o.ptr) + batch * args.d_o.batch_stride +
                       head * args.d_o.head_stride;
  const T* const k =
      static_cast<const T*>(f.k.ptr) + batch * f.k.batch_stride + head_kv * f.k.head_stride;
  const T* const v =
      static_cast<const T*>(f.v.ptr) + batch * f.v.batch_stride + head_kv * f.v.head_stride;

  // Prologue: Q_i, dO_i, K_0, V_0 in one group.
  load_tile_async<Tr, Tr::kBlockM>(q_tile, q, f.q.row_stride, q_start, seqlen_q, tid);
  load_tile_async<Tr, Tr::kBlockM>(do_tile, d_o, args.d_o.row_stride, q_start, seqlen_q, tid);
  if (n_blocks > 0) {
    load_tile_async<Tr, Tr::kBlockN>(smem + Tr::kOffK, k, f.k.row_stride, 0, seqlen_k, tid);
    load_tile_async<Tr, Tr::kBlockN>(v_tile, v, f.v.row_stride, 0, seqlen_k, tid);
  }
  fa::cp_async_commit();

  // lse (base 2) and D of this thread's two rows (the padded scratch covers the block).
  const int64_t stat =
      (static_cast<int64_t>(batch) * f.heads + head) * seqlen_q_pad + q_start + warp_row0 + group;
  const float lse[2] = {lse_log2[stat], lse_log2[stat + 8]};
  const float d[2] = {d_row[stat], d_row[stat + 8]};

  float dq_acc[Tr::kNTilesD][4];
#pragma unroll
  for (int nd = 0; nd < Tr::kNTilesD; ++nd)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq_acc[nd][e] = 0.f;

  for (int kv_block = 0; kv_block < n_blocks; ++kv_block) {
    const int kv_start = kv_block * Tr::kBlockN;
    const char* const k_tile = smem + Tr::kOffK + (kv_block & 1) * Tr::kKBytes;
    fa::cp_async_wait<0>();
    __syncthreads();  // K_j, V_j have landed; every warp is done with the other K buffer
    if (kv_block + 1 < n_blocks)
      load_tile_async<Tr, Tr::kBlockN>(smem + Tr::kOffK + ((kv_block + 1) & 1) * Tr::kKBytes, k,
                                       f.k.row_stride, kv_start + Tr::kBlockN, seqlen_k, tid);
    fa::cp_async_commit();

    // P = exp2(S scale log2e - L log2e), S = Q_i K_j^T, masked as in the main kernel.
    const bool needs_mask = kv_start + Tr::kBlockN > seqlen_k ||
                            (f.causal && kv_start + Tr::kBlockN - 1 > q_start + diag);
    uint32_t p_frag[Tr::kNTilesS][2];
    {
      float s[Tr::kNTilesS][4];
      mma_abt<Tr, Tr::kNTilesS, T>(s, q_tile, warp_row0, k_tile, 0, lane);
#pragma unroll
      for (int nt = 0; nt < Tr::kNTilesS; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float p = fa::exp2_approx(fmaf(s[nt][e], scale_log2, -lse[e >> 1]));
          if (needs_mask) {
            const int key = kv_start + 8 * nt + 2 * quad + (e & 1);
            const int row = q_start + warp_row0 + group + 8 * (e >> 1);
            if (key >= seqlen_k || (f.causal && key > row + diag)) p = 0.f;
          }
          s[nt][e] = p;
        }
      pack_fragments<T>(p_frag, s);
    }
    // dP = dO_i V_j^T and dS = P o (dP - D).
    uint32_t ds_frag[Tr::kNTilesS][2];
    {
      float dp[Tr::kNTilesS][4];
      mma_abt<Tr, Tr::kNTilesS, T>(dp, do_tile, warp_row0, v_tile, 0, lane);
#pragma unroll
      for (int nt = 0; nt < Tr::kNTilesS; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          dp[nt][e] = unpack_half<T>(p_frag[nt][e >> 1], e & 1) * (dp[nt][e] - d[e >> 1]);
      pack_fragments<T>(ds_frag, dp);
    }
    __syncthreads();  // every warp is done with V_j
    if (kv_block + 1 < n_blocks)
      load_tile_async<Tr, Tr::kBlockN>(v_tile, v, f.v.row_stride, kv_start + Tr::kBlockN, seqlen_k,
                                       tid);
    fa::cp_async_commit();

    // dQ_i += dS K_j.
    mma_reg_ab<Tr, Tr::kNTilesD, Tr::kNTilesS / 2, T>(dq_acc, ds_frag, k_tile, 0, 0, lane);
  }

  // Epilogue: scale * dQ_i through the Q tile (no longer needed), 16-byte stores.
  fa::cp_async_wait<0>();
  __syncthreads();
#pragma unroll
  for (int nd = 0; nd < Tr::kNTilesD; ++nd)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      *reinterpret_cast<uint32_t*>(q_tile + swizzle<Tr::kRowBytes>(warp_row0 + group + 8 * h, nd) +
                                   4 * quad) =
          fa::pack2<T>(dq_acc[nd][2 * h] * f.scale, dq_acc[nd][2 * h + 1] * f.scale);
  __syncthreads();
  T* const dq =
      static_cast<T*>(args.dq.ptr) + batch * args.dq.batch_stride + head * args.dq.head_stride;
#pragma unroll
  for (int idx = tid; idx < Tr::kBlockM * Tr::kChunksPerRow; idx += Tr::kNumThreads) {
    const int row = idx / Tr::kChunksPerRow, chunk = idx % Tr::kChunksPerRow;
    if (q_start + row < seqlen_q)
      *reinterpret_cast<uint4*>(dq + (q_start + row) * args.dq.row_stride + 8 * chunk) =
          *reinterpret_cast<const uint4*>(q_tile + swizzle<Tr::kRowBytes>(row, chunk));
  }
}

// ------------------------------------------------------------------------------------------
// Backward launcher
// ------------------------------------------------------------------------------------------

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

/// Launches the main kernel with the small or large tile shape and, in atomic mode, the dQ
/// conversion, which reads dq_accum in that shape's layout (`dq_accum` null: the
/// deterministic variant without the dQ part).
template <typename T, int kHeadDim, bool kLargeSmem>
fa_status launch_dk_dv(const fa_bwd_args& args, cudaStream_t stream, int seqlen_q_pad,
                       const float* lse_log2, const float* d_row, float* dq_accum,
                       float scale_log2) {
  using Tr = BwdTraits<kHeadDim, kLargeSmem>;
  const fa_fwd_args& f = args.fwd;
  const dim3 grid((f.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN, f.heads_kv, f.batch);
  const auto kernel = dq_accum != nullptr ? bwd_dk_dv_kernel<T, kHeadDim, kLargeSmem, true>
                                          : bwd_dk_dv_kernel<T, kHeadDim, kLargeSmem, false>;
  const fa_status status = set_smem(kernel, Tr::kSmemBytes, "bwd_dk_dv_kernel");
  if (status != FA_OK) return status;
  kernel<<<grid, Tr::kNumThreads, Tr::kSmemBytes, stream>>>(args, dq_accum, lse_log2, d_row,
                                                            seqlen_q_pad, scale_log2);
  FA_LAUNCH_TRY();
  if (dq_accum != nullptr) {
    const dim3 convert_grid((f.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM, f.heads, f.batch);
    bwd_convert_dq_kernel<Tr, T>
        <<<convert_grid, Tr::kNumThreads, 0, stream>>>(args, dq_accum, seqlen_q_pad);
    FA_LAUNCH_TRY();
  }
  return FA_OK;
}

/// Runs the backward kernels on the scratch buffers (`dq_accum` null in deterministic mode):
/// preprocess; then dK/dV with atomic dQ and the dQ conversion, or dK/dV and the
/// deterministic dQ kernel. The main kernel takes the large tile shape where the GPU has the
/// shared memory for it (H100, H200: about 194 KiB), else the small one (every sm_80+ GPU,
/// the A100 included).
template <typename T, int kHeadDim>
fa_status launch_backward_kernels(const fa_bwd_args& args, cudaStream_t stream, int seqlen_q_pad,
                                  float* lse_log2, float* d_row, float* dq_accum) {
  const fa_fwd_args& f = args.fwd;
  const float scale_log2 = static_cast<float>(static_cast<double>(f.scale) * M_LOG2E);

  bwd_preprocess_kernel<T, kHeadDim><<<dim3(seqlen_q_pad / 32, f.heads, f.batch), 256, 0, stream>>>(
      args, seqlen_q_pad, lse_log2, d_row, dq_accum);
  FA_LAUNCH_TRY();

  int optin = 0;
  fa_status status = fa::smem_per_block_optin(&optin);
  if (status != FA_OK) return status;
  bool large = false;
  if constexpr (kHasLargeBwdShape<kHeadDim>) large = optin >= BwdTraits<kHeadDim, true>::kSmemBytes;
  if constexpr (kHasLargeBwdShape<kHeadDim>)
    status = large ? launch_dk_dv<T, kHeadDim, true>(args, stream, seqlen_q_pad, lse_log2, d_row,
                                                     dq_accum, scale_log2)
                   : launch_dk_dv<T, kHeadDim, false>(args, stream, seqlen_q_pad, lse_log2, d_row,
                                                      dq_accum, scale_log2);
  else
    status = launch_dk_dv<T, kHeadDim, false>(args, stream, seqlen_q_pad, lse_log2, d_row, dq_accum,
                                              scale_log2);
  if (status != FA_OK) return status;

  if (args.deterministic) {
    using Dq = DqTraits<kHeadDim>;
    const auto dq_kernel = bwd_dq_kernel<T, kHeadDim>;
    status = set_smem(dq_kernel, Dq::kSmemBytes, "bwd_dq_kernel");
    if (status != FA_OK) return status;
    const dim3 dq_grid((f.seqlen_q + Dq::kBlockM - 1) / Dq::kBlockM, f.heads, f.batch);
    dq_kernel<<<dq_grid, Dq::kNumThreads, Dq::kSmemBytes, stream>>>(args, lse_log2, d_row,
                                                                    seqlen_q_pad, scale_log2);
    FA_LAUNCH_TRY();
  }
  return FA_OK;
}

/// Backward pass for one dtype and head dimension: allocates the scratch in stream order
/// (dq_accum unless deterministic, lse in base 2, D), runs the kernels, frees the scratch.
template <typename T, int kHeadDim>
fa_status launch_backward(const fa_bwd_args& args, cudaStream_t stream) {
  const fa_fwd_args& f = args.fwd;
  const int seqlen_q_pad = (f.seqlen_q + kRowPad - 1) / kRowPad * kRowPad;
  const size_t stat_floats = static_cast<size_t>(f.batch) * f.heads * seqlen_q_pad;
  const size_t dq_floats =
      args.deterministic ? 0 : static_cast<size_t>(f.batch) * f.heads * seqlen_q_pad * kHeadDim;
  const size_t bytes = (dq_floats + 2 * stat_floats) * sizeof(float);
  float* scratch = nullptr;
  const cudaError_t alloc = cudaMallocAsync(&scratch, bytes, stream);
  if (alloc == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // not sticky: clear it
    return fa::set_error(FA_ERR_OUT_OF_MEMORY,
                         "07_backward: no device memory for %.1f MiB of scratch "
                         "(dq_accum, lse, D)",
                         bytes / 1048576.0);
  }
  FA_CUDA_TRY(alloc);
  float* const dq_accum = args.deterministic ? nullptr : scratch;
  float* const lse_log2 = scratch + dq_floats;
  float* const d_row = lse_log2 + stat_floats;
  const fa_status status =
      launch_backward_kernels<T, kHeadDim>(args, stream, seqlen_q_pad, lse_log2, d_row, dq_accum);
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
