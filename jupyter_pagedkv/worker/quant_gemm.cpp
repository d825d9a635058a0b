// Linear layers computed from GGUF's packed blocks (see quant_linear.py for why and what).
//
// Weights are GGUF's blocks, eight output features interleaved (quant_layout.h: the layout, and
// why); quant_interleave makes it from the file's rows once, at load.
//
// Two paths, by the number of activation rows:
// - Few rows (decode; fewer than `dense_from_rows`): each activation row is quantized to int8 per
//   32-element block and multiplied with the blocks' quants by integer dot products, one fp32
//   multiply per block (quant_dot.cpp: its numerics, its ISA variants and their run-time choice).
//   The result is the dequantized weights times the int8-rounded activations, up to fp32 rounding.
// - Many rows (prefill, batched decode): activations stay fp32. The weight is dequantized a tile of
//   output features at a time into a cache-sized fp32 scratch and ATen's GEMM runs on each tile, so
//   the fp32 weight never exists whole (writing it out to memory and reading it back cost more than
//   the GEMM itself: see quant_linear.py). The result is the dequantized model's GEMM up to fp32 sums.
// The few-rows kernels with fp32 activations (the decode path before quant_dot.cpp) are kept as the
// "f32-generic" / "f32-avx2" variants: the reference tests and `bench single --gemms` compare with.
#include "quant_gemm.h"

#include "quant_dot.h"
#include "quant_layout.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace {

using quant_layout::half_at;
using quant_layout::kQ4_0;
using quant_layout::kQ4_1;
using quant_layout::kQ8_0;

int64_t block_bytes(int64_t kind) {
  TORCH_CHECK(quant_layout::known(kind), "quant_gemm: unknown block kind ", kind);
  return quant_layout::block_bytes(kind);
}

// One block's 32 weights into w (portable; the reference the AVX2 variant rounds like).
inline void dequant_block(int64_t kind, const uint8_t* b, float* w) {
  const float d = half_at(b);
  if (kind == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < 32; ++j) w[j] = d * static_cast<float>(q[j]);
    return;
  }
  const float m = kind == kQ4_1 ? half_at(b + 2) : -8.0f * d;
  const uint8_t* q = b + (kind == kQ4_1 ? 4 : 2);
  for (int j = 0; j < 16; ++j) {
    w[j] = std::fma(static_cast<float>(q[j] & 0x0F), d, m);
    w[j + 16] = std::fma(static_cast<float>(q[j] >> 4), d, m);
  }
}

// One block's 32 weights into w with AVX2: the same fused d * q + m (or d * q) as dequant_block, so the
// two variants give the same bits.
__attribute__((target("avx2,fma,f16c"))) inline void dequant_block_avx2(int64_t kind, const uint8_t* b, float* w);

struct Args {
  const float* x;        // [rows, k]
  const float* xsum;     // [rows, k / 32]: each block's activation sum (the AVX2 variant's offset term)
  const uint8_t* w;      // [n, k / 32 * block_bytes], interleaved
  float* out;            // [rows, n]
  int64_t rows, n, k, kind, row_bytes;
};

constexpr int kTile = 4;   // activation rows sharing one dequantized block

void rows_generic(const Args& a, int64_t begin, int64_t end) {
  const int64_t nb = a.k / 32;
  float w[32];
  uint8_t tmp[quant_layout::kLargestBlock];
  for (int64_t o = begin; o < end; ++o) {
    for (int64_t r0 = 0; r0 < a.rows; r0 += kTile) {
      const int64_t t = std::min<int64_t>(kTile, a.rows - r0);
      float acc[kTile] = {0, 0, 0, 0};
      for (int64_t b = 0; b < nb; ++b) {
        dequant_block(a.kind, quant_layout::gguf_block(a.w, a.row_bytes, a.kind, a.n, o, b, tmp), w);
        for (int64_t r = 0; r < t; ++r) {
          const float* x = a.x + (r0 + r) * a.k + b * 32;
          float s = 0;
          for (int j = 0; j < 32; ++j) s += w[j] * x[j];
          acc[r] += s;
        }
      }
      for (int64_t r = 0; r < t; ++r) a.out[(r0 + r) * a.n + o] = acc[r];
    }
  }
}

