/// \file report.h
/// \brief Results of runs and how they are printed: a table on stdout, CSV and JSON files.
#ifndef FA_REPORT_H_
#define FA_REPORT_H_

#include <ostream>
#include <string>
#include <vector>

#include "fa/problem.h"

namespace fa {

/// The GPU a report was measured on.
struct GpuInfo {
  std::string name = "none";  ///< e.g. "NVIDIA H200"
  int sm_count = 0;           ///< streaming multiprocessors
  int cc_major = 0;           ///< compute capability, major
  int cc_minor = 0;           ///< compute capability, minor
  std::string driver;         ///< e.g. "580.159"
  std::string runtime;        ///< CUDA runtime, e.g. "13.0"
};

/// The ceilings every kernel is measured against (0 if not measured): two of arithmetic, in
/// TFLOP/s, and one of device-memory bandwidth, in GB/s, for the memory-bound shapes
/// (decoding).
struct Ceilings {
  double mma_tflops = 0;     ///< dense mma.sync m16n8k16, fp16 in, fp32 accumulate
  double cublas_tflops = 0;  ///< large cuBLAS GEMM (8192^3 fp16, fp32 accumulate)
  double copy_gbps = 0;      ///< device-to-device copy: (bytes read + written) / time, GB/s
  double wgmma_tflops = 0;   ///< dense wgmma m64n256k16, fp16 in, fp32 accumulate (sm_90 only)
};

/// Milliseconds per run over the timed repeats.
struct Timing {
  double median_ms = 0;                 ///< median over the repeats (of every round)
  double min_ms = 0;                    ///< fastest run
  double max_ms = 0;                    ///< slowest run
  int repeats = 0;                      ///< timed runs (of every round)
  std::vector<double> samples_ms;       ///< every timed run, sorted
  std::vector<double> round_median_ms;  ///< with several rounds (pool_rounds()): each one's median
};

/// The Timing of a cell's timed runs: sorted samples, median, min and max.
Timing timing_of(std::vector<double> samples_ms);

/// One Timing from the timed runs of several rounds of the same cell (the bench's --rounds):
/// the samples pooled, median, min and max over all of them, and each round's own median in
/// round_median_ms, in round order. An empty list gives an empty Timing.
Timing pool_rounds(const std::vector<Timing>& rounds);

/// One measured (or failed) run of one step on one problem.
struct ResultRow {
  std::string step;               ///< step name
  std::string direction = "fwd";  ///< "fwd" or "bwd"
  ProblemShape shape;             ///< the problem
  bool checked = false;           ///< compared with the oracle
  bool passed = false;            ///< within bounds (meaningful when checked)
  double max_abs = 0;             ///< worst max|out-ref| over the quantities checked
  double rel_l2 = 0;              ///< worst relative L2 error over the quantities checked
  std::string error;              ///< non-empty if the run failed or was rejected
  Timing timing;                  ///< event-timed runs
  double tflops = 0;              ///< achieved TFLOP/s (median time)
  double pct_mma = 0;             ///< percent of Ceilings::mma_tflops
  double pct_cublas = 0;          ///< percent of Ceilings::cublas_tflops
  double pct_wgmma = 0;           ///< percent of Ceilings::wgmma_tflops (0 if not measured)
  double gbps = 0;                ///< forward: K and V bytes (kv_bytes()) / median time, GB/s
  double pct_copy = 0;            ///< percent of Ceilings::copy_gbps (forward rows)
  double speedup_prev = 0;        ///< time of the previous step on the same problem / this time
  double speedup_first = 0;       ///< time of the first step on the same problem / this time
};

/// Fills tflops and the percentages of every row from its timing and FLOP count
/// (forward \f$4BHd\f$ per unmasked pair, backward 2.5x), and for forward rows the K/V
/// bandwidth gbps (kv_bytes() over the median time) and its percentage of the copy ceiling.
void compute_rates(std::vector<ResultRow>* rows, const Ceilings& ceilings);

/// Fills speedup_prev and speedup_first: rows with the same direction and problem are
/// compared in the order of `step_order` (a step's predecessor is the nearest earlier step
/// that has a timed row for that problem).
void compute_speedups(std::vector<ResultRow>* rows, const std::vector<std::string>& step_order);

/// Prints the GPU, the ceilings and one line per row, aligned.
void print_table(std::ostream& os, const GpuInfo& gpu, const Ceilings& ceilings,
                 const std::vector<ResultRow>& rows);

/// One header line, then one line per row.
void write_csv(std::ostream& os, const std::vector<ResultRow>& rows);

/// Metadata passed through to the JSON report.
struct RunInfo {
  std::string commit;   ///< git commit of the build, or "unknown"
  std::string date;     ///< UTC, ISO 8601
  std::string command;  ///< the command line that produced the report
};

/// {"gpu": ..., "ceilings": ..., "run": ..., "results": [...]}.
void write_json(std::ostream& os, const GpuInfo& gpu, const Ceilings& ceilings, const RunInfo& run,
                const std::vector<ResultRow>& rows);

/// Checks, before any work, that write_report_file() could write `path`: it ends in .csv or
/// .json, its folder exists and is writable, and it is not itself a folder or a read-only file.
/// False with a one-line `error` otherwise. Nothing is created.
bool check_report_path(const std::string& path, std::string* error);

/// Writes CSV if `path` ends in ".csv", JSON if it ends in ".json"; false (and `error`) if
/// the extension is neither or the file cannot be written.
bool write_report_file(const std::string& path, const GpuInfo& gpu, const Ceilings& ceilings,
                       const RunInfo& run, const std::vector<ResultRow>& rows, std::string* error);

/// The git commit the build was configured from ("unknown" outside a checkout).
std::string build_commit();

/// This build's commit, the current time and the command line `argv` joined by spaces, with
/// `NAME=<value> ` in front for each variable that changes the kernels a step runs and is set:
/// FA_SMEM_LIMIT (the tile shapes), FA_NUM_SPLITS (08's split of the keys), FA_BWD_TAIL_SPLIT
/// (07's split of the last wave), FA_BWD_LATE_PREPROCESS (07's test knob: a late preprocess),
/// FA_HOPPER_BLOCK_M and FA_HOPPER_GRID (09's and 10's Q block at d = 64 and their grid).
RunInfo run_info(int argc, char** argv);

/// The current UTC time as "2026-11-29T12:00:00Z".
std::string utc_now();

}  // namespace fa

#endif  // FA_REPORT_H_
