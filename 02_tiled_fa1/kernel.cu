/// \file 02_tiled_fa1/kernel.cu
/// \brief Step 02: FlashAttention-1 forward (Dao et al., 2022, Algorithm 1) on tensor cores.
///
/// What this step adds to step 01:
/// - Tiles instead of whole matrices. Q, K and V are cut into blocks of \f$B_r\f$ and
///   \f$B_c\f$ rows that fit in shared memory; \f$S = Q K^T\f$ and \f$P\f$ exist only one
///   tile at a time, on chip. The \f$N_q \times N_k\f$ matrices S and P that step 01 writes to
///   and reads from device memory are gone.
/// - The online softmax: a running row max m and row sum \f$\ell\f$ let each K/V block be
///   folded into O as soon as it is seen, with the earlier blocks' contribution rescaled.
/// - One fused kernel on tensor cores (mma.sync m16n8k16 with fp32 accumulation, ldmatrix,
///   cp.async, a conflict-free swizzled shared-memory layout): the machinery every later step
///   keeps.
///
/// What it still wastes (each later step removes one):
/// - (03) The loop order. The outer loop runs over K/V blocks and the inner loop over Q
///   blocks, so for every (K/V block, Q block) pair the block's O (fp32), m and \f$\ell\f$ are
///   read from device memory and written back: \f$T_c\f$ round trips of O. And one thread
///   block per (head, batch) walks the whole sequence: the grid is only batch x heads thread
///   blocks, which leaves most of a GPU idle when the batch is small.
/// - (04) O is normalized at every K/V block (Algorithm 1 line 12), which needs the complete
///   row sums every block: one more exchange between the warps and more arithmetic.
/// - (05) The warps split K: every warp reads the whole Q tile, the row statistics of every
///   block go through shared memory and barriers, and the partial products \f$P_w V_w\f$ are
///   added into a shared fp32 o_acc in rounds separated by barriers.
///
/// O is accumulated in an fp32 scratch copy in device memory and converted to fp16/bf16 once
/// at the end: rounding it to fp16/bf16 at each of the \f$T_c\f$ write-backs would add
/// \f$T_c\f$ roundings of O (see README.md). Causal attention is done by masking.
///
/// Run: `./build/bin/02_tiled_fa1 --seqlen 4096 --head-dim 128`
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

/// Tile shape per head dimension: \f$B_r\f$ (kBlockM) query rows, \f$B_c\f$ (kBlockN) key
/// rows, kNumWarps warps. The 4 warps split the \f$B_c\f$ keys (16 each, one k16 step of
/// \f$P V\f$) and share all \f$B_r\f$ rows. Shared memory holds Q, one K and one V tile
/// (they change only once per outer iteration), the fp32 O tile (\f$B_r (d + 8) \cdot 4\f$
/// bytes) and the warps' row statistics: 44 KiB at 64 x 64 (d = 64) and 58 KiB at 32 x 64
/// (d = 128), which fits every sm_80+ GPU. The tiles are those of steps 03 and 04, whose two
/// K/V stages need 60 and 90 KiB. kMinBlocksPerSm goes to `__launch_bounds__` so that ptxas
/// cuts the register budget for that many thread blocks per SM (left to itself, ptxas aims
/// at a higher occupancy and spills to reach it); 2 at both head dims, since the grid has only
/// \f$B H\f$ thread blocks anyway.
template <int kHeadDim>
struct TileShape;
template <>
struct TileShape<64> {
  static constexpr int kBlockM = 64, kBlockN = 64, kNumWarps = 4, kMinBlocksPerSm = 2;
};
template <>
struct TileShape<128> {
  static constexpr int kBlockM = 32, kBlockN = 64, kNumWarps = 4, kMinBlocksPerSm = 2;
};

