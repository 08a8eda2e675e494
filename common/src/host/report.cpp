/// \file report.cpp
/// \brief Table, CSV and JSON output of measured rows.
#include "fa/report.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <map>
#include <sstream>
#include <tuple>
#include <utility>

#include "fa/flops.h"

namespace fa {
namespace {

std::string fmt(const char* format, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, x);
  return buf;
}

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out;
}

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += (c == '"') ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

/// A JSON number, or null for NaN/inf (JSON has no such numbers).
std::string json_num(double x) {
  if (!std::isfinite(x)) return "null";
  return fmt("%.6g", x);
}

/// `, "round_ms": [a, b, ...]` for a cell timed in several rounds, else nothing.
std::string round_medians_json(const Timing& t) {
  if (t.round_median_ms.size() < 2) return "";
  std::string out = ", \"round_ms\": [";
  for (size_t i = 0; i < t.round_median_ms.size(); ++i)
    out += (i ? ", " : "") + json_num(t.round_median_ms[i]);
  return out + "]";
}

using ProblemKey = std::tuple<std::string, int, int, int, int, int, int, int, float, bool>;

ProblemKey key_of(const ResultRow& r) {
  const ProblemShape& s = r.shape;
  return ProblemKey(r.direction, static_cast<int>(s.dtype), s.batch, s.heads, s.heads_kv,
                    s.seqlen_q, s.seqlen_k, s.head_dim, s.effective_scale(), s.causal);
}

}  // namespace

Timing timing_of(std::vector<double> samples_ms) {
  Timing t;
  if (samples_ms.empty()) return t;
  std::sort(samples_ms.begin(), samples_ms.end());
  const size_t n = samples_ms.size();
  t.repeats = static_cast<int>(n);
  t.min_ms = samples_ms.front();
  t.max_ms = samples_ms.back();
  t.median_ms = n % 2 ? samples_ms[n / 2] : 0.5 * (samples_ms[n / 2 - 1] + samples_ms[n / 2]);
  t.samples_ms = std::move(samples_ms);
  return t;
}

Timing pool_rounds(const std::vector<Timing>& rounds) {
  std::vector<double> all;
  for (const Timing& t : rounds) all.insert(all.end(), t.samples_ms.begin(), t.samples_ms.end());
  Timing pooled = timing_of(std::move(all));
  if (pooled.repeats == 0) return pooled;
  for (const Timing& t : rounds) pooled.round_median_ms.push_back(t.median_ms);
  return pooled;
}

void compute_rates(std::vector<ResultRow>* rows, const Ceilings& ceilings) {
  for (ResultRow& r : *rows) {
    if (!r.error.empty() || r.timing.median_ms <= 0) continue;
    const ProblemShape& s = r.shape;
    const double flops =
        r.direction == "bwd"
            ? backward_flops(s.batch, s.heads, s.seqlen_q, s.seqlen_k, s.head_dim, s.causal)
            : forward_flops(s.batch, s.heads, s.seqlen_q, s.seqlen_k, s.head_dim, s.causal);
    r.tflops = flops / (r.timing.median_ms * 1e-3) / 1e12;
    r.pct_mma = ceilings.mma_tflops > 0 ? 100.0 * r.tflops / ceilings.mma_tflops : 0;
    r.pct_cublas = ceilings.cublas_tflops > 0 ? 100.0 * r.tflops / ceilings.cublas_tflops : 0;
    r.pct_wgmma = ceilings.wgmma_tflops > 0 ? 100.0 * r.tflops / ceilings.wgmma_tflops : 0;
    r.gbps = r.pct_copy = 0;
    if (r.direction == "fwd") {
      r.gbps =
          kv_bytes(s.batch, s.heads_kv, s.seqlen_k, s.head_dim) / (r.timing.median_ms * 1e-3) / 1e9;
      r.pct_copy = ceilings.copy_gbps > 0 ? 100.0 * r.gbps / ceilings.copy_gbps : 0;
    }
  }
}

