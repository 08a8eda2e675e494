/// \file harness.cpp
/// \brief Device copies of problems, checks against the oracle, and timing.
#include "fa/harness.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>

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
  cuda_check(cudaMalloc(&t.data, t.elements * sizeof(uint16_t)), "cudaMalloc");
  // Gaps hold NaN: a kernel that reads outside its rows produces NaN and fails the check.
  std::vector<uint16_t> nan_fill(std::min<size_t>(t.elements, 1 << 20), kNanBits);
  for (size_t off = 0; off < t.elements; off += nan_fill.size()) {
    const size_t n = std::min(nan_fill.size(), t.elements - off);
    cuda_check(cudaMemcpy(t.data + off, nan_fill.data(), n * 2, cudaMemcpyHostToDevice),
               "cudaMemcpy");
  }
  t.view.ptr = t.data;
  return t;
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
               int width, const std::vector<double>* mag = nullptr) {
  ErrorStats e = compare(out.data(), ref.data(), out.size(), mag ? mag->data() : nullptr);
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

/// Backward check rows of large problems come from one key/value head and the query heads of
/// its group (chosen by `seed`): the oracle's cost for dK and dV grows with every head it
/// touches (all query rows of each), so this keeps a 16K-token check to seconds.
void sample_backward_rows(const ProblemShape& s, int count, uint64_t seed,
                          std::vector<RowId>* q_rows, std::vector<RowId>* kv_rows) {
  const int group = s.heads / s.heads_kv;
  const int b0 = static_cast<int>(seed % s.batch);
  const int hk0 = static_cast<int>((seed / 7) % s.heads_kv);
  ProblemShape one = s;  // the chosen group alone: batch 1, `group` query heads, 1 kv head
  one.batch = 1;
  one.heads = group;
  one.heads_kv = 1;
  *q_rows = sample_q_rows(one, count, seed);
  *kv_rows = sample_kv_rows(one, count, seed + 1);
  for (RowId& r : *q_rows) r = {b0, hk0 * group + r.h, r.s};
  for (RowId& r : *kv_rows) r = {b0, hk0, r.s};
}

}  // namespace

void cuda_check(int error, const char* what) {
  if (error != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " +
                             cudaGetErrorString(static_cast<cudaError_t>(error)));
  }
}

DeviceProblem::DeviceProblem(const HostProblem& p, Layout layout, bool with_backward)
    : shape_(p.shape), with_backward_(with_backward) {
  const ProblemShape& s = p.shape;
  q_ = alloc_tensor(layout, s.batch, s.seqlen_q, s.heads, s.head_dim);
  k_ = alloc_tensor(layout, s.batch, s.seqlen_k, s.heads_kv, s.head_dim);
  v_ = alloc_tensor(layout, s.batch, s.seqlen_k, s.heads_kv, s.head_dim);
  o_ = alloc_tensor(layout, s.batch, s.seqlen_q, s.heads, s.head_dim);
  upload(q_, p.q, s.dtype, s.batch, s.seqlen_q, s.heads, s.head_dim);
  upload(k_, p.k, s.dtype, s.batch, s.seqlen_k, s.heads_kv, s.head_dim);
  upload(v_, p.v, s.dtype, s.batch, s.seqlen_k, s.heads_kv, s.head_dim);
  cuda_check(cudaMalloc(&lse_, static_cast<size_t>(s.batch) * s.heads * s.seqlen_q * 4),
             "cudaMalloc (lse)");
  if (with_backward) {
    d_o_ = alloc_tensor(layout, s.batch, s.seqlen_q, s.heads, s.head_dim);
    dq_ = alloc_tensor(layout, s.batch, s.seqlen_q, s.heads, s.head_dim);
    dk_ = alloc_tensor(layout, s.batch, s.seqlen_k, s.heads_kv, s.head_dim);
    dv_ = alloc_tensor(layout, s.batch, s.seqlen_k, s.heads_kv, s.head_dim);
    upload(d_o_, p.d_o, s.dtype, s.batch, s.seqlen_q, s.heads, s.head_dim);
  }
}

