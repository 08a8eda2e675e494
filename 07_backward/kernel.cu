/// \file 07_backward/kernel.cu
/// \brief Step 07: the FlashAttention-2 backward pass (Algorithm 2 of the paper), on top of
/// the step 06 forward.
///
/// The forward keeps only \f$O\f$ and the logsumexp \f$L\f$; the backward recomputes
/// \f$S = \mathrm{scale}\cdot Q K^T\f$ and \f$P = e^{S - L}\f$ tile by tile instead of reading
/// an \f$N_q \times N_k\f$ matrix back from device memory. Three kernels:
/// 1. preprocess: \f$D_i = \mathrm{rowsum}(dO_i \circ O_i)\f$, \f$L_i \log_2 e\f$, and a zeroed
///    fp32 dQ accumulator (`dq_accum`);
/// 2. the main kernel, one thread block per (kv_block, kv head, batch): the loop order of the
///    forward flips, the outer loop is over K/V blocks and the inner loop over Q blocks, so
///    that \f$dK_j\f$ and \f$dV_j\f$ stay on chip; \f$dQ_i\f$ is shared by every kv_block and
///    is summed across thread blocks with fp32 atomic adds into `dq_accum`;
/// 3. convert `dq_accum` to the output dtype.
/// Deterministic mode (`args.deterministic`): the main kernel skips dQ, and a separate kernel
/// with one thread block per q_block walks the K/V blocks and sums its \f$dQ_i\f$ on chip, in a
/// fixed order, recomputing \f$P\f$ and \f$dS\f$ (no atomics; about 7/5 of the matmul work).
///
/// Run: `./build/bin/07_backward --backward --seqlen 4096 --head-dim 128`
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "fa/check.cuh"
#include "fa/mma.cuh"
#include "fa/step.h"

namespace {

// ===========================================================================================
// Forward pass.
// TODO(06): placeholder. This block is replaced word for word by the forward of
// 06_causal_skip/kernel.cu as soon as that step lands; it only exists so that the backward
// below can be tested (it writes O and the logsumexp L with the same semantics, slowly).
// ===========================================================================================

/// \f$\log_2 e\f$: \f$e^x = 2^{x \log_2 e}\f$, so the softmax runs on the exp2 unit.
constexpr float kLog2e = 1.4426950408889634f;

/// Element of T widened to fp32.
template <typename T>
__device__ __forceinline__ float to_float(T x) {
  return static_cast<float>(x);
}

/// Placeholder forward: one warp per query row, keys visited one by one with the online
/// softmax, \f$O_i = \sum_j e^{S_{ij} - L_i} V_j\f$ and \f$L_i = \log \sum_j e^{S_{ij}}\f$.
/// A row that sees no key gets \f$O_i = 0\f$, \f$L_i = +\infty\f$.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(128)
    placeholder_forward_kernel(const fa_fwd_args args, float scale_log2) {
  constexpr int kPerLane = kHeadDim / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = blockIdx.x * 4 + warp, head = blockIdx.y, batch = blockIdx.z;
  if (row >= args.seqlen_q) return;
  const int head_kv = head / (args.heads / args.heads_kv);
  const T* q = static_cast<const T*>(args.q.ptr) + batch * args.q.batch_stride +
               row * args.q.row_stride + head * args.q.head_stride + lane * kPerLane;
  float q_reg[kPerLane];
  for (int c = 0; c < kPerLane; ++c) q_reg[c] = to_float(q[c]);
  int visible = args.seqlen_k;
  if (args.causal) visible = min(visible, max(0, row + args.seqlen_k - args.seqlen_q + 1));
  float row_max = -INFINITY, row_sum = 0.f, o_acc[kPerLane] = {};
  for (int j = 0; j < visible; ++j) {
    const T* k = static_cast<const T*>(args.k.ptr) + batch * args.k.batch_stride +
                 j * args.k.row_stride + head_kv * args.k.head_stride + lane * kPerLane;
    const T* v = static_cast<const T*>(args.v.ptr) + batch * args.v.batch_stride +
                 j * args.v.row_stride + head_kv * args.v.head_stride + lane * kPerLane;
    float s = 0.f;
    for (int c = 0; c < kPerLane; ++c) s += q_reg[c] * to_float(k[c]);
    for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
    s *= scale_log2;
    const float new_max = fmaxf(row_max, s);
    const float correction = exp2f(row_max - new_max), p = exp2f(s - new_max);
    row_sum = row_sum * correction + p;
    for (int c = 0; c < kPerLane; ++c) o_acc[c] = o_acc[c] * correction + p * to_float(v[c]);
    row_max = new_max;
  }
  T* o = static_cast<T*>(args.o.ptr) + batch * args.o.batch_stride + row * args.o.row_stride +
         head * args.o.head_stride + lane * kPerLane;
  const float inv_sum = visible > 0 ? 1.f / row_sum : 0.f;
  for (int c = 0; c < kPerLane; ++c) o[c] = static_cast<T>(o_acc[c] * inv_sum);
  if (args.lse != nullptr && lane == 0) {
    args.lse[(static_cast<int64_t>(batch) * args.heads + head) * args.seqlen_q + row] =
        visible > 0 ? (row_max + log2f(row_sum)) / kLog2e : INFINITY;
  }
}

/// Launches the placeholder forward for one dtype and head dim.
template <typename T, int kHeadDim>
fa_status forward_impl(const fa_fwd_args& args, cudaStream_t stream) {
  dim3 grid((args.seqlen_q + 3) / 4, args.heads, args.batch);
  placeholder_forward_kernel<T, kHeadDim><<<grid, 128, 0, stream>>>(args, args.scale * kLog2e);
  FA_LAUNCH_TRY();
  return FA_OK;
}

/// Forward pass (placeholder until the 06 forward is copied in).
fa_status forward(const fa_fwd_args& args, cudaStream_t stream) {
  if (args.dtype == FA_BF16) {
    return args.head_dim == 64 ? forward_impl<__nv_bfloat16, 64>(args, stream)
                               : forward_impl<__nv_bfloat16, 128>(args, stream);
  }
  return args.head_dim == 64 ? forward_impl<__half, 64>(args, stream)
                             : forward_impl<__half, 128>(args, stream);
}

// ===========================================================================================
// Backward pass (FlashAttention-2, Algorithm 2).
// ===========================================================================================

/// Element offset of 16-byte chunk `chunk` of row `row` in a shared-memory tile whose rows
/// hold `kChunks` chunks (8 elements each). The chunk index is XORed with `row % 8`, so the 8
/// rows an ldmatrix reads at one logical chunk, and the 8 chunks a quarter-warp of cp.async
/// writes, fall on 8 different bank groups: no bank conflicts either way.
template <int kChunks>
__device__ __forceinline__ int swizzle(int row, int chunk) {
  static_assert(kChunks >= 8, "the swizzle permutes groups of 8 chunks");
  return (row * kChunks + (chunk ^ (row & 7))) * 8;
}

/// Copies a `kRows x kHeadDim` tile of a BSHD tensor (row 0 at `gmem`, rows `row_stride`
/// elements apart) into swizzled shared memory with 16-byte cp.async. Rows at or past
/// `valid_rows` are zero-filled and never read from device memory.
template <int kRows, int kHeadDim, int kThreads, typename T>
__device__ __forceinline__ void load_tile(T* smem, const T* gmem, int64_t row_stride,
                                          int valid_rows, int tid) {
  constexpr int kChunks = kHeadDim / 8;
  static_assert((kRows * kChunks) % kThreads == 0, "every thread copies the same count");
#pragma unroll
  for (int i = 0; i < kRows * kChunks / kThreads; ++i) {
    const int idx = tid + i * kThreads;
    const int row = idx / kChunks, chunk = idx % kChunks;
    const bool valid = row < valid_rows;
    fa::cp_async_16(smem + swizzle<kChunks>(row, chunk),
                    gmem + (valid ? row : 0) * row_stride + chunk * 8, valid);
  }
}

/// Adds two adjacent floats to fp32 device memory (`dst` 8-byte aligned). sm_90 has a
/// vector `red.global.add.v2.f32`; older GPUs take two scalar atomics.
__device__ __forceinline__ void atomic_add_pair(float* dst, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(dst), make_float2(x, y));
#else
  atomicAdd(dst, x);
  atomicAdd(dst + 1, y);
#endif
}

