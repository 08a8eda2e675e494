/// \file ceilings.cu
/// \brief The ceilings measured on the GPU at hand: dense mma.sync and a cuBLAS GEMM (FLOP/s),
/// a device-memory copy (bytes/s) for the memory-bound decode shapes and, on an sm_90 GPU,
/// dense wgmma (common/src/harness/sm90/wgmma_ceiling.cu).
#include <cublas_v2.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "fa/harness.h"
#include "fa/mma.cuh"

namespace fa {
namespace {

constexpr int kChains = 8;         // independent accumulators per warp: hides mma latency
constexpr int kIterations = 4096;  // mma.sync per chain per launch
constexpr int kMmaThreads = 256;

/// Issues kChains x kIterations independent mma.sync m16n8k16 per warp on register operands:
/// no memory traffic, so the time is the tensor cores' alone. The result is stored only so
/// the compiler keeps the work.
__global__ void __launch_bounds__(kMmaThreads) mma_ceiling_kernel(float* sink, uint32_t seed) {
  uint32_t a[4], b[2];
  for (int i = 0; i < 4; ++i) a[i] = pack2<__half>(0.001f * (threadIdx.x + i), 0.5f);
  for (int i = 0; i < 2; ++i) b[i] = pack2<__half>(0.25f, 0.001f * (seed + i));
  float acc[kChains][4] = {};
  for (int it = 0; it < kIterations; ++it) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) mma_m16n8k16<__half>(acc[c], a, b);
  }
  float total = 0.f;
#pragma unroll
  for (int c = 0; c < kChains; ++c) total += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
  if (total == 1.2345f) sink[threadIdx.x] = total;  // practically never true
}

/// Fills n halfs with values in [-1, 1) from a hash (random data, never zeros).
__global__ void fill_random_kernel(__half* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    x[i] = __float2half(static_cast<float>(h & 0xffff) / 32768.f - 1.f);
  }
}

/// Median of `repeats` event-timed calls of `fn` after `warmup` calls, in milliseconds.
template <typename Fn>
double median_ms(Fn fn, int warmup, int repeats) {
  for (int i = 0; i < warmup; ++i) fn();
  cuda_check(cudaDeviceSynchronize(), "ceiling warm-up");
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<float> ms;
  for (int i = 0; i < repeats; ++i) {
    cudaEventRecord(start);
    fn();
    cudaEventRecord(stop);
    cuda_check(cudaEventSynchronize(stop), "ceiling run");
    float t = 0;
    cudaEventElapsedTime(&t, start, stop);
    ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

double measure_mma() {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  float* sink = nullptr;
  cuda_check(cudaMalloc(&sink, kMmaThreads * sizeof(float)), "cudaMalloc (sink)");
  const int blocks = sms * 4;  // several warps per SM sub-partition
  const double ms = median_ms(
      [&] {
        mma_ceiling_kernel<<<blocks, kMmaThreads>>>(sink, 7);
        cuda_check(cudaGetLastError(), "mma_ceiling_kernel");
      },
      2, 9);
  cudaFree(sink);
  const double mmas = static_cast<double>(blocks) * (kMmaThreads / 32) * kChains * kIterations;
  return mmas * 2.0 * 16 * 8 * 16 / (ms * 1e-3) / 1e12;
}

double measure_cublas() {
  const int n = 8192;
  const size_t elems = static_cast<size_t>(n) * n;
  __half *a = nullptr, *b = nullptr, *c = nullptr;
  cuda_check(cudaMalloc(&a, elems * 2), "cudaMalloc");
  cuda_check(cudaMalloc(&b, elems * 2), "cudaMalloc");
  cuda_check(cudaMalloc(&c, elems * 2), "cudaMalloc");
  fill_random_kernel<<<1024, 256>>>(a, elems, 1);
  fill_random_kernel<<<1024, 256>>>(b, elems, 2);
  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) throw std::runtime_error("cublasCreate");
  const float one = 1.f, zero = 0.f;
  const double ms = median_ms(
      [&] {
        if (cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a, CUDA_R_16F, n, b,
                         CUDA_R_16F, n, &zero, c, CUDA_R_16F, n, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS)
          throw std::runtime_error("cublasGemmEx failed");
      },
      3, 15);
  cublasDestroy(handle);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  return 2.0 * n * static_cast<double>(n) * n / (ms * 1e-3) / 1e12;
}

/// Dense wgmma throughput (launch_wgmma_ceiling(), sm_90a code) on an sm_90 GPU, else 0.
double measure_wgmma() {
  int device = 0, major = 0, minor = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (major != 9 || minor != 0) return 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  float* sink = nullptr;
  cuda_check(cudaMalloc(&sink, 256 * sizeof(float)), "cudaMalloc (sink)");
  double flops = 0;
  const double ms = median_ms([&] { flops = launch_wgmma_ceiling(sms, sink); }, 2, 9);
  cudaFree(sink);
  return flops / (ms * 1e-3) / 1e12;
}

constexpr int kCopyThreads = 256;
constexpr int kCopyUnroll = 4;  // 16-byte loads in flight per thread before its stores

/// Copies n 16-byte words from src to dst, grid-stride: each thread loads kCopyUnroll words
/// (one per stride) before it stores them, so that 64 bytes per thread, about 128 KiB per SM,
/// are in flight: enough to keep HBM busy. The copy ceiling is the bandwidth a plain streaming
/// kernel gets, the practical limit of a memory-bound attention kernel that reads K and V once.
__global__ void __launch_bounds__(kCopyThreads)
    copy_ceiling_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * kCopyThreads;
  for (size_t i = blockIdx.x * static_cast<size_t>(kCopyThreads) + threadIdx.x; i < n;
       i += kCopyUnroll * stride) {
    uint4 v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u)
      if (i + u * stride < n) v[u] = src[i + u * stride];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u)
      if (i + u * stride < n) dst[i + u * stride] = v[u];
  }
}

/// Device-to-device copy bandwidth, GB/s: bytes read plus bytes written over the median time
/// of copying 1 GiB (far beyond any L2) between two buffers.
double measure_copy() {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const size_t bytes = size_t{1} << 30;
  const size_t words = bytes / sizeof(uint4);
  uint4 *src = nullptr, *dst = nullptr;
  cuda_check(cudaMalloc(&src, bytes), "cudaMalloc (copy ceiling)");
  if (cudaMalloc(&dst, bytes) != cudaSuccess) {
    cudaFree(src);
    cuda_check(cudaGetLastError(), "cudaMalloc (copy ceiling)");
  }
  fill_random_kernel<<<1024, 256>>>(reinterpret_cast<__half*>(src), bytes / 2, 3);
  const int blocks = sms * (2048 / kCopyThreads);  // one full wave of resident threads
  const double ms = median_ms(
      [&] {
        copy_ceiling_kernel<<<blocks, kCopyThreads>>>(src, dst, words);
        cuda_check(cudaGetLastError(), "copy_ceiling_kernel");
      },
      3, 15);
  cudaFree(src);
  cudaFree(dst);
  return 2.0 * bytes / (ms * 1e-3) / 1e9;
}

}  // namespace

Ceilings measure_ceilings() {
  Ceilings c;
  c.mma_tflops = measure_mma();
  c.cublas_tflops = measure_cublas();
  c.wgmma_tflops = measure_wgmma();
  c.copy_gbps = measure_copy();
  return c;
}

}  // namespace fa
