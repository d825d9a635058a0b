// Causal prefill attention on the CPU with AVX-512 (see prefill_attention.py for why).
//
// One call attends the queries of one prefill chunk, `q [n, heads, d]`, over one run of keys and
// values, `k/v [L, kv_heads, d]` (any row and head strides: a view of the paged cache, or of the
// layer's fused q/k/v projection, serves as is). Query
// i sees key j when j <= i + offset and, under a sliding window w, j > i + offset - w; offset 0
// with L == n is the square causal chunk that starts a sequence, offset >= L the whole of a
// prefix. It returns the output and each row's log-sum-exp, so the caller can merge a prefix's
// part with the chunk's own.
//
// How: flash attention (online softmax over blocks of 64 keys), with float32 scores and sums.
// A work item is one KV head and 32 query positions: the heads sharing that KV head (GQA) are
// stacked as rows of one tile, so each packed key and value block is read once for all of them.
// Scores come from register-tiled FMAs (float32) or VDPBF16PS (bfloat16: pairs of bf16 products
// summed into float32, the precision torch's flash kernel keeps); the softmax weights are rounded
// to the input dtype before they weigh the values, as that kernel does. Work items are taken
// from a shared counter, longest first, so the causal triangle's uneven items balance.
//
// This file is the dispatch: the checks of the tensors, the choice of element type and head size,
// and the work items handed to threads; the tile loop itself is prefill_tile.h.
#include <torch/extension.h>

#include <atomic>

#include "prefill_tile.h"

namespace {

using pkv_prefill::Args;

#if PKV_X86
using pkv_prefill::BF16;
using pkv_prefill::F32;
using pkv_prefill::kQ;

bool has_avx512() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq"); }
bool has_avx512_bf16() { return has_avx512() && __builtin_cpu_supports("avx512bf16"); }

template <typename E, int NV>
void run_all(const Args& a) {
  using T = typename E::T;
  static thread_local std::vector<T> kp, vp;    // the calling thread's; workers get the pointers
  switch (a.codes) {                            // a quantized cache is dequantized as it is packed
    case 1: pkv_prefill::pack<E, int8_t>(a, kp, vp); break;
    case 2: pkv_prefill::pack<E, pkv_codes::Fp8E4M3>(a, kp, vp); break;
    default: pkv_prefill::pack<E>(a, kp, vp); break;
  }
  const T* kdata = kp.data();
  const T* vdata = vp.data();
  const int64_t qblocks = (a.n + kQ - 1) / kQ, items = qblocks * a.kv_heads;
  // Longest first: with causal masking the last query blocks see the most keys.
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> fs;
    std::vector<T> ws;
    for (int64_t t = next.fetch_add(1); t < items; t = next.fetch_add(1)) {
      const int64_t qb = qblocks - 1 - t / a.kv_heads, g = t % a.kv_heads;
      pkv_prefill::Tile<E, NV>::run(a, kdata, vdata, g, qb * kQ, std::min(a.n, (qb + 1) * kQ), fs, ws);
    }
  });
  if (kp.capacity() * sizeof(T) > (size_t{64} << 20)) {    // kept for the next call only up to 64 MiB
    std::vector<T>().swap(kp);
    std::vector<T>().swap(vp);
  }
}
#endif  // PKV_X86

void check(const at::Tensor& t, const char* name, int64_t d) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 3 && t.size(2) == d && t.stride(2) == 1,
              name, " must be a CPU tensor [tokens, heads, ", d, "] with unit stride in the last dimension");
}

}  // namespace

bool supports(const at::Tensor& q) {
#if PKV_X86
  if (q.scalar_type() == at::kFloat) return has_avx512();
  if (q.scalar_type() == at::kBFloat16) return has_avx512_bf16();
#endif
  return false;
}

// (out [n, heads, d], lse [heads, n] float32) of q over k/v; see the top of this file. k/v may be a
// quantized cache's int8 / float8_e4m3fn codes, with k_scale / v_scale float16 [L, kv_heads].
std::tuple<at::Tensor, at::Tensor> attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                          double scale, int64_t offset, int64_t window,
                                          const c10::optional<at::Tensor>& k_scale,
                                          const c10::optional<at::Tensor>& v_scale) {
  const int64_t d = q.size(-1);
  check(q, "q", d);
  check(k, "k", d);
  check(v, "v", d);
  const int codes = k.scalar_type() == at::kChar ? 1 : k.scalar_type() == at::kFloat8_e4m3fn ? 2 : 0;
  TORCH_CHECK((codes != 0 || k.scalar_type() == q.scalar_type()) && v.scalar_type() == k.scalar_type(),
              "q, k, v: one dtype, or k and v int8 / float8_e4m3fn codes");
  TORCH_CHECK((codes != 0) == (k_scale.has_value() && v_scale.has_value()),
              "k_scale and v_scale come with int8 / float8_e4m3fn k and v, and only with them");
  if (codes != 0) {
    for (const auto* s : {&*k_scale, &*v_scale})
      TORCH_CHECK(s->scalar_type() == at::kHalf && s->dim() == 2 && s->size(0) == k.size(0) && s->size(1) == k.size(1),
                  "k_scale / v_scale: float16 [L, kv_heads]");
  }
  TORCH_CHECK(d == 64 || d == 128, "head size ", d, " is not served (64 or 128)");
  TORCH_CHECK(q.size(1) % k.size(1) == 0 && k.size(0) == v.size(0) && k.size(1) == v.size(1), "shapes disagree");
  TORCH_CHECK(supports(q), "this CPU lacks the instructions for ", q.scalar_type());
  auto out = at::empty({q.size(0), q.size(1), d}, q.options());
  auto lse = at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
  Args a{q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr<float>(), q.size(0), k.size(0),
         q.size(1), k.size(1), d, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
         offset, window, static_cast<float>(scale)};
  if (codes != 0) {
    a.codes = codes;
    a.ks = k_scale->data_ptr<at::Half>();
    a.vs = v_scale->data_ptr<at::Half>();
    a.ks_row = k_scale->stride(0), a.ks_head = k_scale->stride(1);
    a.vs_row = v_scale->stride(0), a.vs_head = v_scale->stride(1);
  }
  if (a.n == 0) return {out, lse};
#if PKV_X86
  if (q.scalar_type() == at::kFloat) {
    d == 64 ? run_all<F32, 4>(a) : run_all<F32, 8>(a);
  } else {
    d == 64 ? run_all<BF16, 4>(a) : run_all<BF16, 8>(a);
  }
#endif
  return {out, lse};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supports", &supports, "whether this CPU runs the kernel for q's dtype");
  m.def("attend", &attend, "causal (offset, window) attention of q over k/v: (out, lse)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"), py::arg("offset"), py::arg("window") = 0,
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());
}
