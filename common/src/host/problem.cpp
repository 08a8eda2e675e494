/// \file problem.cpp
/// \brief Problem shapes, seeded inputs and the fp16 / bf16 bit conversions (no CUDA headers).
#include "fa/problem.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace fa {
namespace {

uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

float bits_float(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

/// Rounds the low `shift` bits of `value` away, to nearest, ties to even.
uint32_t shift_round_even(uint32_t value, int shift) {
  const uint32_t kept = value >> shift;
  const uint32_t rest = value & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  return kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
}

uint16_t float_to_half_bits(float x) {
  const uint32_t u = float_bits(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs_bits = u & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) {  // NaN: keep it quiet and keep the top payload bits
    return static_cast<uint16_t>(sign | 0x7e00u | ((abs_bits >> 13) & 0x3ffu));
  }
  // 65520 = 0x477ff000 is the tie between 65504 (odd mantissa) and 2^16: it and everything
  // above round to infinity.
  if (abs_bits >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  const int exponent = static_cast<int>(abs_bits >> 23);  // biased by 127
  if (exponent >= 113) {                                  // fp16 normal: 2^-14 and above
    // A carry out of the mantissa correctly bumps the exponent (65504 cannot carry: see above).
    const uint32_t half =
        (static_cast<uint32_t>(exponent - 112) << 10) | (abs_bits & 0x7fffffu) >> 13;
    const uint32_t rest = abs_bits & 0x1fffu;
    const uint32_t rounded =
        half + ((rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ? 1u : 0u);
    return static_cast<uint16_t>(sign | rounded);
  }
  // fp16 subnormal: value = m * 2^-24. Below 2^-25 (and the tie at 2^-25) it rounds to zero.
  if (exponent < 102) return sign;
  const uint32_t mantissa = (abs_bits & 0x7fffffu) | 0x800000u;
  // value * 2^24 = mantissa * 2^(exponent - 126); the shift is 14..24. Rounding up to 0x400
  // gives the smallest normal, which is the right bit pattern.
  return static_cast<uint16_t>(sign | shift_round_even(mantissa, 126 - exponent));
}

float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return bits_float(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  if (exponent != 0) return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
  // Zero or subnormal: m * 2^-24 is exact in float.
  const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  return sign ? -magnitude : magnitude;
}

uint16_t float_to_bf16_bits(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: quiet it, keep sign and top payload bits
    return static_cast<uint16_t>((u >> 16) | 0x0040u);
  }
  // bf16 is the top half of a float: round the low 16 bits to nearest even. Overflow carries
  // into the exponent and gives infinity, as it should.
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

float bf16_bits_to_float(uint16_t b) {
  return bits_float(static_cast<uint32_t>(b) << 16);
}

/// splitmix64's finalizer: a bijective 64-bit mix.
uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;

/// Uniform in (-1, 1), a pure function of (seed, tensor, index): no state, so the values do not
/// depend on the order or the threads that draw them.
double uniform_pm1(uint64_t seed, uint64_t tensor, uint64_t index) {
  const uint64_t stream = mix64(seed * kGolden + (tensor + 1) * 0xd1b54a32d192ed03ull);
  const uint64_t bits = mix64(stream + (index + 1) * kGolden);
  const double unit = (static_cast<double>(bits >> 11) + 0.5) * 0x1.0p-53;  // (0, 1)
  return 2.0 * unit - 1.0;
}

/// Runs fn(begin, end) over [0, n) in chunks on the machine's cores.
template <typename Fn>
void parallel_chunks(size_t n, Fn fn) {
  constexpr size_t kChunk = 1 << 16;
  const size_t chunks = (n + kChunk - 1) / kChunk;
  const size_t threads =
      std::min<size_t>(chunks, std::max(1u, std::thread::hardware_concurrency()));
  if (threads <= 1) {
    fn(size_t{0}, n);
    return;
  }
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t c = next++; c < chunks; c = next++) fn(c * kChunk, std::min(n, (c + 1) * kChunk));
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
}

void fill(std::vector<float>& out, size_t n, fa_dtype dtype, uint64_t seed, uint64_t tensor,
          double magnitude, double offset) {
  out.resize(n);
  float* data = out.data();
  parallel_chunks(n, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      const double value = magnitude * uniform_pm1(seed, tensor, i) + offset;
      data[i] = round_to(dtype, static_cast<float>(value));
    }
  });
}

}  // namespace