void compute_speedups(std::vector<ResultRow>* rows, const std::vector<std::string>& step_order) {
  std::map<std::string, int> rank;
  for (size_t i = 0; i < step_order.size(); ++i) rank[step_order[i]] = static_cast<int>(i);
  // For every problem: step rank -> median time.
  std::map<ProblemKey, std::map<int, double>> times;
  for (const ResultRow& r : *rows) {
    if (!r.error.empty() || r.timing.median_ms <= 0 || !rank.count(r.step)) continue;
    times[key_of(r)][rank[r.step]] = r.timing.median_ms;
  }
  for (ResultRow& r : *rows) {
    r.speedup_prev = r.speedup_first = 0;
    if (!r.error.empty() || r.timing.median_ms <= 0 || !rank.count(r.step)) continue;
    const auto& by_rank = times[key_of(r)];
    const int me = rank[r.step];
    auto it = by_rank.find(me);
    if (it != by_rank.begin()) r.speedup_prev = std::prev(it)->second / r.timing.median_ms;
    if (by_rank.begin()->first != me)
      r.speedup_first = by_rank.begin()->second / r.timing.median_ms;
  }
}

void print_table(std::ostream& os, const GpuInfo& gpu, const Ceilings& ceilings,
                 const std::vector<ResultRow>& rows) {
  os << "GPU: " << gpu.name << " (sm_" << gpu.cc_major << gpu.cc_minor << ", " << gpu.sm_count
     << " SMs, driver " << gpu.driver << ", CUDA " << gpu.runtime << ")\n";
  os << "Ceilings: mma.sync m16n8k16 " << fmt("%.1f", ceilings.mma_tflops)
     << " TFLOP/s, cuBLAS GEMM " << fmt("%.1f", ceilings.cublas_tflops)
     << " TFLOP/s, device-memory copy " << fmt("%.0f", ceilings.copy_gbps) << " GB/s";
  if (ceilings.wgmma_tflops > 0)
    os << ", wgmma m64n256k16 " << fmt("%.1f", ceilings.wgmma_tflops)
       << " TFLOP/s (%wgmma: percent of it)";
  os << " (GB/s: K and V bytes read once / time)\n";
  const bool wgmma = ceilings.wgmma_tflops > 0;  // then a %wgmma column after %cuBL
  char line[512];
  std::snprintf(
      line, sizeof line,
      "%-20s %-3s %-4s %3s %5s %6s %6s %4s %-6s %9s %7s %8s %6s %6s%s %6s %5s %7s %7s  %s\n",
      "step", "dir", "dt", "B", "H/kv", "Nq", "Nk", "d", "mask", "ms", "spread", "TFLOP/s", "%mma",
      "%cuBL", wgmma ? " %wgmma" : "", "GB/s", "%copy", "vs prev", "vs 1st", "check");
  os << line;
  for (const ResultRow& r : rows) {
    const ProblemShape& s = r.shape;
    const std::string heads = std::to_string(s.heads) + "/" + std::to_string(s.heads_kv);
    if (!r.error.empty()) {
      std::snprintf(line, sizeof line, "%-20s %-3s %-4s %3d %5s %6d %6d %4d %-6s  error: %s\n",
                    r.step.c_str(), r.direction.c_str(), dtype_name(s.dtype), s.batch,
                    heads.c_str(), s.seqlen_q, s.seqlen_k, s.head_dim, s.causal ? "causal" : "none",
                    r.error.c_str());
      os << line;
      continue;
    }
    const double spread = r.timing.median_ms > 0
                              ? 100.0 * (r.timing.max_ms - r.timing.min_ms) / r.timing.median_ms
                              : 0;
    const std::string check = !r.checked
                                  ? "not checked"
                                  : (std::string(r.passed ? "ok" : "FAIL") + " max|err| " +
                                     fmt("%.1e", r.max_abs) + " rel " + fmt("%.1e", r.rel_l2));
    std::snprintf(line, sizeof line,
                  "%-20s %-3s %-4s %3d %5s %6d %6d %4d %-6s %9.3f %6.1f%% %8.1f %6.1f %6.1f%s "
                  "%6s %5s %7s %7s  %s\n",
                  r.step.c_str(), r.direction.c_str(), dtype_name(s.dtype), s.batch, heads.c_str(),
                  s.seqlen_q, s.seqlen_k, s.head_dim, s.causal ? "causal" : "none",
                  r.timing.median_ms, spread, r.tflops, r.pct_mma, r.pct_cublas,
                  wgmma ? fmt(" %6.1f", r.pct_wgmma).c_str() : "",
                  r.gbps > 0 ? fmt("%.0f", r.gbps).c_str() : "-",
                  r.pct_copy > 0 ? fmt("%.1f", r.pct_copy).c_str() : "-",
                  r.speedup_prev > 0 ? fmt("%.2fx", r.speedup_prev).c_str() : "-",
                  r.speedup_first > 0 ? fmt("%.2fx", r.speedup_first).c_str() : "-", check.c_str());
    os << line;
  }
}

