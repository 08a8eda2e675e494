/// \file problem.h
/// \brief A host copy of one attention problem: sizes and seeded random inputs.
#ifndef FA_PROBLEM_H_
#define FA_PROBLEM_H_

#include <cstdint>
#include <string>
#include <vector>

#include "fa/api.h"

namespace fa {

/// Sizes and options of one problem (no data).
struct ProblemShape {
  fa_dtype dtype = FA_FP16;  ///< element type of Q, K, V, dO and the outputs
  int batch = 1;             ///< B
  int heads = 1;             ///< H, query heads
  int heads_kv = 1;          ///< H_kv, key/value heads; divides H
  int seqlen_q = 1;          ///< N_q
  int seqlen_k = 1;          ///< N_k
  int head_dim = 64;         ///< d
  float scale = 0.f;         ///< 0 means the usual 1/sqrt(head_dim); see effective_scale()
  bool causal = false;       ///< bottom-right aligned causal mask

  /// The softmax scale actually used: `scale`, or \f$1/\sqrt{d}\f$ when it is 0.
  float effective_scale() const;
  /// "B=1 H=16/16 Nq=4096 Nk=4096 d=128 fp16 causal" (for logs and failure messages).
  std::string describe() const;
  /// The API arguments for this shape: sizes, dtype, scale and mask set; tensors and lse left
  /// empty for the caller to fill.
  fa_fwd_args args() const;
};

/// A shape from its sizes and options, e.g. `make_shape(1, 16, 16, 4096, 4096, 128, true)`;
/// the scale stays 0 (the usual \f$1/\sqrt{d}\f$). Nothing is checked here: make_problem()
/// and the C API check the sizes.
ProblemShape make_shape(int batch, int heads, int heads_kv, int seqlen_q, int seqlen_k,
                        int head_dim, bool causal = false, fa_dtype dtype = FA_FP16);

/// How the random inputs are drawn.
struct InputSpec {
  uint64_t seed = 1;  ///< the same seed gives the same inputs everywhere
  /// Q and K are uniform in [-magnitude, magnitude]. Large values (50+) test softmax stability.
  float magnitude = 1.f;
  /// V and dO are uniform in [-1, 1] plus this offset, so that O's mean is not 0 and relative
  /// errors stay meaningful.
  float v_offset = 0.5f;
};

/// A problem with its inputs on the host, contiguous BSHD, stored as float values that are
/// exactly representable in the problem's dtype (the device copy holds the same numbers).
struct HostProblem {
  ProblemShape shape;      ///< sizes and options
  InputSpec spec;          ///< how the inputs were drawn
  std::vector<float> q;    ///< [B, Nq, H, d]
  std::vector<float> k;    ///< [B, Nk, Hkv, d]
  std::vector<float> v;    ///< [B, Nk, Hkv, d]
  std::vector<float> d_o;  ///< [B, Nq, H, d], the backward's incoming gradient

  /// Index of element (b, s, h, c) in q, d_o or an output like o or dq.
  size_t q_index(int b, int s, int h, int c) const;
  /// Index of element (b, s, h, c) in k, v, dk or dv (h is a key/value head).
  size_t kv_index(int b, int s, int h, int c) const;
  /// Index of (b, h, i) in an lse array [B, H, Nq].
  size_t lse_index(int b, int h, int i) const;
};

/// The input tensors in the generator's order: Q 0, K 1, V 2, dO 3 (each its own stream).
constexpr int kInputTensors = 4;

/// How input tensor `tensor` (0..3, see kInputTensors) is drawn from `spec`: uniform in
/// \f$[-m, m]\f$ plus an offset (Q, K: the magnitude, no offset; V, dO: magnitude 1 and
/// v_offset). fa/inputs.h draws each element; the host and the device share both.
void input_distribution(const InputSpec& spec, int tensor, double* magnitude, double* offset);

/// Draws a problem's inputs from `spec` (a counter-based generator, fa/inputs.h: the same seed
/// gives the same inputs on every machine, for any thread count, and on the GPU), rounded to
/// the shape's dtype.
/// Throws std::invalid_argument for a non-positive size or heads_kv not dividing heads.
HostProblem make_problem(const ProblemShape& shape, const InputSpec& spec);

/// Rounds a float to the nearest fp16 / bf16 value (round to nearest even) and back.
float round_to(fa_dtype dtype, float x);
/// The 16 bits of `x` rounded to `dtype`.
uint16_t to_bits(fa_dtype dtype, float x);
/// The float value of 16 bits of `dtype`.
float from_bits(fa_dtype dtype, uint16_t bits);
/// "fp16" or "bf16".
const char* dtype_name(fa_dtype dtype);
/// Parses "fp16"/"bf16" (also "half", "bfloat16"); false if unknown.
bool parse_dtype(const std::string& text, fa_dtype* out);

}  // namespace fa

#endif  // FA_PROBLEM_H_
