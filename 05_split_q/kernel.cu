/// \file 05_split_q/kernel.cu
/// \brief Step 05: the warps split the Q block's rows, not its keys (FlashAttention-2,
/// sec. 3.3).
///
/// What this step adds to step 04:
/// - Each of the 4 warps owns its rows of the Q block and sees the whole K/V tile, so its S,
///   softmax statistics and o_acc rows are complete in the warp: o_acc moves into registers,
///   the warps exchange nothing, the two barriers per K/V block guard the K and V tiles, and O
///   leaves through the Q tile. With S in registers, \f$B_c\f$ at d = 128 is FlashAttention-2's
///   64 (04: 128), and `__launch_bounds__` drops 04's minimum of 2 thread blocks per SM.
/// - Riders, each a switch so that README.md measures it alone: the 128-row Q block that a
///   register o_acc allows (`-DFA_FWD_BLOCK_M=64` for 64 rows), and no o_acc rescale when no
///   row max of the warp grew (`-DFA_RESCALE_SKIP=0` turns that off).
///
/// Everything else is step 04.
/// Causal attention: the K/V blocks entirely above the diagonal are skipped, as FlashAttention-1's
/// code skipped them (kv_blocks_seen); every block that is computed is masked.
///
/// Run: `./build/bin/05_split_q --seqlen 4096 --head-dim 128`
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "fa/api.h"
#include "fa/check.cuh"
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
#ifndef FA_FWD_BLOCK_M
#define FA_FWD_BLOCK_M 128  // rider (see the file comment): Q rows per block
#endif
#ifndef FA_RESCALE_SKIP
#define FA_RESCALE_SKIP 1  // rider (see the file comment): skip a rescale by 1
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
  static constexpr int kBlockM = FA_FWD_BLOCK_M, kBlockN = FA_FWD_BLOCK_N_D64, kNumWarps = 4;
};
template <>
struct TileShape<128> {
  static constexpr int kBlockM = FA_FWD_BLOCK_M, kBlockN = FA_FWD_BLOCK_N_D128, kNumWarps = 4;
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
/// (the rest are entirely masked). At least one: a Q block that sees no key writes O = 0.
template <class Tr>
__device__ __forceinline__ int kv_blocks_seen(const fa_fwd_args& args, int q_start) {
  const int n_blocks = (args.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN;
  if (!args.causal) return n_blocks;
  const int last_key =
      min(q_start + Tr::kBlockM, args.seqlen_q) - 1 + args.seqlen_k - args.seqlen_q;
  return min(n_blocks, max(1, (last_key + Tr::kBlockN) / Tr::kBlockN));
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
  if (!FA_RESCALE_SKIP || __any_sync(0xffffffffu, max_grew)) {
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
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(Traits<kHeadDim>::kNumThreads)
    flash_forward_kernel(const fa_fwd_args args, const float scale_log2) {
  using Tr = Traits<kHeadDim>;
  extern __shared__ __align__(128) char smem[];
  char* const q_tile = smem;
  char* const k_tile = smem + Tr::kQBytes;
  char* const v_tile = k_tile + Tr::kKBytes;

  // Which (q_block, head, batch) this thread block computes, in the order launch() explains.
  const int num_q_blocks = (args.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  const int q_block = blockIdx.x % num_q_blocks;
  const int pair = blockIdx.x / num_q_blocks;
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
    // Under causal masking every block that is computed is masked element by element.
    const bool needs_mask = args.causal || kv_start + Tr::kBlockN > seqlen_k;
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
/// batch), in a one-dimensional grid that the kernel decodes, the Q blocks of one (batch,
/// head) pair next to each other, so that the thread blocks that read the same K and V run
/// at the same time and share them in L2.
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
  const dim3 grid(static_cast<unsigned>(num_q_blocks * num_pairs));
  constexpr double kLog2e = 1.4426950408889634;
  const float scale_log2 = static_cast<float>(args.scale * kLog2e);
  kernel<<<grid, Tr::kNumThreads, Tr::kSmemBytes, stream>>>(args, scale_log2);
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

}  // namespace

FA_REGISTER_STEP("FA2 forward: warps split Q rows, o_acc in registers, no exchange between warps",
                 forward, nullptr, supports_head_dim);
