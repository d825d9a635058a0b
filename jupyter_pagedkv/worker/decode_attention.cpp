// Paged decode attention on the CPU: each decode row attends over its own sequence's blocks,
// read where they lie.
//
// Why: the torch path gathers every row's blocks into one padded [rows, longest, kv_heads, d]
// copy and masks the padding, so a step reads the cache, writes the copy and reads it again, all
// at the longest sequence's length. This kernel reads each row's live keys and values once, for
// its own length (and only the last `window` of them under a sliding window). One work item is
// one (row, KV head): the query heads sharing that KV head (GQA) are scored together, so each
// key and value row is loaded once for all of them. Sums run in float32 in a fixed order that
// depends on nothing but the row itself, so a row's result does not change with the batch, the
// thread count or the machine's vector width (16-lane partial sums, always).
//
// The inner loops are compiled three times (AVX-512, AVX2, baseline) and the CPU picks one at
// run time, so one build serves every x86 machine; elsewhere the baseline is the compiler's.
//
// A quantized cache (kv_cache_dtype "int8" or "fp8_e4m3") holds int8 or e4m3 codes and one fp16
// scale per token and KV head (value = code * scale). Its codes are widened to float as they are
// read and the scale comes out of the sums: a key's score is (q . codes) * its scale, a value's
// weight is multiplied by its scale once, so the inner loops stay the same loops over another
// element type. The model-dtype cache ("auto") instantiates the very code it did before.
#include "decode_attention.h"
#include "decode_lanes.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace pkv_lanes;

// T: the query's element type; K: the cache's (T itself, or a quantized code with scales).
template <typename T, typename K>
constexpr bool kQuantized = !std::is_same_v<T, K>;

template <typename T, typename K>
struct Args {
  const T* q;            // [rows, heads, d], row stride q_row, head stride d
  const K* k;            // [blocks, block_size, kv_heads, d], contiguous
  const K* v;
  const c10::Half* ks;   // quantized caches: [blocks, block_size, kv_heads] scales, contiguous
  const c10::Half* vs;
  const int64_t* table;  // [rows, max_blocks]
  const int32_t* lens;   // [rows]
  T* out;                // [rows, heads, d], contiguous
  int64_t q_row, heads, kv_heads, d, block_size, max_blocks, window;
  float scale;
};

