/// \file harness.cpp
/// \brief Device copies of problems, checks against the oracle, and timing.
#include "fa/harness.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <utility>
#include <vector>

namespace fa {
namespace {

constexpr uint16_t kNanBits = 0x7fff;  // a NaN in both fp16 and bf16

/// Strides for a [batch, seqlen, heads, d] tensor in `layout`, and the elements to allocate.
fa_tensor make_view(Layout layout, int batch, int seqlen, int heads, int d, size_t* elements) {
  fa_tensor t{};
  switch (layout) {
    case Layout::kContiguous:
      t.head_stride = d;
      t.row_stride = static_cast<int64_t>(heads) * d;
      t.batch_stride = t.row_stride * seqlen;
      break;
    case Layout::kPadded:  // gaps after each head, row and batch: nothing is contiguous
      t.head_stride = d + 8;
      t.row_stride = static_cast<int64_t>(heads) * t.head_stride + 16;
      t.batch_stride = t.row_stride * seqlen + 24;
      break;
    case Layout::kHeadMajor:
      t.row_stride = d;
      t.head_stride = static_cast<int64_t>(seqlen) * d;
      t.batch_stride = t.head_stride * heads;
      break;
  }
  *elements = static_cast<size_t>(t.batch_stride) * batch;
  return t;
}

DeviceTensor alloc_tensor(Layout layout, int batch, int seqlen, int heads, int d) {
  DeviceTensor t;
  t.view = make_view(layout, batch, seqlen, heads, d, &t.elements);
  const cudaError_t err = cudaMalloc(&t.data, t.elements * sizeof(uint16_t));
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error("cudaMalloc of " + format_bytes(t.elements * 2.0) +
                             " for a tensor failed: " + cudaGetErrorString(err));
  }
  // Gaps hold NaN: a kernel that reads outside its rows produces NaN and fails the check.
  fill_bits_on_device(t.data, t.elements, kNanBits);
  t.view.ptr = t.data;
  return t;
}

/// Copies rows [0, seqlen) of head `h` of batch `b` (d values each) of a device tensor into
/// `out` at out[s * out_row_stride + c], as floats: one strided copy per head.
void download_head(const DeviceTensor& t, fa_dtype dtype, int b, int h, int seqlen, int d,
                   float* out, size_t out_row_stride) {
  std::vector<uint16_t> staged(static_cast<size_t>(seqlen) * d);
  const uint16_t* src = t.data + b * t.view.batch_stride + h * t.view.head_stride;
  cuda_check(cudaMemcpy2D(staged.data(), d * 2, src, t.view.row_stride * 2, d * 2, seqlen,
                          cudaMemcpyDeviceToHost),
             "cudaMemcpy2D (download)");
  for (int s = 0; s < seqlen; ++s)
    for (int c = 0; c < d; ++c)
      out[s * out_row_stride + c] = from_bits(dtype, staged[static_cast<size_t>(s) * d + c]);
}

/// The query heads of group (b, kv_head) of a [B, N, H, d] device tensor as a [N, group, d]
/// host array (the group's HostProblem layout).
std::vector<float> download_group_heads(const DeviceTensor& t, const ProblemShape& s, int b,
                                        int first_head, int heads, int seqlen) {
  std::vector<float> out(static_cast<size_t>(seqlen) * heads * s.head_dim);
  for (int g = 0; g < heads; ++g)
    download_head(t, s.dtype, b, first_head + g, seqlen, s.head_dim,
                  out.data() + static_cast<size_t>(g) * s.head_dim,
                  static_cast<size_t>(heads) * s.head_dim);
  return out;
}

void free_tensor(DeviceTensor* t) {
  if (t->data) cudaFree(t->data);
  t->data = nullptr;
}

/// Calls fn(contiguous index, strided index) for every element of a [batch, seqlen, heads, d]
/// tensor: element i of the contiguous host copy lives at the strided index on the device.
template <typename Fn>
void for_each_element(const fa_tensor& view, int batch, int seqlen, int heads, int d, Fn fn) {
  size_t i = 0;
  for (int b = 0; b < batch; ++b)
    for (int s = 0; s < seqlen; ++s)
      for (int h = 0; h < heads; ++h) {
        const size_t base = b * view.batch_stride + s * view.row_stride + h * view.head_stride;
        for (int c = 0; c < d; ++c) fn(i++, base + c);
      }
}

/// Copies a contiguous host tensor [batch, seqlen, heads, d] into the strided device tensor.
void upload(const DeviceTensor& t, const std::vector<float>& host, fa_dtype dtype, int batch,
            int seqlen, int heads, int d) {
  std::vector<uint16_t> staged(t.elements, kNanBits);
  for_each_element(t.view, batch, seqlen, heads, d,
                   [&](size_t i, size_t at) { staged[at] = to_bits(dtype, host[i]); });
  cuda_check(cudaMemcpy(t.data, staged.data(), t.elements * 2, cudaMemcpyHostToDevice),
             "cudaMemcpy (upload)");
}

/// Copies the strided device tensor back as a contiguous [batch, seqlen, heads, d] array.
std::vector<float> download(const DeviceTensor& t, fa_dtype dtype, int batch, int seqlen, int heads,
                            int d) {
  std::vector<uint16_t> staged(t.elements);
  cuda_check(cudaMemcpy(staged.data(), t.data, t.elements * 2, cudaMemcpyDeviceToHost),
             "cudaMemcpy (download)");
  std::vector<float> out(static_cast<size_t>(batch) * seqlen * heads * d);
  for_each_element(t.view, batch, seqlen, heads, d,
                   [&](size_t i, size_t at) { out[i] = from_bits(dtype, staged[at]); });
  return out;
}

void poison(const DeviceTensor& t) {
  if (t.data) cuda_check(cudaMemset(t.data, 0xff, t.elements * 2), "cudaMemset (poison)");
}

/// Gathers the rows named in `rows` (d values each) from a contiguous [B, N, H, d] array.
std::vector<float> gather_rows(const std::vector<float>& all, const std::vector<RowId>& rows,
                               int seqlen, int heads, int d) {
  std::vector<float> out;
  out.reserve(rows.size() * d);
  for (const RowId& r : rows) {
    const size_t base = ((static_cast<size_t>(r.b) * seqlen + r.s) * heads + r.h) * d;
    out.insert(out.end(), all.begin() + base, all.begin() + base + d);
  }
  return out;
}

/// Waits for the launched work; false (with the message in `result`) if the API or the GPU
/// reported an error.
bool finished(fa_status st, CheckResult* result) {
  if (st == FA_OK) st = cudaDeviceSynchronize() == cudaSuccess ? FA_OK : FA_ERR_CUDA;
  if (st != FA_OK) {
    result->error = st == FA_ERR_CUDA && fa_last_error()[0] == '\0'
                        ? cudaGetErrorString(cudaGetLastError())
                        : fa_last_error();
    return false;
  }
  result->ran = true;
  result->ok = true;
  return true;
}

/// Compares one quantity, gathered in the order of `rows` (`width` values per row: d, or 1 for
/// lse), records its stats and where its largest error is, and fails the result if out of bounds.
void add_stats(CheckResult* result, const std::string& name, const std::vector<float>& out,
               const std::vector<double>& ref, const Tolerance& tol, const std::vector<RowId>& rows,
               int width, const std::vector<double>* mag = nullptr,
               const std::vector<double>* floor = nullptr) {
  ErrorStats e = compare(out.data(), ref.data(), out.size(), mag ? mag->data() : nullptr,
                         floor ? floor->data() : nullptr);
  result->stats.emplace_back(name, e);
  ErrorLocation where;
  where.quantity = name;
  if (e.count > 0 && e.worst < out.size() && width > 0 && e.worst / width < rows.size()) {
    const RowId& r = rows[e.worst / width];
    where.b = r.b;
    where.h = r.h;
    where.s = r.s;
    where.c = width > 1 ? static_cast<int>(e.worst % width) : -1;
    where.out = out[e.worst];
    where.ref = ref[e.worst];
  }
  result->where.push_back(where);
  if (!within(e, tol)) {
    result->ok = false;
    std::string message = name + " out of bounds: " + describe(e, tol);
    if (where.b >= 0) message += " at " + where.describe();
    result->failures.push_back(message);
    if (!result->error.empty()) result->error += "; ";
    result->error += message;
  }
}

}  // namespace