/// Packs an fp32 accumulator (m16n8 C layout, `acc[n8 tile][4]`) into 16-bit pairs:
/// `out[tile][0]` = row `lane/4`, `out[tile][1]` = row `lane/4 + 8`, columns `2(lane%4)..+1`.
template <typename T, int kTiles>
__device__ __forceinline__ void pack_fragment(uint32_t (&out)[kTiles][2],
                                              const float (&acc)[kTiles][4]) {
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt) {
    out[nt][0] = fa::pack2<T>(acc[nt][0], acc[nt][1]);
    out[nt][1] = fa::pack2<T>(acc[nt][2], acc[nt][3]);
  }
}

/// Element `hi` (0: low, 1: high) of a pair packed by fa::pack2, widened to fp32.
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

/// Warp-level \f$C \mathrel{+}= A B^T\f$ on tensor cores: \f$A\f$ is rows `a_row0..+15` and
/// \f$B\f$ rows `b_row0..+kN-1` of two swizzled shared-memory tiles stored [row][k] (k =
/// `kK` contiguous elements, e.g. the head dim), so both operands load with plain ldmatrix:
/// A as four 8x8 matrices (rows 0-7 / 8-15 x k 0-7 / 8-15), B as two n8 tiles per x4. `acc` is
/// the 16 x kN fp32 accumulator in the m16n8 C layout of mma.cuh.
template <typename T, int kN, int kK>
__device__ __forceinline__ void warp_mma_abt(float (&acc)[kN / 8][4], const T* a_tile, int a_row0,
                                             const T* b_tile, int b_row0, int lane) {
  constexpr int kChunks = kK / 8;
#pragma unroll 4
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t a[4];
    fa::ldmatrix_x4(a, a_tile + swizzle<kChunks>(a_row0 + (lane & 7) + 8 * ((lane >> 3) & 1),
                                                 2 * kk + (lane >> 4)));
#pragma unroll
    for (int nt = 0; nt < kN / 8; nt += 2) {
      uint32_t b[4];
      fa::ldmatrix_x4(b, b_tile + swizzle<kChunks>(b_row0 + nt * 8 + (lane & 7) + 8 * (lane >> 4),
                                                   2 * kk + ((lane >> 3) & 1)));
      fa::mma_m16n8k16<T>(acc[nt], a, {b[0], b[1]});
      fa::mma_m16n8k16<T>(acc[nt + 1], a, {b[2], b[3]});
    }
  }
}

/// Warp-level \f$C \mathrel{+}= A B\f$ with \f$A\f$ (16 x kK) already in registers as packed
/// 16-bit pairs in the C layout of an earlier product (`a[n8 tile][row half]`, see
/// `pack_fragment`): two adjacent n8 accumulator tiles are exactly one k16 A operand, so
/// \f$P\f$ and \f$dS\f$ feed the next product without leaving registers. \f$B\f$ (kK x kN) is
/// rows `b_row0..` of a swizzled [k][n] tile with `kRowChunks` chunks per row, starting at
/// column chunk `b_chunk0`; k runs down the rows, so it loads with ldmatrix.trans.
template <typename T, int kN, int kK, int kRowChunks>
__device__ __forceinline__ void warp_mma_ab_reg(float (&acc)[kN / 8][4],
                                                const uint32_t (&a)[kK / 8][2], const T* b_tile,
                                                int b_row0, int b_chunk0, int lane) {
#pragma unroll
  for (int t = 0; t < kK / 16; ++t) {
    const uint32_t a_frag[4] = {a[2 * t][0], a[2 * t][1], a[2 * t + 1][0], a[2 * t + 1][1]};
#pragma unroll
    for (int nd = 0; nd < kN / 8; nd += 2) {
      uint32_t b[4];
      fa::ldmatrix_x4_trans(
          b, b_tile + swizzle<kRowChunks>(b_row0 + 16 * t + (lane & 7) + 8 * ((lane >> 3) & 1),
                                          b_chunk0 + nd + (lane >> 4)));
      fa::mma_m16n8k16<T>(acc[nd], a_frag, {b[0], b[1]});
      fa::mma_m16n8k16<T>(acc[nd + 1], a_frag, {b[2], b[3]});
    }
  }
}