DeviceProblem::~DeviceProblem() {
  for (DeviceTensor* t : {&q_, &k_, &v_, &o_, &d_o_, &dq_, &dk_, &dv_}) free_tensor(t);
  if (lse_) cudaFree(lse_);
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

bool gpu_available(std::string* why) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    cudaGetLastError();
    if (why) *why = err != cudaSuccess ? cudaGetErrorString(err) : "no device found";
    return false;
  }
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess || prop.major < 8) {
    if (why) *why = std::string(prop.name) + " is older than sm_80";
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

CheckResult check_forward(const std::string& step, DeviceProblem& dp, const HostProblem& p,
                          const std::vector<RowId>& rows) {
  CheckResult result;
  dp.poison_outputs();
  const fa_fwd_args args = dp.forward_args();
  if (!finished(fa_forward(step.c_str(), &args, nullptr), &result)) return result;
  return compare_forward(dp, p, rows);
}

CheckResult compare_forward(const DeviceProblem& dp, const HostProblem& p,
                            const std::vector<RowId>& rows) {
  CheckResult result;
  result.ran = result.ok = true;
  std::vector<float> o, lse;
  dp.download_forward(&o, &lse);
  const ForwardRef ref = reference_forward(p, rows);
  const ProblemShape& s = p.shape;
  add_stats(&result, "O", gather_rows(o, rows, s.seqlen_q, s.heads, s.head_dim), ref.o,
            tolerance(s.dtype, Quantity::kOutput), rows, s.head_dim);
  std::vector<float> lse_rows;
  for (const RowId& r : rows) lse_rows.push_back(lse[p.lse_index(r.b, r.h, r.s)]);
  add_stats(&result, "lse", lse_rows, ref.lse, tolerance(s.dtype, Quantity::kLse), rows, 1);
  return result;
}

CheckResult check_backward(const std::string& step, DeviceProblem& dp, const HostProblem& p,
                           const std::vector<RowId>& q_rows, const std::vector<RowId>& kv_rows,
                           bool deterministic) {
  CheckResult result;
  dp.poison_outputs();
  const fa_fwd_args fwd = dp.forward_args();
  const fa_bwd_args bwd = dp.backward_args(deterministic);
  fa_status st = fa_forward(step.c_str(), &fwd, nullptr);
  if (st == FA_OK) st = fa_backward(step.c_str(), &bwd, nullptr);
  if (!finished(st, &result)) return result;
  std::vector<float> dq, dk, dv;
  dp.download_backward(&dq, &dk, &dv);
  const BackwardRef ref = reference_backward(p, q_rows, kv_rows);
  const ProblemShape& s = p.shape;
  const Tolerance tol = tolerance(s.dtype, Quantity::kGradient);
  add_stats(&result, "dQ", gather_rows(dq, q_rows, s.seqlen_q, s.heads, s.head_dim), ref.dq, tol,
            q_rows, s.head_dim, &ref.dq_mag);
  add_stats(&result, "dK", gather_rows(dk, kv_rows, s.seqlen_k, s.heads_kv, s.head_dim), ref.dk,
            tol, kv_rows, s.head_dim, &ref.dk_mag);
  add_stats(&result, "dV", gather_rows(dv, kv_rows, s.seqlen_k, s.heads_kv, s.head_dim), ref.dv,
            tol, kv_rows, s.head_dim, &ref.dv_mag);
  return result;
}

Timing time_step(const std::string& step, DeviceProblem& dp, bool backward, bool deterministic,
                 int warmup, int repeats) {
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
  for (int i = 0; i < warmup; ++i) run_once();
  cuda_check(cudaDeviceSynchronize(), "warm-up");
  cudaEvent_t start, stop;
  cuda_check(cudaEventCreate(&start), "cudaEventCreate");
  cuda_check(cudaEventCreate(&stop), "cudaEventCreate");
  std::vector<double> ms;
  for (int i = 0; i < repeats; ++i) {
    cuda_check(cudaEventRecord(start), "cudaEventRecord");
    run_once();
    cuda_check(cudaEventRecord(stop), "cudaEventRecord");
    cuda_check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float t = 0;
    cuda_check(cudaEventElapsedTime(&t, start, stop), "cudaEventElapsedTime");
    ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  Timing timing;
  timing.repeats = repeats;
  timing.min_ms = ms.front();
  timing.max_ms = ms.back();
  timing.median_ms =
      ms.size() % 2 ? ms[ms.size() / 2] : 0.5 * (ms[ms.size() / 2 - 1] + ms[ms.size() / 2]);
  return timing;
}

ResultRow measure(const std::string& step, const std::string& direction, DeviceProblem& dp,
                  const HostProblem& p, const MeasureOptions& options) {
  ResultRow row;
  row.step = step;
  row.direction = direction;
  row.shape = p.shape;
  const bool backward = direction == "bwd";
  if (options.check) {
    std::vector<RowId> q_rows, kv_rows;
    if (backward)
      sample_backward_rows(p.shape, options.check_rows, options.seed, &q_rows, &kv_rows);
    else
      q_rows = sample_q_rows(p.shape, options.check_rows, options.seed);
    const CheckResult c = backward
                              ? check_backward(step, dp, p, q_rows, kv_rows, options.deterministic)
                              : check_forward(step, dp, p, q_rows);
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
  try {
    row.timing =
        time_step(step, dp, backward, options.deterministic, options.warmup, options.repeats);
  } catch (const std::exception& e) {
    row.error = e.what();
  }
  return row;
}

}  // namespace fa
