/// \file env.h
/// \brief Strict reading of the FA_* environment variables: a value that is set must parse
/// completely and lie in its range, or the caller gets a one-line error instead of a default.
///
/// Header-only (inline) so that libfa, the harness, the runners and the tests read a variable
/// by the same rule. An empty value counts as set (and invalid): `FA_RANDOM_PROBLEMS= cmd`
/// is a mistake, not a way to ask for the default.
#ifndef FA_ENV_H_
#define FA_ENV_H_

#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace fa {

/// The outcome of reading one environment variable.
enum class EnvStatus {
  kUnset,   ///< not in the environment: the caller uses its default
  kOk,      ///< set, parsed and within range
  kInvalid  ///< set but not a valid value: the error says why
};

/// Reads the integer `name` in [min, max] (decimal, optional sign, nothing else).
inline EnvStatus env_int(const char* name, long long min, long long max, long long* out,
                         std::string* error) {
  const char* text = std::getenv(name);
  if (text == nullptr) return EnvStatus::kUnset;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text, &end, 10);
  if (*text == '\0' || *end != '\0' || errno != 0 || v < min || v > max) {
    if (error)
      *error = std::string(name) + "=" + text + ": expected a whole number from " +
               std::to_string(min) + " to " + std::to_string(max);
    return EnvStatus::kInvalid;
  }
  *out = v;
  return EnvStatus::kOk;
}

/// Reads the unsigned 64-bit integer `name` (a seed: decimal digits only).
inline EnvStatus env_u64(const char* name, uint64_t* out, std::string* error) {
  const char* text = std::getenv(name);
  if (text == nullptr) return EnvStatus::kUnset;
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(text, &end, 10);
  if (*text < '0' || *text > '9' || *end != '\0' || errno != 0) {
    if (error)
      *error = std::string(name) + "=" + text +
               ": expected a whole number from 0 to 18446744073709551615";
    return EnvStatus::kInvalid;
  }
  *out = v;
  return EnvStatus::kOk;
}

/// Reads the finite number `name` in (min, max] (min excluded).
inline EnvStatus env_double(const char* name, double min, double max, double* out,
                            std::string* error) {
  const char* text = std::getenv(name);
  if (text == nullptr) return EnvStatus::kUnset;
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(text, &end);
  if (*text == '\0' || *end != '\0' || errno != 0 || !std::isfinite(v) || !(v > min) || v > max) {
    if (error) {
      char range[64];
      std::snprintf(range, sizeof range, "> %g and <= %g", min, max);
      *error = std::string(name) + "=" + text + ": expected a number " + range;
    }
    return EnvStatus::kInvalid;
  }
  *out = v;
  return EnvStatus::kOk;
}

/// FA_SMEM_LIMIT: the shared memory per block (bytes) a step that picks its tiles by it may
/// assume (see fa::smem_per_block_optin()). Unset: no limit.
inline EnvStatus env_smem_limit(long long* bytes, std::string* error) {
  const EnvStatus st = env_int("FA_SMEM_LIMIT", 1, INT_MAX, bytes, nullptr);
  if (st == EnvStatus::kInvalid && error)
    *error = std::string("FA_SMEM_LIMIT=") + std::getenv("FA_SMEM_LIMIT") +
             ": expected a positive number of bytes (e.g. 101376) up to " + std::to_string(INT_MAX);
  return st;
}

}  // namespace fa

#endif  // FA_ENV_H_
