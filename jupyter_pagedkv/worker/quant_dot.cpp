// Decode-sized linear layers from GGUF blocks with integer dot products (the few-rows path of
// quant_gemm.cpp; the blocks' layouts, GGUF's and the kernels', and their sizes: quant_layout.h).
//
// Why: one decode row reads each weight once, and converting each weight to fp32 to multiply it with
// an fp32 activation (4 conversions and an FMA per 8 weights) cost more than reading it. Quantizing
// the activation row to int8 once per call instead lets the CPU multiply 32 4-bit or 8-bit weights
// by 32 int8 activations in one or two integer instructions, with one fp32 multiply per block.
//
// Numerics: each row's 32-element block is quantized to x^ = dx * qx, dx = max|x| / 127,
// qx = round(x / dx) (nearest, ties to even) in [-127, 127], so |x - x^| <= dx / 2 per element. Then
//   sum_j w_j x^_j = dw * dx * sum_j qw_j qx_j + m * dx * sum_j qx_j
// exactly in integers per block (m: Q4_1's offset, -8 dw for Q4_0, none for Q8_0), the block sums
// scaled and added in fp32. So the result is the dequantized weights times x^, up to fp32 rounding:
// it differs from the fp32-activation result by at most sum over blocks of dx / 2 * sum_j |w_j|.
//
// Variants, chosen at run time by the CPU's features (never called where it lacks them; best_here):
//   generic:    portable C++ integer loops
//   avx2:       u8 x s8 pairs with maddubs (16-bit, no saturation: a pair is at most 2 * 15 * 127
//               for Q4 nibbles, 2 * 128 * 127 = 32512 for Q8_0's |q|), madd to 32-bit
//   avxvnni:    dpbusd (u8 x s8 quads summed into 32-bit lanes), 256-bit, VEX encoded
//   avx512vnni: dpbusd on two blocks per 512-bit register
// Q4 nibbles are unsigned, the activations signed: the u8 x s8 products take them as they are.
// Q8_0 x Q8 is s8 x s8: |qw| as the unsigned operand, qx with qw's sign applied as the signed one.
// The SIMD variants take whole groups of eight output features at a time, as the layout stores
// them (quant_layout.h, quant_dot_eight.h), then the last n % 8, kept as GGUF rows, one at a time
// (here); the portable variant reads every block through quant_layout::gguf_block. Shared helpers:
// quant_dot_blocks.h.
#include "quant_dot.h"
#include "quant_dot_blocks.h"
#include "quant_dot_eight.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

namespace quant_dot {
namespace {

using namespace detail;

// Each row's blocks to int8 (see the numerics above). Every variant sees the same codes: the AVX2
// build does each element's arithmetic as the portable one does (the same fp32 max, divide,
// multiply, round to nearest even and clamp; integer sums), eight lanes at a time. Portable, one
// call of the embedded model's down projection (1536 inputs) took ~5 us, a tenth of the GEMM.
void quantize_rows_generic(const float* x, int64_t rows, int64_t k, int8_t* q, float* dx, float* dxsum) {
  for (int64_t b = 0; b < rows * (k / 32); ++b) {
    const float* xb = x + b * 32;
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int j = 0; j < 32; ++j) {
      const float v = std::min(127.0f, std::max(-127.0f, std::nearbyint(xb[j] * inv)));
      q[b * 32 + j] = static_cast<int8_t>(v);
      sum += static_cast<int>(v);
    }
    dx[b] = d;
    dxsum[b] = d * static_cast<float>(sum);
  }
}

__attribute__((target("avx2,fma"))) void quantize_rows_avx2(const float* x, int64_t rows, int64_t k, int8_t* q,
                                                              float* dx, float* dxsum) {
  const __m256 sign = _mm256_set1_ps(-0.0f), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
  for (int64_t b = 0; b < rows * (k / 32); ++b) {
    const float* xb = x + b * 32;
    __m256 v[4];
    __m256 m = _mm256_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      v[c] = _mm256_loadu_ps(xb + 8 * c);
      m = _mm256_max_ps(_mm256_andnot_ps(sign, v[c]), m);   // operands as std::max's: a NaN leaves m
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float d = amax / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
    const __m256 scale = _mm256_set1_ps(inv);
    __m256i codes[4], sum = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[c], scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      codes[c] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));   // NaN -> -127, as std::max
      sum = _mm256_add_epi32(sum, codes[c]);
    }
    // int32 -> int8 in element order: packs work within 128-bit halves, the permute restores it.
    const __m256i w16 = _mm256_packs_epi32(codes[0], codes[1]), w16b = _mm256_packs_epi32(codes[2], codes[3]);
    const __m256i w8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16, w16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * 32), w8);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    dx[b] = d;
    dxsum[b] = d * static_cast<float>(_mm_cvtsi128_si32(s4));
  }
}

