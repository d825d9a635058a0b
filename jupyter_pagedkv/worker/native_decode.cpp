// A decode-only engine step through Llama-shaped layers, in C++ (see native_decode.py for why).
//
// Every line computes what the Python lean loop (lean_forward.py) computes, with the same
// roundings in the same order, so the results are bit for bit the lean loop's, which are the
// model's own. Only the Python between the ops is gone, and, for fp32 and bf16 activations, the
// ATen calls for elementwise steps: a decode token's ~25 small ops a layer cost ~2-4 us each in
// dispatch and allocation, more than their arithmetic. Those are plain loops (row_loops.h), each rounding exactly where
// the ATen op it replaces rounds (one multiply, add or divide per rounding; -ffp-contract=off, so
// no fused multiply-add merges two). The lean loop calls the same loops for a prefill's rows
// (norm_rows, rotate_rows, gated_rows below). Reductions and transcendental functions (the norm's mean,
// SiLU's exp) stay ATen's own, whose summation order and approximations a loop would not match.
// Keep the two in step: the runner proves them equal on its first decode step and keeps the
// Python loop if they are not.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <cstring>
#include <type_traits>

#include "decode_attention.h"
#include "kv_quantize.h"
#include "quant_gemm.h"
#include "row_loops.h"

namespace {

// mkldnn::_linear_pointwise(x, packed_weight, bias, "none", [], ""): the packed GEMM.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x.contiguous());
  stack.emplace_back(w);
  stack.emplace_back(b);
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<c10::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// A projection: a oneDNN-packed weight (kind 0), or GGUF blocks of GGML type `kind` computed by
// quant_gemm.cpp (weights="packed"), as the lean loop's layers call them.
at::Tensor project(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b, int64_t kind,
                   int64_t dense_from_rows) {
  return kind == 0 ? packed_linear(x, w, b) : quant_linear(x, w, kind, b, dense_from_rows);
}

// transformers' Llama RMSNorm, op for op (lean_forward._rms_norm).
at::Tensor rms_norm(const at::Tensor& h, const at::Tensor& weight, double eps) {
  auto x = h.to(at::kFloat);
  x = x * at::rsqrt(x.pow(2).mean(-1, true) + eps);
  return weight * x.to(h.scalar_type());
}

// Store x [T, kv_heads, d] at `slots` of one layer's quantized cache (int8 or float8_e4m3fn
// codes) and its float16 scales [blocks, block_size, kv_heads]: kv_quant.write_quantized's codes
// and scales bit for bit (int8 with kv_quant.quantize's ATen ops, fp8's scale search in
// kv_quantize.cpp). Also the torch path's write where this module is loaded (attention.py).
void write_quantized(const at::Tensor& cache, const at::Tensor& scales, const at::Tensor& x, const at::Tensor& slots) {
  TORCH_CHECK(cache.scalar_type() == at::kChar || cache.scalar_type() == at::kFloat8_e4m3fn,
              "write_quantized: an int8 or float8_e4m3fn cache layer");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && slots.scalar_type() == at::kLong && x.dim() == 3 &&
                  x.size(1) == cache.size(-2) && x.size(2) == cache.size(-1) && slots.numel() == x.size(0),
              "write_quantized: float16 scales, int64 slots, x [T, kv_heads, d] matching the cache");
  TORCH_CHECK(cache.is_cpu() && scales.is_cpu() && x.is_cpu() && slots.is_cpu(), "write_quantized: CPU tensors");
  const int64_t kv_heads = cache.size(-2), d = cache.size(-1);
  at::Tensor q, scale;
  if (cache.scalar_type() == at::kChar) {
    auto xf = x.to(at::kFloat);
    scale = (xf.abs().amax(-1) / 127.0).clamp(6.103515625e-05, 65504.0).to(at::kHalf);  // float16's tiny, max
    q = (xf / scale.to(at::kFloat).unsqueeze(-1)).clamp(-127.0, 127.0).round().to(at::kChar);
  } else {
    std::tie(q, scale) = quantize_fp8_rows(x);
  }
  // index_copy_ has no float8 kernel on the CPU: the bytes are copied (a bit-exact move).
  cache.view({-1, kv_heads, d}).view(at::kByte).index_copy_(0, slots, q.view(at::kByte));
  scales.view({-1, kv_heads}).index_copy_(0, slots, scale);
}

// Rotary embedding of x [T, heads, d] (lean_forward._rotate).
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  return x * cos + at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1) * sin;
}

