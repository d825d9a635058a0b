"""The C++ prefill attention kernel (worker/prefill_attention.cpp) equals the plain definition
(`kernels/reference.py`, fp32 from the same inputs): chunks that start a sequence, chunks after
block-aligned and unaligned prefixes read in place or gathered, sliding windows that cut part or
all of a prefix, GQA groups of 1 to 4, head sizes 64 and 128, both dtypes, inputs with the strides
the model and the lean loop give. Where this CPU lacks the instructions a dtype needs, the tests
check instead that the engine says so and keeps torch's SDPA (never a silent skip)."""
from __future__ import annotations

import pytest
import torch

from jupyter_pagedkv.worker import prefill_attention, sdpa
from jupyter_pagedkv.worker.attention import paged_attention_torch
from jupyter_pagedkv.worker.plan import Decision, decide_prefill_attention

from test_prefill_attention import TOLERANCE, expected, laid_out_consecutively, prefill_batch

DTYPES = [torch.float32, torch.bfloat16]


def kernel_for(dtype):
    """The kernel module where this CPU runs it for `dtype`, else None (and why, checked)."""
    why, module = decide_prefill_attention("auto", torch.device("cpu"), "torch", dtype, 64)
    if module is None:
        assert "lacks AVX-512" in why.reason or "did not build" in why.reason, why
    return module


def assert_native_refused(dtype) -> None:
    with pytest.raises(ValueError, match=r"^prefill_attention='native' cannot run here: .*; use 'auto' or 'torch'$"):
        decide_prefill_attention("native", torch.device("cpu"), "torch", dtype, 64)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_matches_the_reference_at_random_shapes(seed, dtype, monkeypatch):
    module = kernel_for(dtype)
    g = torch.Generator().manual_seed(100 + seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))   # noqa: E731
    kv_heads = [1, 2, 3][seed % 3]
    heads = kv_heads * [1, 3, 4][seed // 2 % 3]
    head_dim, block_size = [64, 128][seed % 2], [16, 5, 32][seed % 3]
    # a chunk that starts its sequence (longer than a key block), chunks after aligned and
    # unaligned prefixes, a one-token chunk after a long prefix, a chunk as long as its prefix
    chunks = [(0, draw(65, 200)), (block_size * draw(1, 12), draw(2, 130)), (draw(1, 300), draw(2, 64)),
              (draw(100, 400), 1), (70, 70)]
    window = [None, draw(8, 60), None, draw(60, 200)][seed % 4]
    calls = []
    monkeypatch.setattr(prefill_attention, "attend", lambda *a, **kw: calls.append(1) or _attend(*a, **kw))
    query, k_cache, v_cache, meta, new_k, new_v = prefill_batch(chunks, heads, kv_heads, head_dim, block_size,
                                                                dtype, g)
    scale = head_dim ** -0.5
    want = expected(query, k_cache, v_cache, meta, scale, window)
    k2, v2, meta2 = laid_out_consecutively(k_cache, v_cache, meta, block_size)
    for k, v, m in ((k_cache, v_cache, meta), (k2, v2, meta2)):     # blocks gathered, or read in place
        m.prefill_kernel = module
        for keys in ((new_k, new_v), (None, None)):     # own keys read in place, or gathered back
            out = paged_attention_torch(query, k, v, m, scale, window, *keys)
            assert out.dtype == dtype
            assert (out.float() - want.float()).abs().max().item() <= TOLERANCE[dtype]
    assert len(calls) == (0 if module is None else 4 * (len(chunks) + sum(s > 0 for s, _ in chunks)))


_attend = prefill_attention.attend


def reference(q, k, v, scale, offset, window):
    """fp64 attention of q [n, H, d] over k/v [L, KV, d] under the kernel's visibility rule."""
    n, heads, _ = q.shape
    group = heads // k.shape[1]
    kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    i, j = torch.arange(n).view(-1, 1), torch.arange(k.shape[0]).view(1, -1)
    visible = j <= i + offset
    if window:
        visible &= j > i + offset - window
    scores = torch.einsum("nhd,lhd->hnl", q.double(), kk).mul(scale).masked_fill(~visible, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1).nan_to_num(0.0), vv), torch.logsumexp(scores, -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, length, offset, window", [
    (1, 1, 0, 0),          # one token
    (64, 64, 0, 0),        # exactly one block of keys and two query tiles
    (97, 97, 0, 0),        # ragged ends
    (5, 300, 300, 0),      # all of a prefix visible
    (40, 130, 130, 50),    # a window over a prefix: early keys cut for every query
    (40, 130, 130, 5),     # a window so short that some queries see none of the prefix
])
def test_edges_and_log_sum_exps(dtype, n, length, offset, window):
    module = kernel_for(dtype)
    if module is None:      # no kernel here: insisting on it must say so (kernel_for checked why)
        assert_native_refused(dtype)
        return
    g = torch.Generator().manual_seed(n + length)
    # q/k/v as the lean loop slices them out of one fused projection: strided rows
    qkv = torch.randn(max(n, length), 9 + 2 * 3, 64, generator=g).to(dtype)
    q, k, v = qkv[:n, :9], qkv[:length, 9:12], qkv[:length, 12:]
    out, lse = prefill_attention.attend(module, q, k, v, 0.125, offset, window)
    want, want_lse = reference(q, k, v, 0.125, offset, window)
    assert (out.double() - want).abs().max().item() <= TOLERANCE[dtype]
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    assert (lse.double()[seen] - want_lse[seen]).abs().max().item() <= 1e-5
    assert not out.double()[~seen.t()].any()          # rows that saw no key are zero, not NaN


