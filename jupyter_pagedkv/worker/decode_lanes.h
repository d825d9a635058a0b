// The decode attention kernel's per-element arithmetic (decode_attention.cpp): widening a cache
// element to float, 16-lane dot products and their fixed summation tree, e^x, the value update,
// prefetching. Each function is small and always inlined into the kernel's target-attributed
// functions, so it is compiled once per ISA variant and gives the same bits under each.
#pragma once
#include "kv_codes.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace pkv_lanes {

constexpr int kLanes = 16;

#define PAGEDKV_INLINE inline __attribute__((always_inline))

PAGEDKV_INLINE float to_float(float x) { return x; }
PAGEDKV_INLINE float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
PAGEDKV_INLINE float to_float(c10::Half x) { return static_cast<float>(x); }
PAGEDKV_INLINE float to_float(int8_t x) { return static_cast<float>(x); }

using pkv_codes::Fp8E4M3;
// e4m3 codes through a 1 KiB table of `widen`'s values (the same floats, bit for bit): in the
// dot and axpy loops below, the arithmetic form did not vectorise, and decode over an fp8 cache
// ran 13x slower than over int8 (9.96 against 0.76 ms a layer at 16 sequences of 500 tokens).
inline const std::array<float, 256> kFp8Values = [] {
  std::array<float, 256> t{};
  for (int c = 0; c < 256; ++c) t[c] = pkv_codes::widen(Fp8E4M3{static_cast<uint8_t>(c)});
  return t;
}();
PAGEDKV_INLINE float to_float(Fp8E4M3 b) { return kFp8Values[b.x]; }

// The 16 partial sums added in a fixed pairwise tree: lane l + 8 onto l, then l + 4, l + 2, l + 1.
// In vector types, so each level is one add under every ISA variant: written as scalar loops, the
// compiler emitted ~30 shuffles and scalar adds a key, most of the kernel's time.
// (Passed by value only into always-inline functions, so GCC's note that a 64-byte vector's
// calling convention differs without AVX-512 concerns no real call.)
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float Floats16 __attribute__((vector_size(64)));
typedef float Floats8 __attribute__((vector_size(32)));
typedef float Floats4 __attribute__((vector_size(16)));
PAGEDKV_INLINE float reduce(Floats16 part) {
  Floats8 lo, hi;
  std::memcpy(&lo, &part, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&part) + sizeof lo, sizeof hi);
  const Floats8 eight = lo + hi;
  Floats4 a, b;
  std::memcpy(&a, &eight, sizeof a);
  std::memcpy(&b, reinterpret_cast<const char*>(&eight) + sizeof a, sizeof b);
  const Floats4 four = a + b;
  return (four[0] + four[2]) + (four[1] + four[3]);
}
PAGEDKV_INLINE float reduce(const float* part) {
  Floats16 v;
  std::memcpy(&v, part, sizeof v);
  return reduce(v);
}

// Sixteen keys' partial-sum vectors reduced together: lane t of the result is `reduce(parts[t])`,
// bit for bit (each key's sums are added in the same tree: l + 8, then l + 4, then (0 + 2) +
// (1 + 3)), but pairs of vectors share each level's shuffles and adds: 30 two-source shuffles and
// 15 adds for 16 keys, where `reduce` takes five shuffles and five adds for one.
// (`__builtin_shufflevector`: GCC 12 and later, and clang.)
#define PAGEDKV_PAIR_SUM(a, b, LO, HI) (__builtin_shufflevector(a, b, LO) + __builtin_shufflevector(a, b, HI))
#define PAGEDKV_E_LO 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define PAGEDKV_E_HI 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define PAGEDKV_F_LO 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define PAGEDKV_F_HI 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
#define PAGEDKV_T_LO 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29
#define PAGEDKV_T_HI 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31
#define PAGEDKV_O_LO 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define PAGEDKV_O_HI 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
PAGEDKV_INLINE Floats16 reduce16(const float* parts) {
  Floats16 v[16];
  std::memcpy(v, parts, sizeof v);
  Floats16 eight[8];     // eight[i]: keys 2i and 2i + 1, eight lanes each (lane l + lane l + 8)
  for (int i = 0; i < 8; ++i) eight[i] = PAGEDKV_PAIR_SUM(v[2 * i], v[2 * i + 1], PAGEDKV_E_LO, PAGEDKV_E_HI);
  Floats16 four[4];      // four[i]: keys 4i to 4i + 3, four lanes each (l + l + 4)
  for (int i = 0; i < 4; ++i) four[i] = PAGEDKV_PAIR_SUM(eight[2 * i], eight[2 * i + 1], PAGEDKV_F_LO, PAGEDKV_F_HI);
  Floats16 two[2];       // two[i]: keys 8i to 8i + 7, (lane 0 + lane 2, lane 1 + lane 3) each
  for (int i = 0; i < 2; ++i) two[i] = PAGEDKV_PAIR_SUM(four[2 * i], four[2 * i + 1], PAGEDKV_T_LO, PAGEDKV_T_HI);
  return PAGEDKV_PAIR_SUM(two[0], two[1], PAGEDKV_O_LO, PAGEDKV_O_HI);
}
#undef PAGEDKV_PAIR_SUM
#undef PAGEDKV_E_LO
#undef PAGEDKV_E_HI
#undef PAGEDKV_F_LO
#undef PAGEDKV_F_HI
#undef PAGEDKV_T_LO
#undef PAGEDKV_T_HI
#undef PAGEDKV_O_LO
#undef PAGEDKV_O_HI

