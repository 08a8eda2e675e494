/// \file 01_naive/kernel.cu
/// \brief Step 01: standard attention, the way the papers write it before FlashAttention.
///
/// Three passes over device memory, for every (batch, head):
/// 1. \f$S = \mathrm{scale}\cdot Q K^T\f$, an \f$N_q \times N_k\f$ fp32 matrix (cuBLAS);
/// 2. \f$P = \mathrm{softmax}(S)\f$ row by row, causal mask applied here, written in the input
///    dtype, with the logsumexp \f$L\f$ (one kernel, one thread block per row);
/// 3. \f$O = P V\f$ (cuBLAS).
/// S and P make \f$\Theta(N^2)\f$ bytes of device-memory traffic per head, against
/// \f$\Theta(N d)\f$ for the inputs and the output: at N = 4096, d = 128 about 200 MB against
/// 4 MB per head, 48x more.
/// This is the baseline every later step is measured against. S and P live in a workspace that
/// is allocated once and kept between calls (fa/workspace.h), so that a timed call measures
/// the three passes, not the allocation of gigabytes.
///
/// The backward is the standard one too (the baseline for 07_backward): recompute S, form
/// \f$P = e^{S - L}\f$, then \f$dV = P^T dO\f$, \f$dP = dO\,V^T\f$,
/// \f$dS = P \circ (dP - D)\f$ with \f$D_i = dO_i \cdot O_i\f$, \f$dQ = s\,dS\,K\f$,
/// \f$dK = s\,dS^T Q\f$; P and dS are materialized in device memory, the five products
/// go through cuBLAS.
///
/// Run: `./build/bin/01_naive --seqlen 4096 --head-dim 128 --heads 16`
/// and  `./build/bin/01_naive --backward --seqlen 4096 --head-dim 128 --heads 16`
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "fa/check.cuh"
#include "fa/step.h"
#include "fa/workspace.h"

