/// \file flops.h
/// \brief Floating-point operations of attention, counted as the FlashAttention papers do.
#ifndef FA_FLOPS_H_
#define FA_FLOPS_H_

#include <cstdint>

namespace fa {

/// Query/key pairs that are not masked: \f$N_q N_k\f$, or under causal masking (bottom-right
/// aligned) \f$\sum_i \mathrm{clamp}(i + N_k - N_q + 1, 0, N_k)\f$.
int64_t unmasked_pairs(int64_t seqlen_q, int64_t seqlen_k, bool causal);

/// Forward FLOPs: \f$4 B H d\f$ times the unmasked pairs (two matrix products, 2 FLOPs per
/// multiply-add).
double forward_flops(int batch, int heads, int seqlen_q, int seqlen_k, int head_dim, bool causal);

/// Backward FLOPs: 2.5 times the forward (five matrix products instead of two).
double backward_flops(int batch, int heads, int seqlen_q, int seqlen_k, int head_dim, bool causal);

/// Bytes of K and V a forward pass must read, each element once: \f$2 B H_{kv} N_k d\f$
/// elements of 2 bytes (fp16, bf16). Under causal masking (bottom-right aligned) the last
/// query row sees every key, so the count does not depend on the mask. Decoding is bound by
/// this traffic, not by the FLOPs: the bench reports it per second beside TFLOP/s.
double kv_bytes(int batch, int heads_kv, int seqlen_k, int head_dim);

}  // namespace fa

#endif  // FA_FLOPS_H_
