// The block layouts' helpers every quant_dot.cpp variant shares (included only there and by
// quant_dot_eight.h; the layouts: quant_layout.h; numerics: quant_dot.cpp).
#pragma once
#include <immintrin.h>

#include "quant_layout.h"

namespace quant_dot::detail {

using quant_layout::block_bytes;
using quant_layout::half_at;
using quant_layout::kQ4_0;
using quant_layout::kQ4_1;
using quant_layout::kQ8_0;
using quant_layout::quants_at;
constexpr int kTile = 4;                                    // activation rows sharing one block's quants

// The quantized activations and what each block of them needs: qx [rows, k], dx and dx * sum(qx)
// [rows, k / 32]; then the weight blocks (interleaved, quant_layout.h) and the output.
struct Job {
  const int8_t* qx;
  const float* dx;
  const float* dxsum;
  const uint8_t* w;
  float* out;         // [rows, n]
  int64_t rows, n, k, row_bytes;
};

// The offset each weight block adds per unit of activation: Q4_1's m, Q4_0's -8 d, Q8_0 none.
template <int64_t Kind> inline float offset_of(const uint8_t* blk, float dw) {
  return Kind == kQ4_1 ? half_at(blk + 2) : Kind == kQ4_0 ? -8.0f * dw : 0.0f;
}

// The same two with F16C's one-instruction conversion (c10::Half's portable one is ~a dozen
// instructions: per block, that cost as much as the block's dot product).
__attribute__((target("f16c"), always_inline)) inline float half_f16c(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}
template <int64_t Kind> __attribute__((target("f16c"), always_inline)) inline float offset_f16c(const uint8_t* blk, float dw) {
  return Kind == kQ4_1 ? half_f16c(blk + 2) : Kind == kQ4_0 ? -8.0f * dw : 0.0f;
}

// Weight rows are read once per call, from memory rather than cache when the model is bigger than
// the cache: a row kAhead ahead is asked for while this one is computed. Without it one thread read
// Q4_1 rows at ~3 GB/s while the same loop on cached rows ran at ~7.5 (2-core Xeon, 2026-12-03).
constexpr int64_t kAhead = 8;
constexpr int64_t kAheadGroups = 3;   // the same for eight features at a time
inline void prefetch_row(const uint8_t* p, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(p + at, 0, 3);
}

}  // namespace quant_dot::detail
