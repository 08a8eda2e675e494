/// \file gpu_test_util.h
/// \brief What the GPU tests share: the skip rule, the registered steps, per-test seeds.
#ifndef FA_GPU_TEST_UTIL_H_
#define FA_GPU_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "fa/api.h"

namespace fa {

/// Every registered step, in folder order.
std::vector<std::string> registered_steps();

/// True if an sm_80+ GPU is present; `why` says why not (decided once per process).
bool test_gpu_available(std::string* why);

/// The run's base seed (FA_TEST_SEED in the environment, else fresh; printed at start-up).
uint64_t base_seed();

/// A seed for one test: the base seed hashed with the test's name, so that each test draws
/// different inputs and a failure reproduces with FA_TEST_SEED=<base seed>.
uint64_t test_seed(const std::string& name);

/// Random problems per (step, direction) when FA_RANDOM_PROBLEMS is not set: enough for every
/// coverage class of test_random.cpp and as many again drawn freely, so that a full GPU run
/// stays well under a minute; FA_RANDOM_PROBLEMS=2000 makes a soak run.
constexpr int kDefaultRandomProblems = 24;

/// The suite's settings from the environment, read strictly once at start-up
/// (read_settings()): a variable that is set but not valid stops the run with a message.
struct Settings {
  uint64_t base_seed = 0;                        ///< FA_TEST_SEED, else from the clock
  int random_problems = kDefaultRandomProblems;  ///< FA_RANDOM_PROBLEMS (1 .. 10^7)
  bool random_seed_set = false;     ///< FA_RANDOM_SEED was given: run exactly those seeds
  uint64_t random_seed = 0;         ///< FA_RANDOM_SEED
  int random_max_seqlen = 4224;     ///< FA_RANDOM_MAX_SEQLEN (1 .. 2^20)
  double random_seconds = 0;        ///< FA_RANDOM_SECONDS (> 0), else 0: no time limit
  int decode_problems = 24;         ///< FA_DECODE_PROBLEMS (1 .. 10^7)
  int decode_max_seqlen_k = 65536;  ///< FA_DECODE_MAX_SEQLEN_K (1 .. 2^24)
  bool decode_seed_set = false;     ///< FA_DECODE_SEED was given: run only that problem
  uint64_t decode_seed = 0;         ///< FA_DECODE_SEED
};

/// Reads every FA_* variable the suite uses (FA_TEST_SEED, FA_RANDOM_PROBLEMS, FA_RANDOM_SEED,
/// FA_RANDOM_MAX_SEQLEN, FA_RANDOM_SECONDS, FA_DECODE_PROBLEMS, FA_DECODE_MAX_SEQLEN_K,
/// FA_DECODE_SEED, and FA_SMEM_LIMIT, which libfa reads); false with a one-line `error` on
/// the first invalid one.
bool read_settings(std::string* error);

/// The settings read_settings() found (defaults before it runs).
const Settings& settings();

}  // namespace fa

/// Skips the current test, with the message ctest looks for, when there is no usable GPU.
#define FA_REQUIRE_GPU()                                                                  \
  do {                                                                                    \
    std::string fa_why_;                                                                  \
    if (!fa::test_gpu_available(&fa_why_)) GTEST_SKIP() << "No CUDA device: " << fa_why_; \
  } while (0)

#endif  // FA_GPU_TEST_UTIL_H_