/// Every size the kernel derives from the tile shape, in one place.
template <int kHeadDim_>
struct Traits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = TileShape<kHeadDim>::kBlockM;  ///< \f$B_r\f$, Q rows
  static constexpr int kBlockN = TileShape<kHeadDim>::kBlockN;  ///< \f$B_c\f$, K/V rows
  static constexpr int kNumWarps = TileShape<kHeadDim>::kNumWarps;
  static constexpr int kNumThreads = 32 * kNumWarps;
  static constexpr int kMinBlocksPerSm = TileShape<kHeadDim>::kMinBlocksPerSm;
  static constexpr int kWarpKeys = kBlockN / kNumWarps;     ///< K/V rows owned by one warp
  static constexpr int kMTiles = kBlockM / 16;              ///< m16 mma tiles: all Q rows
  static constexpr int kNTilesS = kWarpKeys / 8;            ///< n8 tiles of S (this warp's keys)
  static constexpr int kOSliceCols = kHeadDim / kNumWarps;  ///< O columns added per round
  static constexpr int kNTilesO = kOSliceCols / 8;          ///< n8 tiles of one O slice
  static constexpr int kRowBytes = kHeadDim * 2;            ///< one row of Q/K/V/O, 2-byte types
  static constexpr int kChunksPerRow = kHeadDim / 8;        ///< 16-byte chunks in one row
  static constexpr int kQBytes = kBlockM * kRowBytes;
  static constexpr int kKBytes = kBlockN * kRowBytes;
  static constexpr int kVBytes = kBlockN * kRowBytes;
  static constexpr int kStageBytes = kKBytes + kVBytes;  ///< one K tile and one V tile
  static constexpr int kOAccPitch = kHeadDim + 8;  ///< floats per o_acc row (see accumulate_pv)
  static constexpr int kOAccBytes = kBlockM * kOAccPitch * 4;
  static constexpr int kStatsBytes = 2 * kNumWarps * kBlockM * 4;  ///< warp_max and warp_sum
  static constexpr int kSmemBytes = kQBytes + kStageBytes + kOAccBytes + kStatsBytes;

  static_assert(kBlockM % 16 == 0, "the Q block is whole m16 tiles");
  static_assert(kWarpKeys % 16 == 0, "each warp's keys are whole k16 steps of P V");
  static_assert(kOSliceCols % 16 == 0, "V fragments are loaded 16 columns at a time");
  static_assert(kOAccPitch % 32 == 8, "o_acc rows 8 banks apart: float2 adds conflict-free");
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
// The algorithm: S = Q K^T, mask, online softmax, O += P V (warps split K)
// ------------------------------------------------------------------------------------------