// The 32 quants of a block as floats, unscaled: Q4 nibbles 0..15, Q8_0 int8.
__attribute__((target("avx2,fma,f16c"))) inline void quants_avx2(int64_t kind, const uint8_t* b, __m256 q[4]) {
  if (kind == kQ8_0) {
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * i))));
    return;
  }
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (kind == kQ4_1 ? 4 : 2)));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

__attribute__((target("avx2,fma"))) inline float hsum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Per block, sum_j x_j (d q_j + m) = d * (q . x) + m * sum(x): the dot product of the raw quants
// is scaled once per block, and the offset term uses the block's activation sum (computed once
// per call), so a weight costs one multiply-add instead of two.
__attribute__((target("avx2,fma,f16c"))) void rows_avx2(const Args& a, int64_t begin, int64_t end) {
  const int64_t nb = a.k / 32;
  __m256 q[4];
  uint8_t tmp[quant_layout::kLargestBlock];
  for (int64_t o = begin; o < end; ++o) {
    for (int64_t r0 = 0; r0 < a.rows; r0 += kTile) {
      const int64_t t = std::min<int64_t>(kTile, a.rows - r0);
      __m256 acc[kTile] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      float offset[kTile] = {0, 0, 0, 0};
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = quant_layout::gguf_block(a.w, a.row_bytes, a.kind, a.n, o, b, tmp);
        quants_avx2(a.kind, blk, q);
        const float ds = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk));
        const __m256 d = _mm256_set1_ps(ds);
        const float m = a.kind == kQ4_1 ? _cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk + 2))
                        : a.kind == kQ4_0 ? -8.0f * ds : 0.0f;
        for (int64_t r = 0; r < t; ++r) {
          const float* x = a.x + (r0 + r) * a.k + b * 32;
          __m256 s = _mm256_mul_ps(q[0], _mm256_loadu_ps(x));
          s = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(x + 8), s);
          s = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(x + 16), s);
          s = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(x + 24), s);
          acc[r] = _mm256_fmadd_ps(d, s, acc[r]);
          offset[r] = std::fma(m, a.xsum[(r0 + r) * nb + b], offset[r]);
        }
      }
      for (int64_t r = 0; r < t; ++r) a.out[(r0 + r) * a.n + o] = hsum_avx2(acc[r]) + offset[r];
    }
  }
}

__attribute__((target("avx2,fma,f16c"))) inline void dequant_block_avx2(int64_t kind, const uint8_t* b, float* w) {
  __m256 q[4];
  quants_avx2(kind, b, q);
  const float ds = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(b));
  const __m256 d = _mm256_set1_ps(ds);
  if (kind == kQ8_0) {
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(w + 8 * i, _mm256_mul_ps(q[i], d));
    return;
  }
  const __m256 m = _mm256_set1_ps(kind == kQ4_1 ? _cvtsh_ss(*reinterpret_cast<const uint16_t*>(b + 2)) : -8.0f * ds);
  for (int i = 0; i < 4; ++i) _mm256_storeu_ps(w + 8 * i, _mm256_fmadd_ps(q[i], d, m));
}

bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

using RowsFn = void (*)(const Args&, int64_t, int64_t);

// The fp32-activation few-rows kernel of an "f32-..." variant name.
RowsFn pick_f32(const std::string& isa) {
  TORCH_CHECK(isa != "f32-avx2" || has_avx2(), "quant_gemm: this CPU has no AVX2/FMA/F16C");
  return isa == "f32-avx2" ? &rows_avx2 : &rows_generic;
}

bool is_f32(const std::string& isa) { return isa == "f32-generic" || isa == "f32-avx2"; }

