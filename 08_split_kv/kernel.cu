/// \file 08_split_kv/kernel.cu
/// \brief Step 08: FlashDecoding. When the query rows cannot fill the GPU, the keys are split
/// into chunks handled by separate thread blocks, and the partial results are merged exactly
/// through their logsumexps.
///
/// What this step adds to step 06:
/// - **Split K/V.** Steps 03-06 give each thread block one Q block of one head. When a model
///   generates text, \f$N_q\f$ is 1..16 against thousands of keys: a few thread blocks, each
///   walking the whole K/V sequence, leave most SMs idle. Here the K/V blocks of a Q tile are
///   cut into `num_splits` chunks (gridDim.y), one thread block each; split s computes the
///   attention of its rows over its chunk alone, \f$O_s\f$ (normalized, fp32) and
///   \f$L_s = \log \sum_{j \in s} e^{S_{ij}}\f$, into a workspace. A second kernel merges
///   them exactly: \f$L = \log \sum_s e^{L_s}\f$ and \f$O = \sum_s e^{L_s - L} O_s\f$.
///   launch() picks num_splits from the SM count, the occupancy and the problem size; with
///   num_splits = 1 the kernel writes O and L itself, as step 06's does.
/// - **Query heads packed by K/V head.** Under grouped-query attention the H / H_kv query heads
///   of one K/V head read the same keys. With few query rows they share one tile: packed row r
///   of a tile is query position r / pack of query head r % pack, so each K/V chunk is read
///   once for the whole group.
/// - **A tile for few rows.** Decode problems (N_q <= 64, so up to 64 g packed rows per K/V
///   head) get a 64-row tile with 64-key K/V blocks (4 stages at d = 64, 2 at d = 128; the work
///   is memory-bound), and a warp whose rows are all padding skips the arithmetic.
/// - **One K/V loop for both tiles: a ring of (K, V) stages.** The decode tile needs K/V
///   blocks in flight, so K and V of a block load together into a ring of kStages stages, one
///   barrier per block. Step 06's 128-row tile runs the same loop with 2 stages instead of
///   06's FlashAttention-2 order (one K and one V stage, two barriers per block).
///
/// Everything else is step 06: the causal loop bound and diagonal-only masking, 4 warps split
/// the tile's rows, each warp's S, softmax statistics and o_acc stay in its registers, the
/// K/V tile loads overlap the two matrix products, and 06's work order (longest first, in
/// groups that fit the L2).
///
/// Run: `./build/bin/08_split_kv --seqlen-q 1 --seqlen-k 32768 --heads 32 --heads-kv 8`
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "fa/api.h"
#include "fa/check.cuh"
#include "fa/env.h"
#include "fa/mma.cuh"
#include "fa/step.h"
#include "fa/workspace.h"

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
// The tile for few query rows (DecodeTileShape): K/V rows per block and pipeline stages per
// head dimension. d = 128: the fastest of seven tiles measured on the H200 (NOTES.md).
#ifndef FA_DECODE_BLOCK_N_D64
#define FA_DECODE_BLOCK_N_D64 64
#endif
#ifndef FA_DECODE_STAGES_D64
#define FA_DECODE_STAGES_D64 4
#endif
#ifndef FA_DECODE_BLOCK_N_D128
#define FA_DECODE_BLOCK_N_D128 64
#endif
#ifndef FA_DECODE_STAGES_D128
#define FA_DECODE_STAGES_D128 2
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
  static constexpr int kBlockM = 128, kBlockN = FA_FWD_BLOCK_N_D64, kNumWarps = 4, kStages = 2;
  static constexpr bool kPackHeads = false;
};
template <>
struct TileShape<128> {
  static constexpr int kBlockM = 128, kBlockN = FA_FWD_BLOCK_N_D128, kNumWarps = 4, kStages = 2;
  static constexpr bool kPackHeads = false;
};

/// The tile for few query rows (decoding): 64 rows, 16 per warp, and kStages K/V stages in a
/// ring, so that kStages - 1 of them load while one is computed. Decode problems (N_q <= 64)
/// have up to 64 g packed rows per K/V head and do little arithmetic per key (\f$4 d\f$ FLOPs per
/// key and row): the time is the time to read K and V. At d = 128, 64 keys in 2 stages read fastest
/// of the tiles measured on the H200 (NOTES.md): half the loop iterations and barriers per
/// byte of 32-key blocks; deeper rings did not help. Shared memory: \f$(64 + 2 \cdot
/// k_{stages} B_c)\, d \cdot 2\f$ bytes, 72 KiB (d = 64: 64 keys, 4 stages) and 80 KiB
/// (d = 128: 64 keys, 2 stages): every sm_80+ GPU, two thread blocks per SM on the A100 and
/// the H100/H200.
template <int kHeadDim>
struct DecodeTileShape {
  static constexpr int kBlockM = 64, kNumWarps = 4;
  static constexpr bool kPackHeads = true;  ///< query heads of a K/V head share the tile
  static constexpr int kBlockN = kHeadDim == 64 ? FA_DECODE_BLOCK_N_D64 : FA_DECODE_BLOCK_N_D128;
  static constexpr int kStages = kHeadDim == 64 ? FA_DECODE_STAGES_D64 : FA_DECODE_STAGES_D128;
};