using QuantizeFn = void (*)(const float*, int64_t, int64_t, int8_t*, float*, float*);

// The quantizer a variant runs: every variant but the portable one is built on AVX2.
QuantizeFn quantizer(const std::string& variant) {
  return variant == "generic" ? &quantize_rows_generic : &quantize_rows_avx2;
}

// The tile heights a call's rows split into: whole tiles of kTile, then one of rows % kTile. Each
// height is its own instantiation, so a tile's accumulators are registers: with the height known
// only at run time they lived on the stack, and every block's FMA waited on a store and a reload
// (decode's one row ran at ~13 cycles a block on a Xeon, against ~4 on a Zen 4, whose memory
// renaming hid it).
#define QUANT_DOT_TILES(TILE, FROM)                                         \
  for (int64_t o = FROM; o < end; ++o) {                                    \
    const uint8_t* row = j.w + o * j.row_bytes;                             \
    if (o + kAhead < end) prefetch_row(row + kAhead * j.row_bytes, j.row_bytes); \
    int64_t r0 = 0;                                                         \
    for (; r0 + kTile <= j.rows; r0 += kTile) TILE<Kind, kTile>(j, row, o, r0); \
    switch (j.rows - r0) {                                                  \
      case 1: TILE<Kind, 1>(j, row, o, r0); break;                          \
      case 2: TILE<Kind, 2>(j, row, o, r0); break;                          \
      case 3: TILE<Kind, 3>(j, row, o, r0); break;                          \
      default: break;                                                       \
    }                                                                       \
  }

// Every feature one at a time, whether its blocks lie in a group's record or in GGUF's layout.
template <int64_t Kind, int T> inline void tile_generic(const Job& j, const uint8_t*, int64_t o, int64_t r0) {
  const int64_t nb = j.k / 32;
  int qw[32];
  uint8_t tmp[quant_layout::kLargestBlock];
  float acc[T] = {}, off[T] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = quant_layout::gguf_block(j.w, j.row_bytes, Kind, j.n, o, b, tmp);
    const uint8_t* qs = blk + quants_at(Kind);
    for (int i = 0; i < 16; ++i) {
      qw[i] = Kind == kQ8_0 ? static_cast<int8_t>(qs[i]) : qs[i] & 0x0F;
      qw[i + 16] = Kind == kQ8_0 ? static_cast<int8_t>(qs[i + 16]) : qs[i] >> 4;
    }
    const float dw = half_at(blk), m = offset_of<Kind>(blk, dw);
    for (int r = 0; r < T; ++r) {
      const int64_t xb = (r0 + r) * nb + b;
      const int8_t* x = j.qx + xb * 32;
      int s = 0;
      for (int i = 0; i < 32; ++i) s += qw[i] * x[i];
      acc[r] += static_cast<float>(s) * (dw * j.dx[xb]);
      if (Kind != kQ8_0) off[r] += m * j.dxsum[xb];
    }
  }
  for (int r = 0; r < T; ++r) j.out[(r0 + r) * j.n + o] = acc[r] + off[r];
}

template <int64_t Kind> void rows_generic(const Job& j, int64_t begin, int64_t end) { QUANT_DOT_TILES(tile_generic, begin) }

