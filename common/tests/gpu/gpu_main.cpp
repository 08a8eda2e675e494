/// \file gpu_main.cpp
/// \brief main() of the GPU suite: prints the GPU (or why the tests skip) and the base seed.
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "fa/env.h"
#include "fa/harness.h"
#include "gpu_test_util.h"

namespace fa {

std::vector<std::string> registered_steps() {
  std::vector<std::string> steps;
  for (int i = 0; i < fa_step_count(); ++i) {
    // On a GPU, a step built for another architecture (09, 10: sm_90a) gets no tests here;
    // main() says so in one line. Without a GPU every step's tests exist and skip.
    if (test_gpu_available(nullptr) && fa_step_check_device(fa_step_name(i)) != FA_OK) continue;
    steps.push_back(fa_step_name(i));
  }
  return steps;
}

bool test_gpu_available(std::string* why) {
  static std::string reason;
  static const bool available = gpu_available(&reason);
  if (why) *why = reason;
  return available;
}

namespace {
Settings g_settings;
}  // namespace

const Settings& settings() {
  return g_settings;
}

bool read_settings(std::string* error) {
  Settings s;
  if (env_u64("FA_TEST_SEED", &s.base_seed, error) == EnvStatus::kInvalid) return false;
  if (std::getenv("FA_TEST_SEED") == nullptr)
    s.base_seed = static_cast<uint64_t>(
        std::chrono::system_clock::now().time_since_epoch().count() % 1000000007ULL);
  long long n = kDefaultRandomProblems;
  if (env_int("FA_RANDOM_PROBLEMS", 1, 10000000, &n, error) == EnvStatus::kInvalid) return false;
  s.random_problems = static_cast<int>(n);
  const EnvStatus seed = env_u64("FA_RANDOM_SEED", &s.random_seed, error);
  if (seed == EnvStatus::kInvalid) return false;
  s.random_seed_set = seed == EnvStatus::kOk;
  n = 4224;  // 4096 + 128
  if (env_int("FA_RANDOM_MAX_SEQLEN", 1, 1 << 20, &n, error) == EnvStatus::kInvalid) return false;
  s.random_max_seqlen = static_cast<int>(n);
  if (env_double("FA_RANDOM_SECONDS", 0, 1e7, &s.random_seconds, error) == EnvStatus::kInvalid)
    return false;
  n = s.decode_problems;
  if (env_int("FA_DECODE_PROBLEMS", 1, 10000000, &n, error) == EnvStatus::kInvalid) return false;
  s.decode_problems = static_cast<int>(n);
  n = s.decode_max_seqlen_k;
  if (env_int("FA_DECODE_MAX_SEQLEN_K", 1, 1 << 24, &n, error) == EnvStatus::kInvalid) return false;
  s.decode_max_seqlen_k = static_cast<int>(n);
  const EnvStatus decode_seed = env_u64("FA_DECODE_SEED", &s.decode_seed, error);
  if (decode_seed == EnvStatus::kInvalid) return false;
  s.decode_seed_set = decode_seed == EnvStatus::kOk;
  long long smem = 0;
  if (env_smem_limit(&smem, error) == EnvStatus::kInvalid) return false;
  g_settings = s;
  return true;
}

uint64_t base_seed() {
  return g_settings.base_seed;
}

uint64_t test_seed(const std::string& name) {
  uint64_t h = 1469598103934665603ULL ^ base_seed();  // FNV-1a over the name
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ULL;
  return h % 1000000007ULL + 1;
}

}  // namespace fa

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  std::string why;
  if (!fa::read_settings(&why)) {
    std::fprintf(stderr, "fa_gpu_tests: %s\n", why.c_str());
    return 1;
  }
  if (fa::test_gpu_available(&why)) {
    std::printf("GPU: %s; base seed %llu (FA_TEST_SEED=%llu reproduces this run)\n",
                fa::current_gpu().name.c_str(), static_cast<unsigned long long>(fa::base_seed()),
                static_cast<unsigned long long>(fa::base_seed()));
    for (int i = 0; i < fa_step_count(); ++i)
      if (fa_step_check_device(fa_step_name(i)) != FA_OK)
        std::printf("Skipping the tests of %s: %s\n", fa_step_name(i), fa_last_error());
  } else
    std::printf("No CUDA device: %s. Every GPU test will be skipped.\n", why.c_str());
  return RUN_ALL_TESTS();
}
