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

}  // namespace fa

/// Skips the current test, with the message ctest looks for, when there is no usable GPU.
#define FA_REQUIRE_GPU()                                                                  \
  do {                                                                                    \
    std::string fa_why_;                                                                  \
    if (!fa::test_gpu_available(&fa_why_)) GTEST_SKIP() << "No CUDA device: " << fa_why_; \
  } while (0)

#endif  // FA_GPU_TEST_UTIL_H_