// A block's 32 quants as the unsigned operand (Q4: nibbles 0..15 in weight order; Q8_0: |q|), and
// for Q8_0 the signed quants, whose signs go onto the activations.
template <int64_t Kind>
__attribute__((target("avx2"), always_inline)) inline __m256i unsigned_quants(const uint8_t* blk, __m256i* sq) {
  if (Kind == kQ8_0) {
    *sq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    return _mm256_abs_epi8(*sq);
  }
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + quants_at(Kind)));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

__attribute__((target("avx2"), always_inline)) inline __m256i dot_avx2(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
__attribute__((target("avx2,avxvnni"), always_inline)) inline __m256i dot_avxvnni(__m256i u, __m256i s) {
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
}
__attribute__((target("avx2,avx512f,avx512vl,avx512vnni"), always_inline)) inline __m256i dot_avx512vl(__m256i u, __m256i s) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}

__attribute__((target("avx2,fma"), always_inline)) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Block BI of one output feature against rows [r0, r0 + t): ACC += (its 8 int32 partial sums) *
// dw * dx in fp32 lanes, OFF += m * dx * sum(qx). A macro, not a function, because each variant must
// compile it under its own target (a shared inline function would need the widest one).
#define QUANT_DOT_BLOCK(DOT, ACC, OFF, BI)                                                      \
  {                                                                                             \
    const uint8_t* blk = row + (BI) * block_bytes(Kind);                                       \
    __m256i sq;                                                                                 \
    const __m256i u = unsigned_quants<Kind>(blk, &sq);                                          \
    const float dw = half_f16c(blk), m = offset_f16c<Kind>(blk, dw);                           \
    for (int r = 0; r < T; ++r) {                                                               \
      const int64_t xb = (r0 + r) * nb + (BI);                                                  \
      __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(j.qx + xb * 32));         \
      if (Kind == kQ8_0) s = _mm256_sign_epi8(s, sq);                                           \
      ACC[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DOT(u, s)), _mm256_set1_ps(dw * j.dx[xb]), ACC[r]); \
      if (Kind != kQ8_0) OFF[r] += m * j.dxsum[xb];                                             \
    }                                                                                           \
  }

// A 256-bit variant: one tile of T rows against one output feature. Even and odd blocks sum into
// separate accumulators: one chain of dependent adds per row was the bottleneck.
#define QUANT_DOT_ROWS(NAME, TARGET, DOT)                                                       \
  template <int64_t Kind, int T>                                                                \
  __attribute__((target(TARGET), always_inline)) inline void NAME##_tile(const Job& j, const uint8_t* row, int64_t o, \
                                                                        int64_t r0) {         \
    const int64_t nb = j.k / 32;                                                                \
    __m256 acc[T], acc2[T];                                                                     \
    float off[T] = {}, off2[T] = {};                                                            \
    for (int r = 0; r < T; ++r) acc[r] = acc2[r] = _mm256_setzero_ps();                         \
    int64_t b = 0;                                                                              \
    for (; b + 1 < nb; b += 2) {                                                                \
      QUANT_DOT_BLOCK(DOT, acc, off, b)                                                         \
      QUANT_DOT_BLOCK(DOT, acc2, off2, b + 1)                                                   \
    }                                                                                           \
    if (b < nb) QUANT_DOT_BLOCK(DOT, acc, off, b)                                               \
    for (int r = 0; r < T; ++r)                                                                 \
      j.out[(r0 + r) * j.n + o] = hsum8(_mm256_add_ps(acc[r], acc2[r])) + (off[r] + off2[r]);   \
  }                                                                                             \
  template <int64_t Kind> __attribute__((target(TARGET))) void NAME(const Job& j, int64_t begin, int64_t end) { \
    NAME##_eight<Kind>(j, begin, end);                                                          \
    QUANT_DOT_TILES(NAME##_tile, begin + eight_done<Kind>(begin, end))                          \
  }

QUANT_DOT_EIGHT(rows_avx2_eight, "avx2,fma,f16c", dotacc_avx2, q4sum_avx2)
QUANT_DOT_EIGHT(rows_avxvnni_eight, "avx2,fma,f16c,avxvnni", dotacc_avxvnni, q4sum_avxvnni)
QUANT_DOT_EIGHT(rows_avx512vnni_eight, "avx2,fma,f16c,avx512f,avx512vl,avx512vnni", dotacc_avx512vl, q4sum_avx512vl)

QUANT_DOT_ROWS(rows_avx2, "avx2,fma,f16c", dot_avx2)
QUANT_DOT_ROWS(rows_avxvnni, "avx2,fma,f16c,avxvnni", dot_avxvnni)

// Two blocks of one output feature in one 512-bit register: their quants side by side, the
// activations' 64 contiguous bytes, each half scaled by its own block's dw * dx.
template <int64_t Kind, int T>
__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"), always_inline)) inline void
two_blocks_avx512(const Job& j, const uint8_t* row, int64_t b, int64_t r0, __m512* acc, float* off) {
  const int64_t nb = j.k / 32;
  const uint8_t* b0 = row + b * block_bytes(Kind);
  const uint8_t* b1 = b0 + block_bytes(Kind);
  __m256i sq0, sq1;
  const __m256i u0 = unsigned_quants<Kind>(b0, &sq0), u1 = unsigned_quants<Kind>(b1, &sq1);
  const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(u0), u1, 1);
  const __mmask64 neg = Kind == kQ8_0 ? _mm512_movepi8_mask(_mm512_inserti64x4(_mm512_castsi256_si512(sq0), sq1, 1)) : 0;
  const float d0 = half_f16c(b0), d1 = half_f16c(b1), m0 = offset_f16c<Kind>(b0, d0), m1 = offset_f16c<Kind>(b1, d1);
  for (int r = 0; r < T; ++r) {
    const int64_t xb = (r0 + r) * nb + b;
    __m512i s = _mm512_loadu_si512(j.qx + xb * 32);
    if (Kind == kQ8_0) s = _mm512_mask_sub_epi8(s, neg, _mm512_setzero_si512(), s);
    const __m512 scale = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d0 * j.dx[xb]), _mm512_set1_ps(d1 * j.dx[xb + 1]));
    const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
    if (Kind != kQ8_0) off[r] += m0 * j.dxsum[xb] + m1 * j.dxsum[xb + 1];
  }
}

