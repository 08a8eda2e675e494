/// \file test_api_validation.cpp
/// \brief Every parameter the C API rejects, with its message; no GPU needed.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>

#include "fa/api.h"

namespace {

alignas(16) uint16_t g_buffer[64];

fa_tensor view(int seqlen, int heads, int d) {
  fa_tensor t{g_buffer, 0, 0, 0};
  t.head_stride = d;
  t.row_stride = static_cast<int64_t>(heads) * d;
  t.batch_stride = t.row_stride * seqlen;
  return t;
}

fa_fwd_args valid_forward() {
  fa_fwd_args a{};
  a.dtype = FA_FP16;
  a.batch = 2;
  a.heads = 8;
  a.heads_kv = 2;
  a.seqlen_q = 100;
  a.seqlen_k = 200;
  a.head_dim = 64;
  a.scale = 0.125f;
  a.causal = 1;
  a.q = a.o = view(100, 8, 64);
  a.k = a.v = view(200, 2, 64);
  a.lse = reinterpret_cast<float*>(g_buffer);
  return a;
}

fa_bwd_args valid_backward() {
  fa_bwd_args b{};
  b.fwd = valid_forward();
  b.d_o = b.dq = b.fwd.q;
  b.dk = b.dv = b.fwd.k;
  return b;
}

/// The first registered step (every build has 01_naive).
const char* first_step() {
  return fa_step_name(0);
}

/// Expects `mutate` applied to a valid problem to be rejected with `status` and a message
/// containing `needle`.
void expect_rejected(const std::function<void(fa_fwd_args&)>& mutate, fa_status status,
                     const std::string& needle) {
  fa_fwd_args a = valid_forward();
  mutate(a);
  EXPECT_EQ(fa_check_forward(first_step(), &a), status) << fa_last_error();
  EXPECT_NE(std::string(fa_last_error()).find(needle), std::string::npos)
      << "message was: " << fa_last_error();
}

TEST(ApiValidation, ValidProblemPasses) {
  fa_fwd_args a = valid_forward();
  EXPECT_EQ(fa_check_forward(first_step(), &a), FA_OK) << fa_last_error();
  EXPECT_STREQ(fa_last_error(), "");
}

TEST(ApiValidation, RegistryListsStepsInOrder) {
  ASSERT_GE(fa_step_count(), 1);
  EXPECT_STREQ(fa_step_name(0), "01_naive");
  EXPECT_EQ(fa_step_name(fa_step_count()), nullptr);
  EXPECT_EQ(fa_step_name(-1), nullptr);
  for (int i = 0; i < fa_step_count(); ++i) {
    const char* name = fa_step_name(i);
    ASSERT_NE(name, nullptr);
    EXPECT_NE(fa_step_summary(name), nullptr);
    EXPECT_EQ(fa_step_supports_head_dim(name, 64), 1) << name;
    EXPECT_EQ(fa_step_supports_head_dim(name, 128), 1) << name;
    if (i > 0) EXPECT_LT(std::string(fa_step_name(i - 1)), std::string(name));
  }
}

TEST(ApiValidation, UnknownStep) {
  fa_fwd_args a = valid_forward();
  EXPECT_EQ(fa_check_forward("99_nope", &a), FA_ERR_UNKNOWN_STEP);
  EXPECT_NE(std::string(fa_last_error()).find("unknown step '99_nope'"), std::string::npos);
  EXPECT_NE(std::string(fa_last_error()).find("01_naive"), std::string::npos);
  EXPECT_EQ(fa_step_has_backward("99_nope"), -1);
  EXPECT_EQ(fa_step_supports_head_dim("99_nope", 64), -1);
  EXPECT_EQ(fa_step_summary("99_nope"), nullptr);
}

TEST(ApiValidation, NullArgs) {
  EXPECT_EQ(fa_check_forward(first_step(), nullptr), FA_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fa_last_error()).find("args is NULL"), std::string::npos);
}

TEST(ApiValidation, UnsupportedDtype) {
  expect_rejected([](fa_fwd_args& a) { a.dtype = static_cast<fa_dtype>(7); }, FA_ERR_UNSUPPORTED,
                  "dtype 7 is not supported");
}

