/// \file test_api_validation.cpp
/// \brief Every parameter the C API rejects, with its message; no GPU needed.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <functional>
#include <string>

#include "fa/api.h"

namespace {

alignas(16) uint16_t g_buffer[64];

/// A fake, never dereferenced, 16-byte aligned device address; `slot` n is 4 GiB after n - 1,
/// so tensors in different slots never overlap.
void* fake(int slot, int64_t offset_elements = 0) {
  return reinterpret_cast<void*>((uintptr_t{1} << 44) + (static_cast<uintptr_t>(slot) << 32) +
                                 2 * offset_elements);
}

fa_tensor view(int slot, int seqlen, int heads, int d) {
  fa_tensor t{fake(slot), 0, 0, 0};
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
  a.q = view(0, 100, 8, 64);
  a.k = view(1, 200, 2, 64);
  a.v = view(2, 200, 2, 64);
  a.o = view(3, 100, 8, 64);
  a.lse = static_cast<float*>(fake(4));
  return a;
}

fa_bwd_args valid_backward() {
  fa_bwd_args b{};
  b.fwd = valid_forward();
  b.d_o = view(5, 100, 8, 64);
  b.dq = view(6, 100, 8, 64);
  b.dk = view(7, 200, 2, 64);
  b.dv = view(8, 200, 2, 64);
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
  // The kernels multiply scores by scale * log2(e) in fp32: it must be a normal fp32 number.
  for (float scale : {0.f, -0.f, -1.f, std::nanf(""), INFINITY, 1e-40f /* subnormal */,
                      3e38f /* * log2(e) overflows */, FLT_MAX})
    expect_rejected([scale](fa_fwd_args& a) { a.scale = scale; }, FA_ERR_INVALID_ARGUMENT,
                    "scale must be finite and > 0, from 1.18e-38 to 2.36e+38");
  for (float scale : {FLT_MIN, 1e-20f, 0.088f, 1.f, 1e30f, 2.3e38f}) {
    fa_fwd_args a = valid_forward();
    a.scale = scale;
    EXPECT_EQ(fa_check_forward(first_step(), &a), FA_OK) << scale << ": " << fa_last_error();
  }
}

TEST(ApiValidation, SizesTooLargeForTheKernelsArithmetic) {
  expect_rejected(
      [](fa_fwd_args& a) {
        a.seqlen_q = (1 << 30) + 1;
        a.q.batch_stride = a.o.batch_stride = a.q.row_stride * a.seqlen_q;
      },
      FA_ERR_UNSUPPORTED, "must be <= 1073741824");
  expect_rejected([](fa_fwd_args& a) { a.seqlen_k = 2147483647; }, FA_ERR_UNSUPPORTED,
                  "seqlen_k (2147483647) must be <= 1073741824");
  expect_rejected([](fa_fwd_args& a) { a.k.batch_stride = int64_t{1} << 62; }, FA_ERR_UNSUPPORTED,
                  "k spans more than 2^62 elements");
  expect_rejected(
      [](fa_fwd_args& a) {
        a.batch = a.heads = 65535;
        a.heads_kv = 1;
        a.seqlen_q = a.seqlen_k = 1 << 30;
      },
      FA_ERR_UNSUPPORTED, "more than 2^62 scores");
}

// Outputs are written from many threads while the inputs are read: they may not share memory
// with themselves, each other or an input. Views that interleave without touching are fine.
TEST(ApiValidation, OutputsThatShareMemory) {
  expect_rejected([](fa_fwd_args& a) { a.o = a.q; }, FA_ERR_INVALID_ARGUMENT,
                  "o overlaps the input q in memory");
  expect_rejected([](fa_fwd_args& a) { a.o.ptr = fake(0, 99 * 8 * 64); },  // q's last row
                  FA_ERR_INVALID_ARGUMENT, "o overlaps the input q");
  expect_rejected([](fa_fwd_args& a) { a.o.batch_stride = 0; }, FA_ERR_INVALID_ARGUMENT,
                  "o.batch_stride is 0 with batch = 2: an output cannot be broadcast");
  expect_rejected([](fa_fwd_args& a) { a.o.row_stride = 64; }, FA_ERR_INVALID_ARGUMENT,
                  "make two of its elements share memory");  // row s + 1 = head h + 1
  expect_rejected([](fa_fwd_args& a) { a.lse = static_cast<float*>(fake(3, 8)); },
                  FA_ERR_INVALID_ARGUMENT, "o and lse overlap in memory");
  expect_rejected([](fa_fwd_args& a) { a.o.ptr = fake(2, 64); }, FA_ERR_INVALID_ARGUMENT,
                  "o overlaps the input v");
  // Inputs may share memory: q, k and v all the same tensor (self-attention on one buffer).
  fa_fwd_args a = valid_forward();
  a.heads_kv = a.heads;
  a.seqlen_k = a.seqlen_q;
  a.k = a.v = a.q;
  EXPECT_EQ(fa_check_forward(first_step(), &a), FA_OK) << fa_last_error();
}

TEST(ApiValidation, InterleavedViewsOfOneBufferAreDisjoint) {
  // q, k, v, o as slices of one [B, N, 4, H, d] buffer: every view has the strides of the whole,
  // and they interleave row by row without sharing a byte.
  const int B = 2, N = 100, H = 8, d = 64;
  fa_fwd_args a = valid_forward();
  a.heads_kv = H;
  a.seqlen_k = N;
  fa_tensor packed{fake(0), int64_t{N} * 4 * H * d, 4 * H * d, d};
  fa_tensor* views[4] = {&a.q, &a.k, &a.v, &a.o};
  for (int i = 0; i < 4; ++i) {
    *views[i] = packed;
    views[i]->ptr = fake(0, i * H * d);
  }
  EXPECT_EQ(fa_check_forward(first_step(), &a), FA_OK) << fa_last_error();
  // Heads interleaved: o takes the odd heads of a [B, N, 2H, d] buffer whose even heads are q.
  a = valid_forward();
  a.q = {fake(0), int64_t{N} * 2 * H * d, 2 * H * d, 2 * d};
  a.o = a.q;
  a.o.ptr = fake(0, d);
  EXPECT_EQ(fa_check_forward(first_step(), &a), FA_OK) << fa_last_error();
  a.o.ptr = fake(0, 2 * d);  // now o's head h is q's head h + 1
  EXPECT_EQ(fa_check_forward(first_step(), &a), FA_ERR_INVALID_ARGUMENT);
  // The backward's gradients as slices of one [B, N, H + 2 Hkv, d] buffer (packed GQA).
  const int Hkv = 2, W = H + 2 * Hkv;
  fa_bwd_args b = valid_backward();
  b.fwd.seqlen_k = N;
  b.fwd.k = view(1, N, Hkv, d);
  b.fwd.v = view(2, N, Hkv, d);
  const fa_tensor grads{fake(9), int64_t{N} * W * d, W * d, d};
  b.dq = b.dk = b.dv = grads;
  b.dk.ptr = fake(9, H * d);
  b.dv.ptr = fake(9, (H + Hkv) * d);
  const char* step = nullptr;
  for (int i = 0; i < fa_step_count(); ++i)
    if (fa_step_has_backward(fa_step_name(i)) == 1) step = fa_step_name(i);
  if (step == nullptr) return;
  EXPECT_EQ(fa_check_backward(step, &b), FA_OK) << fa_last_error();
  b.dv.ptr = fake(9, (H + 1) * d);  // dv's head 0 is dk's head 1
  EXPECT_EQ(fa_check_backward(step, &b), FA_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fa_last_error()).find("dk and dv overlap in memory"), std::string::npos)
      << fa_last_error();
  (void)B;
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
  (void)g_buffer;
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
  // Gradients may not share memory with the forward's tensors, dO or each other.
  const struct {
    std::function<void(fa_bwd_args&)> mutate;
    const char* needle;
  } overlaps[] = {
      {[](fa_bwd_args& g) { g.dq = g.d_o; }, "dq overlaps the input d_o in memory"},
      {[](fa_bwd_args& g) { g.dq = g.fwd.o; }, "dq overlaps the input o"},
      {[](fa_bwd_args& g) { g.dk = g.fwd.k; }, "dk overlaps the input k"},
      {[](fa_bwd_args& g) { g.dv = g.dk; }, "dk and dv overlap in memory"},
      {[](fa_bwd_args& g) { g.dv.ptr = fake(4); }, "dv overlaps the input fwd.lse"},
      {[](fa_bwd_args& g) { g.dq.batch_stride = 0; }, "dq.batch_stride is 0 with batch = 2"},
      {[](fa_bwd_args& g) { g.dk.row_stride = 0; }, "dk.row_stride (0) is smaller than head_dim"},
  };
  for (const auto& o : overlaps) {
    b = valid_backward();
    o.mutate(b);
    EXPECT_EQ(fa_check_backward(step, &b), FA_ERR_INVALID_ARGUMENT) << o.needle;
    EXPECT_NE(std::string(fa_last_error()).find(o.needle), std::string::npos) << fa_last_error();
  }
  // In the backward o and lse are inputs: a gradient may not overlap them, but they may
  // overlap the other inputs (read-only), e.g. d_o = o.
  b = valid_backward();
  b.d_o = b.fwd.o;
  EXPECT_EQ(fa_check_backward(step, &b), FA_OK) << fa_last_error();
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