template <int64_t Kind, int T>
__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"), always_inline)) inline void
tile_avx512vnni(const Job& j, const uint8_t* row, int64_t o, int64_t r0) {
  const int64_t nb = j.k / 32;
  __m512 wide[T], wide2[T];     // two accumulators, as in the 256-bit variants
  __m256 acc[T];
  float off[T] = {}, off2[T] = {};
  for (int r = 0; r < T; ++r) wide[r] = wide2[r] = _mm512_setzero_ps(), acc[r] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 3 < nb; b += 4) {
    two_blocks_avx512<Kind, T>(j, row, b, r0, wide, off);
    two_blocks_avx512<Kind, T>(j, row, b + 2, r0, wide2, off2);
  }
  if (b + 1 < nb) two_blocks_avx512<Kind, T>(j, row, b, r0, wide, off), b += 2;
  if (b < nb) QUANT_DOT_BLOCK(dot_avx512vl, acc, off, b)     // an odd last block
  for (int r = 0; r < T; ++r)
    j.out[(r0 + r) * j.n + o] =
        _mm512_reduce_add_ps(_mm512_add_ps(wide[r], wide2[r])) + hsum8(acc[r]) + (off[r] + off2[r]);
}

template <int64_t Kind>
__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"))) void rows_avx512vnni(
    const Job& j, int64_t begin, int64_t end) {
  rows_avx512vnni_eight<Kind>(j, begin, end);
  QUANT_DOT_TILES(tile_avx512vnni, begin + eight_done<Kind>(begin, end))
}

using RowsFn = void (*)(const Job&, int64_t, int64_t);

bool supports(const std::string& v) {
  if (v == "generic") return true;
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (v == "avx2") return avx2;
  if (v == "avxvnni") return avx2 && __builtin_cpu_supports("avxvnni");
  if (v == "avx512vnni")
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return false;
}

template <int64_t Kind> RowsFn for_kind(const std::string& v) {
  if (v == "avx2") return &rows_avx2<Kind>;
  if (v == "avxvnni") return &rows_avxvnni<Kind>;
  if (v == "avx512vnni") return &rows_avx512vnni<Kind>;
  return &rows_generic<Kind>;
}