namespace {

/// Returns FA_ERR_CUDA from the enclosing launcher if a cuBLAS call fails.
#define CUBLAS_TRY(call)                                                                     \
  do {                                                                                       \
    cublasStatus_t st_ = (call);                                                             \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                        \
      return fa::set_error(FA_ERR_CUDA, "%s failed: %s", #call, cublasGetStatusString(st_)); \
  } while (0)

/// One cuBLAS handle per host thread and device, created on first use.
cublasHandle_t cublas_handle() {
  thread_local cublasHandle_t handles[64] = {};
  int device = 0;
  cudaGetDevice(&device);
  if (device < 0 || device >= 64) return nullptr;
  if (!handles[device] && cublasCreate(&handles[device]) != CUBLAS_STATUS_SUCCESS)
    handles[device] = nullptr;
  return handles[device];
}

/// `bytes` rounded up to a multiple of 256: the parts of a workspace start where cuBLAS and the
/// kernels read them at full speed (cudaMalloc's own alignment).
constexpr size_t aligned(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

/// Only under compute-sanitizer's initcheck (common/scripts/sanitize.sh sets
/// FA_INITCHECK_PREFILL=1): zero a scratch buffer that cuBLAS is about to overwrite. initcheck
/// does not see cuBLAS's writes on Hopper (common/scripts/initcheck_cublas.cu: a GEMM's output,
/// read by a one-line kernel, is reported uninitialized), so without this every read of S, dP
/// and the dK/dV accumulators by the kernels below is a false report. Normal runs skip it.
/// Any value but 0 (or empty) turns it on: an internal switch that only sanitize.sh sets.
cudaError_t prefill_for_initcheck(void* ptr, size_t bytes, cudaStream_t stream) {
  static const char* const env = std::getenv("FA_INITCHECK_PREFILL");
  static const bool prefill = env != nullptr && env[0] != '\0' && env[0] != '0';
  return prefill ? cudaMemsetAsync(ptr, 0, bytes, stream) : cudaSuccess;
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

/// Max (or sum) of one float per thread over the whole thread block.
template <bool kMax>
__device__ float block_reduce(float x, float* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) {
    float y = __shfl_xor_sync(0xffffffffu, x, offset);
    x = kMax ? fmaxf(x, y) : x + y;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch may still be read by the previous reduction
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = scratch[0];
  for (int w = 1; w < blockDim.x / 32; ++w) x = kMax ? fmaxf(x, scratch[w]) : x + scratch[w];
  return x;
}

constexpr int kSoftmaxThreads = 256;

/// Row softmax of S, one thread block per row (i, h, b):
/// \f$P_{ij} = e^{S_{ij} - m_i} / \ell_i\f$ with \f$m_i = \max_j S_{ij}\f$,
/// \f$\ell_i = \sum_j e^{S_{ij} - m_i}\f$, and \f$L_i = m_i + \log \ell_i\f$.
/// Under causal masking key j is visible iff \f$j \le i + N_k - N_q\f$; masked entries get
/// \f$P_{ij} = 0\f$. A row that sees no key gets P = 0 (so O = 0) and \f$L_i = +\infty\f$.
template <typename T>
__global__ void __launch_bounds__(kSoftmaxThreads)
    softmax_kernel(const float* __restrict__ s, T* __restrict__ p, float* __restrict__ lse,
                   int heads, int seqlen_q, int seqlen_k, bool causal) {
  __shared__ float scratch[kSoftmaxThreads / 32];
  const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t row = (static_cast<int64_t>(b) * heads + h) * seqlen_q + i;
  const float* s_row = s + row * seqlen_k;
  T* p_row = p + row * seqlen_k;
  // Keys [0, visible) are unmasked: all of them, or a prefix under causal masking.
  const int64_t last = causal ? static_cast<int64_t>(i) + seqlen_k - seqlen_q : seqlen_k - 1;
  const int visible = static_cast<int>(last < 0 ? 0 : (last >= seqlen_k ? seqlen_k : last + 1));

  float row_max = -INFINITY;
  for (int j = threadIdx.x; j < visible; j += blockDim.x) row_max = fmaxf(row_max, s_row[j]);
  row_max = block_reduce<true>(row_max, scratch);

  float row_sum = 0.f;
  for (int j = threadIdx.x; j < visible; j += blockDim.x) row_sum += __expf(s_row[j] - row_max);
  row_sum = block_reduce<false>(row_sum, scratch);

  const float inv_sum = visible > 0 ? 1.f / row_sum : 0.f;
  for (int j = threadIdx.x; j < seqlen_k; j += blockDim.x) {
    const float pj = j < visible ? __expf(s_row[j] - row_max) * inv_sum : 0.f;
    p_row[j] = from_float<T>(pj);
  }
  if (lse != nullptr && threadIdx.x == 0)
    lse[row] = visible > 0 ? row_max + logf(row_sum) : INFINITY;
}

/// Forward pass: two batched cuBLAS products around the softmax kernel.
template <typename T>
fa_status forward_impl(const fa_fwd_args& a, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(a.batch) * a.heads * a.seqlen_q;
  const int64_t s_elems = rows * a.seqlen_k;
  const size_t s_bytes = aligned(static_cast<size_t>(s_elems) * sizeof(float));
  const size_t p_bytes = aligned(static_cast<size_t>(s_elems) * sizeof(T));
  const size_t lse_bytes = a.lse ? 0 : static_cast<size_t>(rows) * sizeof(float);
  void* scratch = nullptr;
  const cudaError_t alloc = fa::workspace(s_bytes + p_bytes + lse_bytes, stream, &scratch);
  if (alloc == cudaErrorMemoryAllocation) {
    return fa::set_error(FA_ERR_OUT_OF_MEMORY,
                         "01_naive materializes S (fp32) and P: %.2f GiB for B*H*Nq*Nk = %lld "
                         "scores did not fit in device memory",
                         (s_bytes + p_bytes) / 1073741824.0, static_cast<long long>(s_elems));
  }
  FA_CUDA_TRY(alloc);
  cublasHandle_t handle = cublas_handle();
  if (!handle) return fa::set_error(FA_ERR_CUDA, "cublasCreate failed");
  CUBLAS_TRY(cublasSetStream(handle, stream));

  // S (fp32), then P, then L when the caller does not want it.
  float* s = static_cast<float*>(scratch);
  T* p = reinterpret_cast<T*>(static_cast<char*>(scratch) + s_bytes);
  float* lse =
      a.lse ? a.lse : reinterpret_cast<float*>(static_cast<char*>(scratch) + s_bytes + p_bytes);
  FA_CUDA_TRY(prefill_for_initcheck(s, s_bytes, stream));

  const cudaDataType_t dt = std::is_same<T, __half>::value ? CUDA_R_16F : CUDA_R_16BF;
  const int group = a.heads / a.heads_kv;  // query heads per key/value head (GQA)
  const int64_t nn = static_cast<int64_t>(a.seqlen_q) * a.seqlen_k;
  const float one = 1.f, zero = 0.f;
  const T* q = static_cast<const T*>(a.q.ptr);
  const T* k = static_cast<const T*>(a.k.ptr);
  const T* v = static_cast<const T*>(a.v.ptr);
  T* o = static_cast<T*>(a.o.ptr);
  fa_status status = FA_OK;

  // cuBLAS is column-major: a row-major [rows x cols] matrix with row stride ld is its
  // transpose in column-major. So S^T = K Q^T and O^T = V^T P^T. Query head h = hk*group + g
  // uses key/value head hk: for each (b, g), one strided batch runs over hk.
  for (int b = 0; b < a.batch && status == FA_OK; ++b) {
    for (int g = 0; g < group && status == FA_OK; ++g) {
      const T* q_bg = q + b * a.q.batch_stride + g * a.q.head_stride;
      const T* k_b = k + b * a.k.batch_stride;
      float* s_bg = s + (static_cast<int64_t>(b) * a.heads + g) * nn;
      // S^T [Nk x Nq] = scale * K [Nk x d] * Q^T [d x Nq]
      cublasStatus_t st = cublasGemmStridedBatchedEx(
          handle, CUBLAS_OP_T, CUBLAS_OP_N, a.seqlen_k, a.seqlen_q, a.head_dim, &a.scale, k_b, dt,
          static_cast<int>(a.k.row_stride), a.k.head_stride, q_bg, dt,
          static_cast<int>(a.q.row_stride), group * a.q.head_stride, &zero, s_bg, CUDA_R_32F,
          a.seqlen_k, group * nn, a.heads_kv, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      if (st != CUBLAS_STATUS_SUCCESS) {
        status = fa::set_error(FA_ERR_CUDA, "cublasGemmStridedBatchedEx (S = QK^T): %s",
                               cublasGetStatusString(st));
      }
    }
  }
  if (status == FA_OK) {
    dim3 grid(a.seqlen_q, a.heads, a.batch);
    softmax_kernel<T><<<grid, kSoftmaxThreads, 0, stream>>>(s, p, lse, a.heads, a.seqlen_q,
                                                            a.seqlen_k, a.causal != 0);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess)
      status = fa::set_error(FA_ERR_CUDA, "softmax_kernel launch: %s", cudaGetErrorString(err));
  }
  for (int b = 0; b < a.batch && status == FA_OK; ++b) {
    for (int g = 0; g < group && status == FA_OK; ++g) {
      const T* v_b = v + b * a.v.batch_stride;
      const T* p_bg = p + (static_cast<int64_t>(b) * a.heads + g) * nn;
      T* o_bg = o + b * a.o.batch_stride + g * a.o.head_stride;
      // O^T [d x Nq] = V^T [d x Nk] * P^T [Nk x Nq]
      cublasStatus_t st = cublasGemmStridedBatchedEx(
          handle, CUBLAS_OP_N, CUBLAS_OP_N, a.head_dim, a.seqlen_q, a.seqlen_k, &one, v_b, dt,
          static_cast<int>(a.v.row_stride), a.v.head_stride, p_bg, dt, a.seqlen_k, group * nn,
          &zero, o_bg, dt, static_cast<int>(a.o.row_stride), group * a.o.head_stride, a.heads_kv,
          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      if (st != CUBLAS_STATUS_SUCCESS) {
        status = fa::set_error(FA_ERR_CUDA, "cublasGemmStridedBatchedEx (O = PV): %s",
                               cublasGetStatusString(st));
      }
    }
  }
  return status;
}

/// One strided-batched product over the key/value heads \f$h_{kv}\f$ of batch b for group
/// member g (query head \f$h = h_{kv} G + g\f$), fp32 accumulation, column-major as cuBLAS
/// wants it. Pointers are already offset to (b, g); strides are per \f$h_{kv}\f$.
struct Gemm {
  cublasOperation_t op_a, op_b;
  int m, n, k;
  float alpha, beta;
  const void* a;
  cudaDataType_t a_type;
  int64_t lda, stride_a;
  const void* b;
  cudaDataType_t b_type;
  int64_t ldb, stride_b;
  void* c;
  cudaDataType_t c_type;
  int64_t ldc, stride_c;
};

fa_status run_gemm(cublasHandle_t handle, const Gemm& g, int batch_count, const char* what) {
  const cublasStatus_t st = cublasGemmStridedBatchedEx(
      handle, g.op_a, g.op_b, g.m, g.n, g.k, &g.alpha, g.a, g.a_type, static_cast<int>(g.lda),
      g.stride_a, g.b, g.b_type, static_cast<int>(g.ldb), g.stride_b, &g.beta, g.c, g.c_type,
      static_cast<int>(g.ldc), g.stride_c, batch_count, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (st != CUBLAS_STATUS_SUCCESS)
    return fa::set_error(FA_ERR_CUDA, "cuBLAS %s: %s", what, cublasGetStatusString(st));
  return FA_OK;
}

/// Recomputes \f$P_{ij} = e^{S_{ij} - L_i}\f$ from the stored logsumexp (0 where masked, and for
/// rows that see no key, whose L is \f$+\infty\f$). One thread block per row (i, h, b).
template <typename T>
__global__ void __launch_bounds__(kSoftmaxThreads)
    recompute_p_kernel(const float* __restrict__ s, const float* __restrict__ lse,
                       T* __restrict__ p, int heads, int seqlen_q, int seqlen_k, bool causal) {
  const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t row = (static_cast<int64_t>(b) * heads + h) * seqlen_q + i;
  const int64_t last = causal ? static_cast<int64_t>(i) + seqlen_k - seqlen_q : seqlen_k - 1;
  const float l = lse[row];
  for (int j = threadIdx.x; j < seqlen_k; j += blockDim.x) {
    const float pj = j <= last ? __expf(s[row * seqlen_k + j] - l) : 0.f;
    p[row * seqlen_k + j] = from_float<T>(pj);
  }
}

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  return static_cast<float>(x);
}

/// \f$dS_{ij} = P_{ij}(dP_{ij} - D_i)\f$ with \f$D_i = \sum_c dO_{ic} O_{ic}\f$, one thread
/// block per row (i, h, b). dP arrives in `dp` (fp32); dS is written in the input dtype.
template <typename T>
__global__ void __launch_bounds__(kSoftmaxThreads)
    ds_kernel(const float* __restrict__ dp, const T* __restrict__ p, const T* __restrict__ o,
              const T* __restrict__ d_o, fa_tensor o_t, fa_tensor do_t, T* __restrict__ ds,
              int heads, int seqlen_q, int seqlen_k, int head_dim) {
  __shared__ float scratch[kSoftmaxThreads / 32];
  const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t row = (static_cast<int64_t>(b) * heads + h) * seqlen_q + i;
  const T* o_row = o + b * o_t.batch_stride + i * o_t.row_stride + h * o_t.head_stride;
  const T* do_row = d_o + b * do_t.batch_stride + i * do_t.row_stride + h * do_t.head_stride;
  float d = 0.f;
  for (int c = threadIdx.x; c < head_dim; c += blockDim.x)
    d += to_float(o_row[c]) * to_float(do_row[c]);
  d = block_reduce<false>(d, scratch);
  for (int j = threadIdx.x; j < seqlen_k; j += blockDim.x) {
    const int64_t idx = row * seqlen_k + j;
    ds[idx] = from_float<T>(to_float(p[idx]) * (dp[idx] - d));
  }
}

/// Writes an fp32 accumulator [B, H_kv, N_k, d] into a strided dtype tensor.
template <typename T>
__global__ void convert_kernel(const float* __restrict__ acc, T* __restrict__ out, fa_tensor t,
                               int heads_kv, int seqlen_k, int head_dim, int64_t total) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int c = e % head_dim;
    const int64_t r = e / head_dim;
    const int j = r % seqlen_k;
    const int hk = (r / seqlen_k) % heads_kv;
    const int b = r / (static_cast<int64_t>(seqlen_k) * heads_kv);
    out[b * t.batch_stride + j * t.row_stride + hk * t.head_stride + c] = from_float<T>(acc[e]);
  }
}

/// Standard backward: P and dS materialized, five cuBLAS products, the group of query heads
/// that shares a key/value head summed into fp32 dK, dV accumulators (beta = 1).
template <typename T>
fa_status backward_impl(const fa_bwd_args& args, cudaStream_t stream) {
  const fa_fwd_args& a = args.fwd;
  const int64_t rows = static_cast<int64_t>(a.batch) * a.heads * a.seqlen_q;
  const int64_t s_elems = rows * a.seqlen_k;
  const int64_t kv_elems = static_cast<int64_t>(a.batch) * a.heads_kv * a.seqlen_k * a.head_dim;
  const size_t acc_bytes = aligned(kv_elems * sizeof(float)), s_bytes = aligned(s_elems * 4);
  const size_t p_bytes = aligned(s_elems * sizeof(T));
  const size_t need = 2 * acc_bytes + s_bytes + 2 * p_bytes;
  void* scratch = nullptr;
  const cudaError_t alloc = fa::workspace(need, stream, &scratch);
  if (alloc == cudaErrorMemoryAllocation) {
    return fa::set_error(FA_ERR_OUT_OF_MEMORY,
                         "01_naive backward materializes S/dP (fp32), P and dS: %.2f GiB did not "
                         "fit in device memory",
                         need / 1073741824.0);
  }
  FA_CUDA_TRY(alloc);
  cublasHandle_t handle = cublas_handle();
  if (!handle) return fa::set_error(FA_ERR_CUDA, "cublasCreate failed");
  CUBLAS_TRY(cublasSetStream(handle, stream));
  // The workspace holds the dK and dV accumulators (fp32), S/dP (fp32), P and dS.
  char* const base = static_cast<char*>(scratch);
  float* dk_acc = reinterpret_cast<float*>(base);
  float* dv_acc = reinterpret_cast<float*>(base + acc_bytes);
  float* s = reinterpret_cast<float*>(base + 2 * acc_bytes);
  T* p = reinterpret_cast<T*>(base + 2 * acc_bytes + s_bytes);
  T* ds = reinterpret_cast<T*>(base + 2 * acc_bytes + s_bytes + p_bytes);
  FA_CUDA_TRY(prefill_for_initcheck(s, s_elems * sizeof(float), stream));
  FA_CUDA_TRY(prefill_for_initcheck(dk_acc, kv_elems * sizeof(float), stream));
  FA_CUDA_TRY(prefill_for_initcheck(dv_acc, kv_elems * sizeof(float), stream));

  const cudaDataType_t dt = std::is_same<T, __half>::value ? CUDA_R_16F : CUDA_R_16BF;
  const int group = a.heads / a.heads_kv;
  const int64_t nn = static_cast<int64_t>(a.seqlen_q) * a.seqlen_k;
  const int64_t kv_head = static_cast<int64_t>(a.seqlen_k) * a.head_dim;  // acc per kv head
  const T* qt = static_cast<const T*>(a.q.ptr);
  const T* kt = static_cast<const T*>(a.k.ptr);
  const T* vt = static_cast<const T*>(a.v.ptr);
  const T* dot = static_cast<const T*>(args.d_o.ptr);
  T* dqt = static_cast<T*>(args.dq.ptr);
  const dim3 row_grid(a.seqlen_q, a.heads, a.batch);
  fa_status st = FA_OK;

  // 1. S = scale Q K^T and P = exp(S - L), as in the forward but with the stored L.
  for (int b = 0; b < a.batch && st == FA_OK; ++b)
    for (int g = 0; g < group && st == FA_OK; ++g) {
      const int64_t bg = static_cast<int64_t>(b) * a.heads + g;
      st = run_gemm(handle,
                    {CUBLAS_OP_T, CUBLAS_OP_N, a.seqlen_k, a.seqlen_q, a.head_dim, a.scale, 0.f,
                     kt + b * a.k.batch_stride, dt, a.k.row_stride, a.k.head_stride,
                     qt + b * a.q.batch_stride + g * a.q.head_stride, dt, a.q.row_stride,
                     group * a.q.head_stride, s + bg * nn, CUDA_R_32F, a.seqlen_k, group * nn},
                    a.heads_kv, "S = QK^T");
    }
  if (st == FA_OK) {
    recompute_p_kernel<T><<<row_grid, kSoftmaxThreads, 0, stream>>>(
        s, a.lse, p, a.heads, a.seqlen_q, a.seqlen_k, a.causal != 0);
    if (cudaGetLastError() != cudaSuccess) st = fa::set_error(FA_ERR_CUDA, "recompute_p_kernel");
  }
  // 2. dV = P^T dO (summed over the group), 3. dP = dO V^T (into the S buffer).
  for (int b = 0; b < a.batch && st == FA_OK; ++b)
    for (int g = 0; g < group && st == FA_OK; ++g) {
      const int64_t bg = static_cast<int64_t>(b) * a.heads + g;
      const T* do_bg = dot + b * args.d_o.batch_stride + g * args.d_o.head_stride;
      st = run_gemm(handle,
                    {CUBLAS_OP_N, CUBLAS_OP_T, a.head_dim, a.seqlen_k, a.seqlen_q, 1.f,
                     g > 0 ? 1.f : 0.f, do_bg, dt, args.d_o.row_stride,
                     group * args.d_o.head_stride, p + bg * nn, dt, a.seqlen_k, group * nn,
                     dv_acc + b * a.heads_kv * kv_head, CUDA_R_32F, a.head_dim, kv_head},
                    a.heads_kv, "dV = P^T dO");
      if (st != FA_OK) break;
      st = run_gemm(handle,
                    {CUBLAS_OP_T, CUBLAS_OP_N, a.seqlen_k, a.seqlen_q, a.head_dim, 1.f, 0.f,
                     vt + b * a.v.batch_stride, dt, a.v.row_stride, a.v.head_stride, do_bg, dt,
                     args.d_o.row_stride, group * args.d_o.head_stride, s + bg * nn, CUDA_R_32F,
                     a.seqlen_k, group * nn},
                    a.heads_kv, "dP = dO V^T");
    }
  // 4. dS = P (dP - D), D = rowsum(dO * O).
  if (st == FA_OK) {
    ds_kernel<T><<<row_grid, kSoftmaxThreads, 0, stream>>>(s, p, static_cast<const T*>(a.o.ptr),
                                                           dot, a.o, args.d_o, ds, a.heads,
                                                           a.seqlen_q, a.seqlen_k, a.head_dim);
    if (cudaGetLastError() != cudaSuccess) st = fa::set_error(FA_ERR_CUDA, "ds_kernel");
  }
  // 5. dQ = scale dS K, 6. dK = scale dS^T Q (summed over the group).
  for (int b = 0; b < a.batch && st == FA_OK; ++b)
    for (int g = 0; g < group && st == FA_OK; ++g) {
      const int64_t bg = static_cast<int64_t>(b) * a.heads + g;
      st = run_gemm(
          handle,
          {CUBLAS_OP_N, CUBLAS_OP_N, a.head_dim, a.seqlen_q, a.seqlen_k, a.scale, 0.f,
           kt + b * a.k.batch_stride, dt, a.k.row_stride, a.k.head_stride, ds + bg * nn, dt,
           a.seqlen_k, group * nn, dqt + b * args.dq.batch_stride + g * args.dq.head_stride, dt,
           args.dq.row_stride, group * args.dq.head_stride},
          a.heads_kv, "dQ = dS K");
      if (st != FA_OK) break;
      st =
          run_gemm(handle,
                   {CUBLAS_OP_N, CUBLAS_OP_T, a.head_dim, a.seqlen_k, a.seqlen_q, a.scale,
                    g > 0 ? 1.f : 0.f, qt + b * a.q.batch_stride + g * a.q.head_stride, dt,
                    a.q.row_stride, group * a.q.head_stride, ds + bg * nn, dt, a.seqlen_k,
                    group * nn, dk_acc + b * a.heads_kv * kv_head, CUDA_R_32F, a.head_dim, kv_head},
                   a.heads_kv, "dK = dS^T Q");
    }
  if (st == FA_OK) {
    const int blocks = static_cast<int>(std::min<int64_t>((kv_elems + 255) / 256, 65535));
    convert_kernel<T><<<blocks, 256, 0, stream>>>(dk_acc, static_cast<T*>(args.dk.ptr), args.dk,
                                                  a.heads_kv, a.seqlen_k, a.head_dim, kv_elems);
    convert_kernel<T><<<blocks, 256, 0, stream>>>(dv_acc, static_cast<T*>(args.dv.ptr), args.dv,
                                                  a.heads_kv, a.seqlen_k, a.head_dim, kv_elems);
    if (cudaGetLastError() != cudaSuccess) st = fa::set_error(FA_ERR_CUDA, "convert_kernel");
  }
  return st;
}

/// Runs the standard backward pass for either dtype (cuBLAS is deterministic here, so both
/// modes are the same).
fa_status backward(const fa_bwd_args& args, cudaStream_t stream) {
  return args.fwd.dtype == FA_BF16 ? backward_impl<__nv_bfloat16>(args, stream)
                                   : backward_impl<__half>(args, stream);
}

/// Runs the standard forward pass for either dtype.
fa_status forward(const fa_fwd_args& args, cudaStream_t stream) {
  return args.dtype == FA_BF16 ? forward_impl<__nv_bfloat16>(args, stream)
                               : forward_impl<__half>(args, stream);
}

/// cuBLAS takes any head dimension; the harness asks for multiples of 8 up to 256.
bool supports_head_dim(int head_dim) {
  return head_dim % 8 == 0 && head_dim <= 256;
}

}  // namespace

FA_REGISTER_STEP("standard attention: S and P written to device memory (cuBLAS + softmax)", forward,
                 backward, supports_head_dim);
