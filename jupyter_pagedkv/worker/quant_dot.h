// Decode-sized products from GGUF blocks with int8 activations (quant_dot.cpp): internal to
// quant_gemm.cpp, which chooses between them and its fp32-activation kernels.
#pragma once
#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

namespace quant_dot {

// Variant names: "generic" (portable C++), "avx2" (maddubs + madd), "avxvnni" (256-bit
// dpbusd, VEX), "avx512vnni" (dpbusd, two blocks per 512-bit register).
const std::vector<std::string>& all_variants();
// Those this CPU can run (checked at run time), and the one "auto" runs (fastest as measured).
std::vector<std::string> variants_here();
std::string best_here();

// out [rows, n] = Q8(x2) @ W^T: each row of x2 [rows, k] quantized to int8 per 32-element block
// (d = max|x| / 127, q = round(x / d)), then integer dot products with the blocks of W [n, k / 32
// * block bytes] of GGML type `kind` in the kernels' layout (quant_layout.h), one fp32 multiply
// per block. Refuses a variant this CPU lacks.
void linear(const at::Tensor& x2, const at::Tensor& blocks, int64_t kind, at::Tensor& out, const std::string& variant);

// (qx int8 [rows, k], dx, dx * sum(qx) [rows, k / 32]): x2's rows quantized as `variant` quantizes
// them inside `linear` (tests: every variant must give the portable loop's codes).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize(const at::Tensor& x2, const std::string& variant);

}  // namespace quant_dot
