/// \file hopper_blocks.cu
/// \brief The building blocks of step 09, each checked alone on an sm_90 GPU, so that when
/// the whole kernel fails the log says which block is wrong: the TMA load of a tile into the
/// 128-byte swizzled layout (4-D tensor map, padded strides, rows past the sequence zero and
/// never taken from another head), \f$S = Q K^T\f$ by wgmma from shared
/// memory (descriptors, accumulator layout), \f$O = P V\f$ by wgmma with P from registers and
/// V transposed on the fly, and the epilogue's TMA store (swizzled staging, rows past
/// \f$N_q\f$ dropped, L), for every tile shape the step compiles.
///
/// It compiles step 09's own kernel.cu into this program and calls its device functions from
/// small test kernels. Inputs are small multiples of 1/4 and 1/8, so that every product and
/// sum is exact in fp32 and the results must match the host's bit for bit.
///
/// Run: `./build/bin/fa_hopper_blocks` (exit 0: every block passed or no sm_90 GPU, 1: a
/// block failed; one line per check).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

// Step 09's kernel, under a symbol of its own (this program does not link libfa).
#undef FA_STEP_SYMBOL
#define FA_STEP_SYMBOL fa_step_09_hopper_blocks_copy
#include "../../../09_hopper_wgmma/kernel.cu"

namespace fa {
fa_status set_error(fa_status status, const char* format, ...) {
  va_list ap;
  va_start(ap, format);
  std::vfprintf(stderr, format, ap);
  va_end(ap);
  std::fprintf(stderr, "\n");
  return status;
}
}  // namespace fa

