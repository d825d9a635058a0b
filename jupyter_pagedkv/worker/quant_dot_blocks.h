// The GGUF block layouts and the small helpers every quant_dot.cpp variant shares (included only
// there and by quant_dot_eight.h; numerics in quant_dot.cpp).
#pragma once
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace quant_dot::detail {

enum Kind : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };   // GGML's type numbers
constexpr int kTile = 4;                                    // activation rows sharing one block's quants

// The quantized activations and what each block of them needs: qx [rows, k], dx and dx * sum(qx)
// [rows, k / 32]; then the weight blocks and the output.
struct Job {
  const int8_t* qx;
  const float* dx;
  const float* dxsum;
  const uint8_t* w;
  float* out;         // [rows, n]
  int64_t rows, n, k, row_bytes;
};

constexpr int64_t block_bytes(int64_t kind) { return kind == kQ4_0 ? 18 : kind == kQ4_1 ? 20 : 34; }
constexpr int64_t quants_at(int64_t kind) { return kind == kQ4_1 ? 4 : 2; }

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

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
