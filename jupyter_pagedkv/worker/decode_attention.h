// Paged decode attention on the CPU (decode_attention.cpp); shared by the C++ decode loop
// (native_decode.cpp) and, through the extension module, by attention.paged_attention_torch.
#pragma once
#include <ATen/ATen.h>

#include <string>

// query [rows, heads, d] (one token per row); k_cache / v_cache one layer's [blocks, block_size,
// kv_heads, d]; table [>= rows, max_blocks] int64, each row's blocks in order; lens [>= rows]
// int32, each row's context length including its new token; window > 0 keeps the last `window`
// positions (a sliding window), 0 keeps all. Returns [rows, heads, d] in the query's dtype.
// A quantized cache (int8 or float8_e4m3fn codes) comes with k_scale / v_scale, float16
// [blocks, block_size, kv_heads]: a stored value is code * scale (kv_cache_dtype, docs/design.md).
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& table, const at::Tensor& lens, double scale, int64_t window,
                                  const c10::optional<at::Tensor>& k_scale = c10::nullopt,
                                  const c10::optional<at::Tensor>& v_scale = c10::nullopt);

// The same with one variant of the inner loops forced ("avx512", "avx2" or "generic"; a variant
// this CPU lacks falls back to the next narrower one): for tests that check they agree.
at::Tensor paged_decode_attention_isa(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                      const at::Tensor& table, const at::Tensor& lens, double scale, int64_t window,
                                      const std::string& isa, const c10::optional<at::Tensor>& k_scale = c10::nullopt,
                                      const c10::optional<at::Tensor>& v_scale = c10::nullopt);