TEST(ApiValidation, NonPositiveSizes) {
  expect_rejected([](fa_fwd_args& a) { a.batch = 0; }, FA_ERR_INVALID_ARGUMENT,
                  "batch must be >= 1 (got 0)");
  expect_rejected([](fa_fwd_args& a) { a.heads = -3; }, FA_ERR_INVALID_ARGUMENT,
                  "heads must be >= 1 (got -3)");
  expect_rejected([](fa_fwd_args& a) { a.heads_kv = 0; }, FA_ERR_INVALID_ARGUMENT,
                  "heads_kv must be >= 1");
  expect_rejected([](fa_fwd_args& a) { a.seqlen_q = 0; }, FA_ERR_INVALID_ARGUMENT,
                  "seqlen_q must be >= 1");
  expect_rejected([](fa_fwd_args& a) { a.seqlen_k = -1; }, FA_ERR_INVALID_ARGUMENT,
                  "seqlen_k must be >= 1");
  expect_rejected([](fa_fwd_args& a) { a.head_dim = 0; }, FA_ERR_INVALID_ARGUMENT,
                  "head_dim must be >= 1");
}

TEST(ApiValidation, TooManyHeadsOrBatches) {
  expect_rejected([](fa_fwd_args& a) { a.batch = 70000; }, FA_ERR_UNSUPPORTED, "<= 65535");
}

TEST(ApiValidation, HeadsNotDivisibleByHeadsKv) {
  expect_rejected([](fa_fwd_args& a) { a.heads_kv = 3; }, FA_ERR_INVALID_ARGUMENT,
                  "heads (8) must be a multiple of heads_kv (3)");
}

TEST(ApiValidation, UnsupportedHeadDim) {
  expect_rejected(
      [](fa_fwd_args& a) {
        a.head_dim = 260;
        a.q.head_stride = a.k.head_stride = a.v.head_stride = a.o.head_stride = 264;
        a.q.row_stride = a.k.row_stride = a.v.row_stride = a.o.row_stride = 8 * 264;
      },
      FA_ERR_UNSUPPORTED, "head_dim 260 is not supported by step 01_naive");
}

TEST(ApiValidation, BadScale) {
  expect_rejected([](fa_fwd_args& a) { a.scale = 0.f; }, FA_ERR_INVALID_ARGUMENT,
                  "scale must be finite and > 0");
  expect_rejected([](fa_fwd_args& a) { a.scale = -1.f; }, FA_ERR_INVALID_ARGUMENT,
                  "scale must be finite and > 0");
  expect_rejected([](fa_fwd_args& a) { a.scale = std::nanf(""); }, FA_ERR_INVALID_ARGUMENT,
                  "scale must be finite and > 0");
}

TEST(ApiValidation, BadCausalFlag) {
  expect_rejected([](fa_fwd_args& a) { a.causal = 2; }, FA_ERR_INVALID_ARGUMENT,
                  "causal must be 0 or 1 (got 2)");
}

TEST(ApiValidation, NullPointers) {
  expect_rejected([](fa_fwd_args& a) { a.q.ptr = nullptr; }, FA_ERR_INVALID_ARGUMENT,
                  "q.ptr is NULL");
  expect_rejected([](fa_fwd_args& a) { a.k.ptr = nullptr; }, FA_ERR_INVALID_ARGUMENT,
                  "k.ptr is NULL");
  expect_rejected([](fa_fwd_args& a) { a.v.ptr = nullptr; }, FA_ERR_INVALID_ARGUMENT,
                  "v.ptr is NULL");
  expect_rejected([](fa_fwd_args& a) { a.o.ptr = nullptr; }, FA_ERR_INVALID_ARGUMENT,
                  "o.ptr is NULL");
}

TEST(ApiValidation, MisalignedPointers) {
  expect_rejected([](fa_fwd_args& a) { a.v.ptr = g_buffer + 1; }, FA_ERR_INVALID_ARGUMENT, "v.ptr");
  expect_rejected([](fa_fwd_args& a) { a.o.ptr = g_buffer + 4; }, FA_ERR_INVALID_ARGUMENT,
                  "is not 16-byte aligned");
  expect_rejected([](fa_fwd_args& a) { a.lse = reinterpret_cast<float*>(g_buffer + 2); },
                  FA_ERR_INVALID_ARGUMENT, "lse");
}