void cuda_check(int error, const char* what) {
  if (error != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " +
                             cudaGetErrorString(static_cast<cudaError_t>(error)));
  }
}

void DeviceProblem::allocate(Layout layout) {
  const ProblemShape& s = shape_;
  // Everything this problem allocates, checked against the free memory first so that a
  // problem too large fails with its sizes rather than somewhere inside cudaMalloc.
  struct Planned {
    DeviceTensor* tensor;
    int seqlen, heads;
  };
  std::vector<Planned> plan = {{&q_, s.seqlen_q, s.heads},
                               {&k_, s.seqlen_k, s.heads_kv},
                               {&v_, s.seqlen_k, s.heads_kv},
                               {&o_, s.seqlen_q, s.heads}};
  if (with_backward_)
    plan.insert(plan.end(), {{&d_o_, s.seqlen_q, s.heads},
                             {&dq_, s.seqlen_q, s.heads},
                             {&dk_, s.seqlen_k, s.heads_kv},
                             {&dv_, s.seqlen_k, s.heads_kv}});
  const size_t lse_bytes = static_cast<size_t>(s.batch) * s.heads * s.seqlen_q * 4;
  double need = static_cast<double>(lse_bytes);
  for (const Planned& t : plan) {
    size_t elements = 0;
    make_view(layout, s.batch, t.seqlen, t.heads, s.head_dim, &elements);
    need += 2.0 * elements;
  }
  size_t free_bytes = 0, total_bytes = 0;
  cuda_check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
  if (need > static_cast<double>(free_bytes))
    throw std::runtime_error(s.describe() + ": the tensors need " + format_bytes(need) +
                             " of device memory, " + format_bytes(free_bytes) + " of " +
                             format_bytes(total_bytes) + " is free");
  try {
    for (const Planned& t : plan)
      *t.tensor = alloc_tensor(layout, s.batch, t.seqlen, t.heads, s.head_dim);
    cuda_check(cudaMalloc(&lse_, lse_bytes), "cudaMalloc (lse)");
  } catch (...) {
    release();
    throw;
  }
}

