/// \file 10_hopper_pingpong/kernel.cu
/// \brief Step 10: step 09 with its consumer warpgroups taking turns at the tensor cores
/// (pingpong), and inside a warpgroup the next \f$Q K^T\f$ issued before the current
/// \f$P V\f$ (FlashAttention-3, sec. 3.1 and 3.2).
///
/// What this step changes against step 09 (everything else is step 09: TMA, wgmma, the
/// producer warpgroup, the K/V ring, the persistent grid, the online softmax, the work order,
/// the epilogue):
/// - Pingpong between warpgroups. In step 09 the consumer warpgroups wait for the same K/V
///   block, issue their matrix products at the same moment, then run their softmax at the
///   same moment: the tensor cores idle while the exponentials run, and the other way round.
///   Here named barriers hand a "turn" round: a warpgroup issues its wgmma only in its turn
///   and passes the turn on right after issuing them, so that one warpgroup's products run
///   while the other (two, at d = 64) compute their softmax.
/// - Overlap inside a warpgroup. Per turn a warpgroup issues \f$S_{j} = Q K_{j}^T\f$ and then
///   \f$O \mathrel{+}= P_{j-1} V_{j-1}\f$, waits only for \f$S_j\f$, and computes the softmax
///   of block j while \f$P_{j-1} V_{j-1}\f$ still runs (its exponentials come before the branch
///   that makes the rescale factors, which keeps them ahead of the second wait in the machine
///   code: README.md, "Overlap inside a warpgroup"). The rescale of
///   o_acc by the new row max therefore moves out of the softmax (online_softmax() returns the
///   factors) to after the wait for \f$P_{j-1} V_{j-1}\f$ (rescale_o()). Block 0's \f$Q K^T\f$ runs
///   before the loop and the last block's \f$P V\f$ after it.
/// - A consumer with no row to compute. The last Q block of a head can have a consumer whose
///   64 rows all lie past \f$N_q\f$ (at d = 64 the 192-row Q block pads N = 1024 to 1152 rows:
///   two of its three consumers). That consumer still takes its turns and makes its barrier
///   arrivals, but issues nothing, so the others have the tensor cores in its turns
///   (README.md, "A consumer with no row to compute", measured with and without it).
///
/// Built for sm_90a only (wgmma and setmaxnreg exist nowhere else): the API reports the step
/// as needing an sm_90 GPU on any other device.
///
/// Run: `./build/bin/10_hopper_pingpong --seqlen 4096 --head-dim 128 --causal` (H100 / H200)
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "fa/api.h"
#include "fa/check.cuh"
#include "fa/env.h"
#include "fa/hopper.cuh"
#include "fa/step.h"
#include "fa/workspace.h"

namespace {

// ------------------------------------------------------------------------------------------
// Tile configuration
// ------------------------------------------------------------------------------------------

/// Tile shape per head dimension: \f$B_r\f$ (kBlockM) query rows, 64 per consumer warpgroup
/// (the M of one wgmma), \f$B_c\f$ (kBlockN) key rows, and kStages K/V buffers. At d = 128 a
/// K/V block is 2048 cycles of tensor-core work for 128 rows and 1024 cycles of exponentials
/// (16 per cycle and SM). At d = 64 the products take half as long and the exponentials as
/// long as before: a third consumer (192 rows, as FlashAttention-3) gives the K/V block 1.5x
/// the rows to amortize its loads, barriers and waits over, and the SM a third warpgroup to
/// run while two wait. Shared memory: two Q tiles, the O staging tile and kStages K and V
/// tiles, \f$(3 B_r + 2 \cdot kStages \cdot B_c)\, d \cdot 2\f$ bytes: 136 KiB (d = 64) and
/// 224 KiB (d = 128), one thread block per SM.
template <int kHeadDim>
struct TileShape;
template <>
struct TileShape<64> {
  static constexpr int kBlockM = 192, kBlockN = 128, kStages = 2;
};
template <>
struct TileShape<128> {
  static constexpr int kBlockM = 128, kBlockN = 128, kStages = 2;
};

/// Every size the kernel derives from the tile shape, in one place.
template <int kHeadDim_, int kBlockM_ = TileShape<kHeadDim_>::kBlockM,
          int kBlockN_ = TileShape<kHeadDim_>::kBlockN>
struct Traits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;                       ///< \f$B_r\f$, Q rows
  static constexpr int kBlockN = kBlockN_;                       ///< \f$B_c\f$, K/V rows
  static constexpr int kStages = TileShape<kHeadDim>::kStages;   ///< K/V buffers in the ring
  static constexpr int kConsumerRows = 64;                       ///< Q rows of one warpgroup
  static constexpr int kNumConsumers = kBlockM / kConsumerRows;  ///< consumer warpgroups
  static constexpr int kNumThreads = 128 * (1 + kNumConsumers);  ///< + the producer warpgroup
  static constexpr int kNumConsumerWarps = 4 * kNumConsumers;    ///< arrivals on "empty"
  static constexpr int kMTiles = 1;                              ///< m16 tiles per warp (16 rows)
  static constexpr int kNTilesS = kBlockN / 8;                   ///< n8 tiles of S (keys)
  static constexpr int kNTilesO = kHeadDim / 8;                  ///< n8 tiles of O (head dim)
  static constexpr int kPanelBytes = 128;                        ///< one swizzled row of a panel
  static constexpr int kPanelCols = kPanelBytes / 2;             ///< 64 columns of 2-byte types
  static constexpr int kPanels = kHeadDim / kPanelCols;          ///< panels side by side in a tile
  static constexpr int kQBuffers = 2;  ///< the next tile's Q lands while this one's is read
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kOBytes = kBlockM * kHeadDim * 2;
  static constexpr int kKBytes = kBlockN * kHeadDim * 2;
  static constexpr int kVBytes = kBlockN * kHeadDim * 2;
  static constexpr int kTileBytes = kQBuffers * kQBytes + kOBytes + kStages * (kKBytes + kVBytes);
  /// Registers per thread at launch: `__launch_bounds__(kNumThreads, 1)` lets ptxas give each
  /// thread the 64K-register file's share, rounded down to a multiple of 8 (168 for 384
  /// threads, 128 for 512). They are the thread block's pool: `setmaxnreg` moves registers
  /// between its warpgroups and never takes more (a request beyond the pool waits forever).
  static constexpr int kLaunchRegs = 65536 / kNumThreads / 8 * 8;
  /// Registers per producer thread (the tile loop needs more than 24), and per consumer
  /// thread what the pool leaves (a multiple of 8): 232 with two consumers, 160 with three.
  static constexpr int kProducerRegs = 32;
  static constexpr int kConsumerRegs =
      std::min(240, ((1 + kNumConsumers) * kLaunchRegs - kProducerRegs) / kNumConsumers / 8 * 8);