/// \f$S_w = Q K_w^T\f$ for all kBlockM query rows of the Q tile and this warp's kWarpKeys keys
/// (starting at tile key `warp_key0`), unscaled, in fp32 accumulator fragments: s[mi][nj] is
/// the m16n8 tile of rows 16 mi and keys warp_key0 + 8 nj. Every warp reads the whole Q tile.
template <class Tr, typename T>
__device__ __forceinline__ void compute_scores(float (&s)[Tr::kMTiles][Tr::kNTilesS][4],
                                               const char* q_tile, const char* k_tile,
                                               int warp_key0, int lane) {
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
      load_a_fragment<Tr>(q_frag[mi], q_tile, a_offset, 16 * mi, k_step);
#pragma unroll
    for (int nj = 0; nj < Tr::kNTilesS; nj += 2) {
      uint32_t k_frag[2][2];
      load_b_fragments<Tr>(k_frag, k_tile, b_offset, warp_key0 + 8 * nj, k_step);
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
/// `q_row0` is the sequence position of this thread's first row (tile row `group`);
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

/// The first half of the online softmax under split-K: the maximum of every row over this
/// warp's keys (a row's keys are spread over the 4 lanes of a quad: two shuffles), written to
/// `warp_max[warp][row]` in shared memory for the other warps. A barrier must separate this
/// from online_softmax, which reads every warp's maxima.
template <class Tr>
__device__ __forceinline__ void publish_row_max(const float (&s)[Tr::kMTiles][Tr::kNTilesS][4],
                                                float* warp_max, int warp, int lane) {
  const int group = lane / 4, quad = lane % 4;
#pragma unroll
  for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m = -INFINITY;
#pragma unroll
      for (int nj = 0; nj < Tr::kNTilesS; ++nj)
        m = fmaxf(m, fmaxf(s[mi][nj][2 * h], s[mi][nj][2 * h + 1]));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      if (quad == 0) warp_max[warp * Tr::kBlockM + 16 * mi + 8 * h + group] = m;
    }
}

/// The online softmax of FlashAttention-1 (Algorithm 1, lines 10-12) for one K/V block, per
/// row i of the Q block:
/// \f[ m_i^{new} = \max(m_i, \max_w m_{i,w}),\quad P_{ij} = e^{c (S_{ij} - m_i^{new})},\quad
///     \ell_i^{new} = e^{c (m_i - m_i^{new})} \ell_i + \sum_j P_{ij},\f]
/// \f[ O_i \leftarrow \frac{\ell_i e^{c (m_i - m_i^{new})}}{\ell_i^{new}} O_i +
///     \sum_j \frac{P_{ij}}{\ell_i^{new}} V_j \f]
/// with c the softmax scale and \f$m_{i,w}\f$ warp w's maximum from publish_row_max.
/// (Algorithm 1 writes \f$e^{\tilde m - m^{new}} \tilde P\f$ with the block's own max
/// \f$\tilde m\f$; that is the same \f$P\f$.) The block's row sums are reduced over the quad
/// and published in `warp_sum`; after a barrier every warp adds the kNumWarps partial sums of
/// each row in the same order, so every warp keeps the same full row_sum (and row_max). The
/// factor for \f$O_i\f$ is returned in `o_scale` (o_acc lives in shared memory and is
/// rescaled in accumulate_pv); the factor \f$1 / \ell^{new}\f$ of the new term is applied to
/// P here, in fp32, before P is rounded for the mma. In base 2,
/// \f$e^{c x} = 2^{x c \log_2 e}\f$, so with `scale_log2` \f$= c \log_2 e\f$ each
/// probability is one FFMA and one ex2. A row with no visible key yet has \f$m = -\infty\f$:
/// the subtracted max is then taken as 0 so that no \f$-\infty - (-\infty)\f$ makes a NaN,
/// and \f$\ell^{new} = 0\f$ gives factors 0. On return s holds \f$P / \ell^{new}\f$ (fp32).
template <class Tr>
__device__ __forceinline__ void online_softmax(float (&s)[Tr::kMTiles][Tr::kNTilesS][4],
                                               float (&row_max)[Tr::kMTiles][2],
                                               float (&row_sum)[Tr::kMTiles][2],
                                               float (&o_scale)[Tr::kMTiles][2],
                                               const float* warp_max, float* warp_sum,
                                               float scale_log2, int warp, int lane) {
  const int group = lane / 4, quad = lane % 4;
  float m_new[Tr::kMTiles][2];
#pragma unroll
  for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m = row_max[mi][h];
#pragma unroll
      for (int w = 0; w < Tr::kNumWarps; ++w)
        m = fmaxf(m, warp_max[w * Tr::kBlockM + 16 * mi + 8 * h + group]);
      m_new[mi][h] = m;
    }
#pragma unroll
  for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m_scaled = (m_new[mi][h] == -INFINITY) ? 0.f : m_new[mi][h] * scale_log2;
      // exp(c (m_old - m_new)); 0 when the row had no visible key before (m_old = -inf).
      const float rescale = fa::exp2_approx(row_max[mi][h] * scale_log2 - m_scaled);
      row_sum[mi][h] *= rescale;
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
      block_sum += __shfl_xor_sync(0xffffffffu, block_sum, 1);
      block_sum += __shfl_xor_sync(0xffffffffu, block_sum, 2);
      if (quad == 0) warp_sum[warp * Tr::kBlockM + 16 * mi + 8 * h + group] = block_sum;
    }
  __syncthreads();  // every warp's block sums are published
#pragma unroll
  for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float block_sum = 0.f;
#pragma unroll
      for (int w = 0; w < Tr::kNumWarps; ++w)
        block_sum += warp_sum[w * Tr::kBlockM + 16 * mi + 8 * h + group];
      const float l_new = row_sum[mi][h] + block_sum;
      const float inv_l_new = l_new > 0.f ? 1.f / l_new : 0.f;
      o_scale[mi][h] = row_sum[mi][h] * inv_l_new;
      row_sum[mi][h] = l_new;
#pragma unroll
      for (int nj = 0; nj < Tr::kNTilesS; ++nj)
#pragma unroll
        for (int e = 0; e < 2; ++e) s[mi][nj][2 * h + e] *= inv_l_new;
    }
}