void DeviceProblem::release() {
  for (DeviceTensor* t : {&q_, &k_, &v_, &o_, &d_o_, &dq_, &dk_, &dv_}) free_tensor(t);
  if (lse_) cudaFree(lse_);
  lse_ = nullptr;
}

DeviceProblem::DeviceProblem(const HostProblem& p, Layout layout, bool with_backward)
    : shape_(p.shape), spec_(p.spec), with_backward_(with_backward) {
  allocate(layout);
  const ProblemShape& s = p.shape;
  try {
    upload(q_, p.q, s.dtype, s.batch, s.seqlen_q, s.heads, s.head_dim);
    upload(k_, p.k, s.dtype, s.batch, s.seqlen_k, s.heads_kv, s.head_dim);
    upload(v_, p.v, s.dtype, s.batch, s.seqlen_k, s.heads_kv, s.head_dim);
    if (with_backward) upload(d_o_, p.d_o, s.dtype, s.batch, s.seqlen_q, s.heads, s.head_dim);
  } catch (...) {
    release();
    throw;
  }
}

DeviceProblem::DeviceProblem(const ProblemShape& shape, const InputSpec& spec, Layout layout,
                             bool with_backward)
    : shape_(shape), spec_(spec), with_backward_(with_backward) {
  allocate(layout);
  const ProblemShape& s = shape;
  try {
    fill_inputs_on_device(q_.data, q_.view, s.batch, s.seqlen_q, s.heads, s.head_dim, s.dtype, spec,
                          0);
    fill_inputs_on_device(k_.data, k_.view, s.batch, s.seqlen_k, s.heads_kv, s.head_dim, s.dtype,
                          spec, 1);
    fill_inputs_on_device(v_.data, v_.view, s.batch, s.seqlen_k, s.heads_kv, s.head_dim, s.dtype,
                          spec, 2);
    if (with_backward)
      fill_inputs_on_device(d_o_.data, d_o_.view, s.batch, s.seqlen_q, s.heads, s.head_dim, s.dtype,
                            spec, 3);
    cuda_check(cudaDeviceSynchronize(), "making the inputs on the GPU");
  } catch (...) {
    release();
    throw;
  }
}

DeviceProblem::~DeviceProblem() {
  release();
}

