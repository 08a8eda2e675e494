/// \file api.h
/// \brief The one door into every step: plain C structs and a small C API.
///
/// The C++ runner, the tests, the benchmark and the Python `ctypes` wrapper all call the
/// kernels through these functions, exported from the shared library `libfa`.
///
/// Layout is BSHD: element `(b, s, h, c)` of a tensor lives at
/// `ptr + b * batch_stride + s * row_stride + h * head_stride + c` (strides in elements, the
/// head dimension `c` contiguous). The logsumexp `lse` is fp32, contiguous, shape
/// `[batch, heads, seqlen_q]`.
///
/// Attention computed for query head \f$h\f$ (key/value head \f$h / (H / H_{kv})\f$):
/// \f[ S = \mathrm{scale}\cdot Q K^T,\quad P = \mathrm{softmax}(S),\quad O = P V,\quad
///     L_i = \log \sum_j e^{S_{ij}} \f]
/// Under causal masking query row \f$i\f$ sees key \f$j\f$ iff \f$j \le i + N_k - N_q\f$
/// (bottom-right aligned, as FlashAttention-2 does). A row that sees no key (possible when
/// \f$N_q > N_k\f$) gets \f$O_i = 0\f$ and \f$L_i = +\infty\f$, so that a backward pass that
/// recomputes \f$P = e^{S - L}\f$ gets exactly zero for it.
///
/// What the checks (fa_check_forward(), fa_check_backward(), and every call) reject, each with
/// a one-line message in fa_last_error():
/// - sizes below 1; batch or heads above 65535; seqlen_q or seqlen_k above \f$2^{30}\f$; a
///   tensor spanning more than \f$2^{62}\f$ elements, or more than \f$2^{62}\f$ scores
///   (\f$B H N_q N_k\f$); heads not a multiple of heads_kv; a head dim the step lacks;
/// - a scale that is not finite, or whose \f$\mathrm{scale} \cdot \log_2 e\f$ (the factor
///   the kernels multiply scores by, in fp32) is not a normal fp32 number: from
///   \f$1.18 \cdot 10^{-38}\f$ to \f$2.36 \cdot 10^{38}\f$;
/// - null or misaligned pointers, negative strides, strides that are not multiples of 8, rows
///   or heads narrower than head_dim;
/// - **outputs that share memory** (o and lse in the forward; dq, dk and dv in the backward):
///   an output may not overlap itself (a stride of 0 with a size above 1, or strides under
///   which two elements meet), another output, or an input (q, k, v, and for the backward o,
///   lse and d_o). Inputs may share memory with each other. The rule is on the bytes actually
///   used, not on address ranges: views that interleave in one buffer (q, k, v or dq, dk, dv as
///   slices of one packed [B, N, 3, H, d] tensor) are disjoint and accepted. The test is exact
///   for strides that nest (each stride at least the extent of the dimensions inside it, true
///   of every contiguous, padded, transposed or sliced layout); for strides that do not, a
///   layout it cannot prove disjoint within a small search is rejected.
#ifndef FA_API_H_
#define FA_API_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/// Marks the functions exported from libfa.
#if defined(_WIN32)
#define FA_EXPORT __declspec(dllexport)
#else
#define FA_EXPORT __attribute__((visibility("default")))
#endif

/// Element type of Q, K, V, O and of the gradients.
typedef enum { FA_FP16 = 0, FA_BF16 = 1 } fa_dtype;

/// Result of every API call. The message behind it is in fa_last_error().
typedef enum {
  FA_OK = 0,
  FA_ERR_INVALID_ARGUMENT = 1,  ///< a size, stride, pointer or combination is invalid
  FA_ERR_UNSUPPORTED = 2,       ///< valid input this step does not support (e.g. head dim)
  FA_ERR_NO_DEVICE = 3,         ///< no CUDA device, or one older than sm_80
  FA_ERR_OUT_OF_MEMORY = 4,     ///< the problem does not fit in device memory
  FA_ERR_CUDA = 5,              ///< a CUDA or cuBLAS call failed
  FA_ERR_UNKNOWN_STEP = 6,      ///< no registered step has that name
} fa_status;

/// One BSHD tensor: a device pointer and its strides in elements (last dim contiguous).
typedef struct {
  void* ptr;             ///< device pointer to element (0, 0, 0, 0), 16-byte aligned
  int64_t batch_stride;  ///< elements between (b, s, h, c) and (b + 1, s, h, c)
  int64_t row_stride;    ///< elements between sequence positions s and s + 1
  int64_t head_stride;   ///< elements between heads h and h + 1
} fa_tensor;

