/// \file inputs.cu
/// \brief The problem's inputs made on the GPU: the same values fa::make_problem() draws on the
/// host (fa/inputs.h, shared code), written straight into the strided device tensors, so that a
/// tensor of billions of elements takes milliseconds instead of minutes and no host memory.
#include <cuda_runtime.h>

#include <algorithm>

#include "fa/harness.h"
#include "fa/inputs.h"

namespace fa {
namespace {

/// Blocks of a grid-stride launch over `n` items (at most 65535 * 32 blocks, enough to fill
/// the GPU many times over).
unsigned blocks_for(size_t n, int threads) {
  return static_cast<unsigned>(
      std::min<size_t>((n + threads - 1) / threads, static_cast<size_t>(65535) * 32));
}

/// Writes `bits` into every element of `data[0, n)`.
__global__ void fill_bits_kernel(uint16_t* __restrict__ data, size_t n, uint16_t bits) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    data[i] = bits;
}

/// Element i of the contiguous [batch, seqlen, heads, d] order (the generator's index) goes to
/// (b, s, h, c) of the strided tensor `t`.
__global__ void fill_inputs_kernel(uint16_t* __restrict__ data, fa_tensor t, int seqlen, int heads,
                                   int d, size_t n, bool bf16, uint64_t seed, int tensor,
                                   double magnitude, double offset) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const int c = static_cast<int>(i % d);
    size_t rest = i / d;
    const int h = static_cast<int>(rest % heads);
    rest /= heads;
    const int s = static_cast<int>(rest % seqlen);
    const int64_t b = static_cast<int64_t>(rest / seqlen);
    data[b * t.batch_stride + s * t.row_stride + h * t.head_stride + c] =
        inputs::element_bits(bf16, seed, tensor, i, magnitude, offset);
  }
}

}  // namespace

void fill_bits_on_device(uint16_t* data, size_t n, uint16_t bits) {
  if (n == 0) return;
  fill_bits_kernel<<<blocks_for(n, 256), 256>>>(data, n, bits);
  cuda_check(cudaGetLastError(), "fill_bits_kernel");
}

void fill_inputs_on_device(uint16_t* data, const fa_tensor& view, int batch, int seqlen, int heads,
                           int d, fa_dtype dtype, const InputSpec& spec, int tensor) {
  const size_t n = static_cast<size_t>(batch) * seqlen * heads * d;
  if (n == 0) return;
  double magnitude = 0, offset = 0;
  input_distribution(spec, tensor, &magnitude, &offset);
  fill_inputs_kernel<<<blocks_for(n, 256), 256>>>(data, view, seqlen, heads, d, n, dtype == FA_BF16,
                                                  spec.seed, tensor, magnitude, offset);
  cuda_check(cudaGetLastError(), "fill_inputs_kernel");
}

}  // namespace fa