TEST(ApiValidation, BadStrides) {
  expect_rejected([](fa_fwd_args& a) { a.q.row_stride = 8 * 64 + 4; }, FA_ERR_INVALID_ARGUMENT,
                  "q.row_stride (516) must be a multiple of 8 elements");
  expect_rejected([](fa_fwd_args& a) { a.k.batch_stride = -8; }, FA_ERR_INVALID_ARGUMENT,
                  "k.batch_stride must be >= 0");
  expect_rejected([](fa_fwd_args& a) { a.v.head_stride = 32; }, FA_ERR_INVALID_ARGUMENT,
                  "v.head_stride (32) is smaller than head_dim (64)");
  expect_rejected([](fa_fwd_args& a) { a.o.row_stride = 56; }, FA_ERR_INVALID_ARGUMENT,
                  "o.row_stride (56) is smaller than head_dim (64)");
}

TEST(ApiValidation, LseIsOptionalForTheForward) {
  fa_fwd_args a = valid_forward();
  a.lse = nullptr;
  EXPECT_EQ(fa_check_forward(first_step(), &a), FA_OK) << fa_last_error();
}

TEST(ApiValidation, BackwardNeedsAStepWithOne) {
  for (int i = 0; i < fa_step_count(); ++i) {
    const char* step = fa_step_name(i);
    fa_bwd_args b = valid_backward();
    const fa_status st = fa_check_backward(step, &b);
    if (fa_step_has_backward(step) == 1) {
      EXPECT_EQ(st, FA_OK) << step << ": " << fa_last_error();
    } else {
      EXPECT_EQ(st, FA_ERR_UNSUPPORTED) << step;
      EXPECT_NE(std::string(fa_last_error()).find("has no backward pass"), std::string::npos);
    }
  }
}

TEST(ApiValidation, BackwardArguments) {
  const char* step = nullptr;
  for (int i = 0; i < fa_step_count(); ++i)
    if (fa_step_has_backward(fa_step_name(i)) == 1) step = fa_step_name(i);
  if (step == nullptr) GTEST_SKIP() << "no registered step has a backward pass yet";
  fa_bwd_args b = valid_backward();
  b.fwd.lse = nullptr;
  EXPECT_EQ(fa_check_backward(step, &b), FA_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fa_last_error()).find("fwd.lse is NULL"), std::string::npos);
  b = valid_backward();
  b.dk.ptr = nullptr;
  EXPECT_EQ(fa_check_backward(step, &b), FA_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fa_last_error()).find("dk.ptr is NULL"), std::string::npos);
  b = valid_backward();
  b.d_o.row_stride = 12;
  EXPECT_EQ(fa_check_backward(step, &b), FA_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fa_last_error()).find("d_o.row_stride"), std::string::npos);
  b = valid_backward();
  b.deterministic = 5;
  EXPECT_EQ(fa_check_backward(step, &b), FA_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fa_last_error()).find("deterministic must be 0 or 1"), std::string::npos);
}

TEST(ApiValidation, ForwardWithoutGpuSaysSo) {
  // On a machine without a GPU a valid call must fail cleanly with FA_ERR_NO_DEVICE; with a
  // GPU this test has nothing to show (the GPU suite runs the kernels).
  int count = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess && count > 0) GTEST_SKIP() << "a GPU is present";
  fa_fwd_args a = valid_forward();
  EXPECT_EQ(fa_forward(first_step(), &a, nullptr), FA_ERR_NO_DEVICE);
  EXPECT_NE(std::string(fa_last_error()).find("no CUDA device"), std::string::npos)
      << fa_last_error();
}

TEST(ApiValidation, StatusNames) {
  EXPECT_STREQ(fa_status_name(FA_OK), "FA_OK");
  EXPECT_STREQ(fa_status_name(FA_ERR_UNSUPPORTED), "FA_ERR_UNSUPPORTED");
  EXPECT_STREQ(fa_status_name(static_cast<fa_status>(99)), "FA_ERR_UNKNOWN_STATUS");
}

}  // namespace