/// Everything a forward pass needs.
typedef struct {
  fa_dtype dtype;  ///< FA_FP16 or FA_BF16, for all of Q, K, V, O
  int batch;       ///< B
  int heads;       ///< H, query heads
  int heads_kv;    ///< H_kv, key/value heads; must divide H (H_kv < H is GQA, 1 is MQA)
  int seqlen_q;    ///< N_q
  int seqlen_k;    ///< N_k
  int head_dim;    ///< d
  float scale;     ///< softmax scale, usually 1/sqrt(d); must be finite and > 0
  int causal;      ///< 0 or 1
  fa_tensor q;     ///< [B, N_q, H, d], read
  fa_tensor k;     ///< [B, N_k, H_kv, d], read
  fa_tensor v;     ///< [B, N_k, H_kv, d], read
  fa_tensor o;     ///< [B, N_q, H, d], written
  float* lse;      ///< [B, H, N_q] fp32, written if not null (the backward needs it)
} fa_fwd_args;

/// Everything a backward pass needs: the forward's inputs and outputs, dO, and the gradients.
typedef struct {
  fa_fwd_args fwd;    ///< q, k, v, o and lse (required) as the forward left them; read only
  fa_tensor d_o;      ///< [B, N_q, H, d], read
  fa_tensor dq;       ///< [B, N_q, H, d], written
  fa_tensor dk;       ///< [B, N_k, H_kv, d], written (summed over the heads of a group)
  fa_tensor dv;       ///< [B, N_k, H_kv, d], written
  int deterministic;  ///< 1: results independent of thread block order (the same bits every run)
} fa_bwd_args;

/// Opaque CUDA stream (a cudaStream_t); NULL is the default stream. Steps that need scratch
/// memory (01's S and P, 02's fp32 O, 08's split partials, ...) keep it from one call to the
/// next, one buffer per stream (per host thread on cudaStreamPerThread), grown when a call
/// needs more, until the process ends (fa/workspace.h). 07's backward still allocates its
/// dQ accumulator in every call (cudaMallocAsync, freed in stream order after its kernels).
typedef void* fa_stream;

/// Number of registered steps.
FA_EXPORT int fa_step_count(void);
/// Name of step i (0-based, in folder order), or NULL when out of range.
FA_EXPORT const char* fa_step_name(int i);
/// One-line description of a step, or NULL for an unknown name.
FA_EXPORT const char* fa_step_summary(const char* step);
/// 1 if the step has a backward pass, 0 if not, -1 for an unknown name.
FA_EXPORT int fa_step_has_backward(const char* step);
/// 1 if the step supports head dimension d, 0 if not, -1 for an unknown name.
FA_EXPORT int fa_step_supports_head_dim(const char* step, int head_dim);

/// FA_OK if `step` can run on the current CUDA device. Otherwise FA_ERR_NO_DEVICE (no device,
/// or one older than sm_80), FA_ERR_UNSUPPORTED (the step was built for one architecture,
/// e.g. sm_90a, and this GPU is another: fa_last_error() says so in one line) or
/// FA_ERR_UNKNOWN_STEP. fa_forward() and fa_backward() make the same check.
FA_EXPORT fa_status fa_step_check_device(const char* step);

/// Checks a forward problem for `step` without touching the GPU. FA_OK if it would run.
FA_EXPORT fa_status fa_check_forward(const char* step, const fa_fwd_args* args);
/// Checks a backward problem for `step` without touching the GPU. FA_OK if it would run.
FA_EXPORT fa_status fa_check_backward(const char* step, const fa_bwd_args* args);

/// Runs step `step`'s forward pass on `stream` (asynchronous, like a kernel launch).
FA_EXPORT fa_status fa_forward(const char* step, const fa_fwd_args* args, fa_stream stream);
/// Runs step `step`'s backward pass on `stream` (asynchronous, like a kernel launch).
FA_EXPORT fa_status fa_backward(const char* step, const fa_bwd_args* args, fa_stream stream);

/// The message of the last failed call on this thread ("" after a success).
FA_EXPORT const char* fa_last_error(void);
/// A short name for a status ("FA_ERR_UNSUPPORTED", ...).
FA_EXPORT const char* fa_status_name(fa_status status);

/// Bytes one element of `dtype` takes (2 for both).
static inline int fa_dtype_size(fa_dtype dtype) {
  (void)dtype;
  return 2;
}

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // FA_API_H_