/// Rows of the padded per-row scratch (`lse_log2`, `d_row`): seqlen_q rounded up to a multiple
/// of every q_block size, so that q_block loads of it need no bounds check.
constexpr int kRowPad = 64;

/// Preprocess, one group of 8 threads per query row (i, head, batch):
/// \f$D_i = \sum_c dO_{ic} O_{ic}\f$ (fp32), \f$L_i \log_2 e\f$ (for the exp2 trick) and, when
/// `dq_accum` is not null, a zeroed fp32 dQ accumulator row. Padding rows
/// \f$N_q \le i < N_{q,\mathrm{pad}}\f$ get \f$D_i = 0\f$ and \f$L_i = +\infty\f$, so that they
/// contribute \f$P = 0\f$.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(256)
    flash_bwd_preprocess_kernel(const fa_bwd_args args, int seqlen_q_pad, float* lse_log2,
                                float* d_row, float* dq_accum) {
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
    if (dq_accum != nullptr) {
      float4* dq_row = reinterpret_cast<float4*>(dq_accum + (bh * f.seqlen_q + row) * kHeadDim);
      for (int i = sub; i < kHeadDim / 4; i += kLanesPerRow) dq_row[i] = make_float4(0, 0, 0, 0);
    }
  }
  for (int offset = kLanesPerRow / 2; offset > 0; offset /= 2)
    dot += __shfl_xor_sync(0xffffffffu, dot, offset);
  if (sub == 0) {
    const int64_t idx = bh * seqlen_q_pad + row;
    d_row[idx] = dot;
    lse_log2[idx] = row < f.seqlen_q ? f.lse[bh * f.seqlen_q + row] * kLog2e : INFINITY;
  }
}

/// Tile shape of the main (dK, dV) kernel for one head dimension. 8 warps; `kBlockN` keys of
/// a kv_block (16 per warp row), `kBlockM` queries of a q_block, `kWarpsN x kWarpsM` warps
/// over (keys x queries) for \f$S^T\f$, \f$dP^T\f$, \f$dV\f$ and \f$dK\f$; `kStagesDo` dO buffers.
/// Both fit the 99 KB of shared memory of every sm_80+ GPU.
template <int kHeadDim>
struct BwdTiles;
template <>
struct BwdTiles<64> {
  static constexpr int kBlockN = 128, kBlockM = 64, kWarpsN = 8, kStagesDo = 2;
};
template <>
struct BwdTiles<128> {
  static constexpr int kBlockN = 64, kBlockM = 64, kWarpsN = 4, kStagesDo = 1;
};

/// Threads of the main kernel.
constexpr int kBwdThreads = 256;

/// Shared memory of the main kernel: K, V, two Q buffers, dO buffers, \f$dS^T\f$ (atomic mode
/// only), and per stage the q_block's \f$L \log_2 e\f$ and D. The epilogue reuses it as an fp32
/// staging area for dK and dV; the launch takes the larger of the two.
template <int kHeadDim, bool kAtomicDq>
constexpr int dkdv_smem_bytes() {
  using C = BwdTiles<kHeadDim>;
  constexpr int kMain =
      2 * (2 * C::kBlockN * kHeadDim + (2 + C::kStagesDo) * C::kBlockM * kHeadDim +
           (kAtomicDq ? C::kBlockN * C::kBlockM : 0)) +
      4 * (2 * 2 * C::kBlockM);
  constexpr int kEpilogue = 4 * (kBwdThreads / 32 / C::kWarpsN) * C::kBlockN * (kHeadDim + 8);
  return kMain > kEpilogue ? kMain : kEpilogue;
}

/// Writes one kv_block's dK or dV (`mult` times the sum of the warps' fp32 partials `acc`) to
/// device memory. The accumulator fragments go to an fp32 staging tile in shared memory
/// (padded rows, conflict-free), the `kWarpsM` partials of a key row (warps that split the
/// queries) are summed there, and each thread stores 16-byte chunks; rows at or past
/// `valid_rows` are not stored.
template <int kHeadDim, int kBlockN, int kWarpsM, typename T>
__device__ __forceinline__ void store_kv_grad(const float (&acc)[kHeadDim / 8][4], float mult,
                                              float* stage, T* gmem, int64_t row_stride,
                                              int valid_rows, int warp_m, int key0, int lane,
                                              int tid) {
  constexpr int kStride = kHeadDim + 8, kChunks = kHeadDim / 8;
  __syncthreads();  // the staging area is free
  float* mine = stage + (warp_m * kBlockN + key0 + lane / 4) * kStride + 2 * (lane % 4);
#pragma unroll
  for (int nd = 0; nd < kHeadDim / 8; ++nd) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      *reinterpret_cast<float2*>(mine + half * 8 * kStride + nd * 8) =
          make_float2(acc[nd][2 * half], acc[nd][2 * half + 1]);
    }
  }
  __syncthreads();
#pragma unroll
  for (int idx = tid; idx < kBlockN * kChunks; idx += kBwdThreads) {
    const int row = idx / kChunks, chunk = idx % kChunks;
    float sum[8] = {};
#pragma unroll
    for (int wm = 0; wm < kWarpsM; ++wm) {
      const float4* src =
          reinterpret_cast<const float4*>(stage + (wm * kBlockN + row) * kStride + chunk * 8);
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
      *reinterpret_cast<uint4*>(gmem + row * row_stride + chunk * 8) = out;
    }
  }
}