namespace {

int g_failures = 0;

#define CHECK_CUDA(call)                                                                       \
  do {                                                                                         \
    cudaError_t e_ = (call);                                                                   \
    if (e_ != cudaSuccess) {                                                                   \
      std::printf("FAIL %s: %s (%s:%d)\n", #call, cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

void report(bool ok, const std::string& what, const std::string& detail) {
  std::printf("%s %s%s%s\n", ok ? "PASS" : "FAIL", what.c_str(), detail.empty() ? "" : ": ",
              detail.c_str());
  std::fflush(stdout);
  if (!ok) ++g_failures;
}

/// Bits of a float rounded to T (exact for the values used here).
template <typename T>
uint16_t bits_of(float x) {
  T h = static_cast<T>(x);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}

/// A value that every 16-bit type holds exactly: a multiple of 1/4 in [-4, 4].
__host__ __device__ float small_value(uint32_t i) {
  uint32_t h = i * 2654435761u;
  h ^= h >> 15;
  return static_cast<float>(static_cast<int>(h % 33) - 16) / 4.f;
}

/// Rounds the shared-memory base up to 1024 bytes, as the step's kernel does.
__device__ char* align_1024(char* p) {
  return p + ((1024 - (fa::smem_u32(p) & 1023)) & 1023);
}

/// Thread 0 makes `bar` a barrier of one arrival (its own, with the TMA's bytes), initialized
/// for the whole block and the TMA unit before anyone uses it.
__device__ void init_load_barrier(uint64_t* bar) {
  if (threadIdx.x == 0) {
    fa::mbarrier_init(bar, 1);
    fa::fence_barrier_init();
  }
  __syncthreads();
}

// ------------------------------------------------------------------------------------------
// 1. TMA load into the swizzled panels
// ------------------------------------------------------------------------------------------

/// Loads the Q-sized box at (row0, head, batch) with load_tile() and copies it back out in
/// plain row-major order through swizzle(): out[r][c] = tile element (r, c).
template <int kHeadDim>
__global__ void tma_load_kernel(const __grid_constant__ CUtensorMap map, int row0, int head,
                                int batch, uint16_t* out) {
  using Tr = Traits<kHeadDim>;
  extern __shared__ char smem_raw[];
  char* const tile = align_1024(smem_raw);
  __shared__ uint64_t bar;
  init_load_barrier(&bar);
  if (threadIdx.x == 0) {
    fa::mbarrier_arrive_expect_tx(&bar, Tr::kQBytes);
    load_tile<Tr, Tr::kBlockM>(tile, &map, &bar, row0, head, batch);
  }
  fa::mbarrier_wait(&bar, 0);
  constexpr int kChunks = kHeadDim / 8;
  for (int i = threadIdx.x; i < Tr::kBlockM * kChunks; i += blockDim.x) {
    const int row = i / kChunks, chunk = i % kChunks;
    *reinterpret_cast<uint4*>(out + row * kHeadDim + chunk * 8) =
        *reinterpret_cast<const uint4*>(tile + swizzle<Tr, Tr::kBlockM>(row, chunk));
  }
}

template <int kHeadDim>
void test_tma_load(std::initializer_list<int> first_rows) {
  using Tr = Traits<kHeadDim>;
  // A padded BSHD tensor: B = 2, N = 100, H = 3; gaps after each head, row and batch.
  const int B = 2, N = 100, H = 3, d = kHeadDim;
  fa_tensor t{};
  t.head_stride = d + 8;
  t.row_stride = H * t.head_stride + 16;
  t.batch_stride = t.row_stride * N + 24;
  const size_t elems = static_cast<size_t>(t.batch_stride) * B;
  std::vector<uint16_t> host(elems, bits_of<__half>(-99.f));  // the gaps hold -99
  auto value = [&](int b, int s, int h, int c) {
    return static_cast<float>(((b * 131 + s * 17 + h * 7 + c * 3) % 2001) - 1000) / 8.f;
  };
  for (int b = 0; b < B; ++b)
    for (int s = 0; s < N; ++s)
      for (int h = 0; h < H; ++h)
        for (int c = 0; c < d; ++c)
          host[b * t.batch_stride + s * t.row_stride + h * t.head_stride + c] =
              bits_of<__half>(value(b, s, h, c));
  uint16_t *dev = nullptr, *out = nullptr;
  CHECK_CUDA(cudaMalloc(&dev, elems * 2));
  CHECK_CUDA(cudaMalloc(&out, Tr::kBlockM * d * 2));
  CHECK_CUDA(cudaMemcpy(dev, host.data(), elems * 2, cudaMemcpyHostToDevice));
  t.ptr = dev;
  CUtensorMap map;
  if (make_tensor_map<__half>(&map, "x", t, N, H, B, Tr::kBlockM, d) != FA_OK) {
    report(false, "tma_load d=" + std::to_string(d), "make_tensor_map failed");
    return;
  }
  const int smem = Tr::kQBytes + 1024;
  CHECK_CUDA(cudaFuncSetAttribute(tma_load_kernel<kHeadDim>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  // Rows 0.. : real rows; rows 64.. : 36 real rows, then rows past N (zeros, never the next
  // head's rows: the partial last Q block).
  for (int row0 : first_rows) {
    const int head = 1, batch = 1;
    tma_load_kernel<kHeadDim><<<1, 128, smem>>>(map, row0, head, batch, out);
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<uint16_t> got(Tr::kBlockM * d);
    CHECK_CUDA(cudaMemcpy(got.data(), out, got.size() * 2, cudaMemcpyDeviceToHost));
    int bad = 0;
    std::string first;
    for (int r = 0; r < Tr::kBlockM; ++r)
      for (int c = 0; c < d; ++c) {
        const int s = row0 + r;
        const uint16_t want = s < N ? bits_of<__half>(value(batch, s, head, c)) : 0;
        if (got[r * d + c] != want && bad++ == 0)
          first = "row " + std::to_string(r) + " col " + std::to_string(c) + ": got 0x" +
                  std::to_string(got[r * d + c]) + ", want 0x" + std::to_string(want);
      }
    report(bad == 0, "tma_load d=" + std::to_string(d) + " row0=" + std::to_string(row0),
           bad ? std::to_string(bad) + " wrong elements, first at " + first : "");
  }
  cudaFree(dev);
  cudaFree(out);
}

// ------------------------------------------------------------------------------------------
// 2. S = Q K^T (wgmma, both operands from shared memory) and 3. O = P V (P in registers)
// ------------------------------------------------------------------------------------------

/// The tile shape's consumer warpgroups: load Q (kBlockM rows) and K and V (kBlockN rows) by
/// TMA, compute S = Q K^T with compute_scores() and write it out by the accumulator layout;
/// then O = P V with pack_p() and accumulate_pv() for P(row, key) = small_value(row * 1000 +
/// key), written out too.
template <typename T, class Tr>
__global__ void __launch_bounds__(128 * Tr::kNumConsumers)
    mma_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
               const __grid_constant__ CUtensorMap v_map, float* s_out, float* o_out) {
  extern __shared__ char smem_raw[];
  char* const q_tile = align_1024(smem_raw);
  char* const k_tile = q_tile + Tr::kQBytes;
  char* const v_tile = k_tile + Tr::kKBytes;
  __shared__ uint64_t bar;
  init_load_barrier(&bar);
  if (threadIdx.x == 0) {
    fa::mbarrier_arrive_expect_tx(&bar, Tr::kQBytes + Tr::kKBytes + Tr::kVBytes);
    load_tile<Tr, Tr::kBlockM>(q_tile, &q_map, &bar, 0, 0, 0);
    load_tile<Tr, Tr::kBlockN>(k_tile, &k_map, &bar, 0, 0, 0);
    load_tile<Tr, Tr::kBlockN>(v_tile, &v_map, &bar, 0, 0, 0);
  }
  fa::mbarrier_wait(&bar, 0);
  const int consumer = threadIdx.x / 128, wg_tid = threadIdx.x % 128, lane = threadIdx.x % 32;
  const int row0 = consumer * 64 + (wg_tid / 32) * 16 + lane / 4;  // rows row0, row0 + 8
  const int col0 = 2 * (lane % 4);

  float s[Tr::kMTiles][Tr::kNTilesS][4];
  compute_scores<Tr, T>(s, q_tile, k_tile, consumer * 64);
  fa::wgmma_wait<0>();
  fa::fence_operand(s[0]);
  for (int nj = 0; nj < Tr::kNTilesS; ++nj)
    for (int e = 0; e < 4; ++e)
      s_out[(row0 + 8 * (e / 2)) * Tr::kBlockN + 8 * nj + col0 + e % 2] = s[0][nj][e];

  float p[Tr::kMTiles][Tr::kNTilesS][4];
  for (int nj = 0; nj < Tr::kNTilesS; ++nj)
    for (int e = 0; e < 4; ++e)
      p[0][nj][e] = small_value((row0 + 8 * (e / 2)) * 1000 + 8 * nj + col0 + e % 2);
  float o_acc[Tr::kMTiles][Tr::kNTilesO][4] = {};
  uint32_t p_frag[Tr::kBlockN / 16][4];
  pack_p<Tr, T>(p, p_frag);
  accumulate_pv<Tr, T>(o_acc, p_frag, v_tile);
  fa::wgmma_wait<0>();
  fa::fence_operand(o_acc[0]);
  for (int nd = 0; nd < Tr::kNTilesO; ++nd)
    for (int e = 0; e < 4; ++e)
      o_out[(row0 + 8 * (e / 2)) * Tr::kHeadDim + 8 * nd + col0 + e % 2] = o_acc[0][nd][e];
}

/// A name for a tile shape in the report: "d=64 192x128".
template <class Tr>
std::string shape_name() {
  return "d=" + std::to_string(Tr::kHeadDim) + " " + std::to_string(Tr::kBlockM) + "x" +
         std::to_string(Tr::kBlockN);
}

template <typename T, class Tr>
void test_mma(const char* type_name) {
  const int M = Tr::kBlockM, N = Tr::kBlockN, d = Tr::kHeadDim;
  std::vector<float> q(M * d), k(N * d), v(N * d);
  for (int i = 0; i < M * d; ++i) q[i] = small_value(i + 1);
  for (int i = 0; i < N * d; ++i) k[i] = small_value(i + 7777);
  for (int i = 0; i < N * d; ++i) v[i] = small_value(i + 55555);
  auto upload = [](const std::vector<float>& x) {
    std::vector<uint16_t> b(x.size());
    for (size_t i = 0; i < x.size(); ++i) b[i] = bits_of<T>(x[i]);
    void* p = nullptr;
    CHECK_CUDA(cudaMalloc(&p, b.size() * 2));
    CHECK_CUDA(cudaMemcpy(p, b.data(), b.size() * 2, cudaMemcpyHostToDevice));
    return p;
  };
  auto contiguous = [&](void* ptr, int rows) {
    fa_tensor t{};
    t.ptr = ptr;
    t.head_stride = d;
    t.row_stride = d;
    t.batch_stride = static_cast<int64_t>(rows) * d;
    return t;
  };
  void *dq = upload(q), *dk = upload(k), *dv = upload(v);
  CUtensorMap q_map, k_map, v_map;
  const std::string what = std::string(type_name) + " " + shape_name<Tr>();
  if (make_tensor_map<T>(&q_map, "q", contiguous(dq, M), M, 1, 1, M, d) != FA_OK ||
      make_tensor_map<T>(&k_map, "k", contiguous(dk, N), N, 1, 1, N, d) != FA_OK ||
      make_tensor_map<T>(&v_map, "v", contiguous(dv, N), N, 1, 1, N, d) != FA_OK) {
    report(false, "wgmma " + what, "make_tensor_map failed");
    return;
  }
  float *s_out = nullptr, *o_out = nullptr;
  CHECK_CUDA(cudaMalloc(&s_out, M * N * 4));
  CHECK_CUDA(cudaMalloc(&o_out, M * d * 4));
  const int smem = Tr::kQBytes + Tr::kKBytes + Tr::kVBytes + 1024;
  CHECK_CUDA(
      cudaFuncSetAttribute(mma_kernel<T, Tr>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  mma_kernel<T, Tr><<<1, 128 * Tr::kNumConsumers, smem>>>(q_map, k_map, v_map, s_out, o_out);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> s(M * N), o(M * d);
  CHECK_CUDA(cudaMemcpy(s.data(), s_out, s.size() * 4, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(o.data(), o_out, o.size() * 4, cudaMemcpyDeviceToHost));

  int bad = 0;
  std::string first;
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      double want = 0;
      for (int c = 0; c < d; ++c) want += static_cast<double>(q[i * d + c]) * k[j * d + c];
      if (s[i * N + j] != static_cast<float>(want) && bad++ == 0)
        first = "S[" + std::to_string(i) + "][" + std::to_string(j) +
                "] = " + std::to_string(s[i * N + j]) + ", want " + std::to_string(want);
    }
  report(bad == 0, "wgmma S = Q K^T (SS) " + what,
         bad ? std::to_string(bad) + " wrong, first " + first : "");
  bad = 0;
  for (int i = 0; i < M; ++i)
    for (int c = 0; c < d; ++c) {
      double want = 0;
      for (int j = 0; j < N; ++j)
        want += static_cast<double>(small_value(i * 1000 + j)) * v[j * d + c];
      if (o[i * d + c] != static_cast<float>(want) && bad++ == 0)
        first = "O[" + std::to_string(i) + "][" + std::to_string(c) +
                "] = " + std::to_string(o[i * d + c]) + ", want " + std::to_string(want);
    }
  report(bad == 0, "wgmma O = P V (RS, V N-major) " + what,
         bad ? std::to_string(bad) + " wrong, first " + first : "");
  cudaFree(dq);
  cudaFree(dk);
  cudaFree(dv);
  cudaFree(s_out);
  cudaFree(o_out);
}

// ------------------------------------------------------------------------------------------
// 4. The epilogue: staging in the swizzled Q tile, TMA store, L
// ------------------------------------------------------------------------------------------

/// o_acc = pattern, row_sum = 1/2 per lane (\f$\ell = 2\f$ per row), row_max = 1, with
/// args.scale = 1/2: the epilogue must store O = pattern / 2 (exact: the pattern is multiples
/// of 1/4) and \f$L = 1 \cdot 1/2 + \ln 2\f$ for the rows of [q_start, q_start + kBlockM)
/// before N_q, so that an O left unnormalized, a row sum not reduced over its quad, or an L
/// without the scale or the log fails. It runs twice, as for two tiles in a row, so that the
/// second waits for the first store.
template <typename T, class Tr>
__global__ void __launch_bounds__(128 * Tr::kNumConsumers)
    store_kernel(const __grid_constant__ CUtensorMap o_map, const fa_fwd_args args, int batch,
                 int head, int q_start) {
  extern __shared__ char smem_raw[];
  char* const o_stage = align_1024(smem_raw);
  const int consumer = threadIdx.x / 128, wg_tid = threadIdx.x % 128, lane = threadIdx.x % 32;
  const int row0 = consumer * 64 + (wg_tid / 32) * 16 + lane / 4;
  float o_acc[Tr::kMTiles][Tr::kNTilesO][4];
  for (int nd = 0; nd < Tr::kNTilesO; ++nd)
    for (int e = 0; e < 4; ++e)
      o_acc[0][nd][e] = small_value((row0 + 8 * (e / 2)) * 1000 + 8 * nd + 2 * (lane % 4) + e % 2);
  float row_max[1][2] = {{1.f, 1.f}}, row_sum[1][2] = {{0.5f, 0.5f}};
  Tile t{};
  t.q_start = q_start;
  t.head = head;
  t.batch = batch;
  for (int rep = 0; rep < 2; ++rep)
    store_o_and_lse<Tr, T>(o_acc, row_max, row_sum, o_stage, &o_map, args, t, consumer, wg_tid);
  if (wg_tid == 0) fa::tma_store_wait_read();
}

template <typename T, class Tr>
void test_store(const char* type_name, std::initializer_list<int> q_starts) {
  const int B = 2, N = 100, H = 3, d = Tr::kHeadDim;
  fa_tensor t{};
  t.head_stride = d + 8;
  t.row_stride = H * t.head_stride + 16;
  t.batch_stride = t.row_stride * N + 24;
  const size_t elems = static_cast<size_t>(t.batch_stride) * B;
  const uint16_t kPoison = 0xffff;
  uint16_t* dev = nullptr;
  float* lse = nullptr;
  CHECK_CUDA(cudaMalloc(&dev, elems * 2));
  CHECK_CUDA(cudaMalloc(&lse, B * H * N * 4));
  t.ptr = dev;
  CUtensorMap map;
  const std::string what = std::string(type_name) + " " + shape_name<Tr>();
  if (make_tensor_map<T>(&map, "o", t, N, H, B, Tr::kConsumerRows, d) != FA_OK) {
    report(false, "epilogue " + what, "make_tensor_map failed");
    return;
  }
  fa_fwd_args args{};
  args.batch = B;
  args.heads = H;
  args.heads_kv = H;
  args.seqlen_q = N;
  args.seqlen_k = N;
  args.head_dim = d;
  args.scale = 0.5f;  // L = row_max * scale + ln(row sum)
  args.o = t;
  args.lse = lse;
  const int smem = Tr::kOBytes + 1024;
  CHECK_CUDA(
      cudaFuncSetAttribute(store_kernel<T, Tr>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int batch = 1, head = 2;
  for (int q_start : q_starts) {
    CHECK_CUDA(cudaMemset(dev, 0xff, elems * 2));
    CHECK_CUDA(cudaMemset(lse, 0xff, B * H * N * 4));
    store_kernel<T, Tr><<<1, 128 * Tr::kNumConsumers, smem>>>(map, args, batch, head, q_start);
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<uint16_t> got(elems);
    std::vector<float> l(B * H * N);
    CHECK_CUDA(cudaMemcpy(got.data(), dev, elems * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(l.data(), lse, l.size() * 4, cudaMemcpyDeviceToHost));
    std::vector<uint16_t> want(elems, kPoison);
    for (int r = 0; r < Tr::kBlockM && q_start + r < N; ++r)
      for (int c = 0; c < d; ++c)
        want[batch * t.batch_stride + (q_start + r) * t.row_stride + head * t.head_stride + c] =
            bits_of<T>(small_value(r * 1000 + c) / 2.f);
    int bad = 0, bad_lse = 0;
    std::string first;
    for (size_t i = 0; i < elems; ++i)
      if (got[i] != want[i] && bad++ == 0) first = "element " + std::to_string(i);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h)
        for (int s = 0; s < N; ++s) {
          const bool written = b == batch && h == head && s >= q_start && s < q_start + Tr::kBlockM;
          const float x = l[(b * H + h) * N + s];
          bad_lse += written ? !(std::abs(x - (0.5f + std::log(2.f))) <= 1e-6f) : !std::isnan(x);
        }
    report(bad == 0 && bad_lse == 0,
           "epilogue (TMA store) " + what + " q_start=" + std::to_string(q_start),
           bad || bad_lse ? std::to_string(bad) + " wrong O elements (first " + first + "), " +
                                std::to_string(bad_lse) + " wrong L"
                          : "");
  }
  cudaFree(dev);
  cudaFree(lse);
}

}  // namespace

int main() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("No CUDA device: the Hopper building blocks are not checked\n");
    return 0;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9 || prop.minor != 0) {
    std::printf("Skipping the Hopper building blocks: they need an sm_90 GPU (%s is sm_%d%d)\n",
                prop.name, prop.major, prop.minor);
    return 0;
  }
  std::printf("GPU: %s\n", prop.name);
  test_tma_load<64>({0, 64});
  test_tma_load<128>({0, 64});
  // Every tile shape forward() can pick: the defaults and the tuning knobs' (launch()).
  test_mma<__half, Traits<64, 192, 128>>("fp16");
  test_mma<__half, Traits<64, 128, 128>>("fp16");
  test_mma<__half, Traits<128, 128, 128>>("fp16");
  test_mma<__nv_bfloat16, Traits<64, 192, 128>>("bf16");
  test_mma<__nv_bfloat16, Traits<128, 128, 128>>("bf16");
  test_store<__half, Traits<64, 192, 128>>("fp16", {0, 64});
  test_store<__half, Traits<64, 128, 128>>("fp16", {0, 64});
  test_store<__half, Traits<128, 128, 128>>("fp16", {0, 64});
  test_store<__nv_bfloat16, Traits<128, 128, 128>>("bf16", {0, 64});
  std::printf("%s: %d check(s) failed\n", g_failures ? "FAIL" : "PASS", g_failures);
  return g_failures ? 1 : 0;
}