/// \f$O \leftarrow \mathrm{diag}(o\_scale)\, O + \sum_w P_w V_w\f$, where warp w holds
/// \f$P_w\f$, the probabilities of all kBlockM rows for its kWarpKeys keys, and O is the fp32
/// o_acc in shared memory. The sum over warps is done in kNumWarps rounds: O is cut into
/// kNumWarps column slices, and in round r warp w computes its partial product for slice
/// \f$(w + r) \bmod W\f$ in registers and adds it into o_acc. The warps work on different
/// slices in every round, so no atomics are needed; a barrier separates the rounds. The
/// warp that takes a slice in round 0 also applies the rescale. Every element of O thus
/// gets its rescale and its four partial products in a fixed order (deterministic).
///
/// P stays in registers: the accumulator fragments of the S tiles 2 kk and 2 kk + 1, rounded
/// to T and packed in pairs, are the A fragment of the k16 step kk (a0 = rows 0-7 keys 0-7,
/// a1 = rows 8-15 keys 0-7, a2 = rows 0-7 keys 8-15, a3 = rows 8-15 keys 8-15). V's
/// fragments (this warp's key rows) come from shared memory through ldmatrix.trans. A lane
/// adds float2 pairs at rows 16 mi + 8 h + group and columns 8 nd + 2 quad; o_acc rows are
/// kOAccPitch = d + 8 floats apart, 8 banks, so the 16 lanes of a half-warp hit 32 different
/// banks.
template <class Tr, typename T>
__device__ __forceinline__ void accumulate_pv(float* o_acc, const float (&o_scale)[Tr::kMTiles][2],
                                              const float (&p)[Tr::kMTiles][Tr::kNTilesS][4],
                                              const char* v_tile, int warp, int lane) {
  const uint32_t a_offset = a_lane_offset<Tr>(lane);
  const int group = lane / 4, quad = lane % 4;
  uint32_t p_frag[Tr::kWarpKeys / 16][Tr::kMTiles][4];
#pragma unroll
  for (int kk = 0; kk < Tr::kWarpKeys / 16; ++kk)
#pragma unroll
    for (int mi = 0; mi < Tr::kMTiles; ++mi) {
      p_frag[kk][mi][0] = fa::pack2<T>(p[mi][2 * kk][0], p[mi][2 * kk][1]);
      p_frag[kk][mi][1] = fa::pack2<T>(p[mi][2 * kk][2], p[mi][2 * kk][3]);
      p_frag[kk][mi][2] = fa::pack2<T>(p[mi][2 * kk + 1][0], p[mi][2 * kk + 1][1]);
      p_frag[kk][mi][3] = fa::pack2<T>(p[mi][2 * kk + 1][2], p[mi][2 * kk + 1][3]);
    }
#pragma unroll
  for (int round = 0; round < Tr::kNumWarps; ++round) {
    const int col0 = (warp + round) % Tr::kNumWarps * Tr::kOSliceCols;
    float pv[Tr::kMTiles][Tr::kNTilesO][4];
#pragma unroll
    for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
      for (int nd = 0; nd < Tr::kNTilesO; ++nd)
#pragma unroll
        for (int e = 0; e < 4; ++e) pv[mi][nd][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < Tr::kWarpKeys / 16; ++kk)
#pragma unroll
      for (int nd = 0; nd < Tr::kNTilesO; nd += 2) {
        uint32_t v_frag[2][2];
        load_b_fragments_trans<Tr>(v_frag, v_tile, a_offset, warp * Tr::kWarpKeys / 16 + kk,
                                   col0 + 8 * nd);
#pragma unroll
        for (int mi = 0; mi < Tr::kMTiles; ++mi) {
          fa::mma_m16n8k16<T>(pv[mi][nd], p_frag[kk][mi], v_frag[0]);
          fa::mma_m16n8k16<T>(pv[mi][nd + 1], p_frag[kk][mi], v_frag[1]);
        }
      }
    if (round > 0) __syncthreads();  // the previous round's adds to this slice are done
#pragma unroll
    for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int nd = 0; nd < Tr::kNTilesO; ++nd) {
          float2* const dst = reinterpret_cast<float2*>(
              o_acc + (16 * mi + 8 * h + group) * Tr::kOAccPitch + col0 + 8 * nd + 2 * quad);
          float2 o = *dst;
          const float scale = round == 0 ? o_scale[mi][h] : 1.f;
          o.x = fmaf(o.x, scale, pv[mi][nd][2 * h]);
          o.y = fmaf(o.y, scale, pv[mi][nd][2 * h + 1]);
          *dst = o;
        }
  }
}

// ------------------------------------------------------------------------------------------
// O, m and l in device memory (Algorithm 1 lines 2, 8, 12 and 13)
// ------------------------------------------------------------------------------------------