HostProblem DeviceProblem::download_group(int b, int kv_head) const {
  const ProblemShape& s = shape_;
  const int group = s.heads / s.heads_kv;
  HostProblem p;
  p.shape = s;
  p.shape.batch = 1;
  p.shape.heads = group;
  p.shape.heads_kv = 1;
  p.spec = spec_;
  p.q = download_group_heads(q_, s, b, kv_head * group, group, s.seqlen_q);
  p.k = download_group_heads(k_, s, b, kv_head, 1, s.seqlen_k);
  p.v = download_group_heads(v_, s, b, kv_head, 1, s.seqlen_k);
  if (with_backward_) p.d_o = download_group_heads(d_o_, s, b, kv_head * group, group, s.seqlen_q);
  return p;
}

void DeviceProblem::download_group_forward(int b, int kv_head, std::vector<float>* o,
                                           std::vector<float>* lse) const {
  const ProblemShape& s = shape_;
  const int group = s.heads / s.heads_kv;
  *o = download_group_heads(o_, s, b, kv_head * group, group, s.seqlen_q);
  lse->resize(static_cast<size_t>(group) * s.seqlen_q);
  const size_t first = (static_cast<size_t>(b) * s.heads + kv_head * group) * s.seqlen_q;
  cuda_check(cudaMemcpy(lse->data(), lse_ + first, lse->size() * 4, cudaMemcpyDeviceToHost),
             "cudaMemcpy (lse)");
}

void DeviceProblem::download_group_backward(int b, int kv_head, std::vector<float>* dq,
                                            std::vector<float>* dk, std::vector<float>* dv) const {
  if (!with_backward_) throw std::logic_error("DeviceProblem built without backward buffers");
  const ProblemShape& s = shape_;
  const int group = s.heads / s.heads_kv;
  *dq = download_group_heads(dq_, s, b, kv_head * group, group, s.seqlen_q);
  *dk = download_group_heads(dk_, s, b, kv_head, 1, s.seqlen_k);
  *dv = download_group_heads(dv_, s, b, kv_head, 1, s.seqlen_k);
}

fa_fwd_args DeviceProblem::forward_args() const {
  fa_fwd_args a = shape_.args();
  a.q = q_.view;
  a.k = k_.view;
  a.v = v_.view;
  a.o = o_.view;
  a.lse = lse_;
  return a;
}

fa_bwd_args DeviceProblem::backward_args(bool deterministic) const {
  if (!with_backward_) throw std::logic_error("DeviceProblem built without backward buffers");
  fa_bwd_args a{};
  a.fwd = forward_args();
  a.d_o = d_o_.view;
  a.dq = dq_.view;
  a.dk = dk_.view;
  a.dv = dv_.view;
  a.deterministic = deterministic ? 1 : 0;
  return a;
}

void DeviceProblem::poison_outputs() {
  poison(o_);
  cuda_check(cudaMemset(lse_, 0xff,
                        static_cast<size_t>(shape_.batch) * shape_.heads * shape_.seqlen_q * 4),
             "cudaMemset (lse)");
  poison(dq_);
  poison(dk_);
  poison(dv_);
}

void DeviceProblem::download_forward(std::vector<float>* o, std::vector<float>* lse) const {
  const ProblemShape& s = shape_;
  *o = download(o_, s.dtype, s.batch, s.seqlen_q, s.heads, s.head_dim);
  lse->resize(static_cast<size_t>(s.batch) * s.heads * s.seqlen_q);
  cuda_check(cudaMemcpy(lse->data(), lse_, lse->size() * 4, cudaMemcpyDeviceToHost),
             "cudaMemcpy (lse)");
}

void DeviceProblem::download_backward(std::vector<float>* dq, std::vector<float>* dk,
                                      std::vector<float>* dv) const {
  const ProblemShape& s = shape_;
  *dq = download(dq_, s.dtype, s.batch, s.seqlen_q, s.heads, s.head_dim);
  *dk = download(dk_, s.dtype, s.batch, s.seqlen_k, s.heads_kv, s.head_dim);
  *dv = download(dv_, s.dtype, s.batch, s.seqlen_k, s.heads_kv, s.head_dim);
}

