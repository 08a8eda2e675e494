/// \file harness.h
/// \brief Runs a step on the GPU: device copies of a problem, poisoned outputs, checks against
/// the fp64 oracle, CUDA-event timing, and the ceilings measured at start-up.
#ifndef FA_HARNESS_H_
#define FA_HARNESS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "fa/api.h"
#include "fa/metrics.h"
#include "fa/oracle.h"
#include "fa/problem.h"
#include "fa/report.h"

namespace fa {

/// How tensors are laid out in device memory.
enum class Layout {
  kContiguous,  ///< BSHD, no gaps
  kPadded,      ///< BSHD with gaps after every head, row and batch (non-contiguous strides)
  kHeadMajor,   ///< BHSD: head_stride = N * d, row_stride = d
};

/// The layout's name as the tests print it: "contiguous", "padded" or "head-major".
inline const char* layout_name(Layout layout) {
  switch (layout) {
    case Layout::kContiguous:
      return "contiguous";
    case Layout::kPadded:
      return "padded";
    case Layout::kHeadMajor:
      return "head-major";
  }
  return "unknown";
}

/// One 16-bit device tensor with its strides.
struct DeviceTensor {
  uint16_t* data = nullptr;  ///< the allocation (gaps included)
  size_t elements = 0;       ///< allocated elements, gaps included
  fa_tensor view{};          ///< what the API gets
};

/// A problem in device memory, inputs made once and reused across steps and repeats.
class DeviceProblem {
 public:
  /// Uploads `p` with `layout`; `with_backward` also allocates dO (uploaded), dQ, dK, dV.
  DeviceProblem(const HostProblem& p, Layout layout, bool with_backward);
  /// Makes the inputs on the GPU (fill_inputs_on_device()): the values make_problem(shape,
  /// spec) draws, bit for bit, without a host copy, in milliseconds even for tensors of
  /// billions of elements. Check it with check_forward_sampled() / check_backward_sampled(),
  /// which read back only what the oracle needs. Throws std::runtime_error (with the sizes)
  /// if the tensors do not fit in the GPU's free memory.
  DeviceProblem(const ProblemShape& shape, const InputSpec& spec, Layout layout,
                bool with_backward);
  ~DeviceProblem();
  DeviceProblem(const DeviceProblem&) = delete;
  DeviceProblem& operator=(const DeviceProblem&) = delete;

  /// Forward arguments pointing at this problem's buffers (lse always requested).
  fa_fwd_args forward_args() const;
  /// Backward arguments (forward outputs O and lse as last written by a forward run).
  fa_bwd_args backward_args(bool deterministic) const;

  /// Fills O and lse (and dQ, dK, dV) with NaN so that an unwritten element fails the check.
  void poison_outputs();
  /// Copies O [B,Nq,H,d] and lse [B,H,Nq] back, as contiguous floats.
  void download_forward(std::vector<float>* o, std::vector<float>* lse) const;
  /// Copies dQ, dK, dV back as contiguous floats.
  void download_backward(std::vector<float>* dq, std::vector<float>* dk,
                         std::vector<float>* dv) const;

  /// The inputs of one key/value head group (batch `b`, key/value head `kv_head`) copied back:
  /// a HostProblem of shape (batch 1, the group's query heads, 1 key/value head, the same
  /// lengths), all the oracle needs for that group's rows. Row (b, kv_head * group + g, s) of
  /// the problem is row (0, g, s) of the group.
  HostProblem download_group(int b, int kv_head) const;
  /// O and lse of one group, in the group's HostProblem layout: o [Nq, group, d], lse
  /// [group, Nq].
  void download_group_forward(int b, int kv_head, std::vector<float>* o,
                              std::vector<float>* lse) const;
  /// dQ [Nq, group, d], dK and dV [Nk, 1, d] of one group.
  void download_group_backward(int b, int kv_head, std::vector<float>* dq, std::vector<float>* dk,
                               std::vector<float>* dv) const;

  /// Sizes and options of the problem.
  const ProblemShape& shape() const { return shape_; }
  /// How the inputs were drawn.
  const InputSpec& spec() const { return spec_; }

 private:
  ProblemShape shape_;
  InputSpec spec_;
  DeviceTensor q_, k_, v_, o_, d_o_, dq_, dk_, dv_;
  float* lse_ = nullptr;
  bool with_backward_ = false;

