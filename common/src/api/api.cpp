/// \file api.cpp
/// \brief The C API: argument checks (one clear message per mistake), device checks, and
/// dispatch to the registered steps.
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "fa/api.h"
#include "fa/env.h"
#include "fa/registry.h"
#include "fa/step.h"

namespace fa {
namespace {

thread_local std::string g_last_error;

const Step* find_step(const char* name) {
  if (name == nullptr) return nullptr;
  for (int i = 0; kRegisteredSteps[i] != nullptr; ++i)
    if (std::strcmp(kRegisteredSteps[i]->name, name) == 0) return kRegisteredSteps[i];
  return nullptr;
}

std::string step_list(bool with_backward_only) {
  std::string out;
  for (int i = 0; kRegisteredSteps[i] != nullptr; ++i) {
    if (with_backward_only && kRegisteredSteps[i]->backward == nullptr) continue;
    if (!out.empty()) out += ", ";
    out += kRegisteredSteps[i]->name;
  }
  return out.empty() ? "none" : out;
}

std::string head_dim_list(const Step& step) {
  std::string out;
  for (int d = 8; d <= 256; d += 8) {
    if (!step.supports_head_dim(d)) continue;
    if (!out.empty()) out += ", ";
    out += std::to_string(d);
  }
  return out;
}

constexpr int kMaxGridYZ = 65535;  // heads and batch map to grid dims y and z
/// Longest sequence accepted: the kernels round lengths up to whole blocks (up to 256 rows) in
/// 32-bit ints, which must not overflow; 2^30 tokens is far beyond any GPU's memory anyway.
constexpr int kMaxSeqlen = 1 << 30;
/// Largest element offset inside a tensor, and largest number of scores B*H*Nq*Nk: both are
/// kept in 64-bit integers (byte offsets, buffer sizes), which this leaves room for.
constexpr int64_t kMaxElements = int64_t{1} << 62;

/// The memory of one tensor, for the overlap rules: up to three strided dimensions (count and
/// stride in bytes) of contiguous runs of `run` bytes (a row of head_dim elements).
struct Footprint {
  const char* name;
  uintptr_t base;
  int64_t count[3];
  int64_t stride[3];
  int64_t run;
};

Footprint footprint(const char* name, const fa_tensor& t, int batch, int seqlen, int heads,
                    int head_dim) {
  return {name,
          reinterpret_cast<uintptr_t>(t.ptr),
          {batch, seqlen, heads},
          {2 * t.batch_stride, 2 * t.row_stride, 2 * t.head_stride},
          2 * static_cast<int64_t>(head_dim)};
}

/// One unknown of the overlap search: c * v with v in [lo, hi] (c > 0).
struct Term {
  int64_t c, lo, hi;
};

/// Searches for integers v_k in [lo_k, hi_k] with target_lo < sum c_k v_k < target_hi, the terms
/// sorted by decreasing c. At each level only the few values of v_k that the remaining terms can
/// still bring into the interval are tried (at most three when the strides nest, as every real
/// layout's do). `nonzero`: a solution must have some v_k != 0. Returns 1 (found), 0 (none),
/// or -1 when `budget` nodes did not settle it.
int search(const std::vector<Term>& terms, size_t k, __int128 target_lo, __int128 target_hi,
           bool nonzero, int* budget) {
  if (--*budget < 0) return -1;
  if (k == terms.size()) return (!nonzero && target_lo < 0 && 0 < target_hi) ? 1 : 0;
  __int128 rest_min = 0, rest_max = 0;
  for (size_t m = k + 1; m < terms.size(); ++m) {
    rest_min += static_cast<__int128>(terms[m].c) * terms[m].lo;
    rest_max += static_cast<__int128>(terms[m].c) * terms[m].hi;
  }
  const Term& t = terms[k];
  // c v > target_lo - rest_max and c v < target_hi - rest_min (floor division for negatives).
  auto floor_div = [](__int128 a, __int128 b) { return a / b - ((a % b != 0) && (a < 0)); };
  const __int128 v_lo = std::max<__int128>(t.lo, floor_div(target_lo - rest_max, t.c) + 1);
  const __int128 v_hi = std::min<__int128>(t.hi, -floor_div(-(target_hi - rest_min), t.c) - 1);
  if (v_hi - v_lo > 64) return -1;  // strides that do not nest: give up, count as overlap
  bool undecided = false;
  for (__int128 v = v_lo; v <= v_hi; ++v) {
    const int r =
        search(terms, k + 1, target_lo - t.c * v, target_hi - t.c * v, nonzero && v == 0, budget);
    if (r == 1) return 1;
    if (r < 0) undecided = true;
  }
  return undecided ? -1 : 0;
}

/// Adds c * v, v in [lo, hi], merging it into a term of the same c (the same stride: their
/// indices add up, e.g. heads of two views of one buffer).
void add_term(std::vector<Term>* terms, int64_t c, int64_t lo, int64_t hi) {
  if (c == 0 || (lo == 0 && hi == 0)) return;
  for (Term& t : *terms)
    if (t.c == c) {
      t.lo += lo;
      t.hi += hi;
      return;
    }
  terms->push_back({c, lo, hi});
}

int solve(std::vector<Term> terms, __int128 target_lo, __int128 target_hi, bool nonzero) {
  std::sort(terms.begin(), terms.end(), [](const Term& a, const Term& b) { return a.c > b.c; });
  int budget = 4096;
  return search(terms, 0, target_lo, target_hi, nonzero, &budget);
}

/// True unless two elements of an output could share memory; `detail` says which strides.
bool self_disjoint(const Footprint& f) {
  std::vector<Term> terms;
  for (int k = 0; k < 3; ++k) {
    if (f.count[k] <= 1) continue;
    for (const Term& t : terms)
      if (t.c == f.stride[k]) return false;  // two dimensions on the same stride
    add_term(&terms, f.stride[k], -(f.count[k] - 1), f.count[k] - 1);
  }
  // Two different index vectors (a difference v != 0) whose runs overlap: |sum c v| < run.
  return solve(terms, -f.run, f.run, true) == 0;
}

/// True unless the memory of `a` and `b` could intersect (exact for strides that nest, and
/// conservative otherwise: undecided counts as overlapping).
bool disjoint(const Footprint& a, const Footprint& b) {
  // Quick answer: the byte ranges [first, last] are apart.
  auto last = [](const Footprint& f) {
    __int128 end = f.base;
    for (int k = 0; k < 3; ++k) end += static_cast<__int128>(f.count[k] - 1) * f.stride[k];
    return end + f.run;
  };
  if (last(a) <= static_cast<__int128>(b.base) || last(b) <= static_cast<__int128>(a.base))
    return true;
  // A run of a at x and one of b at y overlap iff -run_b < y - x < run_a, with
  // y - x = (b.base - a.base) + sum_k stride_b,k j_k - sum_k stride_a,k i_k.
  std::vector<Term> terms;
  for (int k = 0; k < 3; ++k) {
    if (a.count[k] > 1) add_term(&terms, a.stride[k], -(a.count[k] - 1), 0);
    if (b.count[k] > 1) add_term(&terms, b.stride[k], 0, b.count[k] - 1);
  }
  const __int128 delta = static_cast<__int128>(b.base) - static_cast<__int128>(a.base);
  return solve(terms, -b.run - delta, a.run - delta, false) == 0;
}

fa_status check_tensor(const char* name, const fa_tensor& t, int batch, int seqlen, int heads,
                       int head_dim) {
  if (t.ptr == nullptr) return set_error(FA_ERR_INVALID_ARGUMENT, "%s.ptr is NULL", name);
  if (reinterpret_cast<uintptr_t>(t.ptr) % 16 != 0)
    return set_error(FA_ERR_INVALID_ARGUMENT,
                     "%s.ptr (%p) is not 16-byte aligned (the kernels load 16 bytes at a time)",
                     name, t.ptr);
  const struct {
    const char* what;
    int64_t value;
    int count;
  } strides[] = {{"batch_stride", t.batch_stride, batch},
                 {"row_stride", t.row_stride, seqlen},
                 {"head_stride", t.head_stride, heads}};
  __int128 last = head_dim;  // one past the last element, in elements
  for (const auto& s : strides) {
    if (s.value < 0)
      return set_error(FA_ERR_INVALID_ARGUMENT, "%s.%s must be >= 0 (got %lld)", name, s.what,
                       static_cast<long long>(s.value));
    if (s.value % 8 != 0)
      return set_error(FA_ERR_INVALID_ARGUMENT,
                       "%s.%s (%lld) must be a multiple of 8 elements (16-byte aligned rows)", name,
                       s.what, static_cast<long long>(s.value));
    last += static_cast<__int128>(s.value) * (s.count - 1);
  }
  if (t.row_stride < head_dim)
    return set_error(FA_ERR_INVALID_ARGUMENT,
                     "%s.row_stride (%lld) is smaller than head_dim (%d): rows would overlap", name,
                     static_cast<long long>(t.row_stride), head_dim);
  if (t.head_stride < head_dim)
    return set_error(FA_ERR_INVALID_ARGUMENT,
                     "%s.head_stride (%lld) is smaller than head_dim (%d): heads would overlap",
                     name, static_cast<long long>(t.head_stride), head_dim);
  if (last > kMaxElements || static_cast<__int128>(reinterpret_cast<uintptr_t>(t.ptr)) + 2 * last >
                                 static_cast<__int128>(UINTPTR_MAX))
    return set_error(FA_ERR_UNSUPPORTED,
                     "%s spans more than 2^62 elements with these sizes and strides: too large "
                     "for 64-bit offsets",
                     name);
  return FA_OK;
}

/// An output must not overlap itself (no zero or colliding strides), any input, or any other
/// output: the kernels write it from many threads, in no fixed order, while reading the inputs.
fa_status check_outputs(const std::vector<Footprint>& outputs,
                        const std::vector<Footprint>& inputs) {
  static const char* const kStrideNames[3] = {"batch_stride", "row_stride", "head_stride"};
  static const char* const kCountNames[3] = {"batch", "seqlen", "heads"};
  for (size_t i = 0; i < outputs.size(); ++i) {
    const Footprint& o = outputs[i];
    for (int k = 0; k < 3; ++k)
      if (o.stride[k] == 0 && o.count[k] > 1)
        return set_error(FA_ERR_INVALID_ARGUMENT,
                         "%s.%s is 0 with %s = %lld: an output cannot be broadcast, every element "
                         "it writes needs memory of its own",
                         o.name, kStrideNames[k], kCountNames[k],
                         static_cast<long long>(o.count[k]));
    if (!self_disjoint(o))
      return set_error(FA_ERR_INVALID_ARGUMENT,
                       "%s's strides (batch %lld, row %lld, head %lld elements) make two of its "
                       "elements share memory: an output needs every element in its own place",
                       o.name, static_cast<long long>(o.stride[0] / 2),
                       static_cast<long long>(o.stride[1] / 2),
                       static_cast<long long>(o.stride[2] / 2));
    for (size_t j = 0; j < outputs.size(); ++j)
      if (j != i && !disjoint(o, outputs[j]))
        return set_error(FA_ERR_INVALID_ARGUMENT,
                         "%s and %s overlap in memory: outputs may not share memory with each "
                         "other or with an input",
                         o.name, outputs[j].name);
    for (const Footprint& in : inputs)
      if (!disjoint(o, in))
        return set_error(FA_ERR_INVALID_ARGUMENT,
                         "%s overlaps the input %s in memory: outputs may not share memory with "
                         "an input or with each other",
                         o.name, in.name);
  }
  return FA_OK;
}

Footprint lse_footprint(const char* name, const float* lse, const fa_fwd_args& a) {
  return {name,
          reinterpret_cast<uintptr_t>(lse),
          {a.batch, a.heads, a.seqlen_q},
          {4 * static_cast<int64_t>(a.heads) * a.seqlen_q, 4 * static_cast<int64_t>(a.seqlen_q), 4},
          4};
}

fa_status check_forward_args(const Step& step, const fa_fwd_args& a) {
  if (a.dtype != FA_FP16 && a.dtype != FA_BF16)
    return set_error(FA_ERR_UNSUPPORTED, "dtype %d is not supported (use FA_FP16 or FA_BF16)",
                     static_cast<int>(a.dtype));
  const struct {
    const char* what;
    int value;
  } sizes[] = {{"batch", a.batch},       {"heads", a.heads},       {"heads_kv", a.heads_kv},
               {"seqlen_q", a.seqlen_q}, {"seqlen_k", a.seqlen_k}, {"head_dim", a.head_dim}};
  for (const auto& s : sizes)
    if (s.value < 1)
      return set_error(FA_ERR_INVALID_ARGUMENT, "%s must be >= 1 (got %d)", s.what, s.value);
  if (a.batch > kMaxGridYZ || a.heads > kMaxGridYZ)
    return set_error(FA_ERR_UNSUPPORTED, "batch (%d) and heads (%d) must be <= %d", a.batch,
                     a.heads, kMaxGridYZ);
  if (a.seqlen_q > kMaxSeqlen || a.seqlen_k > kMaxSeqlen)
    return set_error(FA_ERR_UNSUPPORTED,
                     "seqlen_q (%d) and seqlen_k (%d) must be <= %d: the kernels round lengths "
                     "up to whole blocks in 32-bit integers",
                     a.seqlen_q, a.seqlen_k, kMaxSeqlen);
  if (a.heads % a.heads_kv != 0)
    return set_error(FA_ERR_INVALID_ARGUMENT, "heads (%d) must be a multiple of heads_kv (%d)",
                     a.heads, a.heads_kv);
  if (static_cast<__int128>(a.batch) * a.heads * a.seqlen_q * a.seqlen_k > kMaxElements)
    return set_error(FA_ERR_UNSUPPORTED,
                     "batch * heads * seqlen_q * seqlen_k (%d * %d * %d * %d) is more than 2^62 "
                     "scores: too large for 64-bit sizes",
                     a.batch, a.heads, a.seqlen_q, a.seqlen_k);
  if (!step.supports_head_dim(a.head_dim))
    return set_error(FA_ERR_UNSUPPORTED, "head_dim %d is not supported by step %s (supported: %s)",
                     a.head_dim, step.name, head_dim_list(step).c_str());
  // The kernels compute exp2(x * scale * log2(e)) in fp32: that factor must be a normal, finite
  // fp32 number (0, a subnormal or an overflow would give a uniform or an infinite softmax).
  constexpr double kLog2e = 1.4426950408889634;
  if (!std::isfinite(a.scale) || !(a.scale >= FLT_MIN) ||
      !(static_cast<double>(a.scale) * kLog2e <= FLT_MAX))
    return set_error(FA_ERR_INVALID_ARGUMENT,
                     "scale must be finite and > 0, from %.3g to %.3g, so that scale * log2(e) "
                     "is a normal fp32 number (got %g)",
                     static_cast<double>(FLT_MIN), FLT_MAX / kLog2e, static_cast<double>(a.scale));
  if (a.causal != 0 && a.causal != 1)
    return set_error(FA_ERR_INVALID_ARGUMENT, "causal must be 0 or 1 (got %d)", a.causal);
  fa_status st;
  if ((st = check_tensor("q", a.q, a.batch, a.seqlen_q, a.heads, a.head_dim)) != FA_OK) return st;
  if ((st = check_tensor("k", a.k, a.batch, a.seqlen_k, a.heads_kv, a.head_dim)) != FA_OK)
    return st;
  if ((st = check_tensor("v", a.v, a.batch, a.seqlen_k, a.heads_kv, a.head_dim)) != FA_OK)
    return st;
  if ((st = check_tensor("o", a.o, a.batch, a.seqlen_q, a.heads, a.head_dim)) != FA_OK) return st;
  if (a.lse != nullptr && reinterpret_cast<uintptr_t>(a.lse) % 16 != 0)
    return set_error(FA_ERR_INVALID_ARGUMENT, "lse (%p) is not 16-byte aligned",
                     static_cast<void*>(a.lse));
  return FA_OK;
}

/// The forward's tensors as footprints: q, k, v, o, and lse if not null.
std::vector<Footprint> forward_footprints(const fa_fwd_args& a) {
  std::vector<Footprint> f = {footprint("q", a.q, a.batch, a.seqlen_q, a.heads, a.head_dim),
                              footprint("k", a.k, a.batch, a.seqlen_k, a.heads_kv, a.head_dim),
                              footprint("v", a.v, a.batch, a.seqlen_k, a.heads_kv, a.head_dim),
                              footprint("o", a.o, a.batch, a.seqlen_q, a.heads, a.head_dim)};
  if (a.lse != nullptr) f.push_back(lse_footprint("lse", a.lse, a));
  return f;
}

fa_status check_backward_args(const Step& step, const fa_bwd_args& a) {
  if (step.backward == nullptr)
    return set_error(FA_ERR_UNSUPPORTED, "step %s has no backward pass (steps with one: %s)",
                     step.name, step_list(true).c_str());
  fa_status st = check_forward_args(step, a.fwd);
  if (st != FA_OK) return st;
  const fa_fwd_args& f = a.fwd;
  if (f.lse == nullptr)
    return set_error(FA_ERR_INVALID_ARGUMENT,
                     "fwd.lse is NULL: the backward needs the forward's logsumexp");
  if ((st = check_tensor("d_o", a.d_o, f.batch, f.seqlen_q, f.heads, f.head_dim)) != FA_OK)
    return st;
  if ((st = check_tensor("dq", a.dq, f.batch, f.seqlen_q, f.heads, f.head_dim)) != FA_OK) return st;
  if ((st = check_tensor("dk", a.dk, f.batch, f.seqlen_k, f.heads_kv, f.head_dim)) != FA_OK)
    return st;
  if ((st = check_tensor("dv", a.dv, f.batch, f.seqlen_k, f.heads_kv, f.head_dim)) != FA_OK)
    return st;
  if (a.deterministic != 0 && a.deterministic != 1)
    return set_error(FA_ERR_INVALID_ARGUMENT, "deterministic must be 0 or 1 (got %d)",
                     a.deterministic);
  // Everything the forward wrote is read here: q, k, v, o, lse and d_o are the inputs.
  std::vector<Footprint> inputs = forward_footprints(f);
  inputs.back().name = "fwd.lse";
  inputs.push_back(footprint("d_o", a.d_o, f.batch, f.seqlen_q, f.heads, f.head_dim));
  const std::vector<Footprint> outputs = {
      footprint("dq", a.dq, f.batch, f.seqlen_q, f.heads, f.head_dim),
      footprint("dk", a.dk, f.batch, f.seqlen_k, f.heads_kv, f.head_dim),
      footprint("dv", a.dv, f.batch, f.seqlen_k, f.heads_kv, f.head_dim)};
  return check_outputs(outputs, inputs);
}

/// The forward's overlap rules (separate from check_forward_args(), which the backward also
/// runs on its forward arguments, where o and lse are inputs).
fa_status check_forward_outputs(const fa_fwd_args& a) {
  std::vector<Footprint> all = forward_footprints(a);
  const std::vector<Footprint> inputs(all.begin(), all.begin() + 3);
  const std::vector<Footprint> outputs(all.begin() + 3, all.end());
  return check_outputs(outputs, inputs);
}

fa_status lookup(const char* name, const Step** step) {
  *step = find_step(name);
  if (*step == nullptr)
    return set_error(FA_ERR_UNKNOWN_STEP, "unknown step '%s' (registered: %s)",
                     name ? name : "(null)", step_list(false).c_str());
  return FA_OK;
}

/// A step built for one compute capability (Step::required_sm) runs only on a GPU of exactly
/// that one: sm_90a code (wgmma) runs on an H100/H200, not on an sm_80 or sm_100 GPU.
fa_status check_required_sm(const Step& step, int device, int sm) {
  if (step.required_sm == 0 || sm == step.required_sm) return FA_OK;
  return set_error(FA_ERR_UNSUPPORTED,
                   "step %s needs an sm_%d GPU (H100, H200: its kernels are sm_%da code); GPU %d "
                   "is sm_%d",
                   step.name, step.required_sm, step.required_sm, device, sm);
}

/// The current device exists and is sm_80 or newer (checked once per device and thread), and
/// is the architecture `step` needs.
fa_status check_device(const Step& step) {
  int device = -1;
  cudaError_t err = cudaGetDevice(&device);
  int count = 0;
  if (err == cudaSuccess) err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return set_error(FA_ERR_NO_DEVICE, "no CUDA device: %s",
                     err != cudaSuccess ? cudaGetErrorString(err) : "none found");
  }
  thread_local int checked[64] = {};  // sm (major * 10 + minor) of each device seen, 0: not yet
  if (device >= 0 && device < 64 && checked[device])
    return check_required_sm(step, device, checked[device]);
  cudaDeviceProp prop;
  if ((err = cudaGetDeviceProperties(&prop, device)) != cudaSuccess)
    return set_error(FA_ERR_NO_DEVICE, "cudaGetDeviceProperties: %s", cudaGetErrorString(err));
  if (prop.major < 8)
    return set_error(FA_ERR_NO_DEVICE, "GPU %d (%s) is sm_%d%d; the kernels need sm_80 or newer",
                     device, prop.name, prop.major, prop.minor);
  if (device >= 0 && device < 64) checked[device] = prop.major * 10 + prop.minor;
  return check_required_sm(step, device, prop.major * 10 + prop.minor);
}

fa_status finish(fa_status st) {
  if (st == FA_OK) g_last_error.clear();
  return st;
}

}  // namespace

