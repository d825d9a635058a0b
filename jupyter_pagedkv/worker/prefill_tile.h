// The tile loop of the causal prefill attention kernel (prefill_attention.cpp holds its dispatch).
//
// A tile is one KV head and up to 32 query positions, the GQA heads that share the KV head stacked
// as its rows. `Tile<E, NV>::run` walks the keys it may see in packed blocks of 64 (`pack`):
// register-tiled scores (`score_rows`), the causal / sliding-window mask, the online softmax
// (running max and sum per row, weights rounded to the element type), and the weighted values
// (`weigh_rows`); `finish` writes the output rows and their log-sum-exp. All of it is compiled
// for AVX-512 (bf16 through VDPBF16PS), and only on x86; `Args` is what the dispatch fills.
#pragma once
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kv_codes.h"

#if defined(__x86_64__)
#define PKV_X86 1
#include <immintrin.h>
#else
#define PKV_X86 0        // elsewhere the module builds, says it serves nothing, and torch's SDPA runs
#endif

namespace pkv_prefill {
// Internal linkage, as when the kernel was one file: the compiler inlines as it did then (the
// object code of prefill_attention.cpp is the same, only symbol names differ).
namespace {

struct Args {
  const void* q;        // [n, heads, d]: strides q_row, q_head, 1
  const void* k;        // [L, kv_heads, d]: strides k_row, k_head, 1
  const void* v;        // the same, strides v_row, v_head, 1
  void* out;            // [n, heads, d], contiguous
  float* lse;           // [heads, n]
  int64_t n, L, heads, kv_heads, d, q_row, q_head, k_row, k_head, v_row, v_head, offset, window;
  float scale;
  // A quantized cache's keys and values (codes: 1 int8, 2 fp8 e4m3; 0: k/v in q's dtype) and
  // their fp16 scales [L, kv_heads], strides ks_row, ks_head (and vs_...): value = code * scale.
  int codes = 0;
  const c10::Half* ks = nullptr;
  const c10::Half* vs = nullptr;
  int64_t ks_row = 0, ks_head = 0, vs_row = 0, vs_head = 0;
};

#if PKV_X86
#define PKV_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma")))
#define PKV_INLINE inline __attribute__((always_inline)) PKV_TARGET

constexpr int64_t kQ = 32;     // query positions per work item
constexpr int64_t kK = 64;     // keys per block (four 16-lane vectors)
constexpr int kRows = 6;       // tile rows held in registers by the score kernel
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// e^x, 16 lanes; lanes below -88 (masked scores among them) give exactly 0. x = n ln2 + r,
// |r| <= ln2/2, e^r by its degree-6 Taylor polynomial (relative error ~1e-7), times 2^n (scalef).
PKV_INLINE __m512 exp16(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-88.f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

// Element types: float32 (scores by FMA) and bfloat16 (scores by VDPBF16PS on bf16 pairs).
struct F32 {
  using T = float;
  static constexpr int64_t kPair = 1;   // elements per 32-bit lane in the packed layouts
};
struct BF16 {
  using T = c10::BFloat16;
  static constexpr int64_t kPair = 2;
};

// Keys of one KV head packed per block of 64 so the score kernel reads whole vectors: block b
// holds, for each lane-pair p of the head dimension, the 64 keys' elements [p*kPair, p*kPair+kPair)
// side by side. Values likewise, with the pairs taken along the keys (bf16: two keys' elements of
// one feature share a lane), so the weighting kernel reads a key pair's row as d/16 vectors.
// K: the stored element type, T itself or a quantized cache's code (int8_t, Fp8E4M3), whose
// values are dequantized here, once per key and feature (code * scale, rounded to T), so the tile
// loop runs as it does over a cache in the model's dtype.
template <typename E, typename K = typename E::T>
void pack(const Args& a, std::vector<typename E::T>& kp, std::vector<typename E::T>& vp) {
  using T = typename E::T;
  constexpr bool quantized = !std::is_same_v<K, T>;
  constexpr int64_t P = E::kPair;
  const int64_t blocks = (a.L + kK - 1) / kK, d = a.d;
  const int64_t per_block = kK * d;      // elements per packed block of one head
  // Reused from call to call (a fresh buffer's page faults cost more than the packing).
  const size_t size = static_cast<size_t>(a.kv_heads * blocks * per_block);
  if (kp.size() < size) {
    kp.resize(size);
    vp.resize(size);
  }
  const K* k = static_cast<const K*>(a.k);
  const K* v = static_cast<const K*>(a.v);
  at::parallel_for(0, a.kv_heads * blocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t g = item / blocks, b = item % blocks;
      T* kb = kp.data() + item * per_block;
      T* vb = vp.data() + item * per_block;
      const int64_t keys = std::min(kK, a.L - b * kK);
      if (keys < kK) {         // the last block's missing keys: zeros (their weights are 0 too)
        std::fill(kb, kb + per_block, T(0));
        std::fill(vb, vb + per_block, T(0));
      }
      for (int64_t j = 0; j < keys; ++j) {
        const int64_t row = b * kK + j;
        const K* ks = k + row * a.k_row + g * a.k_head;
        const K* vs = v + row * a.v_row + g * a.v_head;
        if constexpr (quantized) {
          const float sk = static_cast<float>(a.ks[row * a.ks_row + g * a.ks_head]);
          const float sv = static_cast<float>(a.vs[row * a.vs_row + g * a.vs_head]);
          for (int64_t e = 0; e < d; e += P)
            for (int64_t i = 0; i < P; ++i) kb[(e * kK + j * P) + i] = T(pkv_codes::widen(ks[e + i]) * sk);
          T* dst = vb + (j / P) * d * P + j % P;
          for (int64_t e = 0; e < d; ++e) dst[e * P] = T(pkv_codes::widen(vs[e]) * sv);
        } else {
          for (int64_t e = 0; e < d; e += P)       // key: [d / P][64 keys][P]
            for (int64_t i = 0; i < P; ++i) kb[(e * kK + j * P) + i] = ks[e + i];
          if constexpr (P == 1) {
            std::memcpy(vb + j * d, vs, d * sizeof(T));     // value: one row per key
          } else {
            T* dst = vb + (j / P) * d * P + j % P;         // value: [64 / P key pairs][d][P]
            for (int64_t e = 0; e < d; ++e) dst[e * P] = vs[e];
          }
        }
      }
    }
  });
}

// scores[r][0..64) = q_r . key_j for rows r0 .. r0 + R of the tile (raw, unscaled).
template <typename E, int R>
PKV_INLINE void score_rows(const typename E::T* const* qrow, const typename E::T* kb, int64_t d, float* s) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  if constexpr (E::kPair == 1) {
    for (int64_t e = 0; e < d; ++e) {
      const float* kk = reinterpret_cast<const float*>(kb) + e * kK;
      const __m512 k0 = _mm512_loadu_ps(kk), k1 = _mm512_loadu_ps(kk + 16);
      const __m512 k2 = _mm512_loadu_ps(kk + 32), k3 = _mm512_loadu_ps(kk + 48);
      for (int r = 0; r < R; ++r) {
        const __m512 b = _mm512_set1_ps(reinterpret_cast<const float*>(qrow[r])[e]);
        acc[r][0] = _mm512_fmadd_ps(b, k0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(b, k1, acc[r][1]);
        acc[r][2] = _mm512_fmadd_ps(b, k2, acc[r][2]);
        acc[r][3] = _mm512_fmadd_ps(b, k3, acc[r][3]);
      }
    }
  } else {
    for (int64_t e = 0; e < d / 2; ++e) {
      const int32_t* kk = reinterpret_cast<const int32_t*>(kb) + e * kK;
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kk), k1 = (__m512bh)_mm512_loadu_si512(kk + 16);
      const __m512bh k2 = (__m512bh)_mm512_loadu_si512(kk + 32), k3 = (__m512bh)_mm512_loadu_si512(kk + 48);
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, reinterpret_cast<const int32_t*>(qrow[r]) + e, sizeof pair);
        const __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], b, k0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], b, k1);
        acc[r][2] = _mm512_dpbf16_ps(acc[r][2], b, k2);
        acc[r][3] = _mm512_dpbf16_ps(acc[r][3], b, k3);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * kK + c * 16, acc[r][c]);
}