GpuInfo current_gpu() {
  GpuInfo g;
  int device = 0;
  cudaDeviceProp prop;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();
    return g;
  }
  g.name = prop.name;
  g.sm_count = prop.multiProcessorCount;
  g.cc_major = prop.major;
  g.cc_minor = prop.minor;
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  g.driver = "CUDA " + std::to_string(driver / 1000) + "." + std::to_string(driver % 1000 / 10);
  g.runtime = std::to_string(runtime / 1000) + "." + std::to_string(runtime % 1000 / 10);
  // The kernel driver's version ("... Kernel Module ... 580.159.04 ..."), where readable.
  if (FILE* f = std::fopen("/proc/driver/nvidia/version", "r")) {
    char line[512] = {};
    if (std::fgets(line, sizeof line, f)) {
      std::string text(line);
      for (size_t i = 0; i < text.size(); ++i) {
        size_t j = i, dots = 0;
        while (j < text.size() &&
               (std::isdigit(static_cast<unsigned char>(text[j])) || (text[j] == '.' && j > i))) {
          dots += text[j] == '.';
          ++j;
        }
        if (dots >= 1 && j - i >= 5 && (i == 0 || text[i - 1] == ' ')) {
          g.driver = text.substr(i, j - i);
          break;
        }
        i = j;
      }
    }
    std::fclose(f);
  }
  return g;
}

namespace {

/// The NVIDIA kernel module is loaded (it publishes its version under /proc).
bool nvidia_driver_loaded() {
  FILE* f = std::fopen("/proc/driver/nvidia/version", "r");
  if (f != nullptr) std::fclose(f);
  return f != nullptr;
}

}  // namespace

bool gpu_available(std::string* why) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    cudaGetLastError();
    std::string reason;
    if (err == cudaSuccess || err == cudaErrorNoDevice) {
      reason = "no CUDA device found";
    } else if (err == cudaErrorInsufficientDriver && !nvidia_driver_loaded()) {
      // The CUDA runtime reports a missing driver as an old one; without the NVIDIA kernel
      // module there is no driver at all, and no GPU it could drive.
      reason = "no NVIDIA driver is loaded: this machine has no GPU, or its driver is missing";
    } else if (err == cudaErrorInsufficientDriver) {
      reason = std::string("the NVIDIA driver is older than this program's CUDA runtime (") +
               cudaGetErrorString(err) + "): update the driver";
    } else {
      reason = cudaGetErrorString(err);
    }
    if (why) *why = reason;
    return false;
  }
  cudaDeviceProp prop;
  err = cudaGetDeviceProperties(&prop, 0);
  if (err != cudaSuccess) {
    cudaGetLastError();
    if (why) *why = std::string("cannot query GPU 0: ") + cudaGetErrorString(err);
    return false;
  }
  if (prop.major < 8) {
    if (why)
      *why = std::string(prop.name) + " is sm_" + std::to_string(prop.major) +
             std::to_string(prop.minor) + ", older than sm_80";
    return false;
  }
  return true;
}

std::string ErrorLocation::describe() const {
  char buf[256];
  if (c >= 0)
    std::snprintf(buf, sizeof buf, "%s[batch %d, head %d, row %d, col %d] = %.6g (expected %.6g)",
                  quantity.c_str(), b, h, s, c, out, ref);
  else
    std::snprintf(buf, sizeof buf, "%s[batch %d, head %d, row %d] = %.6g (expected %.6g)",
                  quantity.c_str(), b, h, s, out, ref);
  return buf;
}

std::string CheckResult::first_failure() const {
  if (!ran) return "error: " + error;
  if (!failures.empty()) return failures.front();
  return ok ? "" : error;
}

std::string CheckResult::summary() const {
  if (!ran) return "error: " + error;
  std::string out = ok ? "ok" : "FAIL";
  for (const auto& [name, e] : stats) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "  %s max|err| %.2e rel %.2e", name.c_str(), e.max_abs,
                  e.rel_l2);
    out += buf;
  }
  if (!ok && !error.empty()) out += "  (" + error + ")";
  return out;
}

