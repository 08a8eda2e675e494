/// \file lab_timing.cpp
/// \brief The timer of the course labs' speed check (common/scripts/lab.py grade): several
/// steps timed on the same inputs, in interleaved rounds, so that a lab, the step it started
/// from and the reference are compared in one run on one GPU.
///
///     fa_lab_timing --steps 05_split_q,lab_06,06_causal_skip --check lab_06 \
///         --direction fwd --shape 4,32,32,4096,4096,64,1 --rounds 5 --out timing.json
///
/// Per shape (B,H,H_kv,N_q,N_k,d,causal; fp16): the inputs are drawn once; the steps named by
/// --check are first compared with the fp64 oracle on a few sampled rows (a lab must be right
/// where it is timed); then `rounds` rounds time every step (`warmup` untimed runs, the
/// median of `repeats` timed runs), each round in a rotated order, so that a drift of the
/// GPU's clock during the run touches every step alike. The JSON report (the bench's format)
/// holds one row per (shape, step, round), in that order; lab.py takes the median over the
/// rounds.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "fa/harness.h"

namespace {

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> parts;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, sep))
    if (!item.empty()) parts.push_back(item);
  return parts;
}

bool parse_shape(const std::string& text, fa::ProblemShape* s) {
  const std::vector<std::string> f = split(text, ',');
  if (f.size() != 7) return false;
  int v[7];
  for (int i = 0; i < 7; ++i) {
    char* end = nullptr;
    v[i] = static_cast<int>(std::strtol(f[i].c_str(), &end, 10));
    if (*end != '\0') return false;
  }
  *s = fa::make_shape(v[0], v[1], v[2], v[3], v[4], v[5], v[6] != 0);
  return true;
}

int usage(const char* why) {
  std::fprintf(stderr,
               "fa_lab_timing: %s\nusage: fa_lab_timing --steps A,B,... [--check A,...] "
               "[--direction fwd|bwd] --shape B,H,Hkv,Nq,Nk,d,causal [--shape ...] [--rounds 5] "
               "[--warmup 2] [--repeats 5] [--check-rows 16] [--seed 1] --out FILE.json\n",
               why);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> steps, checked;
  std::vector<fa::ProblemShape> shapes;
  std::string direction = "fwd", out;
  int rounds = 5, warmup = 2, repeats = 5, check_rows = 16;
  uint64_t seed = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) return usage(("missing value after " + flag).c_str());
    const std::string value = argv[++i];
    if (flag == "--steps") {
      steps = split(value, ',');
    } else if (flag == "--check") {
      checked = split(value, ',');
    } else if (flag == "--direction" && (value == "fwd" || value == "bwd")) {
      direction = value;
    } else if (flag == "--shape") {
      fa::ProblemShape s;
      if (!parse_shape(value, &s)) return usage(("bad --shape " + value).c_str());
      shapes.push_back(s);
    } else if (flag == "--rounds") {
      rounds = std::atoi(value.c_str());
    } else if (flag == "--warmup") {
      warmup = std::atoi(value.c_str());
    } else if (flag == "--repeats") {
      repeats = std::atoi(value.c_str());
    } else if (flag == "--check-rows") {
      check_rows = std::atoi(value.c_str());
    } else if (flag == "--seed") {
      seed = std::strtoull(value.c_str(), nullptr, 10);
    } else if (flag == "--out") {
      out = value;
    } else {
      return usage(("unknown flag or value: " + flag + " " + value).c_str());
    }
  }
  if (steps.empty() || shapes.empty() || out.empty() || rounds < 1 || repeats < 1 || warmup < 0)
    return usage("--steps, --shape and --out are required; rounds and repeats >= 1");
  for (const std::string& s : steps)
    if (fa_step_summary(s.c_str()) == nullptr) return usage(("unknown step '" + s + "'").c_str());
  std::string why;
  if (!fa::gpu_available(&why)) {
    std::fprintf(stderr, "fa_lab_timing: no usable CUDA GPU (%s)\n", why.c_str());
    return 1;
  }
  const std::set<std::string> to_check(checked.begin(), checked.end());
  const bool backward = direction == "bwd";
  try {
    std::vector<fa::ResultRow> rows;
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < shapes.size(); ++i) {
      const fa::HostProblem problem = fa::make_problem(shapes[i], fa::InputSpec{seed + i});
      fa::DeviceProblem dp(problem, fa::Layout::kContiguous, backward);
      std::set<std::string> failed;  // not timed: rejected, or wrong where it is timed
      for (int round = 0; round < rounds; ++round) {
        for (size_t j = 0; j < steps.size(); ++j) {
          const std::string& step = steps[(j + round) % steps.size()];
          if (failed.count(step)) continue;
          fa::MeasureOptions m;
          m.check = round == 0 && to_check.count(step) > 0;
          m.check_rows = check_rows;
          m.seed = seed + i;
          m.warmup = warmup;
          m.repeats = repeats;
          if (backward && fa_step_has_backward(step.c_str()) != 1) {
            fa::ResultRow r;
            r.step = step;
            r.direction = direction;
            r.shape = shapes[i];
            r.error = step + " has no backward pass";
            rows.push_back(r);
          } else {
            rows.push_back(fa::measure(step, direction, dp, m));
          }
          const fa::ResultRow& r = rows.back();
          if (!r.error.empty() || (r.checked && !r.passed)) failed.insert(step);
        }
      }
      const double secs =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::fprintf(stderr, "fa_lab_timing: %s %s done (%.1fs)\n", direction.c_str(),
                   shapes[i].describe().c_str(), secs);
    }
    fa::compute_rates(&rows, fa::Ceilings{});
    if (!fa::write_report_file(out, fa::current_gpu(), fa::Ceilings{}, fa::run_info(argc, argv),
                               rows, &why)) {
      std::fprintf(stderr, "fa_lab_timing: %s\n", why.c_str());
      return 2;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fa_lab_timing: %s\n", e.what());
    return 1;
  }
}