  static_assert(kBlockM % kConsumerRows == 0 && kNumConsumers >= 2 && kNumConsumers <= 3,
                "two or three consumer warpgroups of 64 rows (the M of one wgmma)");
  static_assert(kMTiles * 16 * 4 == kConsumerRows, "a warp holds 16 rows of the accumulator");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "k16 steps of P V; one wgmma for S");
  static_assert(kHeadDim % kPanelCols == 0, "whole 128-byte panels");
  static_assert(kProducerRegs + kNumConsumers * kConsumerRegs <= (1 + kNumConsumers) * kLaunchRegs,
                "setmaxnreg stays within the registers the thread block was launched with");
};

/// What the thread block's warpgroups share besides the tiles: the barriers, and the tile the
/// producer announced. Each barrier completes one phase per use, and a wait names the parity
/// of the phase it waits for. The K/V blocks are counted over the whole life of the thread
/// block, across tiles: buffer s holds blocks i = s, s + kStages, s + 2 kStages, ..., so block
/// i is phase i / kStages of its barriers, parity (i / kStages) & 1; the t-th tile of the
/// thread block uses Q buffer t % 2 and is phase t / 2 of its q_full and q_empty.
template <class Tr>
struct SharedState {
  uint64_t q_full[Tr::kQBuffers];   ///< `tile` is announced and its Q has landed
  uint64_t q_empty[Tr::kQBuffers];  ///< every consumer warp is done reading the buffer's Q
  uint64_t k_full[Tr::kStages];     ///< K has landed in the buffer
  uint64_t v_full[Tr::kStages];     ///< V has landed in the buffer
  uint64_t k_empty[Tr::kStages];    ///< every consumer warp is done reading K
  uint64_t v_empty[Tr::kStages];    ///< every consumer warp is done reading V
  int tile[Tr::kQBuffers];          ///< the tile of the Q buffer (>= num_tiles: none left)
};

/// Shared memory asked for: the tiles, the shared state and slack to align the tiles to 1024.
template <class Tr>
constexpr int smem_bytes() {
  constexpr int bytes = Tr::kTileBytes + static_cast<int>(sizeof(SharedState<Tr>)) + 1024;
  static_assert(bytes <= 227 * 1024, "an H100/H200 thread block has at most 227 KiB");
  return bytes;
}

// ------------------------------------------------------------------------------------------
// Shared memory: tiles in 128-byte swizzled panels (the layout of the TMA and of wgmma)
// ------------------------------------------------------------------------------------------

/// Byte offset of columns [8 chunk, 8 chunk + 8) of row `row` in a tile of `kRows` rows: the
/// tile is kPanels panels of kRows x 128 bytes side by side, and in each panel the 16-byte
/// chunk index is XORed with \f$row \bmod 8\f$ (the TMA's CU_TENSOR_MAP_SWIZZLE_128B). The 8
/// rows that a warp touches at the same column land in 8 different bank groups.
template <class Tr, int kRows>
__device__ __forceinline__ uint32_t swizzle(int row, int chunk) {
  return (chunk / 8) * kRows * Tr::kPanelBytes + row * Tr::kPanelBytes +
         (((chunk % 8) ^ (row & 7)) << 4);
}

// ------------------------------------------------------------------------------------------
// The work: tiles in step 06's order
// ------------------------------------------------------------------------------------------

/// One tile: a Q block of one (batch, head), and what the loops derive from it.
struct Tile {
  int q_start;           ///< sequence position of the block's first row
  int head, head_kv;     ///< query head, and the K/V head it reads (GQA)
  int batch;             ///< batch index
  int n_blocks;          ///< K/V blocks it visits (<= 0: its rows see no key)
  int first_masked_key;  ///< causal: the first key that the block's first row does not see
};