namespace {

/// Compares O and lse (gathered in the order of `rows`, which name the rows in the problem's
/// coordinates) with the oracle's.
void compare_forward(CheckResult* result, const std::vector<float>& o,
                     const std::vector<float>& lse, const ForwardRef& ref,
                     const std::vector<RowId>& rows, const ProblemShape& s) {
  add_stats(result, "O", o, ref.o, tolerance(s.dtype, Quantity::kOutput), rows, s.head_dim);
  add_stats(result, "lse", lse, ref.lse, tolerance(s.dtype, Quantity::kLse), rows, 1);
}

/// Compares dQ on `q_rows` and dK, dV on `kv_rows` (problem coordinates) with the oracle's.
void compare_backward(CheckResult* result, const std::vector<float>& dq,
                      const std::vector<float>& dk, const std::vector<float>& dv,
                      const BackwardRef& ref, const std::vector<RowId>& q_rows,
                      const std::vector<RowId>& kv_rows, const ProblemShape& s) {
  const Tolerance tol = tolerance(s.dtype, Quantity::kGradient);
  add_stats(result, "dQ", dq, ref.dq, tol, q_rows, s.head_dim, &ref.dq_mag, &ref.dq_floor);
  add_stats(result, "dK", dk, ref.dk, tol, kv_rows, s.head_dim, &ref.dk_mag, &ref.dk_floor);
  add_stats(result, "dV", dv, ref.dv, tol, kv_rows, s.head_dim, &ref.dv_mag, &ref.dv_floor);
}

/// Runs a forward (and the backward) of `step` on `dp` with poisoned outputs; false (with the
/// error in `result`) if the API or the GPU reported one.
bool run_step(const std::string& step, DeviceProblem& dp, bool backward, bool deterministic,
              CheckResult* result) {
  dp.poison_outputs();
  const fa_fwd_args fwd = dp.forward_args();
  fa_status st = fa_forward(step.c_str(), &fwd, nullptr);
  if (backward && st == FA_OK) {
    const fa_bwd_args bwd = dp.backward_args(deterministic);
    st = fa_backward(step.c_str(), &bwd, nullptr);
  }
  return finished(st, result);
}

/// The key/value head groups a sampled check reads: the first and the last (highest addresses).
std::vector<std::pair<int, int>> checked_groups(const ProblemShape& s) {
  std::vector<std::pair<int, int>> groups = {{0, 0}};
  if (s.batch > 1 || s.heads_kv > 1) groups.push_back({s.batch - 1, s.heads_kv - 1});
  return groups;
}

/// Row r of group (b, kv_head)'s HostProblem as a row of the whole problem.
RowId in_problem(const RowId& r, int b, int kv_head, int group) {
  return {b, kv_head * group + r.h, r.s};
}

}  // namespace

CheckResult check_forward(const std::string& step, DeviceProblem& dp, const HostProblem& p,
                          const std::vector<RowId>& rows) {
  CheckResult result;
  if (!run_step(step, dp, false, false, &result)) return result;
  return compare_forward(dp, p, rows);
}

CheckResult compare_forward(const DeviceProblem& dp, const HostProblem& p,
                            const std::vector<RowId>& rows) {
  CheckResult result;
  result.ran = result.ok = true;
  std::vector<float> o, lse;
  dp.download_forward(&o, &lse);
  const ProblemShape& s = p.shape;
  std::vector<float> lse_rows;
  for (const RowId& r : rows) lse_rows.push_back(lse[p.lse_index(r.b, r.h, r.s)]);
  compare_forward(&result, gather_rows(o, rows, s.seqlen_q, s.heads, s.head_dim), lse_rows,
                  reference_forward(p, rows), rows, s);
  return result;
}

CheckResult check_backward(const std::string& step, DeviceProblem& dp, const HostProblem& p,
                           const std::vector<RowId>& q_rows, const std::vector<RowId>& kv_rows,
                           bool deterministic) {
  CheckResult result;
  if (!run_step(step, dp, true, deterministic, &result)) return result;
  std::vector<float> dq, dk, dv, o, lse;
  dp.download_backward(&dq, &dk, &dv);
  dp.download_forward(&o, &lse);  // what the backward was given
  const GivenForward given{&o, &lse};
  const ProblemShape& s = p.shape;
  compare_backward(&result, gather_rows(dq, q_rows, s.seqlen_q, s.heads, s.head_dim),
                   gather_rows(dk, kv_rows, s.seqlen_k, s.heads_kv, s.head_dim),
                   gather_rows(dv, kv_rows, s.seqlen_k, s.heads_kv, s.head_dim),
                   reference_backward(p, q_rows, kv_rows, &given), q_rows, kv_rows, s);
  return result;
}

