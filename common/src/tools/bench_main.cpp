/// \file bench_main.cpp
/// \brief The per-step benchmark: every registered step over the paper's sweep (16K tokens,
/// hidden 2048, seqlen 512..16K, head dims 64 and 128, causal off and on), or with --decode
/// over decode shapes (few query rows, long keys, GB/s of K and V beside TFLOP/s): the steps
/// of a shape timed one after another (in --rounds rounds, every other one reversed), then
/// each result checked against the oracle, with each step's speed-up over the step before it
/// and over the first.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "fa/cli.h"
#include "fa/env.h"
#include "fa/harness.h"

int main(int argc, char** argv) {
  fa::BenchOptions opt;
  std::string error;
  if (!fa::parse_bench_args(std::vector<std::string>(argv + 1, argv + argc), &opt, &error)) {
    std::fprintf(stderr, "bench: %s\n", error.c_str());
    return 2;
  }
  if (opt.help) {
    std::cout << fa::bench_usage(argv[0]);
    return 0;
  }
  std::vector<std::string> steps = opt.steps;
  std::vector<std::string> registered;
  for (int i = 0; i < fa_step_count(); ++i) registered.push_back(fa_step_name(i));
  if (steps.empty()) steps = registered;
  for (const std::string& s : steps)
    if (fa_step_summary(s.c_str()) == nullptr) {
      std::fprintf(stderr, "bench: unknown step '%s'\n", s.c_str());
      return 2;
    }
  long long smem_limit = 0;
  if ((!opt.out.empty() && !fa::check_report_path(opt.out, &error)) ||
      fa::env_smem_limit(&smem_limit, &error) == fa::EnvStatus::kInvalid) {
    std::fprintf(stderr, "bench: %s\n", error.c_str());
    return 2;
  }
  std::string why;
  if (!fa::gpu_available(&why)) {
    std::fprintf(stderr, "bench: no usable CUDA GPU (%s); the benchmark needs an sm_80+ GPU\n",
                 why.c_str());
    return 1;
  }
  // A step built for another GPU architecture (09, 10: sm_90a) is left out, in one line.
  std::vector<std::string> runnable;
  for (const std::string& s : steps) {
    if (fa_step_check_device(s.c_str()) == FA_OK)
      runnable.push_back(s);
    else
      std::fprintf(stderr, "bench: skipping %s: %s\n", s.c_str(), fa_last_error());
  }
  steps = runnable;
  if (opt.seed == 0)
    opt.seed = static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count() %
                                     1000000007ULL);

  // The sweep: problems outer (inputs made and uploaded once), steps inner.
  std::vector<fa::ProblemShape> shapes;
  if (opt.decode) shapes = fa::decode_shapes(opt);  // else the paper's sweep:
  for (int d : opt.decode ? std::vector<int>() : opt.head_dims)
    for (int causal : opt.causal)
      for (int n : opt.seqlens) {
        fa::ProblemShape s;
        s.dtype = opt.dtype;
        s.seqlen_q = s.seqlen_k = n;
        s.batch = std::max(1, opt.tokens / n);
        s.head_dim = d;
        s.heads = s.heads_kv = std::max(1, opt.hidden / d);
        s.causal = causal != 0;
        shapes.push_back(s);
      }
  if (shapes.empty()) {  // only a decode sweep can leave none
    std::fprintf(stderr,
                 "bench: no decode shape to run: a --heads-kv value must divide --heads (%d), "
                 "and a shape's K and V must fit in --max-kv-mib\n",
                 opt.heads);
    return 2;
  }
  int total = 0;
  for (size_t i = 0; i < shapes.size(); ++i)
    for (const std::string& dir : opt.directions)
      for (const std::string& st : steps)
        if (dir == "fwd" || fa_step_has_backward(st.c_str()) == 1) ++total;

  try {
    const fa::GpuInfo gpu = fa::current_gpu();
    std::fprintf(stderr, "bench: measuring the ceilings on %s ...\n", gpu.name.c_str());
    const fa::Ceilings ceilings = fa::measure_ceilings();
    std::fprintf(stderr, "bench: %d runs, seed %llu\n", total,
                 static_cast<unsigned long long>(opt.seed));
    std::vector<fa::ResultRow> rows;
    int done = 0, failed = 0, shown = 0;
    const int lines = total * (opt.rounds + (opt.check ? 1 : 0));
    const auto t0 = std::chrono::steady_clock::now();
    const auto progress = [&](const fa::ResultRow& r, const fa::ProblemShape& s, const char* what) {
      ++shown;
      const double secs =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::fprintf(stderr, "\r[%3d/%d] %-20s %s %-40s %-7s %6.1fs%s", shown, lines, r.step.c_str(),
                   r.direction.c_str(), s.describe().c_str(), what, secs,
                   shown == lines ? "\n" : "");
      std::fflush(stderr);
    };
    for (size_t i = 0; i < shapes.size(); ++i) {
      fa::InputSpec spec;
      spec.seed = opt.seed + i;
      const bool any_bwd = [&] {
        for (const std::string& dir : opt.directions)
          for (const std::string& st : steps)
            if (dir == "bwd" && fa_step_has_backward(st.c_str()) == 1) return true;
        return false;
      }();
      fa::DeviceProblem dp(shapes[i], spec, fa::Layout::kContiguous, any_bwd);  // made on the GPU
      // Every cell of the shape is timed first, one after another, and checked afterwards:
      // the oracle runs on the host, and a GPU that idled through it would time its next
      // cell from a cooler, faster clock state than compare.py (which checks on the GPU) does.
      const size_t first = rows.size();
      fa::MeasureOptions timing = fa::measure_options(opt, spec.seed);
      timing.check = false;
      // The GPU idled through the last shape's checks: the first cell's step runs untimed for
      // --heat-ms first, so that every cell of this one is timed at sustained clocks.
      for (const std::string& dir : opt.directions) {
        const auto st = std::find_if(steps.begin(), steps.end(), [&](const std::string& s) {
          return dir == "fwd" || fa_step_has_backward(s.c_str()) == 1;
        });
        if (st == steps.end()) continue;
        fa::heat(*st, dp, dir == "bwd", opt.deterministic, opt.heat_ms);
        break;
      }
      for (const std::string& dir : opt.directions)
        for (const std::string& st : steps) {
          if (dir == "bwd" && fa_step_has_backward(st.c_str()) != 1) continue;
          rows.push_back(fa::measure(st, dir, dp, timing));
          progress(rows.back(), shapes[i], "timed");
        }
      // Further rounds (--rounds): the same cells again, reversed every other round. Under the
      // power cap the clocks drift a little through a shape; a step timed right after its
      // neighbour in one round is timed before it in the next (README, "Burst or sustained").
      const size_t cells = rows.size() - first;
      std::vector<std::vector<fa::Timing>> by_round(cells);
      for (size_t c = 0; c < cells; ++c) by_round[c].push_back(rows[first + c].timing);
      for (int round = 1; round < opt.rounds; ++round)
        for (size_t k = 0; k < cells; ++k) {
          const size_t c = round % 2 ? cells - 1 - k : k;
          fa::ResultRow& r = rows[first + c];
          try {
            if (r.error.empty())
              by_round[c].push_back(fa::time_step(r.step, dp, r.direction == "bwd",
                                                  opt.deterministic, opt.warmup, opt.repeats,
                                                  opt.warmup_ms));
          } catch (const std::exception& e) {
            r.error = e.what();
          }
          progress(r, shapes[i], ("round " + std::to_string(round + 1)).c_str());
        }
      if (opt.rounds > 1)
        for (size_t c = 0; c < cells; ++c)
          if (rows[first + c].error.empty()) rows[first + c].timing = fa::pool_rounds(by_round[c]);
      if (opt.check) {
        fa::MeasureOptions check = fa::measure_options(opt, spec.seed);
        check.time = false;
        for (size_t r = first; r < rows.size(); ++r) {
          const fa::ResultRow c = fa::measure(rows[r].step, rows[r].direction, dp, check);
          rows[r].checked = c.checked;
          rows[r].passed = c.passed;
          rows[r].max_abs = c.max_abs;
          rows[r].rel_l2 = c.rel_l2;
          if (rows[r].error.empty()) rows[r].error = c.error;
          progress(rows[r], shapes[i], "checked");
        }
      }
      for (size_t r = first; r < rows.size(); ++r)
        if (!rows[r].error.empty() || (rows[r].checked && !rows[r].passed)) ++failed;
      done += static_cast<int>(rows.size() - first);
    }
    fa::compute_rates(&rows, ceilings);
    fa::compute_speedups(&rows, registered);
    fa::print_table(std::cout, gpu, ceilings, rows);
    if (!opt.out.empty()) {
      if (!fa::write_report_file(opt.out, gpu, ceilings, fa::run_info(argc, argv), rows, &error)) {
        std::fprintf(stderr, "bench: %s\n", error.c_str());
        return 2;
      }
      std::fprintf(stderr, "bench: wrote %s\n", opt.out.c_str());
    }
    if (failed > 0) {
      std::fprintf(stderr, "bench: %d of %d runs failed or were out of bounds\n", failed, done);
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench: %s\n", e.what());
    return 1;
  }
}