/// Algorithm 1 line 2 for this (batch, head): \f$O = 0\f$, \f$\ell = 0\f$ and
/// \f$m = -\infty\f$ in device memory. `o_hbm` is the fp32 O of this (batch, head)
/// (\f$N_q\f$ rows of kHeadDim floats), `row_max_hbm` and `row_sum_hbm` its m and \f$\ell\f$
/// (\f$N_q\f$ floats each). A barrier must follow before any thread reads them back.
template <class Tr>
__device__ __forceinline__ void init_o_m_l(float* o_hbm, float* row_max_hbm, float* row_sum_hbm,
                                           int seqlen, int tid) {
  for (int64_t i = tid; i < static_cast<int64_t>(seqlen) * (Tr::kHeadDim / 4); i += Tr::kNumThreads)
    reinterpret_cast<float4*>(o_hbm)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int i = tid; i < seqlen; i += Tr::kNumThreads) {
    row_max_hbm[i] = -INFINITY;
    row_sum_hbm[i] = 0.f;
  }
}

/// Algorithm 1 line 8, O part: starts the asynchronous copy of rows [row0, row0 + kBlockM) of
/// the fp32 O in device memory into o_acc (rows kOAccPitch floats apart), 16 bytes (4 floats)
/// per cp.async. Rows at or past `seqlen` are zero-filled and not read. 8 consecutive threads
/// copy 128 contiguous bytes of one row, so the shared-memory writes are conflict-free.
/// store_o_m_l uses the same thread-to-chunk map. The caller commits the group.
template <class Tr>
__device__ __forceinline__ void load_o_tile_async(float* o_acc, const float* o_hbm, int row0,
                                                  int seqlen, int tid) {
  constexpr int kChunks = Tr::kHeadDim / 4;  // 16-byte chunks in one fp32 row
  constexpr int kRowsPerPass = Tr::kNumThreads / kChunks;
  static_assert(Tr::kBlockM % kRowsPerPass == 0, "the threads cover the tile in whole passes");
  const int chunk = tid % kChunks;
  const int tile_row = tid / kChunks;
  const int row = row0 + tile_row;
  float* const dst = o_acc + tile_row * Tr::kOAccPitch + chunk * 4;
  const float* src = o_hbm + static_cast<int64_t>(row) * Tr::kHeadDim + chunk * 4;
#pragma unroll 1
  for (int pass = 0; pass < Tr::kBlockM / kRowsPerPass; ++pass) {
    const bool valid = row + pass * kRowsPerPass < seqlen;
    fa::cp_async_16(dst + pass * kRowsPerPass * Tr::kOAccPitch, valid ? src : o_hbm, valid);
    src += kRowsPerPass * Tr::kHeadDim;
  }
}

/// Algorithm 1 line 8, m and \f$\ell\f$ part: loads the rows this thread holds in the
/// fragment layout (row0 + 16 mi + 8 h + group) into registers. Every warp and every lane of a
/// quad loads the same values, so all copies of row_max and row_sum agree. Rows at or past
/// `seqlen` get \f$-\infty\f$ and 0.
template <class Tr>
__device__ __forceinline__ void load_row_stats(float (&row_max)[Tr::kMTiles][2],
                                               float (&row_sum)[Tr::kMTiles][2],
                                               const float* row_max_hbm, const float* row_sum_hbm,
                                               int row0, int seqlen, int lane) {
  const int group = lane / 4;
#pragma unroll
  for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + 16 * mi + 8 * h + group;
      row_max[mi][h] = row < seqlen ? row_max_hbm[row] : -INFINITY;
      row_sum[mi][h] = row < seqlen ? row_sum_hbm[row] : 0.f;
    }
}

/// Algorithm 1 lines 12 (the write) and 13: writes O_i (o_acc, fp32) and \f$m_i\f$,
/// \f$\ell_i\f$ of rows [row0, row0 + kBlockM) back to device memory; rows at or past
/// `seqlen` are not written. Starts with a barrier, so that every warp's o_acc adds are done.
/// Every warp holds the same row_max and row_sum; warp 0 writes them.
template <class Tr>
__device__ __forceinline__ void store_o_m_l(const float* o_acc,
                                            const float (&row_max)[Tr::kMTiles][2],
                                            const float (&row_sum)[Tr::kMTiles][2], float* o_hbm,
                                            float* row_max_hbm, float* row_sum_hbm, int row0,
                                            int seqlen, int warp, int tid) {
  const int lane = tid % 32;
  const int group = lane / 4, quad = lane % 4;
  __syncthreads();  // every warp's o_acc adds are in shared memory
  if (warp == 0 && quad == 0) {
#pragma unroll
    for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row0 + 16 * mi + 8 * h + group;
        if (row < seqlen) {
          row_max_hbm[row] = row_max[mi][h];
          row_sum_hbm[row] = row_sum[mi][h];
        }
      }
  }
  constexpr int kChunks = Tr::kHeadDim / 4;  // 16-byte chunks in one fp32 row
  constexpr int kRowsPerPass = Tr::kNumThreads / kChunks;
  const int chunk = tid % kChunks;
  const int tile_row = tid / kChunks;
  const int row = row0 + tile_row;
  const float* const src = o_acc + tile_row * Tr::kOAccPitch + chunk * 4;
  float* dst = o_hbm + static_cast<int64_t>(row) * Tr::kHeadDim + chunk * 4;