/// Main backward kernel, one thread block per (kv_block j, kv head, batch). K_j and V_j stay
/// in shared memory, \f$dK_j\f$ and \f$dV_j\f$ in registers; the inner loop walks the q_blocks
/// i of every query head of the GQA group (under causal masking only those with a row that
/// sees a key of the block) and, with \f$P\f$ recomputed from the stored lse,
/// \f[ P_{ij} = 2^{S_{ij}\log_2 e - L_i \log_2 e},\quad dV_j \mathrel{+}= P_{ij}^T dO_i,\quad
///     dP_{ij} = dO_i V_j^T,\quad dS_{ij} = P_{ij} \circ (dP_{ij} - D_i), \f]
/// \f[ dK_j \mathrel{+}= \mathrm{scale}\cdot dS_{ij}^T Q_i,\quad
///     dQ_i \mathrel{+}= dS_{ij} K_j \ \text{(atomic mode; scaled by the convert kernel)}. \f]
/// Each warp computes a slice of \f$S^T = K Q^T\f$ and \f$dP^T = V dO^T\f$ (16 keys x
/// kBlockM / kWarpsM queries); their accumulator fragments are, converted to 16 bits, exactly
/// the A operands of \f$P^T dO\f$ and \f$dS^T Q\f$, so P never leaves registers. \f$dS^T\f$ goes
/// through shared memory once, to feed \f$dS K\f$, whose reduction runs over all keys.
template <typename T, int kHeadDim, bool kAtomicDq>
__global__ void __launch_bounds__(kBwdThreads, 1)
    flash_bwd_dkdv_kernel(const fa_bwd_args args, float* dq_accum, const float* lse_log2,
                          const float* d_row, int seqlen_q_pad, float scale_log2) {
  using C = BwdTiles<kHeadDim>;
  constexpr int kBlockN = C::kBlockN, kBlockM = C::kBlockM, kStagesDo = C::kStagesDo;
  constexpr int kWarpsN = C::kWarpsN, kWarpsM = kBwdThreads / 32 / kWarpsN;
  constexpr int kWarpQ = kBlockM / kWarpsM;  // queries per warp in S^T, dP^T, dV, dK
  constexpr int kChunks = kHeadDim / 8, kDsChunks = kBlockM / 8;
  constexpr int kTileQ = kBlockM * kHeadDim, kTileK = kBlockN * kHeadDim;
  static_assert(kBlockN == 16 * kWarpsN && kWarpQ % 16 == 0, "warp tiles are m16 x k16");

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* s_k = reinterpret_cast<T*>(smem_raw);
  T* s_v = s_k + kTileK;
  T* s_q = s_v + kTileK;                // [2][kBlockM][kHeadDim]
  T* s_do = s_q + 2 * kTileQ;           // [kStagesDo][kBlockM][kHeadDim]
  T* s_ds = s_do + kStagesDo * kTileQ;  // [kBlockN][kBlockM]: dS^T (atomic mode)
  float* s_lse = reinterpret_cast<float*>(s_ds + (kAtomicDq ? kBlockN * kBlockM : 0));  // [2][M]
  float* s_d = s_lse + 2 * kBlockM;                                                     // [2][M]

  const fa_fwd_args& f = args.fwd;
  const int kv_block = blockIdx.x, head_kv = blockIdx.y, batch = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int lane_row = lane / 4, lane_col = lane % 4;  // fragment row and column pair
  const int warp_n = warp % kWarpsN, warp_m = warp / kWarpsN;
  const int key0 = warp_n * 16, query0 = warp_m * kWarpQ;  // this warp's slice of the tile
  const int group_size = f.heads / f.heads_kv;
  const int kv_base = kv_block * kBlockN;
  const int offset = f.seqlen_k - f.seqlen_q;  // causal: row i sees key j iff j <= i + offset

  // Q blocks this kv_block needs: all of them, or under causal masking those from the first
  // one holding a row i >= kv_base - offset (earlier ones are fully masked: skipped).
  const int num_q_blocks = (f.seqlen_q + kBlockM - 1) / kBlockM;
  const int m_begin = f.causal ? min(num_q_blocks, max(0, kv_base - offset) / kBlockM) : 0;
  const int m_count = num_q_blocks - m_begin;
  const int num_iters = group_size * m_count;  // (query head of the group, q_block) pairs

  const T* q_gmem = static_cast<const T*>(f.q.ptr) + batch * f.q.batch_stride;
  const T* do_gmem = static_cast<const T*>(args.d_o.ptr) + batch * args.d_o.batch_stride;

  // Loads the q_block of iteration `it` (Q, and dO if `with_do`; lse and D with Q).
  auto load_q_block = [&](int it, bool with_q, bool with_do) {
    const int head = head_kv * group_size + it / m_count;
    const int q_base = (m_begin + it % m_count) * kBlockM;
    const int stage = it & 1;
    if (with_q) {
      load_tile<kBlockM, kHeadDim, kBwdThreads>(
          s_q + stage * kTileQ, q_gmem + head * f.q.head_stride + q_base * f.q.row_stride,
          f.q.row_stride, f.seqlen_q - q_base, tid);
      const int64_t row0 = (static_cast<int64_t>(batch) * f.heads + head) * seqlen_q_pad + q_base;
      if (tid < kBlockM / 4) {
        fa::cp_async_16(s_lse + stage * kBlockM + tid * 4, lse_log2 + row0 + tid * 4, true);
      } else if (tid < kBlockM / 2) {
        const int i = tid - kBlockM / 4;
        fa::cp_async_16(s_d + stage * kBlockM + i * 4, d_row + row0 + i * 4, true);
      }
    }
    if (with_do) {
      load_tile<kBlockM, kHeadDim, kBwdThreads>(
          s_do + (kStagesDo == 2 ? stage : 0) * kTileQ,
          do_gmem + head * args.d_o.head_stride + q_base * args.d_o.row_stride, args.d_o.row_stride,
          f.seqlen_q - q_base, tid);
    }
  };

  const int64_t k_off = batch * f.k.batch_stride + head_kv * f.k.head_stride;
  const int64_t v_off = batch * f.v.batch_stride + head_kv * f.v.head_stride;
  load_tile<kBlockN, kHeadDim, kBwdThreads>(
      s_k, static_cast<const T*>(f.k.ptr) + k_off + kv_base * f.k.row_stride, f.k.row_stride,
      f.seqlen_k - kv_base, tid);
  load_tile<kBlockN, kHeadDim, kBwdThreads>(
      s_v, static_cast<const T*>(f.v.ptr) + v_off + kv_base * f.v.row_stride, f.v.row_stride,
      f.seqlen_k - kv_base, tid);
  if (num_iters > 0) load_q_block(0, true, true);
  fa::cp_async_commit();

  float dv_acc[kHeadDim / 8][4] = {};  // dV_j, this warp's 16 keys x kHeadDim
  float dk_acc[kHeadDim / 8][4] = {};  // dK_j (unscaled)

  for (int it = 0; it < num_iters; ++it) {
    const int head = head_kv * group_size + it / m_count;
    const int q_base = (m_begin + it % m_count) * kBlockM;
    const int stage = it & 1;
    const T* q_tile = s_q + stage * kTileQ;
    const T* do_tile = s_do + (kStagesDo == 2 ? stage : 0) * kTileQ;

    fa::cp_async_wait<0>();
    __syncthreads();  // Q_i, dO_i, lse, D have landed; the other stage is free
    if (it + 1 < num_iters) load_q_block(it + 1, true, kStagesDo == 2);
    fa::cp_async_commit();

    // P is recomputed, never stored: S^T = K_j Q_i^T (16 keys x kWarpQ queries per warp),
    // P^T = exp2(S^T scale log2e - L log2e) with masked entries (keys past N_k in a ragged
    // last kv_block; causal j > i + offset) set to 0.
    const bool need_mask =
        kv_base + kBlockN > f.seqlen_k || (f.causal && kv_base + kBlockN - 1 > q_base + offset);
    const float* lse_tile = s_lse + stage * kBlockM;
    const float* d_tile = s_d + stage * kBlockM;
    uint32_t p_pack[kWarpQ / 8][2];
    {
      float s_acc[kWarpQ / 8][4] = {};
      warp_mma_abt<T, kWarpQ, kHeadDim>(s_acc, s_k, key0, q_tile, query0, lane);
#pragma unroll
      for (int nt = 0; nt < kWarpQ / 8; ++nt) {
        const int q_local = query0 + nt * 8 + 2 * lane_col;  // columns are queries
        const float2 lse2 = *reinterpret_cast<const float2*>(lse_tile + q_local);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float p = fa::exp2_approx(fmaf(s_acc[nt][e], scale_log2, (e & 1) ? -lse2.y : -lse2.x));
          if (need_mask) {
            const int key = kv_base + key0 + lane_row + 8 * (e >> 1);
            const int query = q_base + q_local + (e & 1);
            if (key >= f.seqlen_k || (f.causal && key > query + offset)) p = 0.f;
          }
          s_acc[nt][e] = p;
        }
      }
      pack_fragment<T>(p_pack, s_acc);
    }
    // dV_j += P^T dO_i (B = dO_i, [query][d], k = query).
    warp_mma_ab_reg<T, kHeadDim, kWarpQ, kChunks>(dv_acc, p_pack, do_tile, query0, 0, lane);

    // dP^T = V_j dO_i^T, dS^T = P^T (dP^T - D).
    uint32_t ds_pack[kWarpQ / 8][2];
    {
      float dp_acc[kWarpQ / 8][4] = {};
      warp_mma_abt<T, kWarpQ, kHeadDim>(dp_acc, s_v, key0, do_tile, query0, lane);
#pragma unroll
      for (int nt = 0; nt < kWarpQ / 8; ++nt) {
        const float2 d2 = *reinterpret_cast<const float2*>(d_tile + query0 + nt * 8 + 2 * lane_col);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float p = unpack_half<T>(p_pack[nt][e >> 1], e & 1);
          dp_acc[nt][e] = p * (dp_acc[nt][e] - ((e & 1) ? d2.y : d2.x));
        }
      }
      pack_fragment<T>(ds_pack, dp_acc);
    }
    // dK_j += dS^T Q_i (B = Q_i, [query][d], k = query); scaled once in the epilogue.
    warp_mma_ab_reg<T, kHeadDim, kWarpQ, kChunks>(dk_acc, ds_pack, q_tile, query0, 0, lane);

    if constexpr (kAtomicDq) {
      // dS^T to shared memory, [key][query]: the dQ product needs all keys of a query row.
#pragma unroll
      for (int nt = 0; nt < kWarpQ / 8; ++nt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int key = key0 + lane_row + 8 * half;
          *reinterpret_cast<uint32_t*>(s_ds + swizzle<kDsChunks>(key, query0 / 8 + nt) +
                                       2 * lane_col) = ds_pack[nt][half];
        }
      }
    }
    if constexpr (kAtomicDq || kStagesDo == 1) __syncthreads();  // dS^T visible; dO_i read
    if constexpr (kStagesDo == 1) {
      if (it + 1 < num_iters) load_q_block(it + 1, false, true);
      fa::cp_async_commit();
    }

    if constexpr (kAtomicDq) {
      // dQ_i += dS K_j: warps split the q_block 16 rows x (kHeadDim / kDqWarpsD) columns,
      // done in passes of 32 columns (fewer live registers). A = dS, read from dS^T by
      // ldmatrix.trans; B = K_j ([key][d], k = key) by ldmatrix.trans. Then fp32 atomics.
      constexpr int kDqWarpsM = kBlockM / 16, kDqWarpsD = kBwdThreads / 32 / kDqWarpsM;
      constexpr int kDqCols = kHeadDim / kDqWarpsD, kPassCols = 32;
      static_assert(kDqCols % kPassCols == 0, "dQ columns come in passes of 32");
      const int dq_row0 = (warp % kDqWarpsM) * 16;
      const int64_t bh = static_cast<int64_t>(batch) * f.heads + head;
#pragma unroll
      for (int pass = 0; pass < kDqCols / kPassCols; ++pass) {
        const int dq_col0 = (warp / kDqWarpsM) * kDqCols + pass * kPassCols;
        float dq_acc[kPassCols / 8][4] = {};
#pragma unroll 2
        for (int kt = 0; kt < kBlockN / 16; ++kt) {
          uint32_t a_ds[4];
          fa::ldmatrix_x4_trans(a_ds,
                                s_ds + swizzle<kDsChunks>(16 * kt + (lane & 7) + 8 * (lane >> 4),
                                                          dq_row0 / 8 + ((lane >> 3) & 1)));
#pragma unroll
          for (int nd = 0; nd < kPassCols / 8; nd += 2) {
            uint32_t b_k[4];
            fa::ldmatrix_x4_trans(
                b_k, s_k + swizzle<kChunks>(16 * kt + (lane & 7) + 8 * ((lane >> 3) & 1),
                                            dq_col0 / 8 + nd + (lane >> 4)));
            fa::mma_m16n8k16<T>(dq_acc[nd], a_ds, {b_k[0], b_k[1]});
            fa::mma_m16n8k16<T>(dq_acc[nd + 1], a_ds, {b_k[2], b_k[3]});
          }
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = q_base + dq_row0 + lane_row + 8 * half;
          if (row < f.seqlen_q) {
            float* dst = dq_accum + (bh * f.seqlen_q + row) * kHeadDim + dq_col0 + 2 * lane_col;
#pragma unroll
            for (int nd = 0; nd < kPassCols / 8; ++nd)
              atomic_add_pair(dst + nd * 8, dq_acc[nd][2 * half], dq_acc[nd][2 * half + 1]);
          }
        }
      }
    }
  }

  // Epilogue: dV_j and scale * dK_j, summed over the warps that split the queries.
  fa::cp_async_wait<0>();
  float* stage = reinterpret_cast<float*>(smem_raw);
  const int valid_keys = f.seqlen_k - kv_base;
  store_kv_grad<kHeadDim, kBlockN, kWarpsM>(
      dv_acc, 1.f, stage,
      static_cast<T*>(args.dv.ptr) + batch * args.dv.batch_stride + head_kv * args.dv.head_stride +
          kv_base * args.dv.row_stride,
      args.dv.row_stride, valid_keys, warp_m, key0, lane, tid);
  store_kv_grad<kHeadDim, kBlockN, kWarpsM>(
      dk_acc, f.scale, stage,
      static_cast<T*>(args.dk.ptr) + batch * args.dk.batch_stride + head_kv * args.dk.head_stride +
          kv_base * args.dk.row_stride,
      args.dk.row_stride, valid_keys, warp_m, key0, lane, tid);
}