CheckResult check_forward_sampled(const std::string& step, DeviceProblem& dp, int rows_per_group,
                                  uint64_t seed) {
  CheckResult result;
  if (!run_step(step, dp, false, false, &result)) return result;
  const ProblemShape& s = dp.shape();
  const int group = s.heads / s.heads_kv;
  std::vector<float> o_rows, lse_rows;
  std::vector<RowId> rows;
  ForwardRef ref;
  for (const auto& [b, kv_head] : checked_groups(s)) {
    const HostProblem p = dp.download_group(b, kv_head);
    const std::vector<RowId> group_rows = sample_q_rows(p.shape, rows_per_group, seed + b);
    std::vector<float> o, lse;
    dp.download_group_forward(b, kv_head, &o, &lse);
    const std::vector<float> gathered = gather_rows(o, group_rows, s.seqlen_q, group, s.head_dim);
    o_rows.insert(o_rows.end(), gathered.begin(), gathered.end());
    for (const RowId& r : group_rows) {
      lse_rows.push_back(lse[p.lse_index(0, r.h, r.s)]);
      rows.push_back(in_problem(r, b, kv_head, group));
    }
    const ForwardRef part = reference_forward(p, group_rows);
    ref.o.insert(ref.o.end(), part.o.begin(), part.o.end());
    ref.lse.insert(ref.lse.end(), part.lse.begin(), part.lse.end());
  }
  ref.rows = rows;
  compare_forward(&result, o_rows, lse_rows, ref, rows, s);
  return result;
}

CheckResult check_backward_sampled(const std::string& step, DeviceProblem& dp, int rows,
                                   uint64_t seed, bool deterministic) {
  CheckResult result;
  if (!run_step(step, dp, true, deterministic, &result)) return result;
  const ProblemShape& s = dp.shape();
  const int group = s.heads / s.heads_kv;
  const int b = s.batch - 1, kv_head = s.heads_kv - 1;  // the highest addresses
  const HostProblem p = dp.download_group(b, kv_head);
  std::vector<RowId> q_rows, kv_rows;
  sample_group_rows(p.shape, 0, 0, rows, seed, &q_rows, &kv_rows);
  add_attended_keys(p, q_rows, rows, &kv_rows);
  std::vector<float> dq, dk, dv, o, lse;
  dp.download_group_backward(b, kv_head, &dq, &dk, &dv);
  dp.download_group_forward(b, kv_head, &o, &lse);  // what the backward was given
  const GivenForward given{&o, &lse};
  std::vector<RowId> q_where, kv_where;
  for (const RowId& r : q_rows) q_where.push_back(in_problem(r, b, kv_head, group));
  for (const RowId& r : kv_rows) kv_where.push_back({b, kv_head, r.s});
  compare_backward(&result, gather_rows(dq, q_rows, s.seqlen_q, group, s.head_dim),
                   gather_rows(dk, kv_rows, s.seqlen_k, 1, s.head_dim),
                   gather_rows(dv, kv_rows, s.seqlen_k, 1, s.head_dim),
                   reference_backward(p, q_rows, kv_rows, &given), q_where, kv_where, s);
  return result;
}

int warmup_batch(double call_ms) {
  if (!(call_ms > 0)) return kWarmupMaxBatch;
  return static_cast<int>(
      std::clamp(std::ceil(kWarmupBatchMs / call_ms), 1.0, static_cast<double>(kWarmupMaxBatch)));
}

