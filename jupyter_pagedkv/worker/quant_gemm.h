// GEMMs on GGUF blocks (Q4_0, Q4_1, Q8_0): see quant_gemm.cpp (and quant_dot.cpp for few rows).
#pragma once
#include <torch/extension.h>

// x [..., k] @ W^T (+ bias) with W as `blocks` [out, k / 32 * block bytes] of GGML type `kind`
// (2 Q4_0, 3 Q4_1, 8 Q8_0) in the kernels' layout (quant_layout.h: GGUF's blocks, eight features
// interleaved); below `dense_from_rows` rows (0: always) the activations are quantized
// to int8 and integer dot products run, from it on W is dequantized a tile at a time and ATen's
// fp32 GEMM runs.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                        const c10::optional<at::Tensor>& bias, int64_t dense_from_rows);
// The same, one variant forced, for tests and benchmarks: "auto", an int8-activation variant
// ("generic", "avx2", "avxvnni", "avx512vnni") or an fp32-activation one ("f32-generic", "f32-avx2").
at::Tensor quant_linear_isa(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                            const c10::optional<at::Tensor>& bias, int64_t dense_from_rows,
                            const std::string& isa_name);
// The fp32 [out, k] weight the GEMMs compute with.
at::Tensor quant_dequantize(const at::Tensor& blocks, int64_t kind, int64_t k);
// Rows `ids` of that weight (an embedding lookup).
at::Tensor quant_dequantize_rows(const at::Tensor& blocks, int64_t kind, int64_t k, const at::Tensor& ids);
// The kernels' layout of a GGUF tensor's rows of blocks (a new tensor of the same shape).
at::Tensor quant_interleave(const at::Tensor& gguf_rows, int64_t kind);
// The variants quant_linear_isa can run on this CPU.
std::vector<std::string> quant_variants();