/// Converts the fp32 accumulator to the output: \f$dQ = \mathrm{scale} \cdot
/// \mathrm{dq\_accum}\f$ in the input dtype, one thread per 8 elements, strided store.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(256)
    flash_bwd_convert_dq_kernel(const fa_bwd_args args, const float* dq_accum) {
  constexpr int kChunks = kHeadDim / 8;
  const fa_fwd_args& f = args.fwd;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x;
  const int head = blockIdx.y, batch = blockIdx.z;
  if (idx >= static_cast<int64_t>(f.seqlen_q) * kChunks) return;
  const int row = static_cast<int>(idx / kChunks), chunk = static_cast<int>(idx % kChunks);
  const float4* src = reinterpret_cast<const float4*>(
      dq_accum + ((static_cast<int64_t>(batch) * f.heads + head) * f.seqlen_q + row) * kHeadDim +
      chunk * 8);
  const float4 lo = src[0], hi = src[1];
  const float s = f.scale;
  uint4 out;
  out.x = fa::pack2<T>(lo.x * s, lo.y * s);
  out.y = fa::pack2<T>(lo.z * s, lo.w * s);
  out.z = fa::pack2<T>(hi.x * s, hi.y * s);
  out.w = fa::pack2<T>(hi.z * s, hi.w * s);
  *reinterpret_cast<uint4*>(static_cast<T*>(args.dq.ptr) + batch * args.dq.batch_stride +
                            row * args.dq.row_stride + head * args.dq.head_stride + chunk * 8) =
      out;
}

