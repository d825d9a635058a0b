// GEMMs on GGUF blocks (Q4_0, Q4_1, Q8_0), fp32 activations: see quant_gemm.cpp.
#pragma once
#include <torch/extension.h>

// x [..., k] @ W^T (+ bias) with W as `blocks` [out, k / 32 * block bytes] of GGML type `kind`
// (2 Q4_0, 3 Q4_1, 8 Q8_0); from `dense_from_rows` rows on (0: never) W is dequantized once and
// ATen's GEMM runs.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                        const c10::optional<at::Tensor>& bias, int64_t dense_from_rows);
// The same, one ISA variant forced ("auto", "avx2" or "generic"), for tests.
at::Tensor quant_linear_isa(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                            const c10::optional<at::Tensor>& bias, int64_t dense_from_rows,
                            const std::string& isa_name);
// The fp32 [out, k] weight the GEMMs compute with.
at::Tensor quant_dequantize(const at::Tensor& blocks, int64_t kind, int64_t k);