void write_csv(std::ostream& os, const std::vector<ResultRow>& rows) {
  os << "step,direction,dtype,batch,heads,heads_kv,seqlen_q,seqlen_k,head_dim,scale,causal,"
        "checked,passed,max_abs,rel_l2,median_ms,min_ms,max_ms,repeats,tflops,pct_mma,"
        "pct_cublas,speedup_prev,speedup_first,gbps,pct_copy,error\n";
  for (const ResultRow& r : rows) {
    const ProblemShape& s = r.shape;
    os << csv_field(r.step) << ',' << r.direction << ',' << dtype_name(s.dtype) << ',' << s.batch
       << ',' << s.heads << ',' << s.heads_kv << ',' << s.seqlen_q << ',' << s.seqlen_k << ','
       << s.head_dim << ',' << fmt("%.6g", s.effective_scale()) << ',' << (s.causal ? 1 : 0) << ','
       << (r.checked ? 1 : 0) << ',' << (r.passed ? 1 : 0) << ',' << fmt("%.3e", r.max_abs) << ','
       << fmt("%.3e", r.rel_l2) << ',' << fmt("%.5f", r.timing.median_ms) << ','
       << fmt("%.5f", r.timing.min_ms) << ',' << fmt("%.5f", r.timing.max_ms) << ','
       << r.timing.repeats << ',' << fmt("%.2f", r.tflops) << ',' << fmt("%.2f", r.pct_mma) << ','
       << fmt("%.2f", r.pct_cublas) << ',' << fmt("%.3f", r.speedup_prev) << ','
       << fmt("%.3f", r.speedup_first) << ',' << fmt("%.1f", r.gbps) << ','
       << fmt("%.2f", r.pct_copy) << ',' << csv_field(r.error) << '\n';
  }
}

void write_json(std::ostream& os, const GpuInfo& gpu, const Ceilings& ceilings, const RunInfo& run,
                const std::vector<ResultRow>& rows) {
  os << "{\n  \"gpu\": {\"name\": \"" << json_escape(gpu.name)
     << "\", \"sm_count\": " << gpu.sm_count << ", \"compute_capability\": \"" << gpu.cc_major
     << "." << gpu.cc_minor << "\", \"driver\": \"" << json_escape(gpu.driver)
     << "\", \"cuda_runtime\": \"" << json_escape(gpu.runtime) << "\"},\n";
  os << "  \"ceilings\": {\"mma_sync_tflops\": " << json_num(ceilings.mma_tflops)
     << ", \"cublas_gemm_tflops\": " << json_num(ceilings.cublas_tflops)
     << ", \"wgmma_tflops\": " << json_num(ceilings.wgmma_tflops)
     << ", \"copy_gbps\": " << json_num(ceilings.copy_gbps) << "},\n";
  os << "  \"run\": {\"commit\": \"" << json_escape(run.commit) << "\", \"date\": \""
     << json_escape(run.date) << "\", \"command\": \"" << json_escape(run.command) << "\"},\n";
  os << "  \"results\": [";
  for (size_t i = 0; i < rows.size(); ++i) {
    const ResultRow& r = rows[i];
    const ProblemShape& s = r.shape;
    os << (i ? ",\n    " : "\n    ") << "{\"step\": \"" << json_escape(r.step)
       << "\", \"direction\": \"" << r.direction << "\", \"dtype\": \"" << dtype_name(s.dtype)
       << "\", \"batch\": " << s.batch << ", \"heads\": " << s.heads
       << ", \"heads_kv\": " << s.heads_kv << ", \"seqlen_q\": " << s.seqlen_q
       << ", \"seqlen_k\": " << s.seqlen_k << ", \"head_dim\": " << s.head_dim
       << ", \"scale\": " << json_num(s.effective_scale())
       << ", \"causal\": " << (s.causal ? "true" : "false")
       << ", \"checked\": " << (r.checked ? "true" : "false")
       << ", \"passed\": " << (r.passed ? "true" : "false")
       << ", \"max_abs\": " << json_num(r.max_abs) << ", \"rel_l2\": " << json_num(r.rel_l2)
       << ", \"median_ms\": " << json_num(r.timing.median_ms)
       << ", \"min_ms\": " << json_num(r.timing.min_ms)
       << ", \"max_ms\": " << json_num(r.timing.max_ms) << ", \"repeats\": " << r.timing.repeats
       << round_medians_json(r.timing) << ", \"tflops\": " << json_num(r.tflops)
       << ", \"pct_mma\": " << json_num(r.pct_mma) << ", \"pct_cublas\": " << json_num(r.pct_cublas)
       << ", \"pct_wgmma\": " << json_num(r.pct_wgmma)
       << ", \"speedup_prev\": " << json_num(r.speedup_prev)
       << ", \"speedup_first\": " << json_num(r.speedup_first) << ", \"gbps\": " << json_num(r.gbps)
       << ", \"pct_copy\": " << json_num(r.pct_copy) << ", \"error\": \"" << json_escape(r.error)
       << "\"}";
  }
  os << "\n  ]\n}\n";
}