// One (row, KV head). `scratch` holds the group's query in float, its sums, its scores and (the
// 16-key path) 16 keys' partial sums per query head.
// D > 0 fixes the head size at compile time (common sizes unroll fully), 0 reads it from `a`.
template <typename T, typename K, int D, bool Wide>
PAGEDKV_INLINE void item_body(const Args<T, K>& a, int64_t item, std::vector<float>& scratch) {
  const int64_t row = item / a.kv_heads, g = item % a.kv_heads;
  const int64_t group = a.heads / a.kv_heads, d = D > 0 ? D : a.d;
  const int64_t len = a.lens[row];
  const int64_t start = a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0;
  const int64_t n = len - start;
  // Float, bf16 and e4m3 caches with a head size fixed at compile time, under AVX-512 (`Wide`): a
  // key or value row is widened into registers once and used by every query head of the group
  // (widening is exact; an e4m3 row's scale multiplies the sums as below). The same sums in the
  // same order as the lane-by-lane loops, so every variant gives the same bits; AVX2 keeps those
  // loops, as it spilled these 64-byte vectors to the stack (2.2x slower). An e4m3 cache gained
  // 2.2-2.5x (a table lookup a code, once a group instead of once a query head); int8's own loops
  // stayed faster than widening its rows as vectors (92-111 against 132-140 ms, 30 layers of 32
  // rows of 400 tokens), so int8 keeps them.
  constexpr bool kWhole = Wide && (std::is_same_v<K, Fp8E4M3> || (!kQuantized<T, K> && kVectorLoads<K>)) &&
                          D > 0 && D % kLanes == 0;
  constexpr int kChunks = D > 0 ? D / kLanes : 1;
  scratch.resize(static_cast<size_t>(group * (2 * d + n + (kWhole ? kLanes * kLanes : 0))));
  float* q = scratch.data();
  float* acc = q + group * d;
  float* scores = acc + group * d;
  for (int64_t j = 0; j < group; ++j) {
    const T* src = a.q + row * a.q_row + (g * group + j) * d;
    for (int64_t i = 0; i < d; ++i) q[j * d + i] = to_float(src[i]);
  }
  const int64_t* blocks = a.table + row * a.max_blocks;
  const int64_t stride = a.kv_heads * d;
  // A key's slot, asking for the key and value kAhead positions on.
  const auto slot_of = [&](int64_t p) {
    if (p + kAhead < len) {
      const int64_t next = blocks[(p + kAhead) / a.block_size] * a.block_size + (p + kAhead) % a.block_size;
      prefetch(a.k + next * stride + g * d, d);
      prefetch(a.v + next * stride + g * d, d);
    }
    return blocks[p / a.block_size] * a.block_size + p % a.block_size;
  };
  int64_t p = start;
  if constexpr (kWhole) {
    // 16 keys at a time: each key widened once for the whole group (left to `dot`, the compiler
    // widened it again for every query head), each head's sum added exactly as `dot` adds it, and
    // the 16 keys' sums reduced together (`reduce16`: the same tree, so the same bits).
    float* parts = scores + group * n;     // [group][16 keys][16 lanes]
    for (; p + kLanes <= len; p += kLanes) {
      float key_scale[kLanes];             // a quantized key's scale times the softmax scale
      for (int t = 0; t < kLanes; ++t) {
        const int64_t slot = slot_of(p + t);
        if constexpr (kQuantized<T, K>) key_scale[t] = static_cast<float>(a.ks[slot * a.kv_heads + g]) * a.scale;
        const K* key = a.k + slot * stride + g * d;
        Floats16 kv[kChunks];
        for (int c = 0; c < kChunks; ++c) kv[c] = load16(key + c * kLanes);
        for (int64_t j = 0; j < group; ++j) {
          Floats16 part = {};
          for (int c = 0; c < kChunks; ++c) part += load16(q + j * d + c * kLanes) * kv[c];
          std::memcpy(parts + (j * kLanes + t) * kLanes, &part, sizeof part);
        }
      }
      for (int64_t j = 0; j < group; ++j) {
        Floats16 s = reduce16(parts + j * kLanes * kLanes);
        if constexpr (kQuantized<T, K>) s *= load16(key_scale);
        else s *= a.scale;
        std::memcpy(scores + j * n + (p - start), &s, sizeof s);
      }
    }
  }
  for (; p < len; ++p) {
    const int64_t slot = slot_of(p);
    const K* key = a.k + slot * stride + g * d;
    if constexpr (kQuantized<T, K>) {
      const float s = static_cast<float>(a.ks[slot * a.kv_heads + g]) * a.scale;
      for (int64_t j = 0; j < group; ++j) scores[j * n + (p - start)] = dot(q + j * d, key, d) * s;
    } else {
      for (int64_t j = 0; j < group; ++j) scores[j * n + (p - start)] = dot(q + j * d, key, d) * a.scale;
    }
  }
  std::fill(acc, acc + group * d, 0.f);
  float total[64];   // group <= 64, checked by the caller
  for (int64_t j = 0; j < group; ++j) {
    float* s = scores + j * n;
    // The maximum over 16 lanes, then over the lanes: the same value as one running maximum
    // (max is exact), without a 4-cycle dependency a score (it was 11% of the kernel).
    float lane_max[kLanes];
    std::fill(lane_max, lane_max + kLanes, -std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i < n; ++i) lane_max[i % kLanes] = std::max(lane_max[i % kLanes], s[i]);
    float m = lane_max[0];
    for (int l = 1; l < kLanes; ++l) m = std::max(m, lane_max[l]);
    for (int64_t i = 0; i < n; ++i) s[i] = exp_nonpositive(s[i] - m);
    float part[kLanes] = {0.f};
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
      for (int l = 0; l < kLanes; ++l) part[l] += s[i + l];
    for (int l = 0; i < n; ++i, ++l) part[l] += s[i];
    total[j] = reduce(part);
  }
  for (int64_t p = start; p < len; ++p) {
    const int64_t slot = blocks[p / a.block_size] * a.block_size + p % a.block_size;
    const K* value = a.v + slot * stride + g * d;
    if constexpr (kWhole) {
      Floats16 vv[kChunks];
      for (int c = 0; c < kChunks; ++c) vv[c] = load16(value + c * kLanes);
      float value_scale = 1.f;
      if constexpr (kQuantized<T, K>) value_scale = static_cast<float>(a.vs[slot * a.kv_heads + g]);
      for (int64_t j = 0; j < group; ++j) {
        float w = scores[j * n + (p - start)];
        if constexpr (kQuantized<T, K>) w *= value_scale;
        for (int c = 0; c < kChunks; ++c) {
          Floats16 sum;
          std::memcpy(&sum, acc + j * d + c * kLanes, sizeof sum);
          sum += w * vv[c];
          std::memcpy(acc + j * d + c * kLanes, &sum, sizeof sum);
        }
      }
    } else if constexpr (kQuantized<T, K>) {
      const float s = static_cast<float>(a.vs[slot * a.kv_heads + g]);
      for (int64_t j = 0; j < group; ++j) axpy(acc + j * d, scores[j * n + (p - start)] * s, value, d);
    } else {
      for (int64_t j = 0; j < group; ++j) axpy(acc + j * d, scores[j * n + (p - start)], value, d);
    }
  }
  for (int64_t j = 0; j < group; ++j) {
    T* dst = a.out + (row * a.heads + g * group + j) * d;
    const float inv = 1.f / total[j];
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(acc[j * d + i] * inv);
  }
}

