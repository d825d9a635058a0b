// The elementwise steps of a Llama layer as loops over rows, rounding exactly where ATen rounds
// (native_decode.cpp calls them; see there for which ATen op each replaces).
//
// Each ATen op on bf16 tensors computes in float and rounds its result to bf16, to nearest even;
// `round_to<T>` is that rounding (nothing for float), placed wherever the op it replaces returns a
// T, and every other step is one float multiply, add or divide (compiled with -ffp-contract=off, so
// no fused multiply-add merges two). So a value does not depend on how the loop is compiled: each
// kernel is built twice, for the baseline x86-64 ISA and with AVX2 (the compiler vectorizes the
// loops there: the bf16 rounding is written as integer arithmetic it can vectorize, where
// c10::BFloat16's own conversion branches on NaN per element), and the AVX2 one runs where the CPU
// has it. The tests compare both against ATen's ops.
#pragma once
#include <c10/util/BFloat16.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace pkv_rows {

#define PKV_ROWS_INLINE inline __attribute__((always_inline))
#define PKV_ROWS_LAMBDA __attribute__((always_inline))     // on a lambda: inlined where it is called

PKV_ROWS_INLINE float widen(float x) { return x; }
PKV_ROWS_INLINE float widen(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
PKV_ROWS_INLINE T round_to(float x);
template <>
PKV_ROWS_INLINE float round_to<float>(float x) { return x; }
// c10::BFloat16(float): NaN to 0x7FC0, else round to nearest even on the upper 16 bits.
template <>
PKV_ROWS_INLINE c10::BFloat16 round_to<c10::BFloat16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint16_t rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return c10::BFloat16(x != x ? uint16_t{0x7FC0} : rounded, c10::BFloat16::from_bits());
}

// --- The kernels: one run of rows or elements each, plain loops the compiler vectorizes ---

// sq[i] = x[i]^2 in float (ATen's `x.float().pow(2)`), i in [lo, hi).
template <typename T>
PKV_ROWS_INLINE void squares(const T* __restrict x, float* __restrict sq, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) sq[i] = widen(x[i]) * widen(x[i]);
}

// Rows [lo, hi) of the norm: y = w * T(x * (1 / sqrt(sum / n + eps))), two roundings.
template <typename T>
PKV_ROWS_INLINE void norm_scale(const T* __restrict x, const T* __restrict w, const float* __restrict sums,
                                T* __restrict y, int64_t n, float eps, int64_t lo, int64_t hi) {
  const float count = static_cast<float>(n);
  for (int64_t t = lo; t < hi; ++t) {
    const float r = 1.0f / std::sqrt(sums[t] / count + eps);
    const T* xr = x + t * n;
    T* yr = y + t * n;
    for (int64_t i = 0; i < n; ++i) yr[i] = round_to<T>(widen(w[i]) * widen(round_to<T>(widen(xr[i]) * r)));
  }
}

// Rows [lo, hi) of rotary: y = T(T(x * cos) + T(rot(x) * sin)), rot(x) = (-x[half:], x[:half]),
// for the first `rotated` of `all` heads of x [T, all, d] into y [T, rotated, d].
template <typename T>
PKV_ROWS_INLINE void rotate(const T* __restrict x, const T* __restrict c, const T* __restrict s, T* __restrict y,
                            int64_t all, int64_t rotated, int64_t d, int64_t lo, int64_t hi) {
  const int64_t half = d / 2;
  for (int64_t t = lo; t < hi; ++t)
    for (int64_t hd = 0; hd < rotated; ++hd) {
      const T* xv = x + (t * all + hd) * d;
      const T* ct = c + t * d;
      const T* st = s + t * d;
      T* yv = y + (t * rotated + hd) * d;
      for (int64_t i = 0; i < half; ++i)
        yv[i] = round_to<T>(widen(round_to<T>(widen(xv[i]) * widen(ct[i]))) +
                            widen(round_to<T>(-widen(xv[i + half]) * widen(st[i]))));
      for (int64_t i = half; i < d; ++i)
        yv[i] = round_to<T>(widen(round_to<T>(widen(xv[i]) * widen(ct[i]))) +
                            widen(round_to<T>(widen(xv[i - half]) * widen(st[i]))));
    }
}

// a[i] = T(a[i] + b[i]) (the residual), i in [lo, hi).
template <typename T>
PKV_ROWS_INLINE void add(T* __restrict a, const T* __restrict b, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) a[i] = round_to<T>(widen(a[i]) + widen(b[i]));
}

// Rows [lo, hi) of the gated product: a[t, i] = T(a[t, i] * up[t, i]), up's rows `up_row` apart.
template <typename T>
PKV_ROWS_INLINE void gate(T* __restrict a, const T* __restrict up, int64_t width, int64_t up_row, int64_t lo,
                          int64_t hi) {
  for (int64_t t = lo; t < hi; ++t)
    for (int64_t i = 0; i < width; ++i) a[t * width + i] = round_to<T>(widen(a[t * width + i]) * widen(up[t * up_row + i]));
}

// `vectorized([&]() PKV_ROWS_LAMBDA { kernel(...); })`: the kernel inlined into a function built for
// AVX2 where the CPU has it (the compiler vectorizes it there), else into a baseline one.
// `allow_avx2` false runs the baseline build everywhere (tests compare the two).
inline std::atomic<bool> allow_avx2{true};
inline bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes && allow_avx2.load(std::memory_order_relaxed);
}
template <typename F>
__attribute__((target("avx2"))) void with_avx2(const F& f) { f(); }
template <typename F>
void with_baseline(const F& f) { f(); }
template <typename F>
inline void vectorized(const F& f) { has_avx2() ? with_avx2(f) : with_baseline(f); }

}  // namespace pkv_rows
