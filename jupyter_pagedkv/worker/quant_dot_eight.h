// Eight output features at a time for quant_dot.cpp's 256-bit variants (included only there).
#pragma once
#include "quant_dot_blocks.h"

namespace quant_dot::detail {

// --- Eight output features at once ---
//
// Why: one feature's block at a time spends about a dozen instructions per 32 weights on scalars
// (two fp16 scales converted, dw * dx, a broadcast, the offset) beside its one integer dot
// product, so decode's one row was bound by instructions, not by reading the weights. Here each
// 32-bit lane holds one of eight features, as the interleaved layout stores them (quant_layout.h):
// each 32-byte chunk of a group's record holds the eight features' 4 quant bytes of one position,
// and the activations' matching 4 bytes are broadcast to every lane; the u8 x s8 quad products of
// the chunks sum a whole block per lane. The eight scales come in one load, and one FMA per block
// scales eight features. Each block's integer sum is exact, then scaled and added in fp32
// (numerics in quant_dot.cpp).
//
// Which features: the call's whole groups of eight from `begin` (run_chunks starts every chunk at
// a multiple of eight, so a feature's group, and thus its arithmetic, does not depend on the number
// of threads); the last n % 8, stored as GGUF rows, go one at a time. Q8_0's signed quants take
// the sign trick of the one-at-a-time path.
template <int64_t Kind> inline int64_t eight_done(int64_t begin, int64_t end) {
  return (end - begin) / 8 * 8;
}

__attribute__((target("avx2"), always_inline)) inline __m256i dotacc_avx2(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
__attribute__((target("avx2,avxvnni"), always_inline)) inline __m256i dotacc_avxvnni(__m256i acc, __m256i u, __m256i s) {
  return _mm256_dpbusd_avx_epi32(acc, u, s);
}
__attribute__((target("avx2,avx512f,avx512vl,avx512vnni"), always_inline)) inline __m256i dotacc_avx512vl(__m256i acc, __m256i u,
                                                                                                        __m256i s) {
  return _mm256_dpbusd_epi32(acc, u, s);
}

// A Q4 block of eight features against one activation block: lanes' sums over the four chunks'
// low nibbles (weights 4c..4c+3, activations xg[c]) and high nibbles (16+4c.., xg[c + 4]).
// AVX2 sums the eight maddubs results in 16 bits and widens once: each is at most
// 2 * 15 * 127 = 3810 in magnitude, eight of them 30480 < 32767, so nothing saturates and the sum
// is exact, with one madd instead of eight. The VNNI variants accumulate in 32 bits anyway.
__attribute__((target("avx2"), always_inline)) inline __m256i q4sum_avx2(const __m256i lo[4], const __m256i hi[4],
                                                                         const int32_t xg[8]) {
  __m256i p = _mm256_maddubs_epi16(lo[0], _mm256_set1_epi32(xg[0]));
  p = _mm256_add_epi16(p, _mm256_maddubs_epi16(hi[0], _mm256_set1_epi32(xg[4])));
  for (int c = 1; c < 4; ++c) {
    p = _mm256_add_epi16(p, _mm256_maddubs_epi16(lo[c], _mm256_set1_epi32(xg[c])));
    p = _mm256_add_epi16(p, _mm256_maddubs_epi16(hi[c], _mm256_set1_epi32(xg[c + 4])));
  }
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}
#define QUANT_DOT_Q4SUM_DPBUSD(NAME, TARGET, DOTACC)                                                 \
  __attribute__((target(TARGET), always_inline)) inline __m256i NAME(const __m256i lo[4], const __m256i hi[4], \
                                                                     const int32_t xg[8]) {          \
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();                               \
    for (int c = 0; c < 4; ++c) {                                                                   \
      s0 = DOTACC(s0, lo[c], _mm256_set1_epi32(xg[c]));                                             \
      s1 = DOTACC(s1, hi[c], _mm256_set1_epi32(xg[c + 4]));                                         \
    }                                                                                               \
    return _mm256_add_epi32(s0, s1);                                                                \
  }
QUANT_DOT_Q4SUM_DPBUSD(q4sum_avxvnni, "avx2,avxvnni", dotacc_avxvnni)
QUANT_DOT_Q4SUM_DPBUSD(q4sum_avx512vl, "avx2,avx512f,avx512vl,avx512vnni", dotacc_avx512vl)

}  // namespace quant_dot::detail

// Features [o0, o0 + 8) against rows [r0, r0 + T), every block of k. Expanded in quant_dot.cpp,
// whose `using namespace detail` makes Job, kTile and the helpers above visible to it.
#define QUANT_DOT_EIGHT(NAME, TARGET, DOTACC, Q4SUM)                                            \
  template <int64_t Kind, int T>                                                                \
  __attribute__((target(TARGET), always_inline)) inline void NAME##_group(const Job& j, int64_t o0, int64_t r0) { \
    const int64_t nb = j.k / 32;                                                                \
    const __m256i nibble = _mm256_set1_epi8(0x0F);                                              \
    __m256 acc[T], off[T];                                                                      \
    for (int r = 0; r < T; ++r) acc[r] = off[r] = _mm256_setzero_ps();                          \
    for (int64_t b = 0; b < nb; ++b) {                                                          \
      const uint8_t* rec = quant_layout::group_record(j.w, j.row_bytes, Kind, o0, b);           \
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec))); \
      const uint8_t* qs = rec + quant_layout::group_quants_at(Kind);                            \
      if constexpr (Kind == kQ8_0) {                                                            \
        __m256i v[8];     /* v[c] lane i: feature i's quants 4c .. 4c + 3 */                    \
        for (int c = 0; c < 8; ++c) v[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c)); \
        for (int r = 0; r < T; ++r) {                                                           \
          const int64_t xb = (r0 + r) * nb + b;                                                 \
          int32_t xg[8];                                                                        \
          std::memcpy(xg, j.qx + xb * 32, 32);                                                  \
          __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();                     \
          for (int c = 0; c < 8; c += 2) {   /* |qw| unsigned, qw's sign moved onto qx */       \
            s0 = DOTACC(s0, _mm256_abs_epi8(v[c]), _mm256_sign_epi8(_mm256_set1_epi32(xg[c]), v[c]));\
            s1 = DOTACC(s1, _mm256_abs_epi8(v[c + 1]), _mm256_sign_epi8(_mm256_set1_epi32(xg[c + 1]), v[c + 1]));\
          }                                                                                     \
          const __m256 sum = _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1));                      \
          acc[r] = _mm256_fmadd_ps(sum, _mm256_mul_ps(d, _mm256_set1_ps(j.dx[xb])), acc[r]);    \
        }                                                                                       \
        continue;                                                                               \
      }                                                                                         \
      const __m256 m = Kind == kQ4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 16))) \
                                     : _mm256_mul_ps(_mm256_set1_ps(-8.0f), d);                 \
      __m256i lo[4], hi[4];  /* weights 4c..4c+3 and 16+4c..16+4c+3 of each feature */          \
      for (int c = 0; c < 4; ++c) {                                                             \
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));    \
        lo[c] = _mm256_and_si256(q, nibble);                                                    \
        hi[c] = _mm256_and_si256(_mm256_srli_epi16(q, 4), nibble);                              \
      }                                                                                         \
      for (int r = 0; r < T; ++r) {                                                             \
        const int64_t xb = (r0 + r) * nb + b;                                                   \
        int32_t xg[8];                                                                          \
        std::memcpy(xg, j.qx + xb * 32, 32);                                                    \
        const __m256 sum = _mm256_cvtepi32_ps(Q4SUM(lo, hi, xg));                               \
        acc[r] = _mm256_fmadd_ps(sum, _mm256_mul_ps(d, _mm256_set1_ps(j.dx[xb])), acc[r]);     \
        off[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(j.dxsum[xb]), off[r]);                       \
      }                                                                                         \
    }                                                                                           \
    for (int r = 0; r < T; ++r) _mm256_storeu_ps(j.out + (r0 + r) * j.n + o0, _mm256_add_ps(acc[r], off[r])); \
  }                                                                                             \
  template <int64_t Kind> __attribute__((target(TARGET))) void NAME(const Job& j, int64_t begin, int64_t end) { \
    const int64_t stop = begin + eight_done<Kind>(begin, end);                                  \
    for (int64_t o = begin; o < stop; o += 8) {                                                 \
      if (o + 8 * (kAheadGroups + 1) <= stop)                                                   \
        prefetch_row(j.w + (o + 8 * kAheadGroups) * j.row_bytes, 8 * j.row_bytes);             \
      int64_t r0 = 0;                                                                           \
      for (; r0 + kTile <= j.rows; r0 += kTile) NAME##_group<Kind, kTile>(j, o, r0);            \
      switch (j.rows - r0) {                                                                    \
        case 1: NAME##_group<Kind, 1>(j, o, r0); break;                                         \
        case 2: NAME##_group<Kind, 2>(j, o, r0); break;                                         \
        case 3: NAME##_group<Kind, 3>(j, o, r0); break;                                         \
        default: break;                                                                         \
      }                                                                                         \
    }                                                                                           \
  }