/// The number of tiles: Q blocks times (batch, head) pairs.
template <class Tr>
__device__ __forceinline__ int count_tiles(const fa_fwd_args& args) {
  return (args.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM * args.batch * args.heads;
}

/// Tile number `tile` of the work order that launch() explains: the (batch, head) pairs are
/// taken in groups of `group_pairs`; inside a group the last Q block of every pair comes
/// first, then the one before it, and so on. Q block b covers rows \f$[b B_r, (b + 1) B_r)\f$:
/// when \f$B_r\f$ does not divide \f$N_q\f$ the last one is partial, as in step 06.
template <class Tr>
__device__ __forceinline__ Tile tile_info(const fa_fwd_args& args, int tile, int group_pairs) {
  const int num_q_blocks = (args.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  const int num_pairs = args.batch * args.heads;
  const int group = tile / (group_pairs * num_q_blocks);
  const int in_group = tile - group * group_pairs * num_q_blocks;
  const int pairs_in_group = min(group_pairs, num_pairs - group * group_pairs);
  const int q_block = num_q_blocks - 1 - in_group / pairs_in_group;  // last Q blocks first
  const int pair = group * group_pairs + in_group % pairs_in_group;
  Tile t;
  t.q_start = q_block * Tr::kBlockM;
  t.head = pair % args.heads;
  t.head_kv = t.head / (args.heads / args.heads_kv);
  t.batch = pair / args.heads;
  t.n_blocks = (args.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN;
  // Under causal masking the block's last row sees keys [0, last_key]: the blocks past the
  // one that holds last_key are entirely masked, so the loop stops there.
  t.first_masked_key = t.q_start + args.seqlen_k - args.seqlen_q + 1;  // first row's key_end
  if (args.causal) {
    const int last_key =
        min(t.q_start + Tr::kBlockM, args.seqlen_q) - 1 + args.seqlen_k - args.seqlen_q;
    t.n_blocks = min(t.n_blocks, (last_key + Tr::kBlockN) / Tr::kBlockN);  // <= 0: no key
  }
  return t;
}

// ------------------------------------------------------------------------------------------
// The producer: TMA loads of Q and of the K/V ring
// ------------------------------------------------------------------------------------------

/// Loads rows [row0, row0 + kRows) of one head of a tensor into the tile `smem_tile`: one TMA
/// per 64-column panel, all counted on barrier `bar`. Coordinates are (column, row, head,
/// batch); rows outside [0, seqlen) come in as zeros (a zero V row times a zero probability
/// stays zero), and never from another head or batch (the tensor map is 4-D).
template <class Tr, int kRows>
__device__ __forceinline__ void load_tile(char* smem_tile, const CUtensorMap* map, uint64_t* bar,
                                          int row0, int head, int batch) {
#pragma unroll
  for (int p = 0; p < Tr::kPanels; ++p)
    fa::tma_load_4d(smem_tile + p * kRows * Tr::kPanelBytes, map, bar, p * Tr::kPanelCols, row0,
                    head, batch);
}

/// The producer thread's work for one tile: Q into Q buffer b (announced on q_full[b] with the
/// tile), then K_j and V_j for j = 0 .. n_blocks - 1, the thread block's K/V blocks
/// kv_iter + j, into K/V buffer (kv_iter + j) % kStages. Before it refills a buffer it waits on
/// that buffer's "empty" barrier for the phase of the block that used it last (kStages blocks
/// earlier, maybe in the previous tile); the first kStages blocks of the thread block find their
/// buffers unused. Each load is one arrival with its byte count on the "full" barrier. A tile whose
/// rows see no key needs no Q: its q_full[b] phase is the producer's arrival alone.
template <class Tr>
__device__ __forceinline__ void load_q_k_v(char* q_tile, char* k_stages, char* v_stages,
                                           SharedState<Tr>* sh, const CUtensorMap* tmap_q,
                                           const CUtensorMap* tmap_k, const CUtensorMap* tmap_v,
                                           const fa_fwd_args& args, const Tile& t, int b,
                                           int kv_iter) {
  // A tensor whose batch stride is 0 (one batch shared by all) is mapped with one batch.
  const int batch_q = args.q.batch_stride != 0 ? t.batch : 0;
  const int batch_k = args.k.batch_stride != 0 ? t.batch : 0;
  const int batch_v = args.v.batch_stride != 0 ? t.batch : 0;
  if (t.n_blocks <= 0) {
    fa::mbarrier_arrive(&sh->q_full[b]);
    return;
  }
  fa::mbarrier_arrive_expect_tx(&sh->q_full[b], Tr::kQBytes);
  load_tile<Tr, Tr::kBlockM>(q_tile, tmap_q, &sh->q_full[b], t.q_start, t.head, batch_q);
  for (int kv_block = 0; kv_block < t.n_blocks; ++kv_block) {
    const int i = kv_iter + kv_block;  // the thread block's K/V block count
    const int stage = i % Tr::kStages;
    const uint32_t reuse_parity = (i / Tr::kStages - 1) & 1;  // block i - kStages
    const int kv_start = kv_block * Tr::kBlockN;
    if (i >= Tr::kStages) fa::mbarrier_wait(&sh->k_empty[stage], reuse_parity);
    fa::mbarrier_arrive_expect_tx(&sh->k_full[stage], Tr::kKBytes);
    load_tile<Tr, Tr::kBlockN>(k_stages + stage * Tr::kKBytes, tmap_k, &sh->k_full[stage], kv_start,
                               t.head_kv, batch_k);
    if (i >= Tr::kStages) fa::mbarrier_wait(&sh->v_empty[stage], reuse_parity);
    fa::mbarrier_arrive_expect_tx(&sh->v_full[stage], Tr::kVBytes);
    load_tile<Tr, Tr::kBlockN>(v_stages + stage * Tr::kVBytes, tmap_v, &sh->v_full[stage], kv_start,
                               t.head_kv, batch_v);
  }
}

// ------------------------------------------------------------------------------------------
// The algorithm: S = Q K^T, mask, online softmax, O += P V (all per consumer warpgroup)
// ------------------------------------------------------------------------------------------

/// Starts \f$S_w = Q_w K_j^T\f$ for this warpgroup's 64 query rows (starting at tile row
/// `wg_row0`) and all kBlockN keys of the K tile, unscaled, in fp32 accumulator fragments:
/// s[0][nj] is the m16n8 tile of this warp's 16 rows and keys 8 nj (the wgmma accumulator
/// layout is, per warp, that of step 06's mma). One wgmma per 16 columns of d, both operands
/// read from shared memory through descriptors: k-step k starts 32 bytes further into the
/// 128-byte panel row (the hardware applies the swizzle to the address it computes), and in
/// the next panel every 4 steps. Asynchronous: s is valid after fa::wgmma_wait().
template <class Tr, typename T>
__device__ __forceinline__ void compute_scores(float (&s)[Tr::kMTiles][Tr::kNTilesS][4],
                                               const char* q_tile, const char* k_tile,
                                               int wg_row0) {
  const uint32_t q_base = fa::smem_u32(q_tile) + wg_row0 * Tr::kPanelBytes;
  const uint32_t k_base = fa::smem_u32(k_tile);
  fa::wgmma_fence();
#pragma unroll
  for (int k_step = 0; k_step < Tr::kHeadDim / 16; ++k_step) {
    const int panel = k_step / 4, byte = (k_step % 4) * 32;
    const uint64_t desc_q =
        fa::wgmma_desc_sw128(q_base + panel * Tr::kBlockM * Tr::kPanelBytes + byte, 16, 1024);
    const uint64_t desc_k =
        fa::wgmma_desc_sw128(k_base + panel * Tr::kBlockN * Tr::kPanelBytes + byte, 16, 1024);
    fa::wgmma_ss<T, Tr::kBlockN>(s[0], desc_q, desc_k, k_step > 0);  // step 0 overwrites S
  }
  fa::wgmma_commit();
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
/// sum until the epilogue. o_acc is not touched here: the previous block's \f$P V\f$ may still
/// be adding into it, so the factors \f$e^{c (m_i - m_i^{new})}\f$ go to `o_scale` and
/// rescale_o() applies them once that product is done. They are exactly 1 for a row whose max
/// did not grow: the function returns false (warp-uniform) when no row of the warp grew, and
/// the caller then skips rescale_o(), which is most blocks once a row has seen a few of them.
/// A row with no visible key yet has \f$m = -\infty\f$: the subtracted max is then taken as 0
/// so that no \f$-\infty - (-\infty)\f$ makes a NaN. On return s holds \f$P\f$
/// (unnormalized, fp32).
template <class Tr>
__device__ __forceinline__ bool online_softmax(float (&s)[Tr::kMTiles][Tr::kNTilesS][4],
                                               float (&row_max)[Tr::kMTiles][2],
                                               float (&row_sum)[Tr::kMTiles][2],
                                               float (&o_scale)[Tr::kMTiles][2], float scale_log2) {
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
  // The exponentials first: they need only the new max. After the branch below they would
  // share a basic block with the loop's inlined wgmma_wait<0>(), which ptxas (CUDA 13.0) puts
  // at the top of its block, and not overlap P_{j-1} V_{j-1} (host.sass.10_hopper_pingpong).
  float block_sum[Tr::kMTiles][2];
#pragma unroll
  for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m_scaled = (m_new[mi][h] == -INFINITY) ? 0.f : m_new[mi][h] * scale_log2;
      float sum = 0.f;
#pragma unroll
      for (int nj = 0; nj < Tr::kNTilesS; ++nj)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float p = fa::exp2_approx(fmaf(s[mi][nj][2 * h + e], scale_log2, -m_scaled));
          s[mi][nj][2 * h + e] = p;
          sum += p;
        }
      block_sum[mi][h] = sum;
    }
  const bool any_grew = __any_sync(0xffffffffu, max_grew);
  if (any_grew) {
#pragma unroll
    for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // exp(c (m_old - m_new)) from the difference of the maxima: exactly 1 where the max did
        // not change (m_old c - m_new c would not be: an FMA keeps the rounding of one product);
        // 0 when the row had no visible key before (m_old = -inf) or still has none.
        o_scale[mi][h] = m_new[mi][h] == -INFINITY
                             ? 0.f
                             : fa::exp2_approx((row_max[mi][h] - m_new[mi][h]) * scale_log2);
        row_sum[mi][h] *= o_scale[mi][h];
      }
  }
#pragma unroll
  for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_max[mi][h] = m_new[mi][h];
      row_sum[mi][h] += block_sum[mi][h];
    }
  return any_grew;
}

