// Host tests of fa/flops.h.
#include <gtest/gtest.h>

#include <algorithm>

#include "fa/flops.h"

namespace fa {
namespace {

TEST(UnmaskedPairs, HandValues) {
  EXPECT_EQ(unmasked_pairs(3, 5, false), 15);
  EXPECT_EQ(unmasked_pairs(4, 4, true), 10);  // 1 + 2 + 3 + 4
  EXPECT_EQ(unmasked_pairs(2, 5, true), 9);   // rows see 4 and 5 keys
  EXPECT_EQ(unmasked_pairs(5, 2, true), 3);   // rows see 0, 0, 0, 1, 2 keys
  EXPECT_EQ(unmasked_pairs(3, 1, true), 1);
  EXPECT_EQ(unmasked_pairs(1, 7, true), 7);  // the last row sees every key
  EXPECT_EQ(unmasked_pairs(0, 7, false), 0);
}

TEST(UnmaskedPairs, CausalSquareIsTriangle) {
  for (int64_t n : {1, 2, 17, 1024, 4096}) EXPECT_EQ(unmasked_pairs(n, n, true), n * (n + 1) / 2);
  const int64_t big = int64_t{1} << 20;  // needs 64 bits
  EXPECT_EQ(unmasked_pairs(big, big, true), big * (big + 1) / 2);
}

TEST(UnmaskedPairs, ClosedFormMatchesCountingLoop) {
  for (int64_t n_q = 1; n_q <= 40; ++n_q)
    for (int64_t n_k = 1; n_k <= 40; ++n_k) {
      int64_t count = 0;
      for (int64_t i = 0; i < n_q; ++i)
        for (int64_t j = 0; j < n_k; ++j) count += j <= i + n_k - n_q;
      ASSERT_EQ(unmasked_pairs(n_q, n_k, true), count) << n_q << "x" << n_k;
      ASSERT_EQ(unmasked_pairs(n_q, n_k, false), n_q * n_k);
    }
}

TEST(Flops, ForwardAndBackward) {
  EXPECT_EQ(forward_flops(1, 1, 4, 4, 64, false), 4.0 * 64 * 16);
  EXPECT_EQ(forward_flops(2, 16, 4096, 4096, 128, false), 4.0 * 2 * 16 * 4096.0 * 4096 * 128);
  EXPECT_EQ(forward_flops(2, 3, 5, 2, 64, true), 4.0 * 2 * 3 * 64 * 3);
  EXPECT_EQ(backward_flops(2, 3, 5, 2, 64, true), 2.5 * forward_flops(2, 3, 5, 2, 64, true));
  EXPECT_EQ(backward_flops(1, 1, 4, 4, 64, false), 2.5 * 4096);
  // Causal halves the work of a long square problem (plus the diagonal).
  const double ratio =
      forward_flops(1, 1, 8192, 8192, 64, true) / forward_flops(1, 1, 8192, 8192, 64, false);
  EXPECT_NEAR(ratio, 0.5, 1e-3);
}

TEST(KvBytes, KAndVReadOnce) {
  EXPECT_EQ(kv_bytes(1, 1, 1, 64), 2.0 * 2 * 64);
  // Decoding, batch 4, 8 K/V heads, 32K keys, d = 128: 537 MB.
  EXPECT_EQ(kv_bytes(4, 8, 32768, 128), 2.0 * 2 * 4 * 8 * 32768.0 * 128);
  const double big = kv_bytes(64, 32, 131072, 128);  // 137 GB: needs more than 32 bits
  EXPECT_EQ(big, 4.0 * 64 * 32 * 131072.0 * 128);
}

}  // namespace
}  // namespace fa