template <typename T, typename K>
using ItemFn = void (*)(const Args<T, K>&, int64_t, std::vector<float>&);

template <typename T, typename K, int D>
void item_generic(const Args<T, K>& a, int64_t item, std::vector<float>& scratch) {
  item_body<T, K, D, false>(a, item, scratch);
}

#if defined(__x86_64__) && defined(__GNUC__)
template <typename T, typename K, int D>
__attribute__((target("avx2,fma"))) void item_avx2(const Args<T, K>& a, int64_t item, std::vector<float>& scratch) {
  item_body<T, K, D, false>(a, item, scratch);
}
template <typename T, typename K, int D>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma"))) void item_avx512(const Args<T, K>& a, int64_t item,
                                                                                std::vector<float>& scratch) {
  item_body<T, K, D, true>(a, item, scratch);
}
#endif

// The widest variant this CPU runs; `isa` ("avx512", "avx2", "generic") asks for one, so tests
// can check that they agree bit for bit.
enum class Isa { kAuto, kAvx512, kAvx2, kGeneric };

template <typename T, typename K, int D>
ItemFn<T, K> pick_isa(Isa isa) {
#if defined(__x86_64__) && defined(__GNUC__)
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if ((isa == Isa::kAuto || isa == Isa::kAvx512) && avx512) return &item_avx512<T, K, D>;
  if ((isa == Isa::kAuto || isa == Isa::kAvx512 || isa == Isa::kAvx2) && avx2) return &item_avx2<T, K, D>;
#endif
  return &item_generic<T, K, D>;
}

template <typename T, typename K>
ItemFn<T, K> pick(int64_t head_dim, Isa isa) {
  switch (head_dim) {
    case 64: return pick_isa<T, K, 64>(isa);
    case 128: return pick_isa<T, K, 128>(isa);
    default: return pick_isa<T, K, 0>(isa);
  }
}

// K: the cache's element type; `ks`/`vs` its scales when it is quantized (else undefined).
template <typename T, typename K>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& ks, const at::Tensor& vs,
         const at::Tensor& table, const at::Tensor& lens, at::Tensor& out, double scale, int64_t window, Isa isa) {
  const c10::Half* kscale = kQuantized<T, K> ? ks.data_ptr<c10::Half>() : nullptr;
  const c10::Half* vscale = kQuantized<T, K> ? vs.data_ptr<c10::Half>() : nullptr;
  Args<T, K> a{q.data_ptr<T>(), static_cast<const K*>(k.data_ptr()), static_cast<const K*>(v.data_ptr()),
               kscale, vscale, table.data_ptr<int64_t>(), lens.data_ptr<int32_t>(), out.data_ptr<T>(), q.stride(0),
               q.size(1), k.size(2), q.size(2), k.size(1), table.size(1), window, static_cast<float>(scale)};
  const ItemFn<T, K> fn = pick<T, K>(a.d, isa);
  at::parallel_for(0, q.size(0) * a.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t item = begin; item < end; ++item) fn(a, item, scratch);
  });
}