// --- fp32 and bf16 activations: the elementwise steps as loops (row_loops.h) ---
using pkv_rows::vectorized;

// Rows [0, rows) of `width` elements each, split over threads in runs of at least ~32K elements:
// a decode batch's few rows stay on the calling thread (no fork), a prefill's thousands spread.
// Each element's arithmetic is the same on any thread, so the split never changes a value.
template <typename F>
inline void over_rows(int64_t rows, int64_t width, const F& body) {
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, width));
  at::parallel_for(0, rows, grain, body);
}

// rms_norm for h [T, hidden]: the mean of squares as ATen's float `x.pow(2).mean(-1)` computes it
// (pow by 2 is x * x; mean is ATen's sum, then a division by the count), then x * (1 / sqrt(mean +
// eps)) rounded to T as `.to(h.dtype)` rounds it, and weight * that, rounded as `weight * x`
// rounds (rsqrt is 1 / sqrt in ATen's float kernels, both correctly rounded). The sum stays
// ATen's own: its order is its reduction kernel's.
template <typename T>
at::Tensor rms_norm_loops(const at::Tensor& h, const at::Tensor& weight, double eps) {
  const int64_t tokens = h.size(0), n = h.size(1);
  auto out = at::empty_like(h);
  // The squares in float: in `out` itself for fp32 (it is overwritten below), else their own.
  const at::Tensor squares = std::is_same_v<T, float> ? out : at::empty({tokens, n}, h.options().dtype(at::kFloat));
  const T* x = h.data_ptr<T>();
  float* sq = squares.data_ptr<float>();
  over_rows(tokens, n, [&](int64_t lo, int64_t hi) {
    vectorized([&]() PKV_ROWS_LAMBDA { pkv_rows::squares(x, sq, lo * n, hi * n); });
  });
  const at::Tensor sum = at::sum(squares, -1, true).contiguous();
  T* y = out.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  const float* m = sum.data_ptr<float>();
  over_rows(tokens, n, [&](int64_t lo, int64_t hi) {
    vectorized([&]() PKV_ROWS_LAMBDA { pkv_rows::norm_scale(x, w, m, y, n, static_cast<float>(eps), lo, hi); });
  });
  return out;
}

// Rotary embedding of the first `rotated` heads of qkv [T, all heads, d] into a new [T, rotated,
// d]: x * cos + rot(x) * sin, rot(x) = (-x[half:], x[:half]), three roundings as in `rotate`.
template <typename T>
at::Tensor rotate_loops(const at::Tensor& qkv, int64_t rotated, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = qkv.size(0), all = qkv.size(1), d = qkv.size(2);
  auto out = at::empty({tokens, rotated, d}, qkv.options());
  const T* x = qkv.data_ptr<T>();
  const T* c = cos.data_ptr<T>();
  const T* sn = sin.data_ptr<T>();
  T* y = out.data_ptr<T>();
  over_rows(tokens, rotated * d, [&](int64_t lo, int64_t hi) {
    vectorized([&]() PKV_ROWS_LAMBDA { pkv_rows::rotate(x, c, sn, y, all, rotated, d, lo, hi); });
  });
  return out;
}

// h += y, elementwise (h is this step's own buffer).
template <typename T>
void add_into(at::Tensor& h, const at::Tensor& y) {
  T* a = h.data_ptr<T>();
  const T* b = y.data_ptr<T>();
  const int64_t width = h.size(-1);
  over_rows(h.numel() / width, width, [&](int64_t lo, int64_t hi) {
    vectorized([&]() PKV_ROWS_LAMBDA { pkv_rows::add(a, b, lo * width, hi * width); });
  });
}

// silu(gate) * up for gate_up [T, 2 I]: ATen's SiLU, the product a loop.
template <typename T>
at::Tensor gated_loops(const at::Tensor& gate_up, int64_t intermediate) {
  auto act = at::silu(gate_up.slice(-1, 0, intermediate)).contiguous();
  T* a = act.data_ptr<T>();
  const T* up = gate_up.data_ptr<T>() + intermediate;
  over_rows(gate_up.size(0), intermediate, [&](int64_t lo, int64_t hi) {
    vectorized([&]() PKV_ROWS_LAMBDA { pkv_rows::gate(a, up, intermediate, 2 * intermediate, lo, hi); });
  });
  return act;
}

