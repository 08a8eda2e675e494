/// \file runner_main.cpp
/// \brief The runner every step folder builds (compiled once per step with FA_RUNNER_STEP):
/// one problem, checked against the fp64 oracle, timed, with TFLOP/s and both ceilings.
///
/// Exit codes: 0 ok (or the step cannot run on this GPU, e.g. an sm_90a step on another GPU:
/// one line says so), 1 the check failed or the GPU/kernel failed, 2 bad flags or a problem
/// the step rejects (the message says why).
#include <chrono>
#include <cstdio>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "fa/cli.h"
#include "fa/harness.h"

#ifndef FA_RUNNER_STEP
#error "FA_RUNNER_STEP must name the step this runner runs"
#endif

namespace {

/// A problem's arguments with placeholder (aligned, non-null) pointers, only for the API's
/// host-side checks before anything touches the GPU.
fa_status check_without_gpu(const std::string& step, const fa::RunnerOptions& o) {
  const fa::ProblemShape& s = o.shape;
  alignas(16) static uint16_t dummy[8];
  auto view = [&](int seqlen, int heads) {
    fa_tensor t{dummy, 0, 0, 0};
    t.head_stride = s.head_dim;
    t.row_stride = static_cast<int64_t>(heads) * s.head_dim;
    t.batch_stride = t.row_stride * seqlen;
    return t;
  };
  fa_fwd_args a = s.args();
  a.q = a.o = view(s.seqlen_q, s.heads);
  a.k = a.v = view(s.seqlen_k, s.heads_kv);
  a.lse = reinterpret_cast<float*>(dummy);
  if (!o.backward) return fa_check_forward(step.c_str(), &a);
  fa_bwd_args b{};
  b.fwd = a;
  b.d_o = b.dq = a.q;
  b.dk = b.dv = a.k;
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
  if (check_without_gpu(step, opt) != FA_OK) {
    std::fprintf(stderr, "%s: %s\n", step.c_str(), fa_last_error());
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
    const fa::HostProblem problem = fa::make_problem(opt.shape, spec);
    fa::DeviceProblem dp(problem, fa::Layout::kContiguous, opt.backward);
    std::vector<fa::ResultRow> rows = {fa::measure(step, opt.backward ? "bwd" : "fwd", dp, problem,
                                                   fa::measure_options(opt, opt.seed))};
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