/// \f$O_i \leftarrow e^{c (m_i - m_i^{new})} O_i\f$ with the factors online_softmax() left in
/// `o_scale`; called once no \f$P V\f$ is adding into o_acc any more.
template <class Tr>
__device__ __forceinline__ void rescale_o(float (&o_acc)[Tr::kMTiles][Tr::kNTilesO][4],
                                          const float (&o_scale)[Tr::kMTiles][2]) {
#pragma unroll
  for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int nd = 0; nd < Tr::kNTilesO; ++nd) {
        o_acc[mi][nd][2 * h] *= o_scale[mi][h];
        o_acc[mi][nd][2 * h + 1] *= o_scale[mi][h];
      }
}

/// Pingpong: consumer warpgroup c issues its wgmma only in its turn, which is named barrier
/// kNumConsumers + 1 + c (1 .. kNumConsumers are the epilogue's) completing with 256 threads:
/// its own 128 waiting here and the 128 of the consumer before it having passed the turn on
/// (pass_turn()). The turns go round, 0, 1, (2,) 0, 1, ..., over the thread block's tiles.
template <class Tr>
__device__ __forceinline__ void wait_for_turn(int consumer) {
  fa::named_barrier_sync(Tr::kNumConsumers + 1 + consumer, 256);
}

/// Hands the turn to the next consumer warpgroup without waiting (its barrier).
template <class Tr>
__device__ __forceinline__ void pass_turn(int consumer) {
  fa::named_barrier_arrive(Tr::kNumConsumers + 1 + (consumer + 1) % Tr::kNumConsumers, 256);
}

/// Consumer 0's arrival on its own turn barrier: its first turn needs no hand-over.
template <class Tr>
__device__ __forceinline__ void open_first_turn(int consumer) {
  if (consumer == 0) fa::named_barrier_arrive(Tr::kNumConsumers + 1, 256);
}

/// Consumer 0's last wait on its turn barrier, which takes the hand-over of the last turn
/// (the last consumer's): no arrival is left over when the thread block exits.
template <class Tr>
__device__ __forceinline__ void close_last_turn(int consumer) {
  if (consumer == 0) wait_for_turn<Tr>(consumer);
}

/// P as the A operand of \f$P V\f$: the accumulator fragments of the S tiles 2 kk and 2 kk + 1
/// (keys 16 kk ... 16 kk + 15), rounded to T and packed in pairs, are the wgmma A fragment of
/// k-step kk (per warp: a0 = rows 0-7 keys 0-7, a1 = rows 8-15 keys 0-7, a2 = rows 0-7 keys
/// 8-15, a3 = rows 8-15 keys 8-15), exactly as for step 06's mma. P never leaves registers.
template <class Tr, typename T>
__device__ __forceinline__ void pack_p(const float (&p)[Tr::kMTiles][Tr::kNTilesS][4],
                                       uint32_t (&p_frag)[Tr::kBlockN / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < Tr::kBlockN / 16; ++kk) {
    p_frag[kk][0] = fa::pack2<T>(p[0][2 * kk][0], p[0][2 * kk][1]);
    p_frag[kk][1] = fa::pack2<T>(p[0][2 * kk][2], p[0][2 * kk][3]);
    p_frag[kk][2] = fa::pack2<T>(p[0][2 * kk + 1][0], p[0][2 * kk + 1][1]);
    p_frag[kk][3] = fa::pack2<T>(p[0][2 * kk + 1][2], p[0][2 * kk + 1][3]);
  }
}

/// Starts \f$O_w \mathrel{+}= P_w V_j\f$ for this warpgroup's 64 rows: one wgmma per 16 keys,
/// A = P from registers (pack_p()), B = V from shared memory as it landed, key by key. B of
/// \f$P V\f$ has its k index (the key) along V's rows, so the descriptor says "N-major"
/// (transposed B) and the hardware reads V column-wise without a transposed copy: per k-step,
/// 16 keys are two groups of 8 rows 1024 bytes apart, and along d the 64-column panels are
/// kBlockN x 128 bytes apart. Asynchronous: o_acc is valid after fa::wgmma_wait().
template <class Tr, typename T>
__device__ __forceinline__ void accumulate_pv(float (&o_acc)[Tr::kMTiles][Tr::kNTilesO][4],
                                              uint32_t (&p_frag)[Tr::kBlockN / 16][4],
                                              const char* v_tile) {
  const uint32_t v_base = fa::smem_u32(v_tile);
  fa::fence_operand(p_frag);
  fa::fence_operand(o_acc[0]);
  fa::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Tr::kBlockN / 16; ++kk) {
    const uint64_t desc_v = fa::wgmma_desc_sw128(v_base + kk * 16 * Tr::kPanelBytes,
                                                 Tr::kBlockN * Tr::kPanelBytes, 1024);
    fa::wgmma_rs<T, Tr::kHeadDim, /*kTransB=*/1>(o_acc[0], p_frag[kk], desc_v, 1);
  }
  fa::wgmma_commit();
}

// ------------------------------------------------------------------------------------------
// Epilogue: O = o_acc / row_sum and L = m + log(row_sum)
// ------------------------------------------------------------------------------------------