/// Tile shape of the deterministic dQ kernel: 4 warps of 16 query rows, kv_blocks of 64 keys.
constexpr int kDqBlockM = 64, kDqBlockN = 64, kDqThreads = 128;

/// Shared memory of the dQ kernel: Q, dO, two K buffers, one V buffer.
template <int kHeadDim>
constexpr int dq_smem_bytes() {
  return 2 * (2 * kDqBlockM * kHeadDim + 3 * kDqBlockN * kHeadDim);
}

/// Deterministic dQ, one thread block per (q_block i, query head, batch), the loop order of
/// the forward: the K/V blocks j that row block i sees are visited in order and
/// \f[ dQ_i = \mathrm{scale} \sum_j \big(P_{ij} \circ (dO_i V_j^T - D_i)\big) K_j \f]
/// is summed in registers, with \f$P_{ij}\f$ recomputed from the lse. Each warp owns 16 query
/// rows, so dS never leaves registers (its accumulator fragments are the A operand of
/// \f$dS K\f$). No atomics: the sum order is fixed, so results are bit-identical run to run.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kDqThreads)
    flash_bwd_dq_kernel(const fa_bwd_args args, const float* lse_log2, const float* d_row,
                        int seqlen_q_pad, float scale_log2) {
  constexpr int kBlockM = kDqBlockM, kBlockN = kDqBlockN, kChunks = kHeadDim / 8;
  constexpr int kTileQ = kBlockM * kHeadDim, kTileK = kBlockN * kHeadDim;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* s_q = reinterpret_cast<T*>(smem_raw);
  T* s_do = s_q + kTileQ;
  T* s_k = s_do + kTileQ;  // [2][kBlockN][kHeadDim]
  T* s_v = s_k + 2 * kTileK;

  const fa_fwd_args& f = args.fwd;
  const int m_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int lane_row = lane / 4, lane_col = lane % 4;
  const int head_kv = head / (f.heads / f.heads_kv);
  const int q_base = m_block * kBlockM;
  const int offset = f.seqlen_k - f.seqlen_q;

  // kv_blocks this q_block sees: all, or under causal masking up to the one holding the last
  // key its last row sees.
  int n_end = (f.seqlen_k + kBlockN - 1) / kBlockN;
  if (f.causal) {
    const int last_key = q_base + kBlockM - 1 + offset;
    n_end = min(n_end, last_key < 0 ? 0 : last_key / kBlockN + 1);
  }

  const T* k_gmem =
      static_cast<const T*>(f.k.ptr) + batch * f.k.batch_stride + head_kv * f.k.head_stride;
  const T* v_gmem =
      static_cast<const T*>(f.v.ptr) + batch * f.v.batch_stride + head_kv * f.v.head_stride;
  load_tile<kBlockM, kHeadDim, kDqThreads>(s_q,
                                           static_cast<const T*>(f.q.ptr) +
                                               batch * f.q.batch_stride + head * f.q.head_stride +
                                               q_base * f.q.row_stride,
                                           f.q.row_stride, f.seqlen_q - q_base, tid);
  load_tile<kBlockM, kHeadDim, kDqThreads>(
      s_do,
      static_cast<const T*>(args.d_o.ptr) + batch * args.d_o.batch_stride +
          head * args.d_o.head_stride + q_base * args.d_o.row_stride,
      args.d_o.row_stride, f.seqlen_q - q_base, tid);
  if (n_end > 0) {
    load_tile<kBlockN, kHeadDim, kDqThreads>(s_k, k_gmem, f.k.row_stride, f.seqlen_k, tid);
    load_tile<kBlockN, kHeadDim, kDqThreads>(s_v, v_gmem, f.v.row_stride, f.seqlen_k, tid);
  }
  fa::cp_async_commit();

  // L log2e and D of this thread's two fragment rows (padded scratch: always in range).
  const int64_t row_idx =
      (static_cast<int64_t>(batch) * f.heads + head) * seqlen_q_pad + q_base + warp * 16 + lane_row;
  const float lse_r[2] = {lse_log2[row_idx], lse_log2[row_idx + 8]};
  const float d_r[2] = {d_row[row_idx], d_row[row_idx + 8]};

  float dq_acc[kHeadDim / 8][4] = {};
  for (int n = 0; n < n_end; ++n) {
    const int kv_base = n * kBlockN;
    const T* k_tile = s_k + (n & 1) * kTileK;
    fa::cp_async_wait<0>();
    __syncthreads();  // K_j, V_j landed; the other K buffer is free
    if (n + 1 < n_end) {
      load_tile<kBlockN, kHeadDim, kDqThreads>(s_k + ((n + 1) & 1) * kTileK,
                                               k_gmem + (kv_base + kBlockN) * f.k.row_stride,
                                               f.k.row_stride, f.seqlen_k - kv_base - kBlockN, tid);
    }
    fa::cp_async_commit();

    // S = Q_i K_j^T (16 rows x kBlockN keys per warp), P = exp2(S scale log2e - L log2e),
    // masked as in the main kernel.
    const bool need_mask =
        kv_base + kBlockN > f.seqlen_k || (f.causal && kv_base + kBlockN - 1 > q_base + offset);
    uint32_t p_pack[kBlockN / 8][2];
    {
      float s_acc[kBlockN / 8][4] = {};
      warp_mma_abt<T, kBlockN, kHeadDim>(s_acc, s_q, warp * 16, k_tile, 0, lane);
#pragma unroll
      for (int nt = 0; nt < kBlockN / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float p = fa::exp2_approx(fmaf(s_acc[nt][e], scale_log2, -lse_r[e >> 1]));
          if (need_mask) {
            const int key = kv_base + nt * 8 + 2 * lane_col + (e & 1);
            const int query = q_base + warp * 16 + lane_row + 8 * (e >> 1);
            if (key >= f.seqlen_k || (f.causal && key > query + offset)) p = 0.f;
          }
          s_acc[nt][e] = p;
        }
      }
      pack_fragment<T>(p_pack, s_acc);
    }
    // dP = dO_i V_j^T, dS = P (dP - D).
    uint32_t ds_pack[kBlockN / 8][2];
    {
      float dp_acc[kBlockN / 8][4] = {};
      warp_mma_abt<T, kBlockN, kHeadDim>(dp_acc, s_do, warp * 16, s_v, 0, lane);
#pragma unroll
      for (int nt = 0; nt < kBlockN / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float p = unpack_half<T>(p_pack[nt][e >> 1], e & 1);
          dp_acc[nt][e] = p * (dp_acc[nt][e] - d_r[e >> 1]);
        }
      }
      pack_fragment<T>(ds_pack, dp_acc);
    }
    __syncthreads();  // every warp is done with V_j
    if (n + 1 < n_end) {
      load_tile<kBlockN, kHeadDim, kDqThreads>(s_v, v_gmem + (kv_base + kBlockN) * f.v.row_stride,
                                               f.v.row_stride, f.seqlen_k - kv_base - kBlockN, tid);
    }
    fa::cp_async_commit();

    // dQ_i += dS K_j (B = K_j, [key][d], k = key).
    warp_mma_ab_reg<T, kHeadDim, kBlockN, kChunks>(dq_acc, ds_pack, k_tile, 0, 0, lane);
  }

  // Epilogue: scale * dQ_i in the input dtype, through shared memory for 16-byte stores.
  fa::cp_async_wait<0>();
  __syncthreads();
