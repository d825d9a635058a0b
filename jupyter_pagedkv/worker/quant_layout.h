// How packed weights lie in memory for the kernels (quant_gemm.cpp, quant_dot.cpp): GGUF's blocks,
// eight output features interleaved. Every `blocks` tensor the kernels take is in this layout;
// quant_interleave makes it from the file's rows once, at load.
//
// GGUF's own blocks, one row of them per output feature (32 weights a block):
//   Q4_0: 18 bytes: fp16 d, 16 bytes of nibbles;                 w = d * (q - 8)
//   Q4_1: 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles;         w = d * q + m
//   Q8_0: 34 bytes: fp16 d, 32 int8;                             w = d * q
// (in a Q4 block, byte j's low nibble is weight j and its high nibble weight j + 16).
//
// Interleaved: rows 8g .. 8g + 7 (a group) hold, block after block, the group's eight blocks of
// that column: the eight d's (fp16, 16 bytes), for Q4_1 the eight m's (16 bytes), then the quants
// in 32-byte chunks, chunk c holding feature i's quant bytes 4c .. 4c + 3 at 4i. A group's
// eight-block record is exactly eight GGUF blocks' bytes (144, 160 or 272), so a group occupies
// the same eight rows of the [out, row_bytes] tensor, and a row slice starting and ending at
// multiples of eight (a stacked layer's member) is itself interleaved. The last out % 8 rows stay
// in GGUF's layout.
//
// Why: decode of one sequence multiplies eight features at a time, each 32-bit lane one feature
// (quant_dot_eight.h). From GGUF's rows that took a gather of the eight scales and a transpose of
// the eight rows' quants per block, and read eight streams a row apart; here the lanes come with
// plain loads from one sequential stream. One row of Q4_1 blocks at a time against eight features
// interleaved, one thread, 2-core AVX2 EPYC: 3072x576 from cache 86 -> 35 us; ninety such weights
// in turn (from memory) 109 -> 84 us on one thread, 65 -> 47 us on two (2026-12-04).
#pragma once
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace quant_layout {

enum Kind : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };   // GGML's type numbers

constexpr bool known(int64_t kind) { return kind == kQ4_0 || kind == kQ4_1 || kind == kQ8_0; }
constexpr int64_t block_bytes(int64_t kind) { return kind == kQ4_0 ? 18 : kind == kQ4_1 ? 20 : 34; }
constexpr int64_t kLargestBlock = 34;   // Q8_0's: room for any one block gathered (gguf_block)
// Where a GGUF block's quants start, and a group record's.
constexpr int64_t quants_at(int64_t kind) { return kind == kQ4_1 ? 4 : 2; }
constexpr int64_t group_quants_at(int64_t kind) { return kind == kQ4_1 ? 32 : 16; }
// 4-byte quant groups per feature per block: 16 bytes of nibbles or 32 int8.
constexpr int64_t chunks(int64_t kind) { return kind == kQ8_0 ? 8 : 4; }

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// The record of block b of the group that starts at feature o0 (a multiple of eight).
inline const uint8_t* group_record(const uint8_t* w, int64_t row_bytes, int64_t kind, int64_t o0, int64_t b) {
  return w + o0 * row_bytes + b * 8 * block_bytes(kind);
}

// Block b of feature o in GGUF's layout: in place for the last n % 8 features, else gathered
// from its group's record into `tmp` (block_bytes(kind) bytes).
inline const uint8_t* gguf_block(const uint8_t* w, int64_t row_bytes, int64_t kind, int64_t n, int64_t o, int64_t b,
                                 uint8_t* tmp) {
  const int64_t bb = block_bytes(kind);
  if (o >= n / 8 * 8) return w + o * row_bytes + b * bb;
  const uint8_t* rec = group_record(w, row_bytes, kind, o / 8 * 8, b);
  const int64_t i = o % 8;
  std::memcpy(tmp, rec + 2 * i, 2);
  if (kind == kQ4_1) std::memcpy(tmp + 2, rec + 16 + 2 * i, 2);
  for (int64_t c = 0; c < chunks(kind); ++c)
    std::memcpy(tmp + quants_at(kind) + 4 * c, rec + group_quants_at(kind) + 32 * c + 4 * i, 4);
  return tmp;
}

// Rows [begin, end) of GGUF-layout `src` (whole groups: begin a multiple of eight) into `dst`,
// interleaved; `n` the tensor's rows (the tail past n / 8 * 8 is copied as it is).
inline void interleave_rows(const uint8_t* src, uint8_t* dst, int64_t kind, int64_t n, int64_t row_bytes,
                            int64_t begin, int64_t end) {
  const int64_t bb = block_bytes(kind), nb = row_bytes / bb, groups_end = n / 8 * 8;
  for (int64_t o0 = begin; o0 < std::min(end, groups_end); o0 += 8)
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* rec = dst + o0 * row_bytes + b * 8 * bb;
      for (int64_t i = 0; i < 8; ++i) {
        const uint8_t* blk = src + (o0 + i) * row_bytes + b * bb;
        std::memcpy(rec + 2 * i, blk, 2);
        if (kind == kQ4_1) std::memcpy(rec + 16 + 2 * i, blk + 2, 2);
        for (int64_t c = 0; c < chunks(kind); ++c)
          std::memcpy(rec + group_quants_at(kind) + 32 * c + 4 * i, blk + quants_at(kind) + 4 * c, 4);
      }
    }
  for (int64_t o = std::max(begin, groups_end); o < end; ++o)
    std::memcpy(dst + o * row_bytes, src + o * row_bytes, row_bytes);
}

}  // namespace quant_layout