/// Finishes this warpgroup's 64 rows of the Q block that starts at row q_start of (batch,
/// head): reduces each row's partial row_sum over its quad, writes \f$O_i = o_i / \ell_i\f$
/// and, when args.lse is not null, \f$L_i = c\, m_i + \ln \ell_i\f$ (natural log of the
/// scaled scores, c = args.scale). A row that saw no key (\f$\ell_i = 0\f$) gets \f$O_i = 0\f$
/// and \f$L_i = +\infty\f$. O goes through the warpgroup's rows of the O staging tile, in the
/// swizzled panel layout, and leaves with one TMA store per panel; the TMA drops rows past
/// \f$N_q\f$ (the partial last Q block). The staging rows are written again only once the
/// previous tile's store has read them.
template <class Tr, typename T>
__device__ __forceinline__ void store_o_and_lse(float (&o_acc)[Tr::kMTiles][Tr::kNTilesO][4],
                                                float (&row_max)[Tr::kMTiles][2],
                                                float (&row_sum)[Tr::kMTiles][2], char* o_stage,
                                                const CUtensorMap* tmap_o, const fa_fwd_args& args,
                                                const Tile& t, int consumer, int wg_tid) {
  const int seqlen = args.seqlen_q;
  float* const lse =
      args.lse == nullptr
          ? nullptr
          : args.lse + (static_cast<int64_t>(t.batch) * args.heads + t.head) * seqlen;
  const int lane = wg_tid % 32;
  const int group = lane / 4, quad = lane % 4;
  const int wg_row0 = consumer * Tr::kConsumerRows;
  const int warp_row0 = wg_row0 + (wg_tid / 32) * 16;
  if (wg_tid == 0) fa::tma_store_wait_read();  // the previous tile's O has left o_stage
  fa::named_barrier_sync(1 + consumer, 128);
#pragma unroll
  for (int mi = 0; mi < Tr::kMTiles; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = row_sum[mi][h];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float inv_sum = sum > 0.f ? __fdividef(1.f, sum) : 0.f;  // sum >= 1 (2^0 at the max)
      const int tile_row = warp_row0 + 16 * mi + 8 * h + group;
      const int row = t.q_start + tile_row;
      const float l = sum > 0.f ? row_max[mi][h] * args.scale + logf(sum + 1e-30f) : INFINITY;
      if (lse != nullptr && quad == 0 && row < seqlen) lse[row] = l;
#pragma unroll
      for (int nd = 0; nd < Tr::kNTilesO; ++nd) {
        const uint32_t packed =
            fa::pack2<T>(o_acc[mi][nd][2 * h] * inv_sum, o_acc[mi][nd][2 * h + 1] * inv_sum);
        *reinterpret_cast<uint32_t*>(o_stage + swizzle<Tr, Tr::kBlockM>(tile_row, nd) + 4 * quad) =
            packed;
      }
    }
  fa::fence_proxy_async_smem();               // the TMA reads what the threads wrote
  fa::named_barrier_sync(1 + consumer, 128);  // the warpgroup's O rows are staged
  const int box_row0 = t.q_start + wg_row0;
  if (wg_tid == 0 && box_row0 < seqlen) {  // else: no row of it exists
    const int batch_o = args.o.batch_stride != 0 ? t.batch : 0;
#pragma unroll
    for (int p = 0; p < Tr::kPanels; ++p)
      fa::tma_store_4d(tmap_o,
                       o_stage + p * Tr::kBlockM * Tr::kPanelBytes + wg_row0 * Tr::kPanelBytes,
                       p * Tr::kPanelCols, box_row0, t.head, batch_o);
    fa::tma_store_commit();
  }
}

// ------------------------------------------------------------------------------------------
// The kernel
// ------------------------------------------------------------------------------------------