// Rows [begin, end) of the fp32 weight of `n` features into `out` (row stride k).
void dequant_rows(const uint8_t* w, int64_t kind, int64_t n, int64_t k, int64_t row_bytes, int64_t begin, int64_t end,
                  float* out, bool avx2) {
  const int64_t nb = k / 32;
  uint8_t tmp[quant_layout::kLargestBlock];
  for (int64_t r = begin; r < end; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = quant_layout::gguf_block(w, row_bytes, kind, n, r, b, tmp);
      float* o = out + (r - begin) * k + b * 32;
      if (avx2) dequant_block_avx2(kind, blk, o); else dequant_block(kind, blk, o);
    }
}

// Output features per dequantized tile: its fp32 scratch about the size of the activations (so
// neither is re-read much more than the other) and at least ~256 KiB (a GEMM call's overhead is
// then small), with at least two tiles per thread so both cores stay busy; a multiple of 16.
int64_t tile_features(int64_t rows, int64_t n, int64_t k) {
  int64_t t = std::max<int64_t>(65536 / k, rows);
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  t = std::min<int64_t>(t, (n + 2 * threads - 1) / (2 * threads));
  t = std::max<int64_t>(16, (t + 15) / 16 * 16);
  return std::min<int64_t>(t, n);
}

// x2 [rows, k] @ W^T, W dequantized one tile of output features at a time into a per-thread fp32
// scratch that stays in cache; each tile's GEMM writes its columns of `out` in place.
at::Tensor tiled_dense(const at::Tensor& x2, const at::Tensor& blocks, int64_t kind, int64_t k, bool avx2) {
  const int64_t rows = x2.size(0), n = blocks.size(0), rb = blocks.size(1);
  const int64_t tile = tile_features(rows, n, k), tiles = (n + tile - 1) / tile;
  auto out = at::empty({rows, n}, x2.options());
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    // Worker threads do not inherit the caller's inference mode; without it they may not write
    // `out` when the caller created it under inference mode. Nothing here is differentiated.
    c10::InferenceMode guard;
    auto scratch = at::empty({tile, k}, at::kFloat);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t o0 = t * tile, nt = std::min<int64_t>(tile, n - o0);
      dequant_rows(w, kind, n, k, rb, o0, o0 + nt, scratch.data_ptr<float>(), avx2);
      auto cols = out.narrow(1, o0, nt);            // strided view: BLAS writes it with ldc = n
      at::mm_out(cols, x2, scratch.narrow(0, 0, nt).t());
    }
  });
  return out;
}

void check(const at::Tensor& blocks, int64_t kind, int64_t k) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "quant_gemm: blocks must be a contiguous uint8 [out, bytes] tensor");
  TORCH_CHECK(k % 32 == 0 && blocks.size(1) == k / 32 * block_bytes(kind),
              "quant_gemm: ", blocks.size(1), " bytes per row do not hold ", k, " weights of kind ", kind);
}

}  // namespace

// The plain fp32 [out, k] weight of packed `blocks`, exactly as the GEMMs below see it.
at::Tensor quant_dequantize(const at::Tensor& blocks, int64_t kind, int64_t k) {
  check(blocks, kind, k);
  const int64_t n = blocks.size(0), rb = blocks.size(1);
  auto out = at::empty({n, k}, at::kFloat);
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const bool avx2 = has_avx2();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    dequant_rows(w, kind, n, k, rb, begin, end, o + begin * k, avx2);
  });
  return out;
}

at::Tensor quant_dequantize_rows(const at::Tensor& blocks, int64_t kind, int64_t k, const at::Tensor& ids) {
  check(blocks, kind, k);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.device().is_cpu(),
              "quant_gemm: ids must be a 1-D int64 CPU tensor");
  const int64_t n = blocks.size(0), rb = blocks.size(1), count = ids.size(0);
  auto idx = ids.contiguous();
  const int64_t* row = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(row[i] >= 0 && row[i] < n, "index ", row[i], " is out of range for ", n, " rows");
  auto out = at::empty({count, k}, at::kFloat);
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const bool avx2 = has_avx2();
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dequant_rows(w, kind, n, k, rb, row[i], row[i] + 1, o + i * k, avx2);
  });
  return out;
}

