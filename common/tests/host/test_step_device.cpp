/// \file test_step_device.cpp
/// \brief fa_step_check_device(): whether a step can run on the current GPU, and the one-line
/// reason when it cannot (no GPU; a step built for sm_90a, such as 09 and 10, on another GPU).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "fa/api.h"

namespace {

/// Compute capability of device 0 as major * 10 + minor, or 0 without a usable GPU.
int gpu_sm() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return 0;
  }
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return 0;
  return prop.major * 10 + prop.minor;
}

bool is_hopper_step(const char* name) {
  return std::strcmp(name, "09_hopper_wgmma") == 0 || std::strcmp(name, "10_hopper_pingpong") == 0;
}

TEST(StepDevice, UnknownStepIsReported) {
  EXPECT_EQ(fa_step_check_device("99_nope"), FA_ERR_UNKNOWN_STEP);
  EXPECT_NE(std::string(fa_last_error()).find("unknown step"), std::string::npos);
}

TEST(StepDevice, WithoutAGpuEveryStepSaysNoDevice) {
  if (gpu_sm() != 0) GTEST_SKIP() << "a GPU is present";
  for (int i = 0; i < fa_step_count(); ++i) {
    EXPECT_EQ(fa_step_check_device(fa_step_name(i)), FA_ERR_NO_DEVICE) << fa_step_name(i);
    EXPECT_NE(std::string(fa_last_error()).find("no CUDA device"), std::string::npos)
        << fa_last_error();
  }
}

TEST(StepDevice, TheHopperStepsRunOnlyOnSm90) {
  const int sm = gpu_sm();
  if (sm < 80) GTEST_SKIP() << "no sm_80+ GPU";
  for (int i = 0; i < fa_step_count(); ++i) {
    const char* name = fa_step_name(i);
    const fa_status st = fa_step_check_device(name);
    if (!is_hopper_step(name) || sm == 90) {
      EXPECT_EQ(st, FA_OK) << name << ": " << fa_last_error();
      continue;
    }
    EXPECT_EQ(st, FA_ERR_UNSUPPORTED) << name;
    const std::string message = fa_last_error();
    EXPECT_NE(message.find("needs an sm_90 GPU"), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << "one line: " << message;
  }
}

}  // namespace