Timing time_step(const std::string& step, DeviceProblem& dp, bool backward, bool deterministic,
                 int warmup, int repeats, int warmup_ms) {
  const fa_fwd_args fwd = dp.forward_args();
  fa_bwd_args bwd{};
  if (backward) {
    bwd = dp.backward_args(deterministic);
    if (fa_forward(step.c_str(), &fwd, nullptr) != FA_OK) throw std::runtime_error(fa_last_error());
  }
  auto run_once = [&] {
    const fa_status st = backward ? fa_backward(step.c_str(), &bwd, nullptr)
                                  : fa_forward(step.c_str(), &fwd, nullptr);
    if (st != FA_OK) throw std::runtime_error(fa_last_error());
  };
  // Warm-up: `warmup` runs, then more until warmup_ms have passed. They are queued back to
  // back in batches, as the timed runs are, and each batch is waited for, so that the host
  // clock measures GPU time, not how fast launches queue up (warmup_batch()).
  const auto now = [] { return std::chrono::steady_clock::now(); };
  const auto ms_since = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
  };
  const auto t0 = now();
  for (int done = 0, batch = std::max(1, warmup); done < warmup || ms_since(t0) < warmup_ms;) {
    const auto b0 = now();
    for (int i = 0; i < batch; ++i) run_once();
    cuda_check(cudaDeviceSynchronize(), "warm-up");
    done += batch;
    batch = warmup_batch(ms_since(b0) / batch);
  }
  if (repeats <= 0) return Timing{};  // heat(): the warm-up alone
  std::vector<cudaEvent_t> events(2 * static_cast<size_t>(repeats));
  for (cudaEvent_t& e : events) cuda_check(cudaEventCreate(&e), "cudaEventCreate");
  for (int i = 0; i < repeats; ++i) {  // queued back to back: no host gap between the runs
    cuda_check(cudaEventRecord(events[2 * i]), "cudaEventRecord");
    run_once();
    cuda_check(cudaEventRecord(events[2 * i + 1]), "cudaEventRecord");
  }
  cuda_check(cudaEventSynchronize(events.back()), "cudaEventSynchronize");
  std::vector<double> ms;
  for (int i = 0; i < repeats; ++i) {
    float t = 0;
    cuda_check(cudaEventElapsedTime(&t, events[2 * i], events[2 * i + 1]), "cudaEventElapsedTime");
    ms.push_back(t);
  }
  for (cudaEvent_t& e : events) cudaEventDestroy(e);
  return timing_of(std::move(ms));
}

void heat(const std::string& step, DeviceProblem& dp, bool backward, bool deterministic, int ms) {
  if (ms > 0) time_step(step, dp, backward, deterministic, 1, 0, ms);
}

ResultRow measure(const std::string& step, const std::string& direction, DeviceProblem& dp,
                  const MeasureOptions& options) {
  ResultRow row;
  row.step = step;
  row.direction = direction;
  row.shape = dp.shape();
  const bool backward = direction == "bwd";
  if (options.check) {
    const int groups = static_cast<int>(checked_groups(dp.shape()).size());
    const CheckResult c =
        backward ? check_backward_sampled(step, dp, options.check_rows, options.seed,
                                          options.deterministic)
                 : check_forward_sampled(step, dp, std::max(1, options.check_rows / groups),
                                         options.seed);
    if (!c.ran) {
      row.error = c.error;
      return row;
    }
    row.checked = true;
    row.passed = c.ok;
    for (const auto& [name, e] : c.stats) {
      row.max_abs = std::max(row.max_abs, e.max_abs);
      row.rel_l2 = std::max(row.rel_l2, e.rel_l2);
    }
  }
  if (!options.time) return row;
  try {
    row.timing = time_step(step, dp, backward, options.deterministic, options.warmup,
                           options.repeats, options.warmup_ms);
  } catch (const std::exception& e) {
    row.error = e.what();
  }
  return row;
}

size_t device_bytes(const ProblemShape& s, bool with_backward) {
  const double q = 2.0 * s.batch * s.seqlen_q * s.heads * s.head_dim;
  const double kv = 2.0 * s.batch * s.seqlen_k * s.heads_kv * s.head_dim;
  const double lse = 4.0 * s.batch * s.heads * s.seqlen_q;
  const double total = (with_backward ? 2 : 1) * (2 * q + 2 * kv) + lse;
  return total >= 1.8e19 ? SIZE_MAX : static_cast<size_t>(total);
}

std::string format_bytes(double bytes) {
  char text[64];
  if (bytes >= 1099511627776.0)
    std::snprintf(text, sizeof text, "%.1f TiB", bytes / 1099511627776.0);
  else if (bytes >= 1073741824.0)
    std::snprintf(text, sizeof text, "%.1f GiB", bytes / 1073741824.0);
  else
    std::snprintf(text, sizeof text, "%.1f MiB", bytes / 1048576.0);
  return text;
}

}  // namespace fa