bool check_report_path(const std::string& path, std::string* error) {
  auto fail = [&](const std::string& why) {
    if (error) *error = "--out " + path + ": " + why;
    return false;
  };
  auto ends_with = [&](const char* ext) {
    const std::string e(ext);
    return path.size() > e.size() && path.compare(path.size() - e.size(), e.size(), e) == 0;
  };
  if (!ends_with(".csv") && !ends_with(".json"))
    return fail("the file name must end in .csv or .json");
  const size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "."
                          : slash == 0               ? "/"
                                                     : path.substr(0, slash);
  struct stat st;
  if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    return fail("the folder " + dir + " does not exist");
  if (access(dir.c_str(), W_OK) != 0) return fail("the folder " + dir + " is not writable");
  if (stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return fail("is a folder");
    if (access(path.c_str(), W_OK) != 0) return fail("exists and is not writable");
  }
  return true;
}

bool write_report_file(const std::string& path, const GpuInfo& gpu, const Ceilings& ceilings,
                       const RunInfo& run, const std::vector<ResultRow>& rows, std::string* error) {
  auto ends_with = [&](const char* ext) {
    const std::string e(ext);
    return path.size() >= e.size() && path.compare(path.size() - e.size(), e.size(), e) == 0;
  };
  const bool csv = ends_with(".csv"), json = ends_with(".json");
  if (!csv && !json) {
    if (error) *error = "output file '" + path + "' must end in .csv or .json";
    return false;
  }
  std::ofstream f(path);
  if (!f) {
    if (error) *error = "cannot write '" + path + "'";
    return false;
  }
  if (csv) write_csv(f, rows);
  if (json) write_json(f, gpu, ceilings, run, rows);
  f.close();
  if (!f) {
    if (error) *error = "error while writing '" + path + "'";
    return false;
  }
  return true;
}

std::string build_commit() {
#ifdef FA_GIT_COMMIT
  return FA_GIT_COMMIT;
#else
  return "unknown";
#endif
}

RunInfo run_info(int argc, char** argv) {
  RunInfo run{build_commit(), utc_now(), ""};
  // The variables that change the kernels some steps run (FA_SMEM_LIMIT: the tile shapes, see
  // fa::smem_per_block_optin; FA_NUM_SPLITS: 08_split_kv's split of the keys;
  // FA_BWD_TAIL_SPLIT: 07_backward's split of the last wave; FA_BWD_LATE_PREPROCESS: 07's test
  // knob that delays its preprocess; FA_HOPPER_BLOCK_M, FA_HOPPER_GRID: 09's and 10's tile and
  // grid) go in front of the command, as in the shell line that reproduces the run. compare.py's
  // KERNEL_ENV is the same list (a host test keeps the two equal).
  for (const char* name : {"FA_SMEM_LIMIT", "FA_NUM_SPLITS", "FA_BWD_TAIL_SPLIT",
                           "FA_BWD_LATE_PREPROCESS", "FA_HOPPER_BLOCK_M", "FA_HOPPER_GRID"})
    if (const char* value = std::getenv(name)) run.command += std::string(name) + "=" + value + " ";
  for (int i = 0; i < argc; ++i) run.command += (i ? " " : "") + std::string(argv[i]);
  return run;
}

std::string utc_now() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace fa