#pragma unroll 1
  for (int pass = 0; pass < Tr::kBlockM / kRowsPerPass; ++pass) {
    if (row + pass * kRowsPerPass < seqlen)
      *reinterpret_cast<float4*>(dst) =
          *reinterpret_cast<const float4*>(src + pass * kRowsPerPass * Tr::kOAccPitch);
    dst += kRowsPerPass * Tr::kHeadDim;
  }
}

// ------------------------------------------------------------------------------------------
// Epilogue: O in the output dtype and L = m + log(l)
// ------------------------------------------------------------------------------------------

/// Algorithm 1 line 16, after the last K/V block, for all \f$N_q\f$ rows of (batch, head):
/// converts the fp32 O in device memory (already normalized) to T in args.o and, when
/// args.lse is not null, writes \f$L_i = c\, m_i + \ln \ell_i\f$ (natural log of the scaled
/// scores, c = args.scale). A row that saw no key (\f$\ell_i = 0\f$) has \f$O_i = 0\f$ and
/// gets \f$L_i = +\infty\f$. Each thread converts whole 16-byte chunks of the output (8
/// elements), so the global stores are coalesced. Starts with a barrier: every write-back of
/// O, m and \f$\ell\f$ is done.
template <class Tr, typename T>
__device__ __forceinline__ void store_o_and_lse(const float* o_hbm, const float* row_max_hbm,
                                                const float* row_sum_hbm, const fa_fwd_args& args,
                                                int batch, int head, int tid) {
  const int seqlen = args.seqlen_q;
  T* const o =
      static_cast<T*>(args.o.ptr) + batch * args.o.batch_stride + head * args.o.head_stride;
  float* const lse = args.lse == nullptr
                         ? nullptr
                         : args.lse + (static_cast<int64_t>(batch) * args.heads + head) * seqlen;
  __syncthreads();  // every write-back of O, m and l is done
  if (lse != nullptr) {
    for (int row = tid; row < seqlen; row += Tr::kNumThreads) {
      const float sum = row_sum_hbm[row];
      lse[row] = sum > 0.f ? row_max_hbm[row] * args.scale + logf(sum) : INFINITY;
    }
  }
  constexpr int kRowsPerPass = Tr::kNumThreads / Tr::kChunksPerRow;
  const int chunk = tid % Tr::kChunksPerRow;
  for (int row = tid / Tr::kChunksPerRow; row < seqlen; row += kRowsPerPass) {
    const float* const o_row = o_hbm + static_cast<int64_t>(row) * Tr::kHeadDim + chunk * 8;
    const float4 lo = *reinterpret_cast<const float4*>(o_row);
    const float4 hi = *reinterpret_cast<const float4*>(o_row + 4);
    uint4 packed;
    packed.x = fa::pack2<T>(lo.x, lo.y);
    packed.y = fa::pack2<T>(lo.z, lo.w);
    packed.z = fa::pack2<T>(hi.x, hi.y);
    packed.w = fa::pack2<T>(hi.z, hi.w);
    *reinterpret_cast<uint4*>(o + row * args.o.row_stride + chunk * 8) = packed;
  }
}

// ------------------------------------------------------------------------------------------
// The kernel
// ------------------------------------------------------------------------------------------