// K or V rows x [T, kv_heads, d] (tokens and heads at any stride, features contiguous) stored at their slots of a model-dtype cache
// layer [blocks, block_size, kv_heads, d]: index_copy_'s copy, row by row.
template <typename T>
void store_rows(const at::Tensor& cache, const at::Tensor& x, const int64_t* slots) {
  const int64_t tokens = x.size(0), kv_heads = x.size(1), d = x.size(2);
  T* base = cache.data_ptr<T>();
  const T* src = x.data_ptr<T>();
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t hd = 0; hd < kv_heads; ++hd)
      std::memcpy(base + (slots[t] * kv_heads + hd) * d, src + t * x.stride(0) + hd * x.stride(1), d * sizeof(T));
}

// Which elementwise code a step runs: ATen's ops, or the loops above for fp32 or bf16.
enum class Act { kAten, kFloat, kBF16 };

at::Tensor norm_step(Act act, const at::Tensor& h, const at::Tensor& weight, double eps) {
  if (act == Act::kFloat) return rms_norm_loops<float>(h, weight, eps);
  if (act == Act::kBF16) return rms_norm_loops<c10::BFloat16>(h, weight, eps);
  return rms_norm(h, weight, eps);
}

// Queries and keys (the first `rotated` heads of qkv) rotated.
at::Tensor rotate_step(Act act, const at::Tensor& qkv, int64_t rotated, const at::Tensor& cos, const at::Tensor& sin) {
  if (act == Act::kFloat) return rotate_loops<float>(qkv, rotated, cos, sin);
  if (act == Act::kBF16) return rotate_loops<c10::BFloat16>(qkv, rotated, cos, sin);
  return rotate(qkv.slice(1, 0, rotated), cos, sin);
}

// The residual: h + y, into h where the loops run (h is then the step's own buffer).
void residual_step(Act act, at::Tensor& h, const at::Tensor& y) {
  if (act == Act::kFloat) add_into<float>(h, y);
  else if (act == Act::kBF16) add_into<c10::BFloat16>(h, y);
  else h = h + y;
}

at::Tensor gated_step(Act act, const at::Tensor& gate_up, int64_t intermediate) {
  if (act == Act::kFloat) return gated_loops<float>(gate_up.contiguous(), intermediate);
  if (act == Act::kBF16) return gated_loops<c10::BFloat16>(gate_up.contiguous(), intermediate);
  auto parts = gate_up.split({intermediate, intermediate}, -1);
  return at::silu(parts[0]) * parts[1];
}

// One layer's K and V into a quantized or model-dtype cache layer.
// `direct`: the cache holds the activations' type (`act`'s), with int64 slots: rows are copied.
void store_kv(const at::Tensor& kc, const at::Tensor& vc, const c10::optional<at::Tensor>& ks,
              const c10::optional<at::Tensor>& vs, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slots, int64_t kv_heads, int64_t head_dim, bool direct, Act act) {
  if (ks.has_value()) {
    write_quantized(kc, *ks, k, slots);
    write_quantized(vc, *vs, v, slots);
  } else if (direct && act == Act::kFloat) {
    store_rows<float>(kc, k, slots.data_ptr<int64_t>());
    store_rows<float>(vc, v, slots.data_ptr<int64_t>());
  } else if (direct && act == Act::kBF16) {
    store_rows<c10::BFloat16>(kc, k, slots.data_ptr<int64_t>());
    store_rows<c10::BFloat16>(vc, v, slots.data_ptr<int64_t>());
  } else {
    kc.view({-1, kv_heads, head_dim}).index_copy_(0, slots, k);
    vc.view({-1, kv_heads, head_dim}).index_copy_(0, slots, v);
  }
}

}  // namespace

