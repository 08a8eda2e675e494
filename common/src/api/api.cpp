/// \file api.cpp
/// \brief The C API: argument checks (one clear message per mistake), device checks, and
/// dispatch to the registered steps.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "fa/api.h"
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

fa_status check_tensor(const char* name, const fa_tensor& t, int head_dim, bool has_rows) {
  if (t.ptr == nullptr) return set_error(FA_ERR_INVALID_ARGUMENT, "%s.ptr is NULL", name);
  if (reinterpret_cast<uintptr_t>(t.ptr) % 16 != 0)
    return set_error(FA_ERR_INVALID_ARGUMENT,
                     "%s.ptr (%p) is not 16-byte aligned (the kernels load 16 bytes at a time)",
                     name, t.ptr);
  const struct {
    const char* what;
    int64_t value;
  } strides[] = {{"batch_stride", t.batch_stride},
                 {"row_stride", t.row_stride},
                 {"head_stride", t.head_stride}};
  for (const auto& s : strides) {
    if (s.value < 0)
      return set_error(FA_ERR_INVALID_ARGUMENT, "%s.%s must be >= 0 (got %lld)", name, s.what,
                       static_cast<long long>(s.value));
    if (s.value % 8 != 0)
      return set_error(FA_ERR_INVALID_ARGUMENT,
                       "%s.%s (%lld) must be a multiple of 8 elements (16-byte aligned rows)", name,
                       s.what, static_cast<long long>(s.value));
  }
  if (has_rows && t.row_stride < head_dim)
    return set_error(FA_ERR_INVALID_ARGUMENT,
                     "%s.row_stride (%lld) is smaller than head_dim (%d): rows would overlap", name,
                     static_cast<long long>(t.row_stride), head_dim);
  if (t.head_stride < head_dim)
    return set_error(FA_ERR_INVALID_ARGUMENT,
                     "%s.head_stride (%lld) is smaller than head_dim (%d): heads would overlap",
                     name, static_cast<long long>(t.head_stride), head_dim);
  return FA_OK;
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
  if (a.heads % a.heads_kv != 0)
    return set_error(FA_ERR_INVALID_ARGUMENT, "heads (%d) must be a multiple of heads_kv (%d)",
                     a.heads, a.heads_kv);
  if (!step.supports_head_dim(a.head_dim))
    return set_error(FA_ERR_UNSUPPORTED, "head_dim %d is not supported by step %s (supported: %s)",
                     a.head_dim, step.name, head_dim_list(step).c_str());
  if (!std::isfinite(a.scale) || a.scale <= 0.f)
    return set_error(FA_ERR_INVALID_ARGUMENT, "scale must be finite and > 0 (got %g)",
                     static_cast<double>(a.scale));
  if (a.causal != 0 && a.causal != 1)
    return set_error(FA_ERR_INVALID_ARGUMENT, "causal must be 0 or 1 (got %d)", a.causal);
  fa_status st;
  if ((st = check_tensor("q", a.q, a.head_dim, true)) != FA_OK) return st;
  if ((st = check_tensor("k", a.k, a.head_dim, true)) != FA_OK) return st;
  if ((st = check_tensor("v", a.v, a.head_dim, true)) != FA_OK) return st;
  if ((st = check_tensor("o", a.o, a.head_dim, true)) != FA_OK) return st;
  if (a.lse != nullptr && reinterpret_cast<uintptr_t>(a.lse) % 16 != 0)
    return set_error(FA_ERR_INVALID_ARGUMENT, "lse (%p) is not 16-byte aligned",
                     static_cast<void*>(a.lse));
  return FA_OK;
}

fa_status check_backward_args(const Step& step, const fa_bwd_args& a) {
  if (step.backward == nullptr)
    return set_error(FA_ERR_UNSUPPORTED, "step %s has no backward pass (steps with one: %s)",
                     step.name, step_list(true).c_str());
  fa_status st = check_forward_args(step, a.fwd);
  if (st != FA_OK) return st;
  if (a.fwd.lse == nullptr)
    return set_error(FA_ERR_INVALID_ARGUMENT,
                     "fwd.lse is NULL: the backward needs the forward's logsumexp");
  if ((st = check_tensor("d_o", a.d_o, a.fwd.head_dim, true)) != FA_OK) return st;
  if ((st = check_tensor("dq", a.dq, a.fwd.head_dim, true)) != FA_OK) return st;
  if ((st = check_tensor("dk", a.dk, a.fwd.head_dim, true)) != FA_OK) return st;
  if ((st = check_tensor("dv", a.dv, a.fwd.head_dim, true)) != FA_OK) return st;
  if (a.deterministic != 0 && a.deterministic != 1)
    return set_error(FA_ERR_INVALID_ARGUMENT, "deterministic must be 0 or 1 (got %d)",
                     a.deterministic);
  return FA_OK;
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
  if (const char* env = std::getenv("FA_SMEM_LIMIT")) {
    char* end = nullptr;
    limit = std::strtoll(env, &end, 10);
    if (end == env || *end != '\0' || limit <= 0)
      return set_error(FA_ERR_INVALID_ARGUMENT,
                       "FA_SMEM_LIMIT=%s: expected a positive number of bytes (e.g. 101376)", env);
  }
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
  return fa::finish(fa::check_forward_args(*s, *args));
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
