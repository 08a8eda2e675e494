/// \file hopper.cuh
/// \brief One-instruction wrappers for the Hopper steps (09, 10; sm_90a only): shared-memory
/// barriers (mbarrier), the tensor memory accelerator (TMA, `cp.async.bulk.tensor`), warpgroup
/// MMA (`wgmma.mma_async`), the proxy fences between them, register reallocation
/// (`setmaxnreg`) and named barriers. As in fa/mma.cuh nothing algorithmic lives here: which
/// tile goes where, the warp roles and the pipeline are written out in each step.
///
/// Layouts the steps rely on (PTX ISA, "Asynchronous Warpgroup Level Matrix Instructions"):
/// - wgmma m64nNk16 accumulator, fp32, N/2 registers per thread: thread t of the warpgroup
///   (warp w = t / 32, lane = 4 group + quad) holds, for each n8 tile j, d[j][0..1] = row
///   16 w + group, columns 8 j + 2 quad + {0, 1}, and d[j][2..3] = row 16 w + group + 8, same
///   columns: per warp, exactly the m16n8 accumulator of `mma.sync`, repeated along N.
/// - wgmma A from registers (16-bit types), 4 registers: a0 = (row 16 w + group, k 2 quad
///   + {0,1}), a1 = (row + 8, same k), a2 = (row, k + 8), a3 = (row + 8, k + 8): the A fragment
///   of `mma.sync` m16n8k16. So two neighbouring n8 accumulator tiles, rounded to 16 bits and
///   packed in pairs, are one k16 A operand (FlashAttention's "P stays in registers").
/// - Shared-memory operands are described by a 64-bit descriptor (wgmma_desc_sw128()). With the
///   128-byte swizzle a tile is stored in "panels" of 64 16-bit columns: row r of a panel is
///   128 bytes at r * 128, and its 16-byte chunk c sits at chunk c ^ (r % 8). The TMA writes
///   exactly that layout when its tensor map asks for CU_TENSOR_MAP_SWIZZLE_128B with a box
///   64 elements wide, provided the panel starts on a 1024-byte boundary.
#ifndef FA_HOPPER_CUH_
#define FA_HOPPER_CUH_

#include <cuda.h>  // CUtensorMap (a type only: nothing here links the driver library)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include "fa/mma.cuh"  // smem_u32(), pack2(), exp2_approx()

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "fa/hopper.cuh needs the sm_90a target: -gencode=arch=compute_90a,code=sm_90a"
#endif

/// How long (ns) a thread waits on one mbarrier phase before the watchdog stops the kernel.
/// A correct pipeline waits microseconds; a wrong phase or arrival count would wait forever.
#ifndef FA_WATCHDOG_NS
#define FA_WATCHDOG_NS 10000000000ull
#endif

namespace fa {

// ------------------------------------------------------------------------------------------
// Shared-memory barriers (mbarrier)
// ------------------------------------------------------------------------------------------

/// Initializes the barrier at `bar` for `count` arrivals per phase (one thread does this).
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count)
               : "memory");
}

/// Makes the initialized barriers visible to the other threads and to the TMA unit; the
/// initializing thread calls it, then the whole thread block synchronizes.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

/// One arrival on the barrier (release semantics: this thread's earlier accesses happen before
/// the phase completes).
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

/// One arrival that also announces `bytes` more bytes of asynchronous (TMA) writes: the phase
/// completes when every arrival has happened and that many bytes have landed.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}

/// True once the phase of parity `parity` of the barrier has completed (acquire semantics).
/// The instruction may suspend the thread for a while before it answers false.
__device__ __forceinline__ bool mbarrier_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

/// Nanoseconds of the GPU's global timer.
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

/// Stops the kernel with an error the host sees: a store to address 0, "an illegal memory
/// access was encountered" (compute-sanitizer names the line). A `trap` would do the same, but
/// ptxas then lowers the register limit of the code around it: step 10 spilled.
__device__ __forceinline__ void watchdog_fail(uint32_t code) {
  asm volatile("st.global.u32 [%0], %1;\n" ::"l"(0ull), "r"(code) : "memory");
}