// h [T, hidden] after the embedding; returns h after the last layer (before the final norm).
// Per layer i: norm weights and epsilons, packed weights and biases of q/k/v (stacked), o,
// gate/up (stacked) and down, and `kinds[4 i .. 4 i + 3]` how each of the four is packed (0:
// oneDNN, else a GGML block type; `dense_from_rows` as quant_linear.DENSE_FROM_ROWS). The caches are [layers, blocks, block_size, kv_heads, d]; `slots`
// [T] where each token's K/V goes; `table` [T, max_blocks] the sequences' blocks; `lens` [T]
// their lengths after this token; `windows` each layer's sliding window (0: none). A quantized
// cache (int8 / float8_e4m3fn) comes with `k_scale`/`v_scale` [layers, blocks, block_size, kv_heads].
at::Tensor decode_layers(
    at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
    const std::vector<at::Tensor>& norm1, const std::vector<double>& eps1,
    const std::vector<at::Tensor>& norm2, const std::vector<double>& eps2,
    const std::vector<at::Tensor>& w_qkv, const std::vector<c10::optional<at::Tensor>>& b_qkv,
    const std::vector<at::Tensor>& w_o, const std::vector<c10::optional<at::Tensor>>& b_o,
    const std::vector<at::Tensor>& w_gate_up, const std::vector<c10::optional<at::Tensor>>& b_gate_up,
    const std::vector<at::Tensor>& w_down, const std::vector<c10::optional<at::Tensor>>& b_down,
    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
    const at::Tensor& table, const at::Tensor& lens, int64_t heads, int64_t kv_heads, int64_t head_dim,
    int64_t intermediate, const std::vector<double>& scaling, const std::vector<int64_t>& windows,
    const std::vector<int64_t>& kinds, int64_t dense_from_rows, const c10::optional<at::Tensor>& k_scale,
    const c10::optional<at::Tensor>& v_scale) {
  const int64_t tokens = h.size(0);
  const int64_t layers = static_cast<int64_t>(norm1.size());
  // The loops' path: fp32 or bf16 activations, with rotary tables and norm weights of the same
  // type, and (for the direct K/V copy) a cache of that type with int64 slots. Anything else
  // takes the ATen ops.
  const auto type = h.scalar_type();
  bool loops = (type == at::kFloat || type == at::kBFloat16) && h.is_contiguous() && h.dim() == 2
               && cos.scalar_type() == type && sin.scalar_type() == type
               && cos.numel() == h.size(0) * head_dim && sin.numel() == cos.numel();
  for (int64_t i = 0; loops && i < layers; ++i)
    loops = norm1[i].scalar_type() == type && norm2[i].scalar_type() == type && norm1[i].is_contiguous()
            && norm2[i].is_contiguous();
  const Act act = !loops ? Act::kAten : type == at::kFloat ? Act::kFloat : Act::kBF16;
  const bool direct = loops && !k_scale.has_value() && k_cache.scalar_type() == type
                      && k_cache.is_contiguous() && v_cache.is_contiguous() && slots.scalar_type() == at::kLong
                      && slots.is_contiguous();
  const at::Tensor cos_c = loops ? cos.contiguous() : cos, sin_c = loops ? sin.contiguous() : sin;
  if (loops) h = h.clone();    // the step's own buffer: residual adds go into it, the caller's h is kept
  for (int64_t i = 0; i < layers; ++i) {
    auto x = norm_step(act, h, norm1[i], eps1[i]);
    auto qkv = project(x, w_qkv[i], b_qkv[i], kinds[4 * i], dense_from_rows).view({tokens, -1, head_dim});
    auto qk = rotate_step(act, qkv, heads + kv_heads, cos_c, sin_c);
    auto q = qk.slice(1, 0, heads);
    auto k = qk.slice(1, heads);
    auto v = qkv.slice(1, heads + kv_heads);
    auto kc = k_cache.select(0, i), vc = v_cache.select(0, i);
    c10::optional<at::Tensor> ks, vs;
    if (k_scale.has_value()) {
      ks = k_scale->select(0, i);
      vs = v_scale->select(0, i);
    }
    store_kv(kc, vc, ks, vs, k, v, slots, kv_heads, head_dim, direct, act);
    // attention.paged_attention_torch's decode rows: the same kernel, blocks read in place.
    auto o = paged_decode_attention(q, kc, vc, table, lens, scaling[i], windows[i], ks, vs);
    auto attn_out = project(o.reshape({tokens, heads * head_dim}), w_o[i], b_o[i], kinds[4 * i + 1], dense_from_rows);
    residual_step(act, h, attn_out);
    x = norm_step(act, h, norm2[i], eps2[i]);
    auto gate_up = project(x, w_gate_up[i], b_gate_up[i], kinds[4 * i + 2], dense_from_rows);
    auto mlp_in = gated_step(act, gate_up, intermediate);
    auto mlp_out = project(mlp_in, w_down[i], b_down[i], kinds[4 * i + 3], dense_from_rows);
    residual_step(act, h, mlp_out);
  }
  return h;
}