/// FlashAttention-1 forward (Algorithm 1), warps split K. One thread block per (head, batch)
/// walks the whole sequence. The outer loop over K/V blocks j loads \f$K_j\f$ and \f$V_j\f$
/// once; the inner loop over Q blocks i loads \f$Q_i\f$ and reads \f$O_i\f$, \f$m_i\f$ and
/// \f$\ell_i\f$ from device memory; each warp computes \f$S_w = Q_i K_{j,w}^T\f$ and masks
/// it; the warps exchange their row maxima and row sums through shared memory; each warp
/// updates its copy of the online softmax and adds \f$P_w V_{j,w} / \ell^{new}\f$ into the
/// shared o_acc; then \f$O_i\f$, \f$m_i\f$ and \f$\ell_i\f$ are written back. Per inner
/// iteration: wait for \f$Q_i\f$, start loading \f$O_i\f$, \f$Q K^T\f$, wait for \f$O_i\f$,
/// start loading the next Q, softmax, \f$P V\f$, write back. `scratch` holds the fp32 O of
/// every (batch, head) (\f$B H N_q d\f$ floats), then m and then \f$\ell\f$
/// (\f$B H N_q\f$ floats each).
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(Traits<kHeadDim>::kNumThreads, Traits<kHeadDim>::kMinBlocksPerSm)
    flash_forward_kernel(const fa_fwd_args args, const float scale_log2, float* const scratch) {
  using Tr = Traits<kHeadDim>;
  extern __shared__ __align__(128) char smem[];
  char* const q_tile = smem;
  char* const k_tile = smem + Tr::kQBytes;
  char* const v_tile = k_tile + Tr::kKBytes;
  float* const o_acc = reinterpret_cast<float*>(v_tile + Tr::kVBytes);
  float* const warp_max = o_acc + Tr::kBlockM * Tr::kOAccPitch;    // [kNumWarps][kBlockM]
  float* const warp_sum = warp_max + Tr::kNumWarps * Tr::kBlockM;  // [kNumWarps][kBlockM]

  // FlashAttention-1 does not split the sequence over the grid: one thread block per
  // (head, batch) runs both loops.
  const int pair = blockIdx.x;
  const int head = pair % args.heads;
  const int batch = pair / args.heads;
  const int head_kv = head / (args.heads / args.heads_kv);
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int warp_key0 = warp * Tr::kWarpKeys;  // this warp's first key in the K/V tile
  const int seqlen_q = args.seqlen_q;
  const int seqlen_k = args.seqlen_k;

  const T* const q =
      static_cast<const T*>(args.q.ptr) + batch * args.q.batch_stride + head * args.q.head_stride;
  const T* const k = static_cast<const T*>(args.k.ptr) + batch * args.k.batch_stride +
                     head_kv * args.k.head_stride;
  const T* const v = static_cast<const T*>(args.v.ptr) + batch * args.v.batch_stride +
                     head_kv * args.v.head_stride;

  // This (batch, head)'s O (fp32), m and l in device memory.
  const int64_t all_rows = static_cast<int64_t>(args.batch) * args.heads * seqlen_q;
  const int64_t first_row = (static_cast<int64_t>(batch) * args.heads + head) * seqlen_q;
  float* const o_hbm = scratch + first_row * Tr::kHeadDim;
  float* const row_max_hbm = scratch + all_rows * Tr::kHeadDim + first_row;
  float* const row_sum_hbm = row_max_hbm + all_rows;

  // Line 2: O = 0, l = 0, m = -inf in device memory (read back after the first barrier).
  init_o_m_l<Tr>(o_hbm, row_max_hbm, row_sum_hbm, seqlen_q, tid);

  const int n_q_blocks = (seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  const int n_blocks = (seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN;

  for (int kv_block = 0; kv_block < n_blocks; ++kv_block) {  // Line 5
    const int kv_start = kv_block * Tr::kBlockN;
    // Line 6: K_j and V_j, with the first Q block, in one cp.async group. No warp reads a
    // tile any more: the last write-back (store_o_m_l) started with a barrier.
    load_tile_async<Tr, Tr::kBlockN>(k_tile, k, args.k.row_stride, kv_start, seqlen_k, tid);
    load_tile_async<Tr, Tr::kBlockN>(v_tile, v, args.v.row_stride, kv_start, seqlen_k, tid);
    load_tile_async<Tr, Tr::kBlockM>(q_tile, q, args.q.row_stride, 0, seqlen_q, tid);
    fa::cp_async_commit();

    for (int q_block = 0; q_block < n_q_blocks; ++q_block) {  // Line 7
      const int q_start = q_block * Tr::kBlockM;
      fa::cp_async_wait<0>();
      __syncthreads();  // Q_i has landed; every warp is done with O_{i-1}
      // Line 8: O_i, m_i and l_i from device memory (Q_i is already on chip).
      load_o_tile_async<Tr>(o_acc, o_hbm, q_start, seqlen_q, tid);
      fa::cp_async_commit();

      // Line 9: S = Q_i K_j^T, masked.
      float s[Tr::kMTiles][Tr::kNTilesS][4];
      compute_scores<Tr, T>(s, q_tile, k_tile, warp_key0, lane);
      // Under causal masking every block is masked element by element (step 06 skips the
      // blocks above the diagonal and masks only the ones that cross it).
      const bool needs_mask = args.causal || kv_start + Tr::kBlockN > seqlen_k;
      if (needs_mask)
        apply_mask<Tr>(s, q_start + lane / 4, kv_start + warp_key0, seqlen_q, seqlen_k, args.causal,
                       lane);
      publish_row_max<Tr>(s, warp_max, warp, lane);
      float row_max[Tr::kMTiles][2];
      float row_sum[Tr::kMTiles][2];
      load_row_stats<Tr>(row_max, row_sum, row_max_hbm, row_sum_hbm, q_start, seqlen_q, lane);

      fa::cp_async_wait<0>();
      __syncthreads();  // O_i has landed; every warp is done with Q_i and published its maxima
      if (q_block + 1 < n_q_blocks) {
        load_tile_async<Tr, Tr::kBlockM>(q_tile, q, args.q.row_stride, q_start + Tr::kBlockM,
                                         seqlen_q, tid);
        fa::cp_async_commit();
      }

      // Lines 10-12: online softmax and
      // O_i = diag(l_new)^-1 (diag(l_i) e^{m_i - m_new} O_i + e^{m~ - m_new} P~ V_j).
      float o_scale[Tr::kMTiles][2];
      online_softmax<Tr>(s, row_max, row_sum, o_scale, warp_max, warp_sum, scale_log2, warp, lane);
      accumulate_pv<Tr, T>(o_acc, o_scale, s, v_tile, warp, lane);
      // Lines 12-13: write O_i, m_i and l_i back to device memory.
      store_o_m_l<Tr>(o_acc, row_max, row_sum, o_hbm, row_max_hbm, row_sum_hbm, q_start, seqlen_q,
                      warp, tid);
    }
  }

  // Line 16: O in the output dtype, and L.
  store_o_and_lse<Tr, T>(o_hbm, row_max_hbm, row_sum_hbm, args, batch, head, tid);
}

// ------------------------------------------------------------------------------------------
// Launcher
// ------------------------------------------------------------------------------------------

/// Launches the kernel for one dtype and head dimension: one thread block per (head, batch)
/// (a one-dimensional grid of \f$B H\f$ blocks; the kernel decodes head and batch), and the fp32
/// scratch for O, m and l in device memory (\f$B H N_q (d + 2)\f$ floats, allocated and freed
/// in stream order).
template <typename T, int kHeadDim>
fa_status launch(const fa_fwd_args& args, cudaStream_t stream) {
  using Tr = Traits<kHeadDim>;
  const auto kernel = flash_forward_kernel<T, kHeadDim>;
  // More than 48 KiB of dynamic shared memory must be asked for explicitly.
  if (Tr::kSmemBytes > 48 * 1024)
    FA_CUDA_TRY(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes));
  const size_t scratch_bytes =
      static_cast<size_t>(args.batch) * args.heads * args.seqlen_q * (kHeadDim + 2) * sizeof(float);
  float* scratch = nullptr;
  const cudaError_t alloc_error = cudaMallocAsync(&scratch, scratch_bytes, stream);
  if (alloc_error == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // clear it: the status below reports it
    return fa::set_error(FA_ERR_OUT_OF_MEMORY,
                         "%s keeps O (fp32), m and l in device memory: %.2f GiB for B*H*Nq = "
                         "%lld rows did not fit",
                         FA_STEP_NAME, scratch_bytes / 1073741824.0,
                         static_cast<long long>(args.batch) * args.heads * args.seqlen_q);
  }
  FA_CUDA_TRY(alloc_error);
  const dim3 grid(static_cast<unsigned>(args.batch) * args.heads);
  constexpr double kLog2e = 1.4426950408889634;
  const float scale_log2 = static_cast<float>(args.scale * kLog2e);
  kernel<<<grid, Tr::kNumThreads, Tr::kSmemBytes, stream>>>(args, scale_log2, scratch);
  const cudaError_t launch_error = cudaGetLastError();
  FA_CUDA_TRY(cudaFreeAsync(scratch, stream));  // in stream order: after the kernel
  if (launch_error != cudaSuccess)
    return fa::set_error(FA_ERR_CUDA, "%s: kernel launch failed: %s", FA_STEP_NAME,
                         cudaGetErrorString(launch_error));
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

FA_REGISTER_STEP("FlashAttention-1: tiles, online softmax, K/V outer loop, O/m/l in HBM, split-K",
                 forward, nullptr, supports_head_dim);
