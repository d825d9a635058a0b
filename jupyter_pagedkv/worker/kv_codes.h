// A quantized KV cache's codes widened to float (kv_cache_dtype "int8" / "fp8_e4m3"; the format:
// docs/design.md). Shared by the decode (decode_attention.cpp) and prefill (prefill_tile.h) kernels.
#pragma once
#include <cstdint>
#include <cstring>

namespace pkv_codes {

// An fp8 e4m3 ("fn": no infinities) code.
struct Fp8E4M3 {
  uint8_t x;
};

// Widened with integer arithmetic the compiler vectorises (no table, no branch): the significand
// (with its implicit 1 unless the exponent field is 0) as an integer, times 2^(max(e, 1) - 10)
// built in a float's exponent bits, and the sign bit moved across. Exact for every finite code;
// the two NaN codes (never written: quantizing clamps to +-448) read as +-480.
inline __attribute__((always_inline)) float widen(Fp8E4M3 b) {
  const int32_t e = (b.x >> 3) & 15, m = b.x & 7;
  const float significand = static_cast<float>(e != 0 ? (m | 8) : m);
  const int32_t pow_bits = ((e != 0 ? e : 1) + 117) << 23;
  float pow2;
  std::memcpy(&pow2, &pow_bits, sizeof pow2);
  const float magnitude = significand * pow2;
  uint32_t bits;
  std::memcpy(&bits, &magnitude, sizeof bits);
  bits |= static_cast<uint32_t>(b.x & 0x80) << 24;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline __attribute__((always_inline)) float widen(int8_t x) { return static_cast<float>(x); }

}  // namespace pkv_codes
