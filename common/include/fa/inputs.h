/// \file inputs.h
/// \brief The random inputs of a problem as pure functions of (seed, tensor, index), and the
/// fp16 / bf16 rounding, written once for the host (fa::make_problem()) and the device (the
/// fast path of fa::DeviceProblem), so that both make the same values bit for bit.
///
/// Element `index` of a contiguous [B, N, H, d] tensor (Q is tensor 0, K 1, V 2, dO 3) is
/// \f$ m \cdot u + o \f$ rounded to fp32 and then to the dtype, with \f$u\f$ uniform in (-1, 1)
/// from a counter-based generator (splitmix64's finalizer): no state, so neither the order of
/// the elements nor the threads that draw them change a value. The product and the sum are
/// rounded separately on both sides (no fused multiply-add), which is what makes the device
/// agree with the host.
#ifndef FA_INPUTS_H_
#define FA_INPUTS_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
/// Compiled for the host and, under nvcc, for the device too.
#define FA_HOST_DEVICE __host__ __device__
#else
#define FA_HOST_DEVICE
#endif

namespace fa {
namespace inputs {

/// splitmix64's finalizer: a bijective 64-bit mix.
FA_HOST_DEVICE inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// Uniform in (-1, 1), a pure function of (seed, tensor, index).
FA_HOST_DEVICE inline double uniform_pm1(uint64_t seed, uint64_t tensor, uint64_t index) {
  constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;
  const uint64_t stream = mix64(seed * kGolden + (tensor + 1) * 0xd1b54a32d192ed03ull);
  const uint64_t bits = mix64(stream + (index + 1) * kGolden);
  const double unit = (static_cast<double>(bits >> 11) + 0.5) * 0x1.0p-53;  // (0, 1), exact
  return 2.0 * unit - 1.0;                                                  // exact
}

/// \f$ m \cdot u + o \f$ in double (two roundings, never fused), then to fp32.
FA_HOST_DEVICE inline float value(uint64_t seed, uint64_t tensor, uint64_t index, double magnitude,
                                  double offset) {
  const double u = uniform_pm1(seed, tensor, index);
#if defined(__CUDA_ARCH__)
  return __double2float_rn(__dadd_rn(__dmul_rn(magnitude, u), offset));
#else
  volatile double product = magnitude * u;  // volatile: the compiler may not fuse it into an FMA
  return static_cast<float>(product + offset);
#endif
}

/// The bits of a float.
FA_HOST_DEVICE inline uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

/// Rounds the low `shift` bits of `value` away, to nearest, ties to even.
FA_HOST_DEVICE inline uint32_t shift_round_even(uint32_t value, int shift) {
  const uint32_t kept = value >> shift;
  const uint32_t rest = value & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  return kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
}

/// The fp16 bits of `x`, rounded to nearest even (subnormals, infinities and NaN included).
FA_HOST_DEVICE inline uint16_t float_to_half_bits(float x) {
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

/// The bf16 bits of `x`, rounded to nearest even.
FA_HOST_DEVICE inline uint16_t float_to_bf16_bits(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: quiet it, keep sign and top payload bits
    return static_cast<uint16_t>((u >> 16) | 0x0040u);
  }
  // bf16 is the top half of a float: round the low 16 bits to nearest even. Overflow carries
  // into the exponent and gives infinity, as it should.
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/// The 16 bits of element `index` of `tensor`: value() rounded to bf16 (`bf16`) or fp16.
FA_HOST_DEVICE inline uint16_t element_bits(bool bf16, uint64_t seed, uint64_t tensor,
                                            uint64_t index, double magnitude, double offset) {
  const float v = value(seed, tensor, index, magnitude, offset);
  return bf16 ? float_to_bf16_bits(v) : float_to_half_bits(v);
}

}  // namespace inputs
}  // namespace fa

#endif  // FA_INPUTS_H_
