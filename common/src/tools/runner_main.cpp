/// \file runner_main.cpp
/// \brief The runner every step folder builds (compiled once per step with FA_RUNNER_STEP):
/// one problem, checked against the fp64 oracle, timed, with TFLOP/s and both ceilings.
///
/// Exit codes: 0 ok (or the step cannot run on this GPU, e.g. an sm_90a step on another GPU:
/// one line says so), 1 the check failed or the GPU/kernel failed, 2 bad flags, a problem the
/// step rejects, an --out file that cannot be written, an invalid FA_SMEM_LIMIT, or a problem
/// that does not fit in the GPU's memory (one line says why; all found before any GPU work).
#include <chrono>
#include <cstdio>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "fa/cli.h"
#include "fa/env.h"
#include "fa/harness.h"

#ifndef FA_RUNNER_STEP
#error "FA_RUNNER_STEP must name the step this runner runs"
#endif

namespace {

/// A problem's arguments with placeholder pointers (aligned, non-null, never dereferenced, each
/// tensor in its own address range), only for the API's host-side checks before anything
/// touches the GPU.
fa_status check_without_gpu(const std::string& step, const fa::RunnerOptions& o) {
  const fa::ProblemShape& s = o.shape;
  uintptr_t next = uintptr_t{1} << 40;
  auto view = [&](int seqlen, int heads) {
    fa_tensor t{reinterpret_cast<void*>(next), 0, 0, 0};
    t.head_stride = s.head_dim;
    t.row_stride = static_cast<int64_t>(heads) * s.head_dim;
    t.batch_stride = t.row_stride * seqlen;
    // The next tensor starts after this one (sizes the API rejects may wrap: it says why first).
    next += (static_cast<uintptr_t>(t.batch_stride) * s.batch * 2 + 4095) & ~uintptr_t{4095};
    return t;
  };
  fa_fwd_args a = s.args();
  a.q = view(s.seqlen_q, s.heads);
  a.k = view(s.seqlen_k, s.heads_kv);
  a.v = view(s.seqlen_k, s.heads_kv);
  a.o = view(s.seqlen_q, s.heads);
  a.lse = reinterpret_cast<float*>(view(s.seqlen_q, s.heads).ptr);
  if (!o.backward) return fa_check_forward(step.c_str(), &a);
  fa_bwd_args b{};
  b.fwd = a;
  b.d_o = view(s.seqlen_q, s.heads);
  b.dq = view(s.seqlen_q, s.heads);
  b.dk = view(s.seqlen_k, s.heads_kv);
  b.dv = view(s.seqlen_k, s.heads_kv);
  b.deterministic = o.deterministic ? 1 : 0;
  return fa_check_backward(step.c_str(), &b);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string step = FA_RUNNER_STEP;
  fa::RunnerOptions opt;
  std::string error;
  if (!fa::parse_runner_args(std::vector<std::string>(argv + 1, argv + argc), &opt, &error)) {
    std::fprintf(stderr, "%s: %s\n", step.c_str(), error.c_str());
    return 2;
  }
  if (opt.help) {
    std::cout << step << ": " << fa_step_summary(step.c_str()) << "\n" << fa::runner_usage(argv[0]);
    return 0;
  }
  // Everything the user gave is checked before any GPU work: the problem (by the C API), the
  // output file, the environment.
  if (check_without_gpu(step, opt) != FA_OK) {
    std::fprintf(stderr, "%s: %s\n", step.c_str(), fa_last_error());
    return 2;
  }
  long long smem_limit = 0;
  if ((!opt.out.empty() && !fa::check_report_path(opt.out, &error)) ||
      fa::env_smem_limit(&smem_limit, &error) == fa::EnvStatus::kInvalid) {
    std::fprintf(stderr, "%s: %s\n", step.c_str(), error.c_str());
    return 2;
  }
  std::string why;
  if (!fa::gpu_available(&why)) {
    std::fprintf(stderr, "%s: no usable CUDA GPU (%s); the kernels need an sm_80+ GPU\n",
                 step.c_str(), why.c_str());
    return 1;
  }
  if (fa_step_check_device(step.c_str()) != FA_OK) {
    std::printf("%s: skipped: %s\n", step.c_str(), fa_last_error());
    return 0;
  }
  size_t free_bytes = 0, total_bytes = 0;
  const size_t need = fa::device_bytes(opt.shape, opt.backward);
  if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess && need > free_bytes) {
    std::fprintf(stderr,
                 "%s: %s does not fit: its tensors need %s of device memory, %s of %s is free\n",
                 step.c_str(), opt.shape.describe().c_str(), fa::format_bytes(need).c_str(),
                 fa::format_bytes(free_bytes).c_str(), fa::format_bytes(total_bytes).c_str());
    return 2;
  }
  if (opt.seed == 0)
    opt.seed = static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count() %
                                     1000000007ULL);
  try {
    const fa::GpuInfo gpu = fa::current_gpu();
    fa::Ceilings ceilings;
    if (opt.ceilings) ceilings = fa::measure_ceilings();
    fa::InputSpec spec;
    spec.seed = opt.seed;
    spec.magnitude = opt.magnitude;
    std::printf("%s: %s, seed %llu\n", step.c_str(), opt.shape.describe().c_str(),
                static_cast<unsigned long long>(opt.seed));
    std::fflush(stdout);
    // Inputs made on the GPU (the values make_problem() draws): seconds even at 2^31 elements.
    fa::DeviceProblem dp(opt.shape, spec, fa::Layout::kContiguous, opt.backward);
    std::vector<fa::ResultRow> rows = {
        fa::measure(step, opt.backward ? "bwd" : "fwd", dp, fa::measure_options(opt, opt.seed))};
    fa::compute_rates(&rows, ceilings);
    fa::print_table(std::cout, gpu, ceilings, rows);
    if (!opt.out.empty()) {
      if (!fa::write_report_file(opt.out, gpu, ceilings, fa::run_info(argc, argv), rows, &error)) {
        std::fprintf(stderr, "%s: %s\n", step.c_str(), error.c_str());
        return 2;
      }
    }
    const fa::ResultRow& r = rows.front();
    if (!r.error.empty()) {
      std::fprintf(stderr, "%s: %s\n", step.c_str(), r.error.c_str());
      return 1;
    }
    if (r.checked && !r.passed) {
      std::fprintf(stderr, "%s: result out of bounds (seed %llu)\n", step.c_str(),
                   static_cast<unsigned long long>(opt.seed));
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", step.c_str(), e.what());
    return 1;
  }
}