// 16 consecutive elements widened to float, as one vector (bf16 by a shift, in vector types, so
// it stays in registers).
template <typename T>
PAGEDKV_INLINE Floats16 load16(const T* b);
template <>
PAGEDKV_INLINE Floats16 load16(const float* b) {
  Floats16 v;
  std::memcpy(&v, b, sizeof v);
  return v;
}
template <>
PAGEDKV_INLINE Floats16 load16(const c10::BFloat16* b) {
  typedef uint16_t Halves16 __attribute__((vector_size(32)));
  typedef uint32_t Words16 __attribute__((vector_size(64)));
  Halves16 h;
  std::memcpy(&h, b, sizeof h);
  const Words16 w = __builtin_convertvector(h, Words16) << 16;
  Floats16 v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}
template <>
PAGEDKV_INLINE Floats16 load16(const Fp8E4M3* b) {
  float f[kLanes];
  for (int l = 0; l < kLanes; ++l) f[l] = kFp8Values[b[l].x];
  Floats16 v;
  std::memcpy(&v, f, sizeof v);
  return v;
}

// Lane l sums the products at l, l + 16, ... (mul, then add: no contraction), then the tree.
// float and bf16 as vectors; other element types lane by lane into an array, which the compiler
// vectorises better for them (int8 and fp16 caches ran 0.8x and 0.5x as vectors of 16).
template <typename T>
constexpr bool kVectorLoads = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

template <typename T>
PAGEDKV_INLINE float dot(const float* a, const T* b, int64_t n) {
  if constexpr (!kVectorLoads<T>) {
    float part[kLanes] = {0.f};
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
      for (int l = 0; l < kLanes; ++l) part[l] += a[i + l] * to_float(b[i + l]);
    for (int l = 0; i < n; ++i, ++l) part[l] += a[i] * to_float(b[i]);
    return reduce(part);
  } else {
    Floats16 part = {};
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) part += load16(a + i) * load16(b + i);
    if (i < n) {
      float rest[kLanes];
      std::memcpy(rest, &part, sizeof rest);
      for (int l = 0; i < n; ++i, ++l) rest[l] += a[i] * to_float(b[i]);
      std::memcpy(&part, rest, sizeof part);
    }
    return reduce(part);
  }
}

// e^x for x <= 0 (scores less their maximum), in a form the compiler vectorises: x = n ln2 + r
// with |r| <= ln2 / 2, e^r by a degree-6 Taylor polynomial (relative error < 2e-7, about an
// ulp: what the vectorised exp inside SDPA gives too), 2^n put in the exponent bits.
PAGEDKV_INLINE float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;                    // below this e^x is no normal float: 1.6e-38 is 0 here
  // n = x / ln 2 rounded to nearest: adding and taking away 1.5 * 2^23 drops the fraction.
  const float n = (x * 1.44269504f + 12582912.f) - 12582912.f;
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;   // ln 2 split in two: r stays exact
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Keys and values this many positions ahead are asked for while the current ones are scored:
// a row's blocks lie anywhere in the pool and one (row, KV head) reads a strided 1/kv_heads of
// each token's row, which the hardware prefetchers do not follow, so without this the loops
// waited on memory (32 rows of 310 bf16 tokens: 4 GB/s of the machine's ~19). The values are
// read in the second pass, by which time they sit in L2 (a row's values are tens of KiB).
constexpr int64_t kAhead = 8;
template <typename K>
PAGEDKV_INLINE void prefetch(const K* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  const int64_t bytes = n * static_cast<int64_t>(sizeof(K));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
  __builtin_prefetch(c + bytes - 1, 0, 3);    // the last line, where the row is not 64-byte aligned
}

template <typename T>
PAGEDKV_INLINE void axpy(float* acc, float w, const T* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += w * to_float(v[i]);
}

}  // namespace pkv_lanes