/// FlashAttention-2 forward on Hopper, warp-specialized and persistent. Each thread block
/// works through tiles (Q blocks of one (batch, head), step 06's order: tile_info()) until
/// none is left: the first is blockIdx.x, the next ones come from `tile_counter` (launch()
/// sets it to 0). Warpgroup 0 produces: its thread 0 announces each tile in shared memory and
/// loads its Q and K/V blocks by TMA. Warpgroups 1 .. kNumConsumers consume, each owning 64
/// rows of the Q block. The consumers take turns at the tensor cores (wait_for_turn(),
/// pass_turn()); in its turn for K/V block j a consumer issues \f$S_j = Q_w K_j^T\f$ and
/// \f$O \mathrel{+}= P_{j-1} V_{j-1}\f$, then, while another consumer has the tensor cores,
/// masks \f$S_j\f$ and runs its online softmax, and only then waits for \f$P_{j-1} V_{j-1}\f$
/// and rescales o_acc. Its S, softmax statistics and o_acc stay in registers, as in step 06. The
/// tensor maps describe Q, K, V and O as 4-D tensors (column, row, head, batch) with 128-byte
/// swizzled boxes (make_tensor_map()).
template <typename T, int kHeadDim, int kBlockM, int kBlockN>
__global__ void __launch_bounds__(Traits<kHeadDim, kBlockM, kBlockN>::kNumThreads, 1)
    flash_forward_kernel(const fa_fwd_args args, const __grid_constant__ CUtensorMap tmap_q,
                         const __grid_constant__ CUtensorMap tmap_k,
                         const __grid_constant__ CUtensorMap tmap_v,
                         const __grid_constant__ CUtensorMap tmap_o, const float scale_log2,
                         const int group_pairs, int* const tile_counter) {
  using Tr = Traits<kHeadDim, kBlockM, kBlockN>;
  extern __shared__ char smem_raw[];
  // The 128-byte swizzle repeats every 1024 bytes: the tiles start on a 1024-byte boundary.
  char* const smem = smem_raw + ((1024 - (fa::smem_u32(smem_raw) & 1023)) & 1023);
  char* const q_tiles = smem;  // Q buffer b at b * kQBytes
  char* const o_stage = q_tiles + Tr::kQBuffers * Tr::kQBytes;
  char* const k_stages = o_stage + Tr::kOBytes;                 // buffer s at s * kKBytes
  char* const v_stages = k_stages + Tr::kStages * Tr::kKBytes;  // buffer s at s * kVBytes
  auto* const sh = reinterpret_cast<SharedState<Tr>*>(smem + Tr::kTileBytes);

  if (threadIdx.x == 0) {
    for (int b = 0; b < Tr::kQBuffers; ++b) {
      fa::mbarrier_init(&sh->q_full[b], 1);  // the producer's arrival (+ the TMA bytes)
      fa::mbarrier_init(&sh->q_empty[b], Tr::kNumConsumerWarps);
    }
    for (int s = 0; s < Tr::kStages; ++s) {
      fa::mbarrier_init(&sh->k_full[s], 1);
      fa::mbarrier_init(&sh->v_full[s], 1);
      fa::mbarrier_init(&sh->k_empty[s], Tr::kNumConsumerWarps);  // one arrival per warp
      fa::mbarrier_init(&sh->v_empty[s], Tr::kNumConsumerWarps);
    }
    fa::fence_barrier_init();
  }
  __syncthreads();  // the barriers are initialized before anyone uses them

  const int warpgroup = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);  // warp-uniform
  if (warpgroup == 0) {
    // ---- Producer: one thread announces the tiles and issues every load. ----
    fa::setmaxnreg_dec<Tr::kProducerRegs>();
    if (threadIdx.x == 0) {
      fa::tma_prefetch_descriptor(&tmap_q);
      fa::tma_prefetch_descriptor(&tmap_k);
      fa::tma_prefetch_descriptor(&tmap_v);
      const int num_tiles = count_tiles<Tr>(args);
      int kv_iter = 0;  // K/V blocks loaded so far
      for (int tile = blockIdx.x, n = 0;; ++n) {
        const int b = n % Tr::kQBuffers;  // tile n - 2 used the buffer last: wait till it's read
        if (n >= Tr::kQBuffers) fa::mbarrier_wait(&sh->q_empty[b], (n / Tr::kQBuffers - 1) & 1);
        sh->tile[b] = tile;  // published by the arrival on q_full[b] (release)
        if (tile >= num_tiles) {
          fa::mbarrier_arrive(&sh->q_full[b]);  // "no tile left"
          break;
        }
        const Tile t = tile_info<Tr>(args, tile, group_pairs);
        load_q_k_v<Tr>(q_tiles + b * Tr::kQBytes, k_stages, v_stages, sh, &tmap_q, &tmap_k, &tmap_v,
                       args, t, b, kv_iter);
        kv_iter += max(t.n_blocks, 0);
        tile = atomicAdd(tile_counter, 1) + gridDim.x;  // the first gridDim.x tiles are taken
      }
    }
  } else {
    // ---- Consumers: warpgroup c + 1 owns rows [64 c, 64 c + 64) of every Q block. ----
    fa::setmaxnreg_inc<Tr::kConsumerRegs>();
    const int consumer = warpgroup - 1;
    const int wg_tid = threadIdx.x % 128;
    const int lane = threadIdx.x % 32;
    const int wg_row0 = consumer * Tr::kConsumerRows;    // this warpgroup's first Q tile row
    const int warp_row0 = wg_row0 + (wg_tid / 32) * 16;  // this warp's first Q tile row
    const int num_tiles = count_tiles<Tr>(args);
    int kv_iter = 0;  // K/V blocks consumed so far
    open_first_turn<Tr>(consumer);

    for (int n = 0;; ++n) {
      const int b = n % Tr::kQBuffers;                             // tile n's Q buffer
      fa::mbarrier_wait(&sh->q_full[b], (n / Tr::kQBuffers) & 1);  // tile n is announced, Q landed
      const int tile = sh->tile[b];
      if (tile >= num_tiles) break;
      const char* const q_tile = q_tiles + b * Tr::kQBytes;
      const Tile t = tile_info<Tr>(args, tile, group_pairs);
      if (t.n_blocks > 0 && t.q_start + wg_row0 >= args.seqlen_q) {
        // All 64 rows of this warpgroup lie past N_q (the ragged last Q block): it computes
        // nothing, but takes the tile's n_blocks + 1 turns and makes its barrier arrivals in
        // the same order as the loop below, so the others run as before, with the tensor
        // cores to themselves in its turns.
        if (lane == 0) fa::mbarrier_arrive(&sh->q_empty[b]);
        for (int kv_block = 0; kv_block <= t.n_blocks; ++kv_block) {
          const int i = kv_iter + kv_block;
          if (kv_block < t.n_blocks)
            fa::mbarrier_wait(&sh->k_full[i % Tr::kStages], (i / Tr::kStages) & 1);
          if (kv_block > 0)
            fa::mbarrier_wait(&sh->v_full[(i - 1) % Tr::kStages], ((i - 1) / Tr::kStages) & 1);
          wait_for_turn<Tr>(consumer);
          pass_turn<Tr>(consumer);
          if (lane == 0) {
            if (kv_block < t.n_blocks) fa::mbarrier_arrive(&sh->k_empty[i % Tr::kStages]);
            if (kv_block > 0) fa::mbarrier_arrive(&sh->v_empty[(i - 1) % Tr::kStages]);
          }
        }
        kv_iter += t.n_blocks;
        continue;
      }

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

      if (t.n_blocks <= 0) {  // its rows see no key (N_q > N_k): O = 0, L = +inf
        if (lane == 0) fa::mbarrier_arrive(&sh->q_empty[b]);  // nor any Q
      } else {
        // Mask (where needed) and online softmax of S_j; true if o_acc must be rescaled.
        float s[Tr::kMTiles][Tr::kNTilesS][4];
        float o_scale[Tr::kMTiles][2];
        auto softmax_of_block = [&](int kv_block) {
          const int kv_start = kv_block * Tr::kBlockN;
          // Only the blocks that cross the diagonal (some key past the first row's key_end)
          // and the ragged last block need the mask; all others take the mask-free path.
          const bool needs_mask = (args.causal && kv_start + Tr::kBlockN > t.first_masked_key) ||
                                  kv_start + Tr::kBlockN > args.seqlen_k;
          if (needs_mask)
            apply_mask<Tr>(s, t.q_start + warp_row0 + lane / 4, kv_start, args.seqlen_q,
                           args.seqlen_k, args.causal, lane);
          return online_softmax<Tr>(s, row_max, row_sum, o_scale, scale_log2);
        };

        // Block 0: S_0 alone (there is no P V yet).
        uint32_t p_frag[Tr::kBlockN / 16][4];
        const int first_stage = kv_iter % Tr::kStages;
        fa::mbarrier_wait(&sh->k_full[first_stage], (kv_iter / Tr::kStages) & 1);  // K_0 landed
        wait_for_turn<Tr>(consumer);
        compute_scores<Tr, T>(s, q_tile, k_stages + first_stage * Tr::kKBytes, wg_row0);
        pass_turn<Tr>(consumer);
        fa::wgmma_wait<0>();
        fa::fence_operand(s[0]);
        if (lane == 0) {
          fa::mbarrier_arrive(&sh->k_empty[first_stage]);             // this warp is done with K_0
          if (t.n_blocks == 1) fa::mbarrier_arrive(&sh->q_empty[b]);  // and with Q
        }
        softmax_of_block(0);  // o_acc is still 0: there is nothing to rescale
        pack_p<Tr, T>(s, p_frag);

#pragma unroll 1
        for (int kv_block = 1; kv_block < t.n_blocks; ++kv_block) {
          const int i = kv_iter + kv_block;  // the thread block's K/V block count
          const int stage = i % Tr::kStages;
          const uint32_t parity = (i / Tr::kStages) & 1;
          const int prev_stage = (i - 1) % Tr::kStages;  // block j - 1, whose P V is due
          const uint32_t prev_parity = ((i - 1) / Tr::kStages) & 1;
          const char* const k_tile = k_stages + stage * Tr::kKBytes;
          const char* const v_tile = v_stages + prev_stage * Tr::kVBytes;

          fa::mbarrier_wait(&sh->k_full[stage], parity);            // K_j has landed
          fa::mbarrier_wait(&sh->v_full[prev_stage], prev_parity);  // V_{j-1} has landed
          wait_for_turn<Tr>(consumer);
          compute_scores<Tr, T>(s, q_tile, k_tile, wg_row0);  // S_j = Q K_j^T ...
          accumulate_pv<Tr, T>(o_acc, p_frag, v_tile);        // ... then O += P_{j-1} V_{j-1}
          pass_turn<Tr>(consumer);
          fa::wgmma_wait<1>();  // S_j is done; P_{j-1} V_{j-1} may still run
          fa::fence_operand(s[0]);
          if (lane == 0) {
            fa::mbarrier_arrive(&sh->k_empty[stage]);  // this warp is done with K_j
            if (kv_block == t.n_blocks - 1) fa::mbarrier_arrive(&sh->q_empty[b]);  // and with Q
          }
          const bool rescale = softmax_of_block(kv_block);
          fa::wgmma_wait<0>();  // P_{j-1} V_{j-1} is done: o_acc and p_frag are free again
          fa::fence_operand(o_acc[0]);
          if (lane == 0) fa::mbarrier_arrive(&sh->v_empty[prev_stage]);  // done with V_{j-1}
          if (rescale) rescale_o<Tr>(o_acc, o_scale);
          pack_p<Tr, T>(s, p_frag);
        }

        // The last block's P V.
        const int last = kv_iter + t.n_blocks - 1;
        const int last_stage = last % Tr::kStages;
        fa::mbarrier_wait(&sh->v_full[last_stage], (last / Tr::kStages) & 1);  // V_last landed
        wait_for_turn<Tr>(consumer);
        accumulate_pv<Tr, T>(o_acc, p_frag, v_stages + last_stage * Tr::kVBytes);
        pass_turn<Tr>(consumer);
        fa::wgmma_wait<0>();
        fa::fence_operand(o_acc[0]);
        if (lane == 0) fa::mbarrier_arrive(&sh->v_empty[last_stage]);  // done with V_last
        kv_iter += t.n_blocks;
      }

      store_o_and_lse<Tr, T>(o_acc, row_max, row_sum, o_stage, &tmap_o, args, t, consumer, wg_tid);
    }
    close_last_turn<Tr>(consumer);
    if (wg_tid == 0) fa::tma_store_wait_read();  // the last O has left shared memory
  }
}

