// A quantized KV cache's fp8 write on the CPU (kv_quantize.cpp): kv_quant.quantize's definition.
#pragma once
#include <ATen/ATen.h>

#include <tuple>

// x [..., d] (any float dtype) -> (codes [..., d] float8_e4m3fn, scales [...] float16): per row,
// the first of the scales absmax / 448 * (1 + j/16), j = 0..15 (float16, within its normal range),
// whose codes read back with the least squared error (summed in double).
std::tuple<at::Tensor, at::Tensor> quantize_fp8_rows(const at::Tensor& x);