#pragma unroll
  for (int nd = 0; nd < kHeadDim / 8; ++nd) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      *reinterpret_cast<uint32_t*>(s_q + swizzle<kChunks>(warp * 16 + lane_row + 8 * half, nd) +
                                   2 * lane_col) =
          fa::pack2<T>(dq_acc[nd][2 * half] * f.scale, dq_acc[nd][2 * half + 1] * f.scale);
    }
  }
  __syncthreads();
  T* dq = static_cast<T*>(args.dq.ptr) + batch * args.dq.batch_stride + head * args.dq.head_stride +
          q_base * args.dq.row_stride;
#pragma unroll
  for (int idx = tid; idx < kBlockM * kChunks; idx += kDqThreads) {
    const int row = idx / kChunks, chunk = idx % kChunks;
    if (q_base + row < f.seqlen_q) {
      *reinterpret_cast<uint4*>(dq + row * args.dq.row_stride + chunk * 8) =
          *reinterpret_cast<const uint4*>(s_q + swizzle<kChunks>(row, chunk));
    }
  }
}

/// Sets a kernel's dynamic shared memory limit and checks that the GPU has that much.
template <typename Kernel>
fa_status prepare_smem(Kernel kernel, int bytes, const char* what) {
  int device = 0, optin = 0;
  FA_CUDA_TRY(cudaGetDevice(&device));
  FA_CUDA_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (bytes > optin) {
    return fa::set_error(FA_ERR_UNSUPPORTED,
                         "07_backward: %s needs %d bytes of shared memory per block, this GPU "
                         "has %d",
                         what, bytes, optin);
  }
  FA_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  return FA_OK;
}