// The query's element type T, then the cache's: T itself, or int8 / fp8 e4m3 codes with scales.
template <typename T>
void run_cache(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& ks,
               const at::Tensor& vs, const at::Tensor& table, const at::Tensor& lens, at::Tensor& out, double scale,
               int64_t window, Isa isa) {
  switch (k.scalar_type()) {
    case at::kChar: run<T, int8_t>(q, k, v, ks, vs, table, lens, out, scale, window, isa); break;
    case at::kFloat8_e4m3fn: run<T, Fp8E4M3>(q, k, v, ks, vs, table, lens, out, scale, window, isa); break;
    default: run<T, T>(q, k, v, ks, vs, table, lens, out, scale, window, isa); break;
  }
}

at::Tensor attend(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                  const at::Tensor& table, const at::Tensor& lens, double scale, int64_t window, Isa isa) {
  // Named for torch.profiler (bench step_profile counts it as attention, not as overhead).
  RECORD_FUNCTION("pagedkv::paged_decode_attention", std::vector<c10::IValue>());
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_attention: query [rows, heads, d] and caches [blocks, block_size, kv_heads, d]");
  const bool quantized = k_cache.scalar_type() == at::kChar || k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK((quantized || query.scalar_type() == k_cache.scalar_type()) && k_cache.is_contiguous()
                  && v_cache.is_contiguous() && v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_decode_attention: contiguous caches in the query's dtype, int8 or float8_e4m3fn");
  TORCH_CHECK(quantized == (k_scale.has_value() && v_scale.has_value()),
              "paged_decode_attention: an int8 or float8_e4m3fn cache takes k_scale and v_scale, "
              "another none");
  at::Tensor ks, vs;
  if (quantized) {
    ks = *k_scale;
    vs = *v_scale;
    TORCH_CHECK(ks.scalar_type() == at::kHalf && vs.scalar_type() == at::kHalf && ks.is_contiguous()
                    && vs.is_contiguous() && ks.sizes() == k_cache.sizes().slice(0, 3) && vs.sizes() == ks.sizes(),
                "paged_decode_attention: contiguous float16 scales [blocks, block_size, kv_heads]");
  }
  TORCH_CHECK(query.size(2) == k_cache.size(3) && query.size(1) % k_cache.size(2) == 0,
              "paged_decode_attention: head size and GQA grouping must match the cache");
  TORCH_CHECK(query.size(1) / k_cache.size(2) <= 64, "paged_decode_attention: at most 64 query heads per KV head");
  TORCH_CHECK(table.scalar_type() == at::kLong && lens.scalar_type() == at::kInt && table.size(0) >= query.size(0)
                  && lens.size(0) >= query.size(0),
              "paged_decode_attention: int64 block table and int32 lengths, a row each");
  // Rows are read with their stride; heads and features must be dense within a row.
  auto q = (query.stride(2) == 1 && query.stride(1) == query.size(2)) ? query : query.contiguous();
  auto t = table.is_contiguous() ? table : table.contiguous();
  auto l = lens.is_contiguous() ? lens : lens.contiguous();
  auto out = at::empty(query.sizes(), query.options());
  switch (query.scalar_type()) {
    case at::kFloat: run_cache<float>(q, k_cache, v_cache, ks, vs, t, l, out, scale, window, isa); break;
    case at::kBFloat16: run_cache<c10::BFloat16>(q, k_cache, v_cache, ks, vs, t, l, out, scale, window, isa); break;
    case at::kHalf: run_cache<c10::Half>(q, k_cache, v_cache, ks, vs, t, l, out, scale, window, isa); break;
    default: TORCH_CHECK(false, "paged_decode_attention: float32, bfloat16 or float16 only");
  }
  return out;
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& table, const at::Tensor& lens, double scale, int64_t window,
                                  const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale) {
  return attend(query, k_cache, v_cache, k_scale, v_scale, table, lens, scale, window, Isa::kAuto);
}

at::Tensor paged_decode_attention_isa(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                      const at::Tensor& table, const at::Tensor& lens, double scale, int64_t window,
                                      const std::string& isa, const c10::optional<at::Tensor>& k_scale,
                                      const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(isa == "avx512" || isa == "avx2" || isa == "generic", "isa: avx512, avx2 or generic");
  return attend(query, k_cache, v_cache, k_scale, v_scale, table, lens, scale, window,
                isa == "avx512" ? Isa::kAvx512 : isa == "avx2" ? Isa::kAvx2 : Isa::kGeneric);
}
