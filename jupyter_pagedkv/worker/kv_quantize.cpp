// fp8 e4m3 KV cache rows with their searched scales, as one pass over each row in C++.
//
// Why: the definition (worker/kv_quant.quantize) tries 16 scales per row; in ATen ops that is a
// [rows, 16, d] tensor through a dozen passes, ~60x the write it replaced (1.3 ms for 32 tokens of
// the embedded model's 3 KV heads, 60 writes a step). Here each row stays in registers: every
// candidate's codes are rounded to the e4m3 grid in float32 with integer arithmetic (no table, no
// branch: the loop vectorises, in row_loops.h's AVX2 build where the CPU has it), the squared error is summed in double in 8 fixed lanes, and only the
// winner is cast to fp8. The values are the definition's bit for bit: the same divisions and
// float16 roundings, and a value on the e4m3 grid casts exactly. Only the order of the double sums
// differs from torch's (whose own order depends on its vector width), so two candidates whose
// errors agree to ~2^-50 could be picked differently; every term is exact, and no such pair has
// been seen (the candidates' scales differ by 6% and more).
// No FP-exception semantics here (flags only, never a value): lets the compiler turn the compares
// of clamp and round_e4m3 into vector blends instead of branches.
#pragma GCC optimize("no-trapping-math")
#include "kv_quantize.h"
#include "row_loops.h"

#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kSteps = 16;            // kv_quant.SCALE_STEPS
constexpr float kLimit = 448.0f;      // e4m3's largest finite value
constexpr float kTiny = 6.103515625e-05f, kHuge = 65504.0f;    // float16's smallest normal and max

// y (|y| <= 448) rounded to the nearest e4m3 value, ties to even, as a float: normal values keep 3
// mantissa bits (a carry rounds into the exponent); below 2^-6 the grid is 2^-9.
PKV_ROWS_INLINE float round_e4m3(float y) {
  uint32_t bits;
  std::memcpy(&bits, &y, sizeof bits);
  bits = (bits + 0x7FFFFu + ((bits >> 20) & 1u)) & ~0xFFFFFu;
  float normal;
  std::memcpy(&normal, &bits, sizeof normal);
  uint32_t tiny_bits, sign = 0;
  const float tiny = (std::fabs(y) + 24576.0f) - 24576.0f;     // 1.5 * 2^14: multiples of 2^-9
  std::memcpy(&sign, &y, sizeof sign);
  std::memcpy(&tiny_bits, &tiny, sizeof tiny_bits);
  tiny_bits |= sign & 0x80000000u;                              // y's sign (-0 too)
  float small;
  std::memcpy(&small, &tiny_bits, sizeof small);
  return std::fabs(y) < 0.015625f ? small : normal;
}

// torch's clamp (NaN stays NaN), as value selects the compiler turns into blends
PKV_ROWS_INLINE float clamp(float v, float lo, float hi) {
  const float up = v < lo ? lo : v;
  return up > hi ? hi : up;
}

// The scale torch computes for candidate j: (amax / 448) * (1 + j/16), clamped to float16's normal
// range, rounded to float16, as the float it widens back to.
PKV_ROWS_INLINE float candidate(float unit, int j) {
  return static_cast<float>(c10::Half(clamp(unit * (1.0f + static_cast<float>(j) / kSteps), kTiny, kHuge)));
}

// The e4m3 code of g, a value on the e4m3 grid (round_e4m3's): sign, exponent rebiased from 127 to
// 7 and the 3 mantissa bits of a normal value; a subnormal's (below 2^-6) count of 2^-9.
// Integer arithmetic the compiler vectorises, where c10's conversion branches per element.
PKV_ROWS_INLINE uint8_t e4m3_code(float g) {
  uint32_t bits;
  std::memcpy(&bits, &g, sizeof bits);
  const uint32_t sign = (bits >> 24) & 0x80u, magnitude = bits & 0x7FFFFFFFu;
  float a;
  std::memcpy(&a, &magnitude, sizeof a);
  const uint32_t normal = (((magnitude >> 23) - 120u) << 3) | ((magnitude >> 20) & 7u);
  const uint32_t small = static_cast<uint32_t>(a * 512.0f);     // exact: a multiple of 2^-9 below 8 of them
  return static_cast<uint8_t>(sign | (a < 0.015625f ? small : normal));
}