/// Launches the backward kernels on the scratch buffers (`dq_accum` null in deterministic
/// mode).
template <typename T, int kHeadDim>
fa_status backward_kernels(const fa_bwd_args& args, cudaStream_t stream, int seqlen_q_pad,
                           float* lse_log2, float* d_row, float* dq_accum) {
  const fa_fwd_args& f = args.fwd;
  const float scale_log2 = f.scale * kLog2e;

  flash_bwd_preprocess_kernel<T, kHeadDim>
      <<<dim3(seqlen_q_pad / 32, f.heads, f.batch), 256, 0, stream>>>(args, seqlen_q_pad, lse_log2,
                                                                      d_row, dq_accum);
  FA_LAUNCH_TRY();

  const dim3 dkdv_grid((f.seqlen_k + BwdTiles<kHeadDim>::kBlockN - 1) / BwdTiles<kHeadDim>::kBlockN,
                       f.heads_kv, f.batch);
  if (!args.deterministic) {
    constexpr int kSmem = dkdv_smem_bytes<kHeadDim, true>();
    auto kernel = flash_bwd_dkdv_kernel<T, kHeadDim, true>;
    fa_status st = prepare_smem(kernel, kSmem, "the dK/dV kernel");
    if (st != FA_OK) return st;
    kernel<<<dkdv_grid, kBwdThreads, kSmem, stream>>>(args, dq_accum, lse_log2, d_row, seqlen_q_pad,
                                                      scale_log2);
    FA_LAUNCH_TRY();
    constexpr int kChunks = kHeadDim / 8;
    const dim3 grid(static_cast<unsigned>((static_cast<int64_t>(f.seqlen_q) * kChunks + 255) / 256),
                    f.heads, f.batch);
    flash_bwd_convert_dq_kernel<T, kHeadDim><<<grid, 256, 0, stream>>>(args, dq_accum);
    FA_LAUNCH_TRY();
  } else {
    constexpr int kSmem = dkdv_smem_bytes<kHeadDim, false>();
    auto kernel = flash_bwd_dkdv_kernel<T, kHeadDim, false>;
    fa_status st = prepare_smem(kernel, kSmem, "the dK/dV kernel");
    if (st != FA_OK) return st;
    kernel<<<dkdv_grid, kBwdThreads, kSmem, stream>>>(args, nullptr, lse_log2, d_row, seqlen_q_pad,
                                                      scale_log2);
    FA_LAUNCH_TRY();
    constexpr int kDqSmem = dq_smem_bytes<kHeadDim>();
    auto dq_kernel = flash_bwd_dq_kernel<T, kHeadDim>;
    st = prepare_smem(dq_kernel, kDqSmem, "the dQ kernel");
    if (st != FA_OK) return st;
    const dim3 grid((f.seqlen_q + kDqBlockM - 1) / kDqBlockM, f.heads, f.batch);
    dq_kernel<<<grid, kDqThreads, kDqSmem, stream>>>(args, lse_log2, d_row, seqlen_q_pad,
                                                     scale_log2);
    FA_LAUNCH_TRY();
  }
  return FA_OK;
}

/// Backward pass for one dtype and head dim: allocates the scratch (stream ordered), runs the
/// kernels, frees the scratch.
template <typename T, int kHeadDim>
fa_status backward_impl(const fa_bwd_args& args, cudaStream_t stream) {
  const fa_fwd_args& f = args.fwd;
  const int seqlen_q_pad = (f.seqlen_q + kRowPad - 1) / kRowPad * kRowPad;
  const size_t row_floats = static_cast<size_t>(f.batch) * f.heads * seqlen_q_pad;
  const size_t dq_floats =
      args.deterministic ? 0 : static_cast<size_t>(f.batch) * f.heads * f.seqlen_q * kHeadDim;
  float* scratch = nullptr;
  const cudaError_t alloc =
      cudaMallocAsync(&scratch, (dq_floats + 2 * row_floats) * sizeof(float), stream);
  if (alloc == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return fa::set_error(FA_ERR_OUT_OF_MEMORY,
                         "07_backward: no device memory for %.1f MiB of scratch (dq_accum, D, lse)",
                         (dq_floats + 2 * row_floats) * 4.0 / 1048576.0);
  }
  FA_CUDA_TRY(alloc);
  float* dq_accum = args.deterministic ? nullptr : scratch;
  float* lse_log2 = scratch + dq_floats;
  float* d_row = lse_log2 + row_floats;
  const fa_status status =
      backward_kernels<T, kHeadDim>(args, stream, seqlen_q_pad, lse_log2, d_row, dq_accum);
  const cudaError_t freed = cudaFreeAsync(scratch, stream);  // stream ordered: after the kernels
  if (status != FA_OK) return status;
  FA_CUDA_TRY(freed);
  return FA_OK;
}

/// Backward pass: dispatch on dtype and head dim.
fa_status backward(const fa_bwd_args& args, cudaStream_t stream) {
  if (args.fwd.dtype == FA_BF16) {
    return args.fwd.head_dim == 64 ? backward_impl<__nv_bfloat16, 64>(args, stream)
                                   : backward_impl<__nv_bfloat16, 128>(args, stream);
  }
  return args.fwd.head_dim == 64 ? backward_impl<__half, 64>(args, stream)
                                 : backward_impl<__half, 128>(args, stream);
}

/// Head dims the kernels are instantiated for.
bool supports_head_dim(int head_dim) {
  return head_dim == 64 || head_dim == 128;
}

}  // namespace

FA_REGISTER_STEP("FA2 backward: recompute P from L, K/V outer loop, dQ by fp32 atomics", forward,
                 backward, supports_head_dim);
