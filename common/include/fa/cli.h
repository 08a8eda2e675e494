/// \file cli.h
/// \brief Command-line flags of the step runners and of the bench program.
#ifndef FA_CLI_H_
#define FA_CLI_H_

#include <cstdint>
#include <string>
#include <vector>

#include "fa/problem.h"

namespace fa {

/// Flags of a step runner (`./build/bin/04_deferred_rescale --help`).
struct RunnerOptions {
  ProblemShape shape;          ///< defaults: B=1, H=16, Nq=Nk=4096, d=128, fp16, no mask
  uint64_t seed = 0;           ///< 0: pick a fresh one from the clock (it is printed)
  float magnitude = 1.f;       ///< Q and K uniform in [-magnitude, magnitude]
  int warmup = 5;              ///< untimed runs
  int warmup_ms = 250;         ///< and untimed runs until this much time has passed
  int repeats = 20;            ///< timed runs, median reported
  bool check = true;           ///< compare with the fp64 oracle before timing
  int check_rows = 256;        ///< query rows (and key rows) sampled for the check
  bool backward = false;       ///< run the backward pass (after a forward)
  bool deterministic = false;  ///< backward with the same bits every run
  bool ceilings = true;        ///< measure the two ceilings first
  std::string out;             ///< write the result to this .csv or .json file
  bool help = false;           ///< print the usage and exit
};

/// Parses runner flags. False with a one-line `error` on an unknown flag or a bad value:
/// a number that does not parse, a --scale that is 0 in fp32 (0, -0, 1e-50: 0 is not "the
/// default"), a --magnitude that is not a finite number >= 0 or does not fit the dtype,
/// --deterministic without --backward. Sizes, the scale's range and --heads-kv are left to the
/// C API, which checks them with its own messages (the runner asks it before any GPU work).
bool parse_runner_args(const std::vector<std::string>& args, RunnerOptions* out,
                       std::string* error);

/// The runner's --help text.
std::string runner_usage(const std::string& program);

/// Flags of the bench program (`./build/bin/bench --help`).
struct BenchOptions {
  std::vector<std::string> steps;  ///< empty: every registered step
  std::vector<int> seqlens = {512, 1024, 2048, 4096, 8192, 16384};  ///< seqlen_q = seqlen_k
  std::vector<int> head_dims = {64, 128};                           ///< head dims
  std::vector<int> causal = {0, 1};                                 ///< mask off, on
  std::vector<std::string> directions = {"fwd", "bwd"};             ///< passes to time
  fa_dtype dtype = FA_FP16;                                         ///< input dtype
  int tokens = 16384;   ///< batch = tokens / seqlen (at least 1)
  int hidden = 2048;    ///< heads = hidden / head_dim
  int warmup = 3;       ///< untimed runs per cell
  int warmup_ms = 250;  ///< and untimed runs until this much time has passed
  int repeats = 10;     ///< timed runs per cell, median reported
  int heat_ms = 2000;   ///< before a shape's cells are timed, its first runs this long
  /// Rounds of timing per shape: every cell of a shape is timed once per round, the rounds in
  /// alternating order (the steps' order, then reversed, ...); a cell's figure is the median
  /// of its runs of every round.
  int rounds = 2;
  bool check = true;           ///< check every cell against the oracle (after a shape's timing)
  int check_rows = 64;         ///< rows sampled per check
  uint64_t seed = 0;           ///< 0: fresh from the clock (printed)
  bool deterministic = false;  ///< deterministic backward
  std::string out;             ///< also write .csv or .json
  bool help = false;           ///< print the usage and exit
  /// The decode sweep instead of the paper's (decode_shapes()); it defaults to head dim 128,
  /// no mask and the forward direction unless --head-dims, --causal or --direction say else.
  bool decode = false;
  std::vector<int> seqlens_q = {1, 16};                     ///< decode: query lengths
  std::vector<int> seqlens_k = {1024, 4096, 16384, 65536};  ///< decode: key lengths
  std::vector<int> batches = {1, 4, 16};                    ///< decode: batch sizes
  int heads = 32;                                           ///< decode: query heads
  std::vector<int> heads_kv = {8, 32};                      ///< decode: key/value heads
  int max_kv_mib = 1024;  ///< decode: shapes whose K and V take more device memory are skipped
};

/// Parses bench flags. False with a one-line `error` on an unknown flag or a bad value
/// (also --deterministic when no backward pass is timed).
bool parse_bench_args(const std::vector<std::string>& args, BenchOptions* out, std::string* error);

/// The decode sweep of `o`: every head dim x causal x heads_kv x seqlen_q x batch x seqlen_k
/// of its lists, with o.heads query heads and o.dtype, in that order, leaving out the shapes
/// whose K and V (kv_bytes()) exceed o.max_kv_mib MiB and those whose heads_kv does not divide
/// o.heads (a sweep left with no shape is an error in the bench). The cap (1 GiB by default)
/// keeps the sweep's time and memory in bounds; compare.py --decode has its own, --max-kv-gib.
std::vector<ProblemShape> decode_shapes(const BenchOptions& o);

/// The bench's --help text.
std::string bench_usage(const std::string& program);

}  // namespace fa

#endif  // FA_CLI_H_