@pytest.mark.parametrize("dtype", DTYPES)
def test_heads_laid_out_as_the_models_forward_gives_them(dtype):
    module = kernel_for(dtype)
    if module is None:
        assert_native_refused(dtype)
        return
    g = torch.Generator().manual_seed(3)
    # transformers' rotary output is [1, heads, T, d] contiguous: as [T, heads, d] the head stride is T * d
    q = torch.randn(6, 150, 64, generator=g).to(dtype).transpose(0, 1)
    k = torch.randn(2, 150, 64, generator=g).to(dtype).transpose(0, 1)
    v = torch.randn(2, 150, 64, generator=g).to(dtype).transpose(0, 1)
    out, _ = prefill_attention.attend(module, q, k, v, 0.125, 0, None)
    assert (out.double() - reference(q, k, v, 0.125, 0, 0)[0]).abs().max().item() <= TOLERANCE[dtype]


def test_modes_and_what_the_engine_is_told():
    cpu = torch.device("cpu")
    assert decide_prefill_attention("torch", cpu, "torch", torch.float32, 64) == (
        Decision("sdpa", "prefill_attention='torch'"), None)
    assert decide_prefill_attention("auto", cpu, "torch", torch.float16, 64) == (
        Decision("sdpa", "the kernel serves float32 and bfloat16, not float16"), None)
    assert decide_prefill_attention("auto", cpu, "torch", torch.float32, 16)[1] is None
    assert decide_prefill_attention("auto", cpu, "triton", torch.float32, 64) == (
        Decision("triton", "the Triton backend's paged attention kernel"), None)
    with pytest.raises(ValueError, match=r"^prefill_attention='native' cannot run here: the kernel serves head "
                                         r"sizes 64 and 128, not 16; use 'auto' or 'torch'$"):
        decide_prefill_attention("native", cpu, "torch", torch.float32, 16)
    with pytest.raises(ValueError, match="must be 'auto', 'native' or 'torch'"):
        decide_prefill_attention("fast", cpu, "torch", torch.float32, 64)
    for dtype in DTYPES:
        why, module = decide_prefill_attention("auto", cpu, "torch", dtype, 64)
        if module is not None:
            assert why.choice == "native"
        else:
            assert why.choice == "sdpa" and "AVX-512" in why.reason
            with pytest.raises(ValueError, match="cannot run here"):
                decide_prefill_attention("native", cpu, "torch", dtype, 64)


def test_soft_capped_logits_keep_torchs_path(monkeypatch):
    module = kernel_for(torch.float32)
    g = torch.Generator().manual_seed(4)
    query, k_cache, v_cache, meta, new_k, new_v = prefill_batch([(0, 40), (30, 20)], 6, 2, 64, 16, torch.float32, g)
    meta.prefill_kernel = module
    monkeypatch.setattr(prefill_attention, "attend", lambda *a, **kw: pytest.fail("kernel used with a softcap"))
    monkeypatch.setattr(prefill_attention, "_native_chunk", lambda *a, **kw: pytest.fail("kernel used with a softcap"))
    paged_attention_torch(query, k_cache, v_cache, meta, 0.125, None, new_k, new_v, softcap=30.0)


def test_merging_a_part_that_saw_nothing_keeps_the_other():
    o1, o2 = torch.full((3, 2, 4), 7.0), torch.randn(3, 2, 4)
    lse1 = torch.full((2, 3), float("-inf"))
    assert torch.equal(sdpa.merge_by_lse(o1, lse1.t(), o2, torch.zeros(2, 3).t()), o2)


def test_a_kernel_that_does_not_build_is_one_line_and_auto_falls_back(tmp_path, monkeypatch):
    from jupyter_pagedkv.worker.native_build import LazyModule, NativeBuildError

    # Its own extensions dir: each run's source path is new, so is its hashed build name.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++\n")
    module = LazyModule("jupyter_pagedkv_test_broken", bad, "the C++ prefill attention kernel",
                        "prefill_attention='torch'", ["-O0"])
    for _ in range(2):        # the second load answers from memory with the same line
        with pytest.raises(NativeBuildError, match=r"^the C\+\+ prefill attention kernel did not build \(Error "
                                                   r"building extension 'jupyter_pagedkv_test_broken_[0-9a-f]{10}'\): install "
                                                   r"g\+\+ and ninja \(pip install ninja\), or use "
                                                   r"prefill_attention='torch'$"):
            module.load()
    monkeypatch.setattr(prefill_attention, "_KERNEL", module)
    why, kernel = decide_prefill_attention("auto", torch.device("cpu"), "torch", torch.float32, 64)
    assert kernel is None and why.choice == "sdpa" and why.reason.startswith("the C++ prefill attention kernel did not build")
    with pytest.raises(ValueError, match="^prefill_attention='native' cannot run here: the C\\+\\+ prefill"):
        decide_prefill_attention("native", torch.device("cpu"), "torch", torch.float32, 64)


@pytest.mark.parametrize("dtype, why", [(torch.float32, "this CPU lacks AVX-512"),
                                        (torch.bfloat16, "this CPU lacks AVX-512 BF16")])
def test_a_cpu_without_the_instructions_keeps_sdpa_and_says_why(monkeypatch, dtype, why):
    class NoAvx512:     # the built module as a CPU without AVX-512 (BF16) answers
        @staticmethod
        def supports(q):
            return False

    monkeypatch.setattr(prefill_attention, "load_kernel", lambda: NoAvx512)
    assert decide_prefill_attention("auto", torch.device("cpu"), "torch", dtype, 64) == (Decision("sdpa", why), None)
    assert_native_refused(dtype)