// acc_r[0..d) += sum_j w_r[j] v_j over one packed value block, rows r0 .. r0 + R.
// NV = d / 16 vectors per row; w holds the rows' weights in the element type.
template <typename E, int NV, int R>
PKV_INLINE void weigh_rows(const typename E::T* w, int64_t w_row, const typename E::T* vb, int64_t keys,
                           float* acc, int64_t d) {
  __m512 o[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) o[r][c] = _mm512_loadu_ps(acc + r * d + c * 16);
  if constexpr (E::kPair == 1) {
    for (int64_t j = 0; j < keys; ++j) {
      const float* vv = reinterpret_cast<const float*>(vb) + j * d;
      __m512 x[NV];
      for (int c = 0; c < NV; ++c) x[c] = _mm512_loadu_ps(vv + c * 16);
      for (int r = 0; r < R; ++r) {
        const __m512 b = _mm512_set1_ps(reinterpret_cast<const float*>(w)[r * w_row + j]);
        for (int c = 0; c < NV; ++c) o[r][c] = _mm512_fmadd_ps(b, x[c], o[r][c]);
      }
    }
  } else {
    for (int64_t j = 0; j < (keys + 1) / 2; ++j) {      // a padded odd key has weight 0 and value 0
      const int32_t* vv = reinterpret_cast<const int32_t*>(vb) + j * d;
      __m512bh x[NV];
      for (int c = 0; c < NV; ++c) x[c] = (__m512bh)_mm512_loadu_si512(vv + c * 16);
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, reinterpret_cast<const int32_t*>(w + r * w_row) + j, sizeof pair);
        const __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
        for (int c = 0; c < NV; ++c) o[r][c] = _mm512_dpbf16_ps(o[r][c], b, x[c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + r * d + c * 16, o[r][c]);
}

PKV_INLINE float hmax(const float* s) {
  __m512 m = _mm512_max_ps(_mm512_max_ps(_mm512_loadu_ps(s), _mm512_loadu_ps(s + 16)),
                           _mm512_max_ps(_mm512_loadu_ps(s + 32), _mm512_loadu_ps(s + 48)));
  return _mm512_reduce_max_ps(m);
}

template <typename E, int NV>
struct Tile {
  using T = typename E::T;
  static constexpr int R2 = 24 / NV;   // weighting rows held in registers

  // One work item: KV head g, query positions [p0, p1).
  PKV_TARGET static void run(const Args& a, const T* kp, const T* vp, int64_t g, int64_t p0, int64_t p1,
                             std::vector<float>& fs, std::vector<T>& ws) {
    const int64_t G = a.heads / a.kv_heads, d = a.d, M = (p1 - p0) * G;
    const int64_t blocks = (a.L + kK - 1) / kK;
    fs.resize(static_cast<size_t>(M * (kK + d + 2)));
    ws.resize(static_cast<size_t>(M * kK));
    float* s = fs.data();              // [M][64] scores of the current block
    float* acc = s + M * kK;           // [M][d]
    float* mx = acc + M * d;           // [M] running max of the raw scores
    float* sum = mx + M;               // [M] running sum of the weights
    T* w = ws.data();                  // [M][64] this block's weights, in the element type
    std::fill(acc, acc + M * d, 0.f);
    std::fill(mx, mx + M, kNegInf);
    std::fill(sum, sum + M, 0.f);
    const T* q = static_cast<const T*>(a.q);
    const T* qrow[kRows];
    // Visible keys: j <= i + offset (and > i + offset - window) for query positions i in [p0, p1).
    const int64_t hi = std::min(a.L, p1 + a.offset);
    const int64_t lo = a.window > 0 ? std::max<int64_t>(0, p0 + a.offset - a.window + 1) : 0;
    if (hi <= lo) return finish(a, g, p0, p1, acc, mx, sum);
    for (int64_t b = lo / kK; b * kK < hi; ++b) {
      const T* kb = kp + (g * blocks + b) * kK * d;
      const T* vb = vp + (g * blocks + b) * kK * d;
      const int64_t j0 = b * kK, keys = std::min(kK, a.L - j0);
      for (int64_t r0 = 0; r0 < M; r0 += kRows) {
        const int64_t R = std::min<int64_t>(kRows, M - r0);
        for (int64_t r = 0; r < R; ++r) {
          const int64_t row = r0 + r, i = p0 + row / G, h = g * G + row % G;
          qrow[r] = q + i * a.q_row + h * a.q_head;
        }
        switch (R) {
          case 6: score_rows<E, 6>(qrow, kb, d, s + r0 * kK); break;
          case 5: score_rows<E, 5>(qrow, kb, d, s + r0 * kK); break;
          case 4: score_rows<E, 4>(qrow, kb, d, s + r0 * kK); break;
          case 3: score_rows<E, 3>(qrow, kb, d, s + r0 * kK); break;
          case 2: score_rows<E, 2>(qrow, kb, d, s + r0 * kK); break;
          default: score_rows<E, 1>(qrow, kb, d, s + r0 * kK); break;
        }
      }
      // Mask what some row may not see: keys past the end, past a row's position, or out of its window.
      const bool edge = j0 + kK > std::min(a.L, p0 + a.offset + 1) ||
                        (a.window > 0 && j0 <= p1 - 1 + a.offset - a.window);
      for (int64_t row = 0; row < M; ++row) {
        float* sr = s + row * kK;
        if (edge) {
          const int64_t i = p0 + row / G;
          const int64_t top = std::min(keys, i + a.offset + 1 - j0);     // keys [0, top) visible
          const int64_t bottom = a.window > 0 ? std::max<int64_t>(0, i + a.offset - a.window + 1 - j0) : 0;
          for (int64_t j = 0; j < kK; ++j)
            if (j >= top || j < bottom) sr[j] = kNegInf;
        }
        const float m_new = std::max(mx[row], hmax(sr));
        T* wr = w + row * kK;
        if (m_new == kNegInf) {          // nothing visible to this row yet
          std::memset(static_cast<void*>(wr), 0, kK * sizeof(T));
          continue;
        }
        const float shift = m_new * a.scale;
        if (mx[row] != m_new) {
          const float alpha = mx[row] == kNegInf ? 0.f : std::exp(mx[row] * a.scale - shift);
          sum[row] *= alpha;
          float* ar = acc + row * d;
          const __m512 al = _mm512_set1_ps(alpha);
          for (int64_t c = 0; c < d; c += 16) _mm512_storeu_ps(ar + c, _mm512_mul_ps(_mm512_loadu_ps(ar + c), al));
          mx[row] = m_new;
        }
        __m512 tot = _mm512_setzero_ps();
        const __m512 sc = _mm512_set1_ps(a.scale), sh = _mm512_set1_ps(shift);
        for (int c = 0; c < 4; ++c) {
          const __m512 x = _mm512_loadu_ps(sr + c * 16);
          const __m512 e = exp16(_mm512_fmsub_ps(x, sc, sh));
          tot = _mm512_add_ps(tot, e);
          if constexpr (E::kPair == 1) {
            _mm512_storeu_ps(reinterpret_cast<float*>(wr) + c * 16, e);
          } else {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(wr + c * 16), (__m256i)_mm512_cvtneps_pbh(e));
          }
        }
        sum[row] += _mm512_reduce_add_ps(tot);
      }
      for (int64_t r0 = 0; r0 < M; r0 += R2) {
        const int64_t R = std::min<int64_t>(R2, M - r0);
        weigh_any(R, w + r0 * kK, vb, keys, acc + r0 * d, d);
      }
    }
    finish(a, g, p0, p1, acc, mx, sum);
  }

  PKV_INLINE static void weigh_any(int64_t R, const T* w, const T* vb, int64_t keys, float* acc, int64_t d) {
    switch (R) {
      case 6: if constexpr (R2 >= 6) { weigh_rows<E, NV, 6>(w, kK, vb, keys, acc, d); return; } break;
      case 5: if constexpr (R2 >= 5) { weigh_rows<E, NV, 5>(w, kK, vb, keys, acc, d); return; } break;
      case 4: if constexpr (R2 >= 4) { weigh_rows<E, NV, 4>(w, kK, vb, keys, acc, d); return; } break;
      case 3: if constexpr (R2 >= 3) { weigh_rows<E, NV, 3>(w, kK, vb, keys, acc, d); return; } break;
      case 2: if constexpr (R2 >= 2) { weigh_rows<E, NV, 2>(w, kK, vb, keys, acc, d); return; } break;
      default: break;
    }
    for (int64_t r = 0; r < R; ++r) weigh_rows<E, NV, 1>(w + r * kK, kK, vb, keys, acc + r * d, d);
  }

  // out = acc / sum in the element type, lse = log-sum-exp of the scaled scores (-inf, and a zero
  // output, for a row that saw no key).
  PKV_TARGET static void finish(const Args& a, int64_t g, int64_t p0, int64_t p1, const float* acc,
                                const float* mx, const float* sum) {
    const int64_t G = a.heads / a.kv_heads, d = a.d;
    T* out = static_cast<T*>(a.out);
    for (int64_t row = 0; row < (p1 - p0) * G; ++row) {
      const int64_t i = p0 + row / G, h = g * G + row % G;
      T* o = out + (i * a.heads + h) * d;
      const float inv = sum[row] > 0.f ? 1.f / sum[row] : 0.f;
      for (int64_t e = 0; e < d; ++e) o[e] = static_cast<T>(acc[row * d + e] * inv);
      a.lse[h * a.n + i] = sum[row] > 0.f ? mx[row] * a.scale + std::log(sum[row]) : kNegInf;
    }
  }
};
#endif  // PKV_X86

}  // namespace
}  // namespace pkv_prefill