// --- The same elementwise steps, one at a time, for the steps the loop above does not serve ---
// A prefill's rows run the lean loop in Python (its attention is per chunk), which calls these
// instead of ATen's chains of ops (the norm alone is eight passes over the rows, each allocating):
// the loops where the tensors suit them (fp32 or bf16, contiguous, weights and rotary tables of the
// activations' type), else ATen's ops, with the same values either way (native_decode.py proves
// the loops against ATen's ops on the model's own weights before the lean loop uses them).

Act loops_for(const at::Tensor& x, bool suited) {
  const auto type = x.scalar_type();
  if (!suited || !x.is_contiguous() || (type != at::kFloat && type != at::kBFloat16)) return Act::kAten;
  return type == at::kFloat ? Act::kFloat : Act::kBF16;
}

// lean_forward._rms_norm(norm, h) for h [T, hidden].
at::Tensor norm_rows(const at::Tensor& h, const at::Tensor& weight, double eps) {
  const bool suited = h.dim() == 2 && weight.scalar_type() == h.scalar_type() && weight.is_contiguous()
                      && weight.numel() == h.size(1);
  return norm_step(loops_for(h, suited), h, weight, eps);
}

// lean_forward._rotate(qkv[:, :rotated], cos, sin) for qkv [T, heads, d], cos/sin [T, 1, d].
at::Tensor rotate_rows(const at::Tensor& qkv, int64_t rotated, const at::Tensor& cos, const at::Tensor& sin) {
  const bool suited = qkv.dim() == 3 && rotated <= qkv.size(1) && cos.scalar_type() == qkv.scalar_type()
                      && sin.scalar_type() == qkv.scalar_type() && cos.is_contiguous() && sin.is_contiguous()
                      && cos.numel() == qkv.size(0) * qkv.size(2) && sin.numel() == cos.numel();
  return rotate_step(loops_for(qkv, suited), qkv, rotated, cos, sin);
}

// silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:], for gate_up [T, 2 intermediate].
at::Tensor gated_rows(const at::Tensor& gate_up, int64_t intermediate) {
  const bool suited = gate_up.dim() == 2 && gate_up.size(1) == 2 * intermediate;
  return gated_step(loops_for(gate_up, suited), gate_up, intermediate);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The step holds no Python object: let other threads (the notebook's widgets, streams, a
  // monitor feed) run while it computes, as they do between the Python loop's ops.
  m.def("decode_layers", &decode_layers, "a decode-only step through Llama-shaped layers",
        py::call_guard<py::gil_scoped_release>());
  m.def("norm_rows", &norm_rows, "the Llama RMS norm of h [T, hidden]", py::call_guard<py::gil_scoped_release>());
  m.def("rotate_rows", &rotate_rows, "rotary embedding of the first `rotated` heads of qkv [T, heads, d]",
        py::call_guard<py::gil_scoped_release>());
  m.def("gated_rows", &gated_rows, "silu(gate) * up of gate_up [T, 2 intermediate]",
        py::call_guard<py::gil_scoped_release>());
  m.def("row_loops_avx2", [](bool allow) { return pkv_rows::allow_avx2.exchange(allow); },
        "whether the row loops (and kv_quantize's AVX-512 build) may run their vector builds (tests compare "
        "them with the baseline one); returns the old setting");
  m.def("write_quantized", &write_quantized, "x [T, kv_heads, d] into a quantized cache layer's slots, with scales",
        py::arg("cache"), py::arg("scales"), py::arg("x"), py::arg("slots"), py::call_guard<py::gil_scoped_release>());
  m.def("quantize_fp8_rows", &quantize_fp8_rows, "fp8 codes and searched float16 scales of x [..., d] (tests)",
        py::call_guard<py::gil_scoped_release>());
  // k_scale / v_scale: a quantized cache's scales (decode_attention.h), None for the model dtype's.
  m.def("paged_decode_attention", &paged_decode_attention, "decode rows attending over their own blocks in place",
        py::arg("query"), py::arg("k_cache"), py::arg("v_cache"), py::arg("table"), py::arg("lens"),
        py::arg("scale"), py::arg("window"), py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_attention_isa", &paged_decode_attention_isa, "the same, one ISA variant forced (tests)",
        py::arg("query"), py::arg("k_cache"), py::arg("v_cache"), py::arg("table"), py::arg("lens"),
        py::arg("scale"), py::arg("window"), py::arg("isa"), py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none(), py::call_guard<py::gil_scoped_release>());
}