float ProblemShape::effective_scale() const {
  return scale != 0.f ? scale : 1.f / std::sqrt(static_cast<float>(head_dim));
}

ProblemShape make_shape(int batch, int heads, int heads_kv, int seqlen_q, int seqlen_k,
                        int head_dim, bool causal, fa_dtype dtype) {
  ProblemShape s;
  s.dtype = dtype;
  s.batch = batch;
  s.heads = heads;
  s.heads_kv = heads_kv;
  s.seqlen_q = seqlen_q;
  s.seqlen_k = seqlen_k;
  s.head_dim = head_dim;
  s.causal = causal;
  return s;
}

fa_fwd_args ProblemShape::args() const {
  fa_fwd_args a{};
  a.dtype = dtype;
  a.batch = batch;
  a.heads = heads;
  a.heads_kv = heads_kv;
  a.seqlen_q = seqlen_q;
  a.seqlen_k = seqlen_k;
  a.head_dim = head_dim;
  a.scale = effective_scale();
  a.causal = causal ? 1 : 0;
  return a;
}

std::string ProblemShape::describe() const {
  std::ostringstream out;
  out << "B=" << batch << " H=" << heads << "/" << heads_kv << " Nq=" << seqlen_q
      << " Nk=" << seqlen_k << " d=" << head_dim << " " << dtype_name(dtype);
  if (scale != 0.f) out << " scale=" << scale;
  if (causal) out << " causal";
  return out.str();
}

size_t HostProblem::q_index(int b, int s, int h, int c) const {
  return ((static_cast<size_t>(b) * shape.seqlen_q + s) * shape.heads + h) * shape.head_dim + c;
}

size_t HostProblem::kv_index(int b, int s, int h, int c) const {
  return ((static_cast<size_t>(b) * shape.seqlen_k + s) * shape.heads_kv + h) * shape.head_dim + c;
}

size_t HostProblem::lse_index(int b, int h, int i) const {
  return (static_cast<size_t>(b) * shape.heads + h) * shape.seqlen_q + i;
}

HostProblem make_problem(const ProblemShape& shape, const InputSpec& spec) {
  if (shape.batch <= 0 || shape.heads <= 0 || shape.heads_kv <= 0 || shape.seqlen_q <= 0 ||
      shape.seqlen_k <= 0 || shape.head_dim <= 0) {
    throw std::invalid_argument("make_problem: sizes must be positive (" + shape.describe() + ")");
  }
  if (shape.heads % shape.heads_kv != 0) {
    throw std::invalid_argument("make_problem: heads_kv must divide heads (" + shape.describe() +
                                ")");
  }
  HostProblem p;
  p.shape = shape;
  p.spec = spec;
  const size_t q_size =
      static_cast<size_t>(shape.batch) * shape.seqlen_q * shape.heads * shape.head_dim;
  const size_t kv_size =
      static_cast<size_t>(shape.batch) * shape.seqlen_k * shape.heads_kv * shape.head_dim;
  // Tensor ids 0..3 give each tensor its own stream of the generator.
  fill(p.q, q_size, shape.dtype, spec.seed, 0, spec.magnitude, 0.0);
  fill(p.k, kv_size, shape.dtype, spec.seed, 1, spec.magnitude, 0.0);
  fill(p.v, kv_size, shape.dtype, spec.seed, 2, 1.0, spec.v_offset);
  fill(p.d_o, q_size, shape.dtype, spec.seed, 3, 1.0, spec.v_offset);
  return p;
}

float round_to(fa_dtype dtype, float x) {
  return from_bits(dtype, to_bits(dtype, x));
}

uint16_t to_bits(fa_dtype dtype, float x) {
  return dtype == FA_BF16 ? float_to_bf16_bits(x) : float_to_half_bits(x);
}

float from_bits(fa_dtype dtype, uint16_t bits) {
  return dtype == FA_BF16 ? bf16_bits_to_float(bits) : half_bits_to_float(bits);
}

const char* dtype_name(fa_dtype dtype) {
  return dtype == FA_BF16 ? "bf16" : "fp16";
}

bool parse_dtype(const std::string& text, fa_dtype* out) {
  std::string lower(text);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  fa_dtype parsed;
  if (lower == "fp16" || lower == "half" || lower == "float16" || lower == "f16") {
    parsed = FA_FP16;
  } else if (lower == "bf16" || lower == "bfloat16") {
    parsed = FA_BF16;
  } else {
    return false;
  }
  if (out) *out = parsed;
  return true;
}

}  // namespace fa