/// Every size the kernel derives from the tile shape, in one place.
template <int kHeadDim_, class Shape = TileShape<kHeadDim_>>
struct Traits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = Shape::kBlockM;  ///< \f$B_r\f$, Q rows
  static constexpr int kBlockN = Shape::kBlockN;  ///< \f$B_c\f$, K/V rows
  static constexpr int kNumWarps = Shape::kNumWarps;
  static constexpr int kStages = Shape::kStages;         ///< K/V tiles in the shared-memory ring
  static constexpr bool kPackHeads = Shape::kPackHeads;  ///< else one query head per tile
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
  static constexpr int kSmemBytes = kQBytes + kStages * kStageBytes;

  static_assert(kWarpRows % 16 == 0, "each warp owns whole m16 tiles");
  static_assert(kStages >= 2, "one stage is computed while the next ones load");
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

/// Starts the asynchronous copy of the packed query rows [row0, row0 + kBlockM) into the
/// swizzled Q tile. `pack` query heads share the tile: packed row r is query position
/// \f$r / pack\f$ of head \f$r \bmod pack\f$ (counted from the head `q` points at), so with
/// pack = 1 this is load_tile_async over Q. Rows at or past `rows` (= \f$N_q \cdot pack\f$)
/// are zero-filled and not read. The caller commits the group.
template <class Tr, typename T>
__device__ __forceinline__ void load_q_tile_async(char* smem_tile, const T* q, const fa_tensor& t,
                                                  int row0, int rows, int pack, int tid) {
  constexpr int kRowsPerPass = Tr::kNumThreads / Tr::kChunksPerRow;
  const int chunk = tid % Tr::kChunksPerRow;
  const int tile_row = tid / Tr::kChunksPerRow;
  char* const dst = smem_tile + swizzle<Tr::kRowBytes>(tile_row, chunk);
#pragma unroll
  for (int pass = 0; pass < Tr::kBlockM / kRowsPerPass; ++pass) {
    const int row = row0 + tile_row + pass * kRowsPerPass;
    const bool valid = row < rows;
    const T* src = q + (row / pack) * t.row_stride + (row % pack) * t.head_stride + chunk * 8;
    fa::cp_async_16(dst + pass * kRowsPerPass * Tr::kRowBytes, valid ? src : q, valid);
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
/// `q_row0` is the packed row of this thread's first row (tile row warp_row0 + group); a
/// thread holds packed rows q_row0 + 16 mi + 8 h, query positions (q_row0 + 16 mi + 8 h) /
/// pack, and keys kv_start + 8 nj + 2 quad + {0, 1}.
template <class Tr>
__device__ __forceinline__ void apply_mask(float (&s)[Tr::kMTiles][Tr::kNTilesS][4], int q_row0,
                                           int pack, int kv_start, int seqlen_q, int seqlen_k,
                                           bool causal, int lane) {
  const int first_key = kv_start + 2 * (lane & 3);
#pragma unroll
  for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = (q_row0 + 16 * mi + 8 * h) / pack;
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

/// How launch() cut the work, read by both kernels.
struct SplitKv {
  int pack;              ///< query heads packed into one tile's rows (1, or H / H_kv)
  int num_splits;        ///< chunks of the K/V sequence per tile, one thread block each
  int blocks_per_split;  ///< K/V blocks per chunk (the last chunk may have fewer)
  float* o_partial;      ///< [num_splits, pairs, rows, d] fp32 workspace (num_splits > 1)
  float* lse_partial;    ///< [num_splits, pairs, rows] fp32 workspace (num_splits > 1)
};

/// Finishes the tile of packed rows [row0, row0 + kBlockM) of (batch, heads head0 ...
/// head0 + pack - 1) when the K/V sequence was not split: reduces each row's partial row_sum
/// over its quad, writes \f$O_i = o_i / \ell_i\f$ and, when args.lse is not null,
/// \f$L_i = c\, m_i + \ln \ell_i\f$ (natural log of the scaled scores, c = args.scale).
/// A row that saw no key (\f$\ell_i = 0\f$) gets \f$O_i = 0\f$ and \f$L_i = +\infty\f$.
/// O goes through the swizzled shared tile `o_stage` (the Q tile, no longer needed) so that
/// the global stores are whole, coalesced 16-byte chunks; rows at or past \f$N_q \cdot
/// pack\f$ (a ragged last tile) are not stored. Packed row r goes to query position r / pack
/// of head head0 + r % pack.
template <class Tr, typename T>
__device__ __forceinline__ void store_o_and_lse(float (&o_acc)[Tr::kMTiles][Tr::kNTilesO][4],
                                                float (&row_max)[Tr::kMTiles][2],
                                                float (&row_sum)[Tr::kMTiles][2], char* o_stage,
                                                const fa_fwd_args& args, int batch, int head0,
                                                int pack, int row0, int warp_row0, int tid) {
  const int seqlen = args.seqlen_q;
  const int rows = seqlen * pack;
  T* const o =
      static_cast<T*>(args.o.ptr) + batch * args.o.batch_stride + head0 * args.o.head_stride;
  float* const lse = args.lse == nullptr
                         ? nullptr
                         : args.lse + (static_cast<int64_t>(batch) * args.heads + head0) * seqlen;
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
      const int row = row0 + tile_row;
      const float l = sum > 0.f ? row_max[mi][h] * args.scale + logf(sum + 1e-30f) : INFINITY;
      if (lse != nullptr && quad == 0 && row < rows) lse[(row % pack) * seqlen + row / pack] = l;
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
  const char* const src = o_stage + swizzle<Tr::kRowBytes>(tile_row, chunk);
  T* dst = o + (row0 + tile_row) * args.o.row_stride + chunk * 8;  // unpacked: row = position
#pragma unroll
  for (int pass = 0; pass < Tr::kBlockM / kRowsPerPass; ++pass) {
    const int row = row0 + tile_row + pass * kRowsPerPass;
    if (Tr::kPackHeads)
      dst = o + (row / pack) * args.o.row_stride + (row % pack) * args.o.head_stride + chunk * 8;
    if (row < rows)
      *reinterpret_cast<uint4*>(dst) =
          *reinterpret_cast<const uint4*>(src + pass * kRowsPerPass * Tr::kRowBytes);
    dst += kRowsPerPass * args.o.row_stride;
  }
}

/// Finishes one split's share of the tile: the attention of the tile's rows over this split's
/// keys alone, into the workspace, for the merge (combine_splits_kernel). Per row i it writes
/// \f$O_{s,i} = o_i / \ell_i\f$ in fp32 (normalized, as a whole attention over the chunk
/// would be) and \f$L_{s,i} = c\, m_i + \ln \ell_i\f$, the logsumexp of the chunk's scores. A
/// row that sees no key of this chunk (causal) has \f$\ell_i = 0\f$: \f$O_{s,i} = 0\f$ and
/// \f$L_{s,i} = -\infty\f$, the true log of an empty sum, so that its weight
/// \f$e^{L_{s,i} - L_i}\f$ in the merge is exactly 0 (the API's \f$+\infty\f$ for a row
/// without keys is the merge's business). No staging
/// through shared memory: the fragments are stored as they are, 8 bytes per lane, and a quad
/// writes 32 contiguous bytes.
template <class Tr>
__device__ __forceinline__ void store_partial_o_and_lse(
    float (&o_acc)[Tr::kMTiles][Tr::kNTilesO][4], float (&row_max)[Tr::kMTiles][2],
    float (&row_sum)[Tr::kMTiles][2], const SplitKv& split, const fa_fwd_args& args, int batch,
    int head0, int pack, int row0, int warp_row0, int lane) {
  // The workspace holds [num_splits, batch, head packs, rows]: this is split blockIdx.y.
  const int packs = args.heads / pack;
  const int rows = args.seqlen_q * pack;
  const int64_t first_row =
      ((static_cast<int64_t>(blockIdx.y) * args.batch + batch) * packs + head0 / pack) * rows;
  float* const o_part = split.o_partial + first_row * Tr::kHeadDim;
  float* const lse_part = split.lse_partial + first_row;
  const int group = lane / 4, quad = lane % 4;
#pragma unroll
  for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = row_sum[mi][h];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float inv_sum = sum > 0.f ? __fdividef(1.f, sum) : 0.f;  // sum >= 1 (2^0 at the max)
      const int row = row0 + warp_row0 + 16 * mi + 8 * h + group;
      if (row >= rows) continue;
      const float l = sum > 0.f ? row_max[mi][h] * args.scale + logf(sum + 1e-30f) : -INFINITY;
      if (quad == 0) lse_part[row] = l;
      float* const o_row = o_part + static_cast<int64_t>(row) * Tr::kHeadDim + 2 * quad;
#pragma unroll
      for (int nd = 0; nd < Tr::kNTilesO; ++nd)
        *reinterpret_cast<float2*>(o_row + 8 * nd) =
            make_float2(o_acc[mi][nd][2 * h] * inv_sum, o_acc[mi][nd][2 * h + 1] * inv_sum);
    }
}

// ------------------------------------------------------------------------------------------
// The kernel
// ------------------------------------------------------------------------------------------

/// FlashAttention-2 forward, warps split Q, keys split across thread blocks. One thread block
/// per (Q tile, head pack, batch) and K/V chunk (blockIdx.y): the tile holds split.pack query
/// heads' rows (packed row r is query position r / pack of head head0 + r % pack) and walks
/// the K/V blocks of chunk blockIdx.y only; warp w owns tile rows [kWarpRows w, kWarpRows
/// (w + 1)). Per K/V block j, each warp computes \f$S = Q_w K_j^T\f$, masks, updates its
/// online softmax and \f$O_w \mathrel{+}= P V_j\f$, all in registers; a warp whose rows are
/// all padding only helps load. K and V have kStages shared-memory stages in a ring: at the
/// top of block j (one barrier) the thread block starts loading block j + kStages - 1 into the
/// stage that block j - 1 just left, and it lands while blocks j ... j + kStages - 2 are
/// computed. Unsplit (kSplit false: one chunk, all the keys, step 06's grid) the tile writes
/// O and L (store_o_and_lse); split, each thread block writes its chunk's partial result
/// (store_partial_o_and_lse) for combine_splits_kernel. `group_pairs` and `tail_rows` set the
/// order of the thread blocks (see launch()).
template <typename T, class Tr, bool kSplit>
__global__ void __launch_bounds__(Tr::kNumThreads)
    flash_forward_kernel(const fa_fwd_args args, const float scale_log2, const int group_pairs,
                         const int tail_rows, const SplitKv split) {
  extern __shared__ __align__(128) char smem[];
  char* const q_tile = smem;
  char* const kv_stages = smem + Tr::kQBytes;  // stage s: K tile, then V tile

  // Which (q_block, head pack, batch) this thread block computes, in the order launch()
  // explains, and which chunk of the K/V sequence.
  const int pack = Tr::kPackHeads ? split.pack : 1;  // a compile-time 1 for step 06's tile
  const int packs = args.heads / pack;               // head packs per batch
  const int packed_rows = args.seqlen_q * pack;      // query rows per (batch, head pack)
  const int num_q_blocks = (packed_rows + Tr::kBlockM - 1) / Tr::kBlockM;
  const int num_pairs = args.batch * packs;
  const int tail_start = (num_q_blocks - tail_rows) * num_pairs;  // then Q blocks [0, tail_rows)
  const bool tail = blockIdx.x >= tail_start;                     // of all pairs in one group
  const int idx = blockIdx.x - (tail ? tail_start : 0), gp = tail ? num_pairs : group_pairs;
  const int rows = tail ? tail_rows : num_q_blocks - tail_rows;  // Q blocks of a pair in a group
  const int group = idx / (gp * rows);
  const int in_group = idx - group * gp * rows;
  const int pairs_in_group = min(gp, num_pairs - group * gp);
  const int q_block = (tail ? tail_rows : num_q_blocks) - 1 - in_group / pairs_in_group;
  const int pair = group * gp + in_group % pairs_in_group;
  const int head0 = (pair % packs) * pack;  // the tile's first query head
  const int batch = pair / packs;
  const int head_kv = head0 / (args.heads / args.heads_kv);
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp_row0 = (tid / 32) * Tr::kWarpRows;  // this warp's first row in the Q tile
  const int seqlen_q = args.seqlen_q;
  const int seqlen_k = args.seqlen_k;
  const int q_start = q_block * Tr::kBlockM;  // the tile's first packed row

  const T* const q =
      static_cast<const T*>(args.q.ptr) + batch * args.q.batch_stride + head0 * args.q.head_stride;
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
  const int first_masked_key = q_start / pack + seqlen_k - seqlen_q + 1;  // first row's key_end
  if (args.causal) {
    const int last_key = (min(q_start + Tr::kBlockM, packed_rows) - 1) / pack + seqlen_k - seqlen_q;
    n_blocks = min(n_blocks, (last_key + Tr::kBlockN) / Tr::kBlockN);  // <= 0: no key
  }
  // This thread block's chunk of the K/V blocks: [kv_begin, kv_end), all of them unsplit.
  const int kv_begin = kSplit ? blockIdx.y * split.blocks_per_split : 0;
  const int kv_end = kSplit ? min(n_blocks, kv_begin + split.blocks_per_split) : n_blocks;
  if (kv_end <= kv_begin) {  // sees no key of its chunk: O = 0, L = +inf (-inf for a split)
    if constexpr (kSplit)
      store_partial_o_and_lse<Tr>(o_acc, row_max, row_sum, split, args, batch, head0, pack, q_start,
                                  warp_row0, lane);
    else
      store_o_and_lse<Tr, T>(o_acc, row_max, row_sum, q_tile, args, batch, head0, pack, q_start,
                             warp_row0, tid);
    return;
  }

  // Prologue: Q with the chunk's first K/V block in one cp.async group, then the next
  // kStages - 2 blocks one group each (a group may be empty: every thread always commits the
  // same number of groups, which cp_async_wait counts).
  load_q_tile_async<Tr>(q_tile, q, args.q, q_start, packed_rows, pack, tid);
#pragma unroll
  for (int stage = 0; stage < Tr::kStages - 1; ++stage) {
    const int kv_block = kv_begin + stage;
    if (kv_block < kv_end) {
      char* const dst = kv_stages + (kv_block % Tr::kStages) * Tr::kStageBytes;
      load_tile_async<Tr, Tr::kBlockN>(dst, k, args.k.row_stride, kv_block * Tr::kBlockN, seqlen_k,
                                       tid);
      load_tile_async<Tr, Tr::kBlockN>(dst + Tr::kKBytes, v, args.v.row_stride,
                                       kv_block * Tr::kBlockN, seqlen_k, tid);
    }
    fa::cp_async_commit();
  }
  // In the tile for few rows, a warp whose rows are all padding needs no arithmetic.
  const bool warp_idle = Tr::kPackHeads && q_start + warp_row0 >= packed_rows;

  for (int kv_block = kv_begin; kv_block < kv_end; ++kv_block) {
    const int kv_start = kv_block * Tr::kBlockN;
    const char* const k_tile = kv_stages + (kv_block % Tr::kStages) * Tr::kStageBytes;
    const char* const v_tile = k_tile + Tr::kKBytes;
    fa::cp_async_wait<Tr::kStages - 2>();
    __syncthreads();  // K_j and V_j have landed; every warp is done with block j - 1's stage
    const int next_block = kv_block + Tr::kStages - 1;
    if (next_block < kv_end) {  // K and V of block j + kStages - 1 into that stage
      char* const next = kv_stages + (next_block % Tr::kStages) * Tr::kStageBytes;
      // (counted from kv_start, as step 06 counts K_{j+1})
      const int next_start = kv_start + (Tr::kStages - 1) * Tr::kBlockN;
      load_tile_async<Tr, Tr::kBlockN>(next, k, args.k.row_stride, next_start, seqlen_k, tid);
      load_tile_async<Tr, Tr::kBlockN>(next + Tr::kKBytes, v, args.v.row_stride, next_start,
                                       seqlen_k, tid);
    }
    fa::cp_async_commit();
    if (warp_idle) continue;

    float s[Tr::kMTiles][Tr::kNTilesS][4];
    compute_scores<Tr, T>(s, q_tile, k_tile, warp_row0, lane);
    // Only the blocks that cross the diagonal (some key past the first row's key_end) and
    // the ragged last block need the mask; all others take the mask-free path.
    const bool needs_mask = (args.causal && kv_start + Tr::kBlockN > first_masked_key) ||
                            kv_start + Tr::kBlockN > seqlen_k;
    if (needs_mask)
      apply_mask<Tr>(s, q_start + warp_row0 + lane / 4, pack, kv_start, seqlen_q, seqlen_k,
                     args.causal, lane);

    online_softmax<Tr>(s, row_max, row_sum, o_acc, scale_log2);
    accumulate_pv<Tr, T>(o_acc, s, v_tile, lane);
  }

  if constexpr (kSplit)
    store_partial_o_and_lse<Tr>(o_acc, row_max, row_sum, split, args, batch, head0, pack, q_start,
                                warp_row0, lane);
  else
    store_o_and_lse<Tr, T>(o_acc, row_max, row_sum, q_tile, args, batch, head0, pack, q_start,
                           warp_row0, tid);
}

// ------------------------------------------------------------------------------------------
// The merge of the splits
// ------------------------------------------------------------------------------------------

constexpr int kMaxSplits = 256;   ///< splits per Q tile at most
constexpr int kCombineWarps = 4;  ///< warps of the merge's thread block, which merges one row

/// Merges the splits' partial results of one packed query row per thread block. With
/// \f$L_s\f$ and \f$O_s\f$ the logsumexp and the (normalized) output of split s for this row,
/// \f[ L = \log \sum_s e^{L_s}, \qquad O = \sum_s e^{L_s - L}\, O_s \f]
/// is exact: \f$e^{L_s} O_s = \sum_{j \in s} e^{S_j} V_j\f$, so the sum over the splits is
/// \f$\sum_j e^{S_j} V_j = e^L O\f$. The sum is taken after subtracting
/// \f$m = \max_s L_s\f$, so no exponential overflows; a split without visible keys has
/// \f$L_s = -\infty\f$ and weight 0. A row whose splits are all empty (causal, \f$N_q > N_k\f$)
/// gets the API's \f$O = 0\f$, \f$L = +\infty\f$.
///
/// What costs time here is waiting for memory: each \f$O_s\f$ is d floats of the workspace
/// (512 bytes at d = 128, just written, in L2), and a warp that read the splits one after the
/// other would wait one memory latency (about half a microsecond) per split, about as long as
/// the split kernel itself at 32 splits of a short sequence. So warp w takes splits w,
/// w + kCombineWarps, ... and issues the reads of kInFlight of them before it uses any; the
/// lanes of a warp read d / 32 consecutive floats each (one coalesced line per split); the
/// warps' sums meet in shared memory, added in a fixed order (the result does not depend on
/// timing).
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(32 * kCombineWarps)
    combine_splits_kernel(const fa_fwd_args args, const SplitKv split) {
  constexpr int kCols = kHeadDim / 32;               // columns per lane
  __shared__ float lse_split[kMaxSplits];            // L_s of this row
  __shared__ float o_warp[kCombineWarps][kHeadDim];  // each warp's share of O
  const int pack = split.pack;
  const int packs = args.heads / pack;
  const int rows = args.seqlen_q * pack;
  const int64_t num_rows = static_cast<int64_t>(args.batch) * packs * rows;  // per split
  const int64_t row_id = blockIdx.x;
  const int num_splits = split.num_splits;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int s = threadIdx.x; s < num_splits; s += 32 * kCombineWarps)
    lse_split[s] = split.lse_partial[s * num_rows + row_id];
  __syncthreads();

  float m = -INFINITY;  // every warp computes L
  for (int s = lane; s < num_splits; s += 32) m = fmaxf(m, lse_split[s]);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  float sum = 0.f;
  if (m != -INFINITY)
    for (int s = lane; s < num_splits; s += 32) sum += expf(lse_split[s] - m);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  const float lse = m == -INFINITY ? -INFINITY : m + logf(sum);

  // This warp's splits, kInFlight at a time: all their reads first, then the sums.
  constexpr int kInFlight = 4;
  float o[kCols] = {};
  if (lse != -INFINITY)
    for (int s0 = warp; s0 < num_splits; s0 += kInFlight * kCombineWarps) {
      float part[kInFlight][kCols];
#pragma unroll
      for (int b = 0; b < kInFlight; ++b) {
        const int s = s0 + b * kCombineWarps;
        const float* const o_s =
            split.o_partial + (s * num_rows + row_id) * kHeadDim + lane * kCols;
        if constexpr (kCols == 4) {
          const float4 x = s < num_splits ? *reinterpret_cast<const float4*>(o_s) : float4{};
          part[b][0] = x.x, part[b][1] = x.y, part[b][2] = x.z, part[b][3] = x.w;
        } else {
          static_assert(kCols == 2, "d = 64 or 128");
          const float2 x = s < num_splits ? *reinterpret_cast<const float2*>(o_s) : float2{};
          part[b][0] = x.x, part[b][1] = x.y;
        }
      }
#pragma unroll
      for (int b = 0; b < kInFlight; ++b) {
        const int s = s0 + b * kCombineWarps;
        const float weight = s < num_splits ? expf(lse_split[s] - lse) : 0.f;  // 0: empty split
#pragma unroll
        for (int c = 0; c < kCols; ++c) o[c] = fmaf(weight, part[b][c], o[c]);
      }
    }
#pragma unroll
  for (int c = 0; c < kCols; ++c) o_warp[warp][lane * kCols + c] = o[c];
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    o[c] = o_warp[0][lane * kCols + c];
#pragma unroll
    for (int w = 1; w < kCombineWarps; ++w) o[c] += o_warp[w][lane * kCols + c];
  }

  // Where the row lives: packed row r of (batch, head pack) is position r / pack of head
  // head0 + r % pack.
  const int r = static_cast<int>(row_id % rows);
  const int pair = static_cast<int>(row_id / rows);
  const int batch = pair / packs;
  const int head = (pair % packs) * pack + r % pack;
  const int i = r / pack;
  T* const out = static_cast<T*>(args.o.ptr) + batch * args.o.batch_stride + i * args.o.row_stride +
                 head * args.o.head_stride + lane * kCols;
  if constexpr (kCols == 4)
    *reinterpret_cast<uint2*>(out) = make_uint2(fa::pack2<T>(o[0], o[1]), fa::pack2<T>(o[2], o[3]));
  else
    *reinterpret_cast<uint32_t*>(out) = fa::pack2<T>(o[0], o[1]);
  if (args.lse != nullptr && lane == 0)
    args.lse[(static_cast<int64_t>(batch) * args.heads + head) * args.seqlen_q + i] =
        lse == -INFINITY ? INFINITY : lse;
}

