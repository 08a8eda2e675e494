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

#include "fa/inputs.h"

namespace fa {
namespace {

float bits_float(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
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

float bf16_bits_to_float(uint16_t b) {
  return bits_float(static_cast<uint32_t>(b) << 16);
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
      data[i] = from_bits(
          dtype, inputs::element_bits(dtype == FA_BF16, seed, tensor, i, magnitude, offset));
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
  std::vector<float>* tensors[kInputTensors] = {&p.q, &p.k, &p.v, &p.d_o};
  for (int t = 0; t < kInputTensors; ++t) {
    double magnitude = 0, offset = 0;
    input_distribution(spec, t, &magnitude, &offset);
    fill(*tensors[t], t == 0 || t == 3 ? q_size : kv_size, shape.dtype, spec.seed, t, magnitude,
         offset);
  }
  return p;
}

void input_distribution(const InputSpec& spec, int tensor, double* magnitude, double* offset) {
  const bool qk = tensor == 0 || tensor == 1;
  *magnitude = qk ? spec.magnitude : 1.0;
  *offset = qk ? 0.0 : spec.v_offset;
}

float round_to(fa_dtype dtype, float x) {
  return from_bits(dtype, to_bits(dtype, x));
}

uint16_t to_bits(fa_dtype dtype, float x) {
  return dtype == FA_BF16 ? inputs::float_to_bf16_bits(x) : inputs::float_to_half_bits(x);
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
