/// \file flops.cpp
/// \brief FLOP counts as the FlashAttention papers count them.
#include "fa/flops.h"

#include <algorithm>

namespace fa {

int64_t unmasked_pairs(int64_t seqlen_q, int64_t seqlen_k, bool causal) {
  if (seqlen_q <= 0 || seqlen_k <= 0) return 0;
  if (!causal) return seqlen_q * seqlen_k;
  // Row i sees i + Nk - Nq + 1 keys, clamped below at 0 (never above Nk since i < Nq): the
  // counts are the consecutive integers first..Nk with first = max(Nk - Nq + 1, 1), so
  // the sum is Nk(Nk+1)/2 - (first-1) first / 2.
  const int64_t first = std::max<int64_t>(seqlen_k - seqlen_q + 1, 1);
  return seqlen_k * (seqlen_k + 1) / 2 - (first - 1) * first / 2;
}

double forward_flops(int batch, int heads, int seqlen_q, int seqlen_k, int head_dim, bool causal) {
  return 4.0 * batch * heads * head_dim *
         static_cast<double>(unmasked_pairs(seqlen_q, seqlen_k, causal));
}

double backward_flops(int batch, int heads, int seqlen_q, int seqlen_k, int head_dim, bool causal) {
  return 2.5 * forward_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal);
}

double kv_bytes(int batch, int heads_kv, int seqlen_k, int head_dim) {
  return 2.0 * 2.0 * batch * heads_kv * static_cast<double>(seqlen_k) * head_dim;
}

}  // namespace fa