// The element's error read back, squared: torch's (back.double() - x.double()).square(). The
// difference is taken in float, where it is exact (back is within a factor 2 of x, or 0).
// x / scale within the codes' range (float16's rounding of a scale may push the largest past 448).
PKV_ROWS_INLINE float scaled(float x, float scale) { return clamp(x / scale, -kLimit, kLimit); }

PKV_ROWS_INLINE double squared(const float* x, int64_t i, float scale) {
  const float back = round_e4m3(scaled(x[i], scale)) * scale;
  const double diff = static_cast<double>(back - x[i]);
  return diff * diff;
}

// The row's squared error read back under `scale`: each element's into `sq` (one flat loop the
// compiler vectorises), then summed in 8 lanes (element i into lane i % 8), then pairwise.
template <int64_t D>
PKV_ROWS_INLINE double squared_error(const float* x, int64_t runtime_d, float scale, double* sq) {
  const int64_t d = D > 0 ? D : runtime_d;
  for (int64_t i = 0; i < d; ++i) sq[i] = squared(x, i, scale);
  double lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const int64_t whole = d - d % 8;
  for (int64_t i = 0; i < whole; i += 8) {
    for (int l = 0; l < 8; ++l) lanes[l] += sq[i + l];      // one vector of 8 lanes
  }
  for (int64_t i = whole; i < d; ++i) lanes[i % 8] += sq[i];
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

// D > 0 fixes the head size at compile time (the loops then carry no remainder code), 0 reads it.
template <int64_t D>
PKV_ROWS_INLINE void quantize_row(const float* x, int64_t runtime_d, uint8_t* codes, c10::Half* scale_out,
                                  double* sq) {
  const int64_t d = D > 0 ? D : runtime_d;
  float amax = 0.0f;
  for (int64_t i = 0; i < d; ++i) {
    const float a = std::fabs(x[i]);
    amax = ((a > amax) | (a != a)) ? a : amax;          // torch's amax propagates NaN
  }
  const float unit = amax / kLimit;
  float best = candidate(unit, 0);
  if (amax != amax) {       // a NaN in the row: torch's NaN scale and x / NaN codes, through c10's casts
    for (int64_t i = 0; i < d; ++i) codes[i] = c10::Float8_e4m3fn(scaled(x[i], best)).x;
    *scale_out = c10::Half(best);
    return;
  }
  double least = squared_error<D>(x, d, best, sq);
  for (int j = 1; j < kSteps; ++j) {
    const float s = candidate(unit, j);
    const double error = squared_error<D>(x, d, s, sq);
    if (error < least) {
      least = error;
      best = s;
    }
  }
  for (int64_t i = 0; i < d; ++i) codes[i] = e4m3_code(round_e4m3(scaled(x[i], best)));
  *scale_out = c10::Half(best);                          // exact: best is a float16 value
}

bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return yes && pkv_rows::allow_avx2.load(std::memory_order_relaxed);   // off: the tests' baseline build
}

template <typename F>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2"))) void with_avx512(const F& f) { f(); }

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_fp8_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && at::isFloatingType(x.scalar_type()),
              "quantize_fp8_rows: x [..., d] of floats on the CPU");
  const auto xf = x.to(at::kFloat).contiguous();
  const int64_t d = x.size(-1), rows = d ? xf.numel() / d : 0;
  auto codes = at::empty(x.sizes(), x.options().dtype(at::kFloat8_e4m3fn));
  auto scales = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kHalf));
  const float* src = xf.data_ptr<float>();
  auto* dst = reinterpret_cast<uint8_t*>(codes.data_ptr<c10::Float8_e4m3fn>());
  auto* out = scales.data_ptr<c10::Half>();
  at::parallel_for(0, rows, 64, [&](int64_t lo, int64_t hi) {     // 64 rows: ~25 us of a thread
    // inlined into an AVX-512 or AVX2 build where the CPU has one: no FMA in any, so the same bits
    std::vector<double> sq(d);
    auto body = [&]() PKV_ROWS_LAMBDA {
      for (int64_t r = lo; r < hi; ++r) {
        if (d == 64) quantize_row<64>(src + r * d, d, dst + r * d, out + r, sq.data());
        else if (d == 128) quantize_row<128>(src + r * d, d, dst + r * d, out + r, sq.data());
        else quantize_row<0>(src + r * d, d, dst + r * d, out + r, sq.data());
      }
    };
    has_avx512() ? with_avx512(body) : pkv_rows::vectorized(body);
  });
  return {codes, scales};
}