at::Tensor quant_interleave(const at::Tensor& gguf_rows, int64_t kind) {
  TORCH_CHECK(gguf_rows.scalar_type() == at::kByte && gguf_rows.dim() == 2,
              "quant_gemm: blocks must be a uint8 [out, bytes] tensor");
  TORCH_CHECK(gguf_rows.size(1) % block_bytes(kind) == 0, "quant_gemm: ", gguf_rows.size(1),
              " bytes per row are not whole blocks of kind ", kind);
  auto src = gguf_rows.contiguous();
  auto out = at::empty_like(src);
  const int64_t n = src.size(0), rb = src.size(1);
  const uint8_t* s = src.data_ptr<uint8_t>();
  uint8_t* d = out.data_ptr<uint8_t>();
  at::parallel_for(0, (n + 7) / 8, 64, [&](int64_t begin, int64_t end) {
    quant_layout::interleave_rows(s, d, kind, n, rb, begin * 8, std::min(n, end * 8));
  });
  return out;
}

at::Tensor quant_linear_isa(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                            const c10::optional<at::Tensor>& bias, int64_t dense_from_rows,
                            const std::string& isa_name) {
  const auto& int8 = quant_dot::all_variants();
  TORCH_CHECK(isa_name == "auto" || is_f32(isa_name) || std::find(int8.begin(), int8.end(), isa_name) != int8.end(),
              "isa: auto, ", c10::Join(", ", int8), ", f32-generic or f32-avx2; got ", isa_name);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "quant_gemm: activations must be float32, got ", x.scalar_type());
  const int64_t k = x.size(-1);
  check(blocks, kind, k);
  const int64_t n = blocks.size(0);
  auto x2 = x.reshape({-1, k}).contiguous();
  const int64_t rows = x2.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  const std::string isa = isa_name == "auto" ? quant_dot::best_here() : isa_name;
  if (isa_name != "auto") {        // a forced variant this CPU lacks is refused on either path
    const auto here = quant_variants();
    TORCH_CHECK(std::find(here.begin(), here.end(), isa) != here.end(), "quant_gemm: this CPU cannot run the ",
                isa, " variant (it runs: ", c10::Join(", ", here), ")");
  }
  if (dense_from_rows > 0 && rows >= dense_from_rows) {
    // Prefill: dequantizing each weight once per call and ATen's GEMM beat re-reading the blocks
    // per row tile; a cache-sized tile at a time beats the whole fp32 weight written out and read back.
    // Every variant name but the generic ones uses the AVX2 dequantization (the same bits).
    const bool generic = isa == "generic" || isa == "f32-generic";
    auto y = tiled_dense(x2, blocks, kind, k, !generic);
    if (bias.has_value()) y.add_(*bias);
    return y.view(shape);
  }
  auto out = at::empty({rows, n}, x.options());
  if (is_f32(isa)) {
    auto xsum = x2.view({rows, k / 32, 32}).sum(-1).contiguous();
    Args a{x2.data_ptr<float>(), xsum.data_ptr<float>(), blocks.data_ptr<uint8_t>(), out.data_ptr<float>(),
           rows, n, k, kind, blocks.size(1)};
    const RowsFn fn = pick_f32(isa);
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) { fn(a, begin, end); });
  } else {
    quant_dot::linear(x2, blocks, kind, out, isa);
  }
  if (bias.has_value()) out.add_(*bias);
  return out.view(shape);
}

std::vector<std::string> quant_variants() {
  std::vector<std::string> v = quant_dot::variants_here();
  v.push_back("f32-generic");
  if (has_avx2()) v.push_back("f32-avx2");
  return v;
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                        const c10::optional<at::Tensor>& bias, int64_t dense_from_rows) {
  return quant_linear_isa(x, blocks, kind, bias, dense_from_rows, "auto");
}