fa_status set_error(fa_status status, const char* format, ...) {
  char buffer[1024];
  va_list ap;
  va_start(ap, format);
  std::vsnprintf(buffer, sizeof buffer, format, ap);
  va_end(ap);
  g_last_error = buffer;
  return status;
}

fa_status smem_per_block_optin(int* bytes) {
  long long limit = -1;  // none
  std::string error;
  if (env_smem_limit(&limit, &error) == EnvStatus::kInvalid)
    return set_error(FA_ERR_INVALID_ARGUMENT, "%s", error.c_str());
  int device = 0, optin = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess)
    return set_error(FA_ERR_CUDA, "cannot read the GPU's shared memory per block: %s",
                     cudaGetErrorString(err));
  if (limit > 0 && limit < optin) optin = static_cast<int>(limit);
  *bytes = optin;
  return FA_OK;
}

}  // namespace fa

extern "C" {

int fa_step_count(void) {
  int n = 0;
  while (fa::kRegisteredSteps[n] != nullptr) ++n;
  return n;
}

const char* fa_step_name(int i) {
  return (i >= 0 && i < fa_step_count()) ? fa::kRegisteredSteps[i]->name : nullptr;
}

const char* fa_step_summary(const char* step) {
  const fa::Step* s = fa::find_step(step);
  return s ? s->summary : nullptr;
}

int fa_step_has_backward(const char* step) {
  const fa::Step* s = fa::find_step(step);
  return s ? (s->backward != nullptr) : -1;
}

int fa_step_supports_head_dim(const char* step, int head_dim) {
  const fa::Step* s = fa::find_step(step);
  return s ? static_cast<int>(s->supports_head_dim(head_dim)) : -1;
}

fa_status fa_check_forward(const char* step, const fa_fwd_args* args) {
  const fa::Step* s = nullptr;
  fa_status st = fa::lookup(step, &s);
  if (st != FA_OK) return st;
  if (args == nullptr) return fa::set_error(FA_ERR_INVALID_ARGUMENT, "args is NULL");
  if ((st = fa::check_forward_args(*s, *args)) != FA_OK) return st;
  return fa::finish(fa::check_forward_outputs(*args));
}

fa_status fa_check_backward(const char* step, const fa_bwd_args* args) {
  const fa::Step* s = nullptr;
  fa_status st = fa::lookup(step, &s);
  if (st != FA_OK) return st;
  if (args == nullptr) return fa::set_error(FA_ERR_INVALID_ARGUMENT, "args is NULL");
  return fa::finish(fa::check_backward_args(*s, *args));
}

fa_status fa_step_check_device(const char* step) {
  const fa::Step* s = nullptr;
  fa_status st = fa::lookup(step, &s);
  if (st != FA_OK) return st;
  return fa::finish(fa::check_device(*s));
}

fa_status fa_forward(const char* step, const fa_fwd_args* args, fa_stream stream) {
  fa_status st = fa_check_forward(step, args);
  if (st != FA_OK) return st;
  if ((st = fa::check_device(*fa::find_step(step))) != FA_OK) return st;
  return fa::finish(fa::find_step(step)->forward(*args, static_cast<cudaStream_t>(stream)));
}

fa_status fa_backward(const char* step, const fa_bwd_args* args, fa_stream stream) {
  fa_status st = fa_check_backward(step, args);
  if (st != FA_OK) return st;
  if ((st = fa::check_device(*fa::find_step(step))) != FA_OK) return st;
  return fa::finish(fa::find_step(step)->backward(*args, static_cast<cudaStream_t>(stream)));
}

const char* fa_last_error(void) {
  return fa::g_last_error.c_str();
}

const char* fa_status_name(fa_status status) {
  switch (status) {
    case FA_OK:
      return "FA_OK";
    case FA_ERR_INVALID_ARGUMENT:
      return "FA_ERR_INVALID_ARGUMENT";
    case FA_ERR_UNSUPPORTED:
      return "FA_ERR_UNSUPPORTED";
    case FA_ERR_NO_DEVICE:
      return "FA_ERR_NO_DEVICE";
    case FA_ERR_OUT_OF_MEMORY:
      return "FA_ERR_OUT_OF_MEMORY";
    case FA_ERR_CUDA:
      return "FA_ERR_CUDA";
    case FA_ERR_UNKNOWN_STEP:
      return "FA_ERR_UNKNOWN_STEP";
  }
  return "FA_ERR_UNKNOWN_STATUS";
}

}  // extern "C"