  void allocate(Layout layout);  // every buffer, NaN in the gaps; frees all if one fails
  void release();
};

/// Throws std::runtime_error with the message of a failed CUDA call.
void cuda_check(int error, const char* what);

/// Writes `bits` into the n 16-bit elements at `data` (device memory).
void fill_bits_on_device(uint16_t* data, size_t n, uint16_t bits);

/// Writes input tensor `tensor` (0..3: Q, K, V, dO) of a problem into the strided device
/// tensor `view` at `data`: element (b, s, h, c) gets what make_problem() draws for it.
void fill_inputs_on_device(uint16_t* data, const fa_tensor& view, int batch, int seqlen, int heads,
                           int d, fa_dtype dtype, const InputSpec& spec, int tensor);

/// Bytes of device memory a DeviceProblem of `shape` takes in the contiguous layout: Q, K, V,
/// O and lse, and with `with_backward` dO, dQ, dK, dV (a step's own scratch comes on top).
/// Saturates at SIZE_MAX instead of overflowing.
size_t device_bytes(const ProblemShape& shape, bool with_backward);

/// "18.4 GiB": a byte count for messages.
std::string format_bytes(double bytes);

/// The GPU in use (name, multiprocessors, compute capability, driver and runtime versions).
GpuInfo current_gpu();

/// True if a usable CUDA device (sm_80+) is present; `why` says why not.
bool gpu_available(std::string* why);

/// Where one checked quantity is furthest from the oracle (its ErrorStats::worst element).
struct ErrorLocation {
  std::string quantity;  ///< "O", "lse", "dQ", "dK" or "dV"
  int b = -1;            ///< batch
  int h = -1;            ///< head: a query head for O, lse and dQ, a key/value head for dK, dV
  int s = -1;            ///< row: query position for O, lse and dQ, key position for dK, dV
  int c = -1;            ///< column in the head dimension (-1 for lse, one value per row)
  double out = 0;        ///< the step's value there (NaN if it was never written)
  double ref = 0;        ///< the oracle's value there
  /// "O[batch 0, head 3, row 127, col 5] = 0.12 (expected 0.43)".
  std::string describe() const;
};

/// The outcome of one check against the oracle.
struct CheckResult {
  bool ran = false;   ///< the API accepted the problem and the kernels ran
  bool ok = false;    ///< ran and every quantity within its bound
  std::string error;  ///< API error message, or what failed (with where, see `where`)
  std::vector<std::pair<std::string, ErrorStats>> stats;  ///< per quantity: "O", "lse", ...
  std::vector<ErrorLocation> where;  ///< the largest error of each entry of `stats`, same order
  /// One message per quantity out of bounds, in the order checked: "dQ out of bounds: ...".
  std::vector<std::string> failures;
  std::string summary() const;  ///< "O max|err| ... ; lse ..." or the error
  /// The first quantity out of bounds: its errors, bounds and where the largest error is,
  /// e.g. "dQ out of bounds: max|out-ref| 3.1e-01 (bound 6.2e-02) ... at dQ[batch 0, head 3,
  /// row 127, col 5] = 0.12 (expected 0.43)"; the API error if the step did not run; "" if
  /// every quantity passed.
  std::string first_failure() const;
};
/// Runs one forward of `step` on `dp` and compares O and lse with the oracle on `rows`.
/// The outputs are poisoned first. API errors come back in CheckResult::error (ran == false).
CheckResult check_forward(const std::string& step, DeviceProblem& dp, const HostProblem& p,
                          const std::vector<RowId>& rows);

/// Compares the O and lse that `dp` holds now (as the last forward left them, e.g. one the
/// caller launched on its own stream and synchronized) with the oracle on `rows`.
CheckResult compare_forward(const DeviceProblem& dp, const HostProblem& p,
                            const std::vector<RowId>& rows);

/// Runs a forward (to get O and lse), then one backward of `step`, and compares dQ on
/// `q_rows`, dK and dV on `kv_rows` with the oracle.
CheckResult check_backward(const std::string& step, DeviceProblem& dp, const HostProblem& p,
                           const std::vector<RowId>& q_rows, const std::vector<RowId>& kv_rows,
                           bool deterministic);

/// Runs one forward of `step` on a problem made on the GPU and compares O and lse with the
/// oracle on `rows_per_group` query rows (drawn with `seed`) of the first and the last key/value
/// head group, the one at the highest addresses; the oracle reads back only those groups'
/// inputs and outputs (DeviceProblem::download_group()).
CheckResult check_forward_sampled(const std::string& step, DeviceProblem& dp, int rows_per_group,
                                  uint64_t seed);

/// Runs a forward and one backward of `step` and compares dQ, dK and dV with the oracle on
/// `rows` query rows and `rows` key rows of the last key/value head group (plus the keys those
/// query rows attend to most, add_attended_keys()), reading back only that group.
CheckResult check_backward_sampled(const std::string& step, DeviceProblem& dp, int rows,
                                   uint64_t seed, bool deterministic);

/// The warm-up queues its runs in batches of about this many milliseconds of GPU time, back to
/// back as the timed runs are, and waits for each batch (time_step()).
inline constexpr double kWarmupBatchMs = 5.0;
/// At most this many runs in a warm-up batch.
inline constexpr int kWarmupMaxBatch = 4096;

/// How many runs of `call_ms` milliseconds each make a warm-up batch of about kWarmupBatchMs
/// (at least 1, at most kWarmupMaxBatch; call_ms <= 0: the most). One run after another, each
/// waited for, left the GPU idle between runs for the launch and the synchronization, a few
/// microseconds from C++ and tens from Python: for a kernel of 0.2 ms the warm-up then drew
/// less power than the timed runs, which are queued back to back, and the two tools timed
/// such cells from different clock states (docs/results/README.md, twenty-sixth session).
int warmup_batch(double call_ms);

/// Median, min and max over `repeats` timed runs, each between two CUDA events and all queued
/// back to back (one synchronization at the end, as compare.py times PyTorch), after untimed
/// runs: at least `warmup` of them and more for at least `warmup_ms` milliseconds, queued in
/// batches (warmup_batch()). The time-based warm-up brings the GPU close to the power and clock
/// state of a sustained load before every measurement, whatever ran (or idled) before it. The H200
/// of this project runs these kernels at its power cap (nvidia-smi dmon: 670-700 W, SM clock
/// 1680-1980 MHz, power violation most of the time), so a short burst after an idle spell
/// runs several percent faster than the same burst on a busy GPU. `backward` times
/// fa_backward (after one forward).
Timing time_step(const std::string& step, DeviceProblem& dp, bool backward, bool deterministic,
                 int warmup, int repeats, int warmup_ms = 0);

/// Runs `step` untimed, back to back in batches, for at least `ms` milliseconds (time_step()'s
/// warm-up alone). The bench calls it before the first timed cell of every shape
/// (`--heat-ms`): the GPU idles through the host-side checks of the shape before, and under
/// the H200's power cap it takes about 2 s of load to reach the clocks of a sustained one,
/// far more than one cell's warm-up. Without it the first cells of a shape time faster than
/// the later ones (05_split_q/NOTES.md, "An order effect in the bench").
void heat(const std::string& step, DeviceProblem& dp, bool backward, bool deterministic, int ms);

/// What measure() does besides timing.
struct MeasureOptions {
  bool check = true;           ///< compare with the oracle first (sampled rows)
  bool time = true;            ///< then time it (false: the check alone)
  int check_rows = 64;         ///< query rows (and key rows for the backward) sampled
  uint64_t seed = 1;           ///< seed of the row sample
  int warmup = 3;              ///< untimed runs first
  int warmup_ms = 0;           ///< and untimed runs until this much time has passed (the
                               ///< runner and bench flags: 250; fa_lab_timing interleaves rounds)
  int repeats = 10;            ///< timed runs; the median is reported
  bool deterministic = false;  ///< backward in deterministic mode
};

/// The MeasureOptions of a runner's or the bench's flags (both have the same fields), with
/// `seed` for the row sample.
template <typename Flags>
MeasureOptions measure_options(const Flags& flags, uint64_t seed) {
  MeasureOptions m;
  m.check = flags.check;
  m.check_rows = flags.check_rows;
  m.seed = seed;
  m.warmup = flags.warmup;
  m.warmup_ms = flags.warmup_ms;
  m.repeats = flags.repeats;
  m.deterministic = flags.deterministic;
  return m;
}

/// Checks (optionally, check_forward_sampled() / check_backward_sampled()) and times one step
/// on one problem in one direction ("fwd" or "bwd") and returns the row for the report (rates
/// and speed-ups are filled later). API errors (e.g. an unsupported head dim, or a problem too
/// large) end up in ResultRow::error.
ResultRow measure(const std::string& step, const std::string& direction, DeviceProblem& dp,
                  const MeasureOptions& options);

/// The ceilings, measured on the current GPU: dense mma.sync m16n8k16 (fp16 in, fp32
/// accumulate, all SMs, no memory traffic), a cuBLAS GEMM (8192^3, fp16, fp32 accumulate),
/// a device-to-device copy of 1 GiB with 16-byte loads ((bytes read + written) / time, GB/s)
/// and, on an sm_90 GPU (H100, H200), dense wgmma m64n256k16, the ceiling of steps 09 and 10.
Ceilings measure_ceilings();

/// Launches the dense wgmma throughput kernel (sm_90a code, common/src/harness/sm90) on
/// `blocks` thread blocks of two warpgroups and returns the FLOPs that launch does. Only for
/// an sm_90 GPU; measure_ceilings() times it.
double launch_wgmma_ceiling(int blocks, float* sink);

}  // namespace fa

#endif  // FA_HARNESS_H_