// ------------------------------------------------------------------------------------------
// Launcher
// ------------------------------------------------------------------------------------------

/// What launch() needs to know about one kernel on one device: SMs and resident thread blocks
/// per SM. Asked once per (device, kernel) and kept, together with the opt-in to more than
/// 48 KiB of dynamic shared memory, so that a launch costs no CUDA queries beyond
/// cudaGetDevice (decode launches are a few microseconds of GPU work). Thread-safe.
struct KernelFacts {
  int num_sms = 0;        ///< streaming multiprocessors of the device
  int blocks_per_sm = 0;  ///< resident thread blocks of the kernel per SM
  int l2_bytes = 0;       ///< bytes of the device's L2 cache
};

/// The facts of `kernel` (launched with `threads` threads and `smem_bytes` bytes of dynamic
/// shared memory) on the current device; the first call per device sets the kernel up.
fa_status kernel_facts(const void* kernel, int threads, int smem_bytes, KernelFacts* facts) {
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, KernelFacts> cache;
  int device = 0;
  FA_CUDA_TRY(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = cache.find({device, kernel});
  if (it != cache.end()) {
    *facts = it->second;
    return FA_OK;
  }
  KernelFacts f;
  // More than 48 KiB of dynamic shared memory must be asked for explicitly.
  if (smem_bytes > 48 * 1024)
    FA_CUDA_TRY(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  FA_CUDA_TRY(cudaDeviceGetAttribute(&f.num_sms, cudaDevAttrMultiProcessorCount, device));
  FA_CUDA_TRY(cudaDeviceGetAttribute(&f.l2_bytes, cudaDevAttrL2CacheSize, device));
  FA_CUDA_TRY(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&f.blocks_per_sm, kernel, threads, smem_bytes));
  cache.emplace(std::make_pair(device, kernel), f);
  *facts = f;
  return FA_OK;
}

/// How many chunks to split the K/V sequence of every Q tile into, for `tiles` thread blocks
/// of whole sequences, `resident` thread blocks that the GPU runs at once (SMs x occupancy)
/// and `n_blocks` K/V blocks per sequence. When the tiles alone fill every resident slot the
/// answer is 1: the grid is step 06's. Otherwise the tiles are multiplied as far as one full
/// wave goes, \f$\lfloor resident / tiles \rfloor\f$ splits (at most one per K/V block and
/// kMaxSplits): every SM gets its share of thread blocks, each walks 1/s of the keys, and no
/// second, partial wave of thread blocks runs after the first. Decoding with 8 tiles on 264
/// resident slots, for example, gives 33 splits (launch() then evens them out to 32 of 16
/// blocks each for 512 K/V blocks): 256 thread blocks instead of 8, 32 times fewer blocks
/// each.
int choose_num_splits(int64_t tiles, int64_t resident, int n_blocks) {
  if (tiles >= resident) return 1;
  return static_cast<int>(std::min<int64_t>({resident / tiles, n_blocks, kMaxSplits}));
}

/// The number of K/V chunks per Q tile for this call: `FA_NUM_SPLITS` when it is set (1 to
/// kMaxSplits, at most one chunk per K/V block; a knob for measuring the choice, see the lab),
/// else choose_num_splits(). An invalid value is an error, not a silent default.
fa_status num_splits_for(int64_t tiles, int64_t resident, int n_blocks, int* num_splits) {
  long long forced = 0;
  std::string error;
  const fa::EnvStatus st = fa::env_int("FA_NUM_SPLITS", 1, kMaxSplits, &forced, &error);
  if (st == fa::EnvStatus::kInvalid)
    return fa::set_error(FA_ERR_INVALID_ARGUMENT, "%s: %s", FA_STEP_NAME, error.c_str());
  if (st == fa::EnvStatus::kOk) {
    *num_splits = static_cast<int>(std::min<long long>(forced, n_blocks));
    return FA_OK;
  }
  *num_splits = choose_num_splits(tiles, resident, n_blocks);
  return FA_OK;
}

/// Launches the kernels for one dtype, head dimension and tile shape, with `pack` query heads
/// in one tile's rows: one thread block per (Q tile, head pack, batch) and K/V chunk, in a
/// grid whose x order the kernel decodes and whose y is the chunk; then, if the keys were
/// split, the merge. The (batch, head pack) pairs are taken in groups; inside a group the
/// thread blocks start with the last Q block of every pair, then the one before it, and so on.
/// Under causal masking the last Q blocks do the most work, so the longest thread blocks start
/// first and the short ones fill the tail of the grid. A group holds at least 4 waves of
/// resident thread blocks, enough for that order to balance the SMs, and no more pairs than
/// that, so that the thread blocks that read the same K and V run at the same time and share
/// them in L2. Without causal masking every thread block has the same work and a group is one
/// pair: one head's Q blocks run together.
/// Where a group's K and V overflow the L2 and fewer than 4 Q blocks of a pair are resident at
/// once (step 06's README.md), a group holds only the pairs whose K and V fit in half the L2, and
/// the first `tail_rows` Q blocks of every pair (2 waves or more) run last, in one group.
template <typename T, int kHeadDim, class Shape>
fa_status launch(const fa_fwd_args& args, int pack, cudaStream_t stream) {
  using Tr = Traits<kHeadDim, Shape>;
  KernelFacts facts;  // the unsplit kernel's; the split one has the same shared memory
  if (const fa_status st =
          kernel_facts(reinterpret_cast<const void*>(flash_forward_kernel<T, Tr, false>),
                       Tr::kNumThreads, Tr::kSmemBytes, &facts);
      st != FA_OK)
    return st;
  const int64_t rows = static_cast<int64_t>(args.seqlen_q) * pack;
  const int64_t num_q_blocks = (rows + Tr::kBlockM - 1) / Tr::kBlockM;
  const int64_t num_pairs = static_cast<int64_t>(args.batch) * (args.heads / pack);
  if (num_q_blocks * num_pairs > INT32_MAX)
    return fa::set_error(FA_ERR_UNSUPPORTED, "%s: more than 2^31 - 1 thread blocks", FA_STEP_NAME);
  const int64_t resident = static_cast<int64_t>(facts.num_sms) * std::max(facts.blocks_per_sm, 1);
  int64_t group_pairs = 1, tail_rows = 0;
  if (args.causal) {
    const int64_t num_groups = std::max<int64_t>(1, num_q_blocks * num_pairs / (4 * resident));
    group_pairs = (num_pairs + num_groups - 1) / num_groups;
    const int64_t kv_bytes = int64_t{4} * args.seqlen_k * args.head_dim;  // K and V of a pair
    if (4 * group_pairs > resident && group_pairs * kv_bytes > facts.l2_bytes) {
      tail_rows = std::min(num_q_blocks, (2 * resident + num_pairs - 1) / num_pairs);
      group_pairs = std::max<int64_t>(1, std::min(group_pairs, facts.l2_bytes / (2 * kv_bytes)));
    }
  }
  // The split of the keys: as many chunks as fill the GPU (choose_num_splits), each a whole
  // number of K/V blocks, none empty.
  const int n_blocks = static_cast<int>((args.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN);
  SplitKv split{pack, 1, 0, nullptr, nullptr};
  if (const fa_status st =
          num_splits_for(num_q_blocks * num_pairs, resident, n_blocks, &split.num_splits);
      st != FA_OK)
    return st;
  split.blocks_per_split = (n_blocks + split.num_splits - 1) / split.num_splits;
  split.num_splits = (n_blocks + split.blocks_per_split - 1) / split.blocks_per_split;
  constexpr double kLog2e = 1.4426950408889634;
  const float scale_log2 = static_cast<float>(args.scale * kLog2e);
  const dim3 grid(static_cast<unsigned>(num_q_blocks * num_pairs), split.num_splits);
  if (split.num_splits == 1) {  // step 06's grid and kernel: the tile writes O and L
    flash_forward_kernel<T, Tr, false><<<grid, Tr::kNumThreads, Tr::kSmemBytes, stream>>>(
        args, scale_log2, static_cast<int>(group_pairs), static_cast<int>(tail_rows), split);
    FA_LAUNCH_TRY();
  } else {  // the chunks write partial results, then the merge writes O and L
    const auto kernel = flash_forward_kernel<T, Tr, true>;
    KernelFacts split_facts;  // (asked once: it also opts the kernel into its shared memory)
    if (const fa_status st = kernel_facts(reinterpret_cast<const void*>(kernel), Tr::kNumThreads,
                                          Tr::kSmemBytes, &split_facts);
        st != FA_OK)
      return st;
    const int64_t merged_rows = num_pairs * rows;  // one thread block each in the merge
    if (merged_rows > INT32_MAX)
      return fa::set_error(FA_ERR_UNSUPPORTED, "%s: more than 2^31 - 1 query rows to merge",
                           FA_STEP_NAME);
    const size_t partial_rows = static_cast<size_t>(split.num_splits) * num_pairs * rows;
    // The stream's buffer, kept between calls (fa/workspace.h): a decode call's kernels take
    // less time than an allocation would.
    const size_t bytes = partial_rows * (kHeadDim + 1) * sizeof(float);
    void* workspace = nullptr;
    const cudaError_t alloc = fa::workspace(bytes, stream, &workspace);
    if (alloc == cudaErrorMemoryAllocation)
      return fa::set_error(FA_ERR_OUT_OF_MEMORY,
                           "%s: cannot allocate the %zu-byte workspace of the K/V splits",
                           FA_STEP_NAME, bytes);
    FA_CUDA_TRY(alloc);
    split.o_partial = static_cast<float*>(workspace);
    split.lse_partial = split.o_partial + partial_rows * kHeadDim;
    kernel<<<grid, Tr::kNumThreads, Tr::kSmemBytes, stream>>>(
        args, scale_log2, static_cast<int>(group_pairs), static_cast<int>(tail_rows), split);
    FA_LAUNCH_TRY();
    combine_splits_kernel<T, kHeadDim>
        <<<static_cast<unsigned>(merged_rows), 32 * kCombineWarps, 0, stream>>>(args, split);
    FA_LAUNCH_TRY();
  }
  return FA_OK;
}

/// The step's forward pass: picks the kernel for the dtype and head dimension, and the tile.
/// Few query rows (decoding) pack the query heads of each K/V head into one tile and take the
/// 64-row decode tile, when that computes at most half the rows, padding included, that step
/// 06's 128-row tile would: \f$2 H_{kv} \lceil N_q g / 64 \rceil 64 \le H \lceil N_q / 128
/// \rceil 128\f$ with \f$g = H / H_{kv}\f$ (for g = 1, \f$N_q \le 64\f$). Everything else, the
/// paper's training shapes included, runs step 06's tile unpacked.
template <typename T, int kHeadDim>
fa_status forward_tile(const fa_fwd_args& args, cudaStream_t stream) {
  using Decode = DecodeTileShape<kHeadDim>;
  const int64_t group = args.heads / args.heads_kv;
  const int64_t decode_rows = args.heads_kv * ((args.seqlen_q * group + Decode::kBlockM - 1) /
                                               Decode::kBlockM * Decode::kBlockM);
  const int64_t full_rows = static_cast<int64_t>(args.heads) *
                            ((args.seqlen_q + TileShape<kHeadDim>::kBlockM - 1) /
                             TileShape<kHeadDim>::kBlockM * TileShape<kHeadDim>::kBlockM);
  if (2 * decode_rows <= full_rows) {
    return launch<T, kHeadDim, Decode>(args, static_cast<int>(group), stream);
  }
  return launch<T, kHeadDim, TileShape<kHeadDim>>(args, 1, stream);
}

/// The step's forward pass: picks the kernel for the dtype and head dimension.
fa_status forward(const fa_fwd_args& args, cudaStream_t stream) {
  const bool bf16 = args.dtype == FA_BF16;
  switch (args.head_dim) {
    case 64:
      return bf16 ? forward_tile<__nv_bfloat16, 64>(args, stream)
                  : forward_tile<__half, 64>(args, stream);
    case 128:
      return bf16 ? forward_tile<__nv_bfloat16, 128>(args, stream)
                  : forward_tile<__half, 128>(args, stream);
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

FA_REGISTER_STEP("FlashDecoding: keys split across thread blocks when queries are few, exact merge",
                 forward, nullptr, supports_head_dim);