/// Waits for the phase of parity `parity` of the barrier. A watchdog: after FA_WATCHDOG_NS
/// nanoseconds the kernel is stopped with an error (watchdog_fail()), so that a wrong phase or
/// a missing arrival fails the run instead of hanging the GPU.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  if (mbarrier_try_wait(bar, parity)) return;
  const uint64_t start = global_timer_ns();
  while (!mbarrier_try_wait(bar, parity))
    if (global_timer_ns() - start > FA_WATCHDOG_NS) watchdog_fail(parity);
}

// ------------------------------------------------------------------------------------------
// Tensor memory accelerator (TMA): whole tiles between global and shared memory
// ------------------------------------------------------------------------------------------

/// Fetches the tensor map (a `__grid_constant__` kernel parameter) into the descriptor cache.
__device__ __forceinline__ void tma_prefetch_descriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

/// Starts the copy of the box at coordinates (c0, c1, c2, c3) of the 4-D tensor `map` into
/// shared memory at `smem_dst`; its bytes count towards the barrier `bar`'s transaction count.
/// Elements outside the tensor are written as zeros.
__device__ __forceinline__ void tma_load_4d(void* smem_dst, const CUtensorMap* map, uint64_t* bar,
                                            int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(smem_u32(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

/// Starts the copy of shared memory at `smem_src` into the box at (c0, c1, c2, c3) of the 4-D
/// tensor `map`. Elements of the box outside the tensor are not written.
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, const void* smem_src, int c0,
                                             int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(smem_u32(smem_src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

/// Closes the group of TMA stores issued so far by this thread.
__device__ __forceinline__ void tma_store_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

/// Waits until this thread's TMA stores have read their shared memory (it may then be reused
/// or freed; the global writes complete on their own before the kernel ends).
__device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

/// Orders this thread's ordinary shared-memory writes before later reads by the async proxy
/// (TMA, wgmma). Each writing thread calls it before the barrier that hands the data over.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ------------------------------------------------------------------------------------------
// Warpgroup MMA (wgmma): 4 warps multiply a 64-row tile together, asynchronously
// ------------------------------------------------------------------------------------------

/// Descriptor of a shared-memory wgmma operand with the 128-byte swizzle, starting at
/// `smem_address` (16-byte units; the swizzle pattern repeats every 1024 bytes from the panel's
/// 1024-byte-aligned start). `lbo` ("leading byte offset") and `sbo` ("stride byte offset") in
/// bytes: for a K-major operand, sbo is the distance between groups of 8 rows (1024 for
/// 128-byte rows) and lbo is unused (16); for an MN-major operand, sbo is the distance between
/// groups of 8 rows along K and lbo the distance between 64-column panels along M or N.
__device__ __forceinline__ uint64_t wgmma_desc_sw128(uint32_t smem_address, uint32_t lbo,
                                                     uint32_t sbo) {
  return static_cast<uint64_t>((smem_address & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

/// Orders earlier register and shared-memory accesses before the wgmma that follow
/// (required before the first wgmma of a batch and whenever its registers were just written).
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

/// Closes the batch of wgmma issued so far by this warpgroup.
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

/// Waits until at most `N` committed wgmma batches of this warpgroup are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/// Tells the compiler that the registers of `x` change here, so that it neither moves their
/// reads above a wgmma_wait() nor their writes below a wgmma_fence(): wgmma reads and writes
/// them asynchronously, behind the compiler's back.
template <int M>
__device__ __forceinline__ void fence_operand(float (&x)[M][4]) {
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(x[i][e])::"memory");
}

/// The same for packed 16-bit A operands.
template <int M>
__device__ __forceinline__ void fence_operand(uint32_t (&x)[M][4]) {
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(x[i][e])::"memory");
}

// The wgmma wrappers below are one `asm` statement each, and that statement must name every
// accumulator register as an operand: 32 per 64 columns of N. These macros write those lists
// once. FA_WGMMA_D64(J): the operands "+f" d[J][0..3] ... d[J + 7][0..3], the eight n8 tiles of
// one 64-column slab starting at tile J. FA_WGMMA_R64_<k>: their names in the PTX text, %0-%31
// for the first slab (k = 0), %32-%63 for the second, and so on; the operands after the
// accumulators (descriptors, A registers, scale_d, the transpose flag) are numbered on from
// there, which is why each wrapper names them itself.
// clang-format off
/// The four accumulator operands of n8 tile J: "+f" d[J][0..3].
#define FA_WGMMA_D4(J) "+f"(d[J][0]), "+f"(d[J][1]), "+f"(d[J][2]), "+f"(d[J][3])
/// The 32 accumulator operands of one 64-column slab, n8 tiles J ... J + 7.
#define FA_WGMMA_D64(J)                                                                            \
  FA_WGMMA_D4(J), FA_WGMMA_D4(J + 1), FA_WGMMA_D4(J + 2), FA_WGMMA_D4(J + 3),                      \
  FA_WGMMA_D4(J + 4), FA_WGMMA_D4(J + 5), FA_WGMMA_D4(J + 6), FA_WGMMA_D4(J + 7)
/// The names of the first slab's accumulators in the PTX text: %0-%31.
#define FA_WGMMA_R64_0                                                                             \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                         \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
/// The second slab's: %32-%63.
#define FA_WGMMA_R64_1                                                                             \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "               \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
/// The third slab's: %64-%95.
#define FA_WGMMA_R64_2                                                                             \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "               \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
/// The fourth slab's: %96-%127.
#define FA_WGMMA_R64_3                                                                             \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, "         \
  "%111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, "           \
  "%125, %126, %127"

/// `wgmma.mma_async` m64nNk16, A and B from shared memory (both K-major), fp32 accumulate;
/// `TY` is f16 or bf16. `REGS`: the accumulators' names (FA_WGMMA_R64_*), `DA`, `DB`, `SCALE`:
/// the names of desc_a, desc_b and scale_d, the operands after them; then the accumulators
/// (FA_WGMMA_D64 per slab). scale_d = 0 (predicate p false) ignores the old D.
#define FA_WGMMA_SS(TY, N, REGS, DA, DB, SCALE, ...)                                               \
  asm volatile(                                                                                    \
      "{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\n"                                           \
      "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" REGS "}, "                  \
      DA ", " DB ", p, 1, 1, 0, 0;\n}\n"                                                           \
      : __VA_ARGS__                                                                                \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d))
/// FA_WGMMA_SS for N = 64.
#define FA_WGMMA_SS_N64(TY)                                                                        \
  FA_WGMMA_SS(TY, 64, FA_WGMMA_R64_0, "%32", "%33", "%34", FA_WGMMA_D64(0))
/// FA_WGMMA_SS for N = 128.
#define FA_WGMMA_SS_N128(TY)                                                                       \
  FA_WGMMA_SS(TY, 128, FA_WGMMA_R64_0 ", " FA_WGMMA_R64_1, "%64", "%65", "%66",                    \
              FA_WGMMA_D64(0), FA_WGMMA_D64(8))
/// FA_WGMMA_SS for N = 192.
#define FA_WGMMA_SS_N192(TY)                                                                       \
  FA_WGMMA_SS(TY, 192, FA_WGMMA_R64_0 ", " FA_WGMMA_R64_1 ", " FA_WGMMA_R64_2, "%96", "%97",       \
              "%98", FA_WGMMA_D64(0), FA_WGMMA_D64(8), FA_WGMMA_D64(16))
/// FA_WGMMA_SS for N = 256.
#define FA_WGMMA_SS_N256(TY)                                                                       \
  FA_WGMMA_SS(TY, 256,                                                                             \
              FA_WGMMA_R64_0 ", " FA_WGMMA_R64_1 ", " FA_WGMMA_R64_2 ", " FA_WGMMA_R64_3,          \
              "%128", "%129", "%130", FA_WGMMA_D64(0), FA_WGMMA_D64(8), FA_WGMMA_D64(16),          \
              FA_WGMMA_D64(24))

/// `wgmma.mma_async` m64nNk16, A from registers, B from shared memory (K-major if `TRANS_B`
/// is 0, N-major if 1), fp32 accumulate; `TY` is f16 or bf16. `REGS`: the accumulators' names;
/// `A`: the names of a[0..3], `DB`, `SCALE`, `TB`: of desc_b, scale_d and TRANS_B; then the
/// accumulators.
#define FA_WGMMA_RS(TY, TRANS_B, N, REGS, A, DB, SCALE, TB, ...)                                   \
  asm volatile(                                                                                    \
      "{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\n"                                           \
      "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" REGS "}, "                  \
      A ", " DB ", p, 1, 1, " TB ";\n}\n"                                                          \
      : __VA_ARGS__                                                                                \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TRANS_B))
/// FA_WGMMA_RS for N = 64.
#define FA_WGMMA_RS_N64(TY, TRANS_B)                                                               \
  FA_WGMMA_RS(TY, TRANS_B, 64, FA_WGMMA_R64_0, "{%32, %33, %34, %35}", "%36", "%37", "%38",        \
              FA_WGMMA_D64(0))
/// FA_WGMMA_RS for N = 128.
#define FA_WGMMA_RS_N128(TY, TRANS_B)                                                              \
  FA_WGMMA_RS(TY, TRANS_B, 128, FA_WGMMA_R64_0 ", " FA_WGMMA_R64_1, "{%64, %65, %66, %67}",        \
              "%68", "%69", "%70", FA_WGMMA_D64(0), FA_WGMMA_D64(8))
// clang-format on

/// \f$D = A B + D\f$ (or \f$D = A B\f$ when `scale_d` is 0) on a 64 x N x 16 tile for the
/// warpgroup: A (64 x 16) and B (N x 16, i.e. \f$B^T\f$ stored row by row) read from shared
/// memory through their descriptors, both K-major; `d` is the fp32 accumulator, d[j][e] as in
/// the file comment. Asynchronous: the result is there after wgmma_commit() and wgmma_wait().
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], uint64_t desc_a, uint64_t desc_b,
                                         int scale_d) {
  constexpr bool kHalf = std::is_same<T, __half>::value;
  static_assert(kHalf || std::is_same<T, __nv_bfloat16>::value, "fp16 or bf16");
  if constexpr (N == 64) {
    if constexpr (kHalf)
      FA_WGMMA_SS_N64("f16");
    else
      FA_WGMMA_SS_N64("bf16");
  } else if constexpr (N == 128) {
    if constexpr (kHalf)
      FA_WGMMA_SS_N128("f16");
    else
      FA_WGMMA_SS_N128("bf16");
  } else if constexpr (N == 192) {
    if constexpr (kHalf)
      FA_WGMMA_SS_N192("f16");
    else
      FA_WGMMA_SS_N192("bf16");
  } else {
    static_assert(N == 256, "wgmma_ss is written out for N = 64, 128, 192, 256");
    if constexpr (kHalf)
      FA_WGMMA_SS_N256("f16");
    else
      FA_WGMMA_SS_N256("bf16");
  }
}

/// \f$D = A B + D\f$ (or \f$D = A B\f$ when `scale_d` is 0) on a 64 x N x 16 tile for the
/// warpgroup: A (64 x 16) from registers (`a`, the layout of the file comment), B (16 x N) from
/// shared memory through its descriptor, K-major when `kTransB` is 0 and N-major (the rows of B
/// contiguous, e.g. a V tile stored key by key) when it is 1. Asynchronous, as wgmma_ss().
template <typename T, int N, int kTransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4],
                                         uint64_t desc_b, int scale_d) {
  constexpr bool kHalf = std::is_same<T, __half>::value;
  static_assert(kHalf || std::is_same<T, __nv_bfloat16>::value, "fp16 or bf16");
  if constexpr (N == 64) {
    if constexpr (kHalf)
      FA_WGMMA_RS_N64("f16", kTransB);
    else
      FA_WGMMA_RS_N64("bf16", kTransB);
  } else {
    static_assert(N == 128, "wgmma_rs is written out for N = 64, 128");
    if constexpr (kHalf)
      FA_WGMMA_RS_N128("f16", kTransB);
    else
      FA_WGMMA_RS_N128("bf16", kTransB);
  }
}

// ------------------------------------------------------------------------------------------
// Register reallocation and named barriers
// ------------------------------------------------------------------------------------------

/// Raises this warpgroup's registers per thread to `kRegs` (taken from the pool that other
/// warpgroups released). Every warp of the warpgroup executes it; the kernel must have a
/// register cap at entry (`__launch_bounds__(threads, 1)`).
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

/// Lowers this warpgroup's registers per thread to `kRegs`, returning the rest to the pool.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

/// Waits at named barrier `id` (1..15; 0 is __syncthreads) until `count` threads (a multiple
/// of 32) have arrived or synced on it.
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

/// Arrives at named barrier `id` without waiting (the other side syncs).
__device__ __forceinline__ void named_barrier_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

}  // namespace fa

#endif  // FA_HOPPER_CUH_