RowsFn pick(int64_t kind, const std::string& v) {
  TORCH_CHECK(supports(v), "quant_dot: this CPU cannot run the ", v, " variant (it runs: ",
              c10::Join(", ", variants_here()), ")");
  switch (kind) {
    case kQ4_0: return for_kind<kQ4_0>(v);
    case kQ4_1: return for_kind<kQ4_1>(v);
    case kQ8_0: return for_kind<kQ8_0>(v);
    default: TORCH_CHECK(false, "quant_dot: unknown block kind ", kind);
  }
}

// Output features in chunks that each thread claims when it is free, about eight per thread:
// with a static half each, one thread descheduled on a shared machine held the other at the end of
// every call (bench single's packed rounds varied 43-71 tok/s).
void run_chunks(RowsFn fn, const Job& job) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  // A multiple of eight, so that every chunk starts a group of eight features (rows_*_eight).
  const int64_t chunk = (std::max<int64_t>(16, (job.n + 8 * threads - 1) / (8 * threads)) + 7) / 8 * 8;
  const int64_t chunks = (job.n + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, chunks), 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1))
      fn(job, c * chunk, std::min(job.n, (c + 1) * chunk));
  });
}

}  // namespace

const std::vector<std::string>& all_variants() {
  static const std::vector<std::string> names{"generic", "avx2", "avxvnni", "avx512vnni"};
  return names;
}

std::vector<std::string> variants_here() {
  std::vector<std::string> here;
  for (const auto& v : all_variants())
    if (supports(v)) here.push_back(v);
  return here;
}

// AVX-VNNI where the CPU has it, before AVX-512 VNNI: on the 2-core AVX-512 EPYC (Zen 4, 512-bit
// operations in two halves) the 256-bit variant was as fast or faster (one thread, one row, Q4_1
// 3072x576: 75 us vs 83 us; the Q8_0 49152x576 output layer 1044 us vs 1224 us; 2026-12-02, loaded).
std::string best_here() {
  static const std::string best = [] {
    for (const char* v : {"avxvnni", "avx512vnni", "avx2"})
      if (supports(v)) return std::string(v);
    return std::string("generic");
  }();
  return best;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize(const at::Tensor& x2, const std::string& variant) {
  TORCH_CHECK(x2.scalar_type() == at::kFloat && x2.dim() == 2 && x2.size(1) % 32 == 0,
              "quant_dot: rows must be float32 [rows, k], k a multiple of 32");
  TORCH_CHECK(supports(variant), "quant_dot: this CPU cannot run the ", variant, " variant (it runs: ",
              c10::Join(", ", variants_here()), ")");
  auto x = x2.contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  auto q = at::empty({rows, k}, at::kChar);
  auto dx = at::empty({rows, k / 32}, at::kFloat), dxsum = at::empty({rows, k / 32}, at::kFloat);
  quantizer(variant)(x.data_ptr<float>(), rows, k, q.data_ptr<int8_t>(), dx.data_ptr<float>(), dxsum.data_ptr<float>());
  return {q, dx, dxsum};
}

void linear(const at::Tensor& x2, const at::Tensor& blocks, int64_t kind, at::Tensor& out, const std::string& variant) {
  const RowsFn fn = pick(kind, variant);
  const int64_t rows = x2.size(0), k = x2.size(1), nb = k / 32, n = blocks.size(0);
  // The quantized activations in this thread's scratch, kept between calls: a decode token makes
  // ~120 calls, and three tensors allocated per call cost more than quantizing one row.
  thread_local std::vector<int8_t> qx;
  thread_local std::vector<float> dx, dxsum;
  qx.resize(rows * k);
  dx.resize(rows * nb);
  dxsum.resize(rows * nb);
  quantizer(variant)(x2.data_ptr<float>(), rows, k, qx.data(), dx.data(), dxsum.data());
  const Job job{qx.data(), dx.data(), dxsum.data(), blocks.data_ptr<uint8_t>(), out.data_ptr<float>(), rows, n, k,
                blocks.size(1)};
  run_chunks(fn, job);
}

}  // namespace quant_dot
