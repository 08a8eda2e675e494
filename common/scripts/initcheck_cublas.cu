// Shows why common/scripts/sanitize.sh sets FA_INITCHECK_PREFILL=1 under initcheck: on an H200
// with CUDA 13.0, compute-sanitizer's initcheck does not see the writes of a cuBLAS GEMM, so a
// kernel that reads the GEMM's output is reported as reading uninitialized memory.
//
//   nvcc -arch=sm_90 common/scripts/initcheck_cublas.cu -lcublas -o /tmp/initcheck_cublas
//   compute-sanitizer --tool initcheck --print-limit 2 /tmp/initcheck_cublas
//
// Expected with a tool that tracks cuBLAS's writes: "ERROR SUMMARY: 0 errors". Seen on the
// H200 (2026-11-29): "Uninitialized __global__ memory read of size 4 bytes at read_all(...)".
#include <cublas_v2.h>
#include <cuda_fp16.h>

#include <cstdio>
#include <cstdlib>

__global__ void read_all(const float* c, int n, float* out) {  // reads every element of C
  float sum = 0.f;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    sum += c[i];
  if (sum == 12345.f) *out = sum;  // keeps the loads
}

__global__ void fill(__half* x, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    x[i] = __float2half(0.001f * (i % 97));
}

int main(int argc, char** argv) {
  const int m = argc > 1 ? std::atoi(argv[1]) : 256, n = m, k = 64;
  __half *a = nullptr, *b = nullptr;
  float *c = nullptr, *out = nullptr;
  cudaMalloc(&a, m * k * sizeof(__half));
  cudaMalloc(&b, n * k * sizeof(__half));
  cudaMalloc(&c, static_cast<size_t>(m) * n * sizeof(float));
  cudaMalloc(&out, sizeof(float));
  fill<<<64, 256>>>(a, m * k);
  fill<<<64, 256>>>(b, n * k);
  cublasHandle_t handle;
  cublasCreate(&handle);
  const float one = 1.f, zero = 0.f;
  // C [m x n] = A^T B, every element of C written by cuBLAS.
  const cublasStatus_t st =
      cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, a, CUDA_R_16F, k, b, CUDA_R_16F,
                   k, &zero, c, CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  read_all<<<64, 256>>>(c, m * n, out);
  cudaDeviceSynchronize();
  std::printf("m=n=%d k=%d: cuBLAS status %d, CUDA %s\n", m, k, static_cast<int>(st),
              cudaGetErrorString(cudaGetLastError()));
  cublasDestroy(handle);
  return 0;
}
