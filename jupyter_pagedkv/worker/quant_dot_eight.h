// Eight output features at a time for quant_dot.cpp's 256-bit variants (included only there).
#pragma once
#include "quant_dot_blocks.h"

namespace quant_dot::detail {

// --- Eight output features at once (Q4_0, Q4_1) ---
//
// Why: one feature's block at a time spends about a dozen instructions per 32 weights on scalars
// (two fp16 scales converted, dw * dx, a broadcast, the offset) beside its one integer dot
// product, so decode's one row was bound by instructions, not by reading the weights. Here each
// 32-bit lane holds one of eight features: the eight rows' quants are transposed in 4-byte groups,
// so lane i holds feature i's 4 weights of one group, and the activations' matching 4 bytes are
// broadcast to every lane; eight u8 x s8 quad products (four groups, low and high nibbles) sum a
// whole block per lane. The eight scales come in one gather, and one FMA per block scales eight
// features. Each block's integer sum is exact, then scaled and added in fp32 (numerics in quant_dot.cpp).
//
// Which features: the call's whole groups of eight from `begin` (run_chunks starts every chunk at
// a multiple of eight, so a feature's group, and thus its arithmetic, does not depend on the number
// of threads); the last n % 8 go one at a time. Q8_0's 32 quant bytes a row take an 8 x 8
// transpose, its signed quants the sign trick of the one-at-a-time path.
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

}  // namespace quant_dot::detail

// Features [o0, o0 + 8) against rows [r0, r0 + T), every block of k. Expanded in quant_dot.cpp,
// whose `using namespace detail` makes Job, kTile and the helpers above visible to it.
#define QUANT_DOT_EIGHT(NAME, TARGET, DOTACC)                                                   \
  template <int64_t Kind, int T>                                                                \
  __attribute__((target(TARGET), always_inline)) inline void NAME##_group(const Job& j, int64_t o0, int64_t r0) { \
    const int64_t nb = j.k / 32, rb = j.row_bytes;                                              \
    const uint8_t* w0 = j.w + o0 * rb;                                                          \
    const __m256i row_at = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),        \
                                              _mm256_set1_epi32(static_cast<int>(rb)));         \
    const __m256i nibble = _mm256_set1_epi8(0x0F);                                              \
    __m256 acc[T], off[T];                                                                      \
    for (int r = 0; r < T; ++r) acc[r] = off[r] = _mm256_setzero_ps();                          \
    for (int64_t b = 0; b < nb; ++b) {                                                          \
      const uint8_t* blk = w0 + b * block_bytes(Kind);                                          \
      /* each feature's first 4 bytes: d, and Q4_1's m */                                       \
      const __m256i head = _mm256_i32gather_epi32(reinterpret_cast<const int*>(blk), row_at, 1); \
      const __m256i halves = _mm256_permute4x64_epi64(                                          \
          _mm256_packus_epi32(_mm256_and_si256(head, _mm256_set1_epi32(0xFFFF)), _mm256_srli_epi32(head, 16)), 0xD8); \
      const __m256 d = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));                         \
      const __m256 m = Kind == kQ4_1 ? _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1))     \
                                     : _mm256_mul_ps(_mm256_set1_ps(-8.0f), d);                 \
      const uint8_t* qs = blk + quants_at(Kind);                                                \
      if constexpr (Kind == kQ8_0) {                                                            \
        /* the eight rows' 32 bytes, an 8 x 8 transpose of 4-byte groups: v[c] lane i = row i's group c */\
        __m256i q[8], v[8];                                                                     \
        for (int i = 0; i < 8; ++i) q[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + i * rb));\
        const __m256i t0 = _mm256_unpacklo_epi32(q[0], q[1]), t1 = _mm256_unpackhi_epi32(q[0], q[1]);\
        const __m256i t2 = _mm256_unpacklo_epi32(q[2], q[3]), t3 = _mm256_unpackhi_epi32(q[2], q[3]);\
        const __m256i t4 = _mm256_unpacklo_epi32(q[4], q[5]), t5 = _mm256_unpackhi_epi32(q[4], q[5]);\
        const __m256i t6 = _mm256_unpacklo_epi32(q[6], q[7]), t7 = _mm256_unpackhi_epi32(q[6], q[7]);\
        const __m256i u[8] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),     \
                              _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3),     \
                              _mm256_unpacklo_epi64(t4, t6), _mm256_unpackhi_epi64(t4, t6),     \
                              _mm256_unpacklo_epi64(t5, t7), _mm256_unpackhi_epi64(t5, t7)};    \
        for (int c = 0; c < 4; ++c) {                                                           \
          v[c] = _mm256_permute2x128_si256(u[c], u[c + 4], 0x20);                               \
          v[c + 4] = _mm256_permute2x128_si256(u[c], u[c + 4], 0x31);                           \
        }                                                                                       \
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
      /* rows i and i + 4 in one register, then a 4 x 4 transpose of 4-byte groups per half */  \
      __m256i a[4];                                                                             \
      for (int i = 0; i < 4; ++i)                                                               \
        a[i] = _mm256_inserti128_si256(                                                         \
            _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + i * rb))), \
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + (i + 4) * rb)), 1);           \
      const __m256i t0 = _mm256_unpacklo_epi32(a[0], a[1]), t1 = _mm256_unpackhi_epi32(a[0], a[1]); \
      const __m256i t2 = _mm256_unpacklo_epi32(a[2], a[3]), t3 = _mm256_unpackhi_epi32(a[2], a[3]); \
      const __m256i g[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),      \
                            _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};      \
      __m256i lo[4], hi[4];  /* weights 4c..4c+3 and 16+4c..16+4c+3 of each feature */          \
      for (int c = 0; c < 4; ++c) {                                                             \
        lo[c] = _mm256_and_si256(g[c], nibble);                                                 \
        hi[c] = _mm256_and_si256(_mm256_srli_epi16(g[c], 4), nibble);                           \
      }                                                                                         \
      for (int r = 0; r < T; ++r) {                                                             \
        const int64_t xb = (r0 + r) * nb + b;                                                   \
        const int8_t* x = j.qx + xb * 32;                                                       \
        int32_t xg[8];                                                                          \
        std::memcpy(xg, x, 32);                                                                 \
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();                       \
        for (int c = 0; c < 4; ++c) {                                                           \
          s0 = DOTACC(s0, lo[c], _mm256_set1_epi32(xg[c]));                                     \
          s1 = DOTACC(s1, hi[c], _mm256_set1_epi32(xg[c + 4]));                                 \
        }                                                                                       \
        const __m256 sum = _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1));                        \
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