// ------------------------------------------------------------------------------------------
// Launcher
// ------------------------------------------------------------------------------------------

/// The driver's cuTensorMapEncodeTiled, looked up once through the runtime, so that nothing
/// links the driver library; null if the driver does not have it.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                             cudaEnableDefault, &found);
#else
    const cudaError_t err =
        cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found);
#endif
    return (err == cudaSuccess && found == cudaDriverEntryPointSuccess)
               ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn)
               : nullptr;
  }();
  return encode;
}

/// Describes BSHD tensor `t` to the TMA as a 4-D tensor (column, row, head, batch) of T with
/// its own strides, read and written in boxes of 64 columns (128 bytes, the swizzle width) x
/// `box_rows` rows of one head and batch, 128-byte swizzled in shared memory. The 4-D map is
/// what keeps a box that runs past the last row of a head from reading the next head's rows:
/// those rows are outside the tensor, so they come in as zeros (and are not written by a
/// store). A tensor with batch stride 0 gets one batch, read by every thread block.
template <typename T>
fa_status make_tensor_map(CUtensorMap* map, const char* name, const fa_tensor& t, int seqlen,
                          int heads, int batch, int box_rows, int head_dim) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr)
    return fa::set_error(FA_ERR_CUDA, "%s: the driver has no cuTensorMapEncodeTiled", FA_STEP_NAME);
  constexpr int64_t kMaxStride = int64_t{1} << 40;  // bytes, a TMA limit
  const int64_t row_bytes = t.row_stride * 2, head_bytes = t.head_stride * 2;
  const int64_t batch_bytes =
      t.batch_stride != 0 ? t.batch_stride * 2 : std::max(row_bytes, head_bytes);
  if (row_bytes >= kMaxStride || head_bytes >= kMaxStride || batch_bytes >= kMaxStride)
    return fa::set_error(FA_ERR_UNSUPPORTED,
                         "%s: %s has a stride of 2^40 bytes or more, beyond what the TMA takes",
                         FA_STEP_NAME, name);
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(seqlen),
                              static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(t.batch_stride != 0 ? batch : 1)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(row_bytes),
                                 static_cast<cuuint64_t>(head_bytes),
                                 static_cast<cuuint64_t>(batch_bytes)};
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(box_rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUtensorMapDataType type = std::is_same<T, __half>::value
                                       ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                       : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const CUresult r = encode(map, type, 4, t.ptr, dims, strides, box, element_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return fa::set_error(
        FA_ERR_UNSUPPORTED,
        "%s: the TMA cannot describe %s (cuTensorMapEncodeTiled error %d; "
        "strides in elements: batch %lld, row %lld, head %lld)",
        FA_STEP_NAME, name, static_cast<int>(r), static_cast<long long>(t.batch_stride),
        static_cast<long long>(t.row_stride), static_cast<long long>(t.head_stride));
  return FA_OK;
}

/// The tuning knobs, read from the environment once, for measured comparisons (the defaults
/// are the step's choice): `FA_HOPPER_BLOCK_M=128` takes 128-row Q blocks (two consumers) at
/// d = 64, the step without its third consumer; `FA_HOPPER_GRID=tiles` launches one thread
/// block per tile instead of one per SM, the step without its persistent grid; and
/// `FA_HOPPER_GRID=n` at most n thread blocks (the tests' way to make every thread block
/// work through many tiles of a small problem). Any other value is an error (forward() says
/// which), not a silent default.
struct Knobs {
  bool d64_block_m_128 = false;  ///< FA_HOPPER_BLOCK_M=128
  int grid = 0;                  ///< FA_HOPPER_GRID: 0 unset, -1 "tiles", else n
  std::string error;             ///< not empty: a knob has a value it does not take
};

/// The knobs of this process.
const Knobs& knobs() {
  static const Knobs k = [] {
    Knobs r;
    if (const char* block_m = std::getenv("FA_HOPPER_BLOCK_M")) {
      r.d64_block_m_128 = std::strcmp(block_m, "128") == 0;
      if (!r.d64_block_m_128)
        r.error = std::string("FA_HOPPER_BLOCK_M=") + block_m + ": expected 128 (or unset)";
    }
    const char* grid = std::getenv("FA_HOPPER_GRID");
    long long n = 0;
    if (grid != nullptr && std::strcmp(grid, "tiles") == 0)
      r.grid = -1;
    else if (fa::env_int("FA_HOPPER_GRID", 1, INT32_MAX, &n, &r.error) == fa::EnvStatus::kOk)
      r.grid = static_cast<int>(n);
    else if (grid != nullptr)
      r.error += " (or tiles)";
    return r;
  }();
  return k;
}

/// Launches the kernel for one dtype and tile shape: a persistent grid of as many thread
/// blocks as fit on the GPU at once (at most one per tile), which take the tiles in this
/// order (tile_info()): the (batch, head) pairs in groups; inside a group the last Q block of
/// every pair first, then the one before it, and so on. Under causal masking the last Q
/// blocks do the most work, so the longest tiles start first and the short ones fill the
/// end. A group holds at least 4 waves of resident thread blocks, enough for that order to
/// balance the SMs, and no more pairs than that, so that the tiles that read the same K and V
/// run at the same time and share them in L2. Without causal masking every tile has the same
/// work and a group is one pair: one head's Q blocks run together.
template <typename T, int kHeadDim, int kBlockM, int kBlockN>
fa_status launch(const fa_fwd_args& args, cudaStream_t stream) {
  using Tr = Traits<kHeadDim, kBlockM, kBlockN>;
  const auto kernel = flash_forward_kernel<T, kHeadDim, kBlockM, kBlockN>;
  constexpr int kSmemBytes = smem_bytes<Tr>();
  // More than 48 KiB of dynamic shared memory must be asked for explicitly.
  FA_CUDA_TRY(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  CUtensorMap tmap_q, tmap_k, tmap_v, tmap_o;
  fa_status st = FA_OK;
  if ((st = make_tensor_map<T>(&tmap_q, "q", args.q, args.seqlen_q, args.heads, args.batch,
                               Tr::kBlockM, kHeadDim)) != FA_OK ||
      (st = make_tensor_map<T>(&tmap_k, "k", args.k, args.seqlen_k, args.heads_kv, args.batch,
                               Tr::kBlockN, kHeadDim)) != FA_OK ||
      (st = make_tensor_map<T>(&tmap_v, "v", args.v, args.seqlen_k, args.heads_kv, args.batch,
                               Tr::kBlockN, kHeadDim)) != FA_OK ||
      (st = make_tensor_map<T>(&tmap_o, "o", args.o, args.seqlen_q, args.heads, args.batch,
                               Tr::kConsumerRows, kHeadDim)) != FA_OK)
    return st;
  const int64_t num_q_blocks = (args.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  const int64_t num_pairs = static_cast<int64_t>(args.batch) * args.heads;
  const int64_t num_tiles = num_q_blocks * num_pairs;
  if (num_tiles > INT32_MAX / 2)  // the tile counter counts past num_tiles by the grid size
    return fa::set_error(FA_ERR_UNSUPPORTED, "%s: more than 2^30 Q blocks", FA_STEP_NAME);
  int device = 0, num_sms = 0, blocks_per_sm = 0;
  FA_CUDA_TRY(cudaGetDevice(&device));
  FA_CUDA_TRY(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  FA_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, Tr::kNumThreads,
                                                            kSmemBytes));
  const int64_t resident = static_cast<int64_t>(num_sms) * std::max(blocks_per_sm, 1);
  int64_t group_pairs = 1;
  if (args.causal) {
    const int64_t num_groups = std::max<int64_t>(1, num_tiles / (4 * resident));
    group_pairs = (num_pairs + num_groups - 1) / num_groups;
  }
  // The tile counter: one int of the stream's workspace, zeroed in stream order.
  void* counter = nullptr;
  if (fa::workspace(sizeof(int), stream, &counter) != cudaSuccess)
    return fa::set_error(FA_ERR_CUDA, "%s: cannot allocate the tile counter", FA_STEP_NAME);
  FA_CUDA_TRY(cudaMemsetAsync(counter, 0, sizeof(int), stream));
  const int64_t num_blocks = knobs().grid < 0    ? num_tiles
                             : knobs().grid == 0 ? std::min(num_tiles, resident)
                                                 : std::min<int64_t>(num_tiles, knobs().grid);
  const dim3 grid(static_cast<unsigned>(num_blocks));
  constexpr double kLog2e = 1.4426950408889634;
  const float scale_log2 = static_cast<float>(args.scale * kLog2e);
  kernel<<<grid, Tr::kNumThreads, kSmemBytes, stream>>>(args, tmap_q, tmap_k, tmap_v, tmap_o,
                                                        scale_log2, static_cast<int>(group_pairs),
                                                        static_cast<int*>(counter));
  FA_LAUNCH_TRY();
  return FA_OK;
}

/// The kernel for the head dimension: TileShape's, or the one the tuning knobs ask for.
template <typename T>
fa_status forward_typed(const fa_fwd_args& args, cudaStream_t stream) {
  switch (args.head_dim) {
    case 64:
      if (knobs().d64_block_m_128) return launch<T, 64, 128, 128>(args, stream);
      return launch<T, 64, TileShape<64>::kBlockM, TileShape<64>::kBlockN>(args, stream);
    case 128:
      return launch<T, 128, TileShape<128>::kBlockM, TileShape<128>::kBlockN>(args, stream);
    default:
      return fa::set_error(FA_ERR_UNSUPPORTED, "%s: head_dim %d is not supported", FA_STEP_NAME,
                           args.head_dim);
  }
}

/// The step's forward pass: picks the kernel for the dtype.
fa_status forward(const fa_fwd_args& args, cudaStream_t stream) {
  if (!knobs().error.empty())
    return fa::set_error(FA_ERR_INVALID_ARGUMENT, "%s: %s", FA_STEP_NAME, knobs().error.c_str());
  return args.dtype == FA_BF16 ? forward_typed<__nv_bfloat16>(args, stream)
                               : forward_typed<__half>(args, stream);
}

/// Head dimensions this step was built for.
bool supports_head_dim(int d) {
  return d == 64 || d == 128;
}

}  // namespace

FA_REGISTER_STEP_FOR_SM(
    90, "FA2 forward on Hopper + pingpong warpgroups, softmax overlapping the GEMMs", forward,
    nullptr, supports_head_dim);
