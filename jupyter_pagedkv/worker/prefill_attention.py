"""Prefill chunks' attention on the torch backend: the C++ kernel (prefill_attention.cpp) where
the execution plan chose it, else torch's SDPA; what the kernel serves, and its calls.

A chunk attends its own keys causally and, after a prefix (a cached prompt, or the earlier chunks
of a long one), every prefix key: the two parts apart, merged by their log-sum-exps (sdpa.py), so
no `[n, context]` mask exists; a window that cuts or soft-capping takes a dense mask instead.

Why: a long prompt's prefill is mostly attention (at 2,048 tokens about half of it in bf16, more
at 8k), and torch's CPU flash kernel computes its scores through MKL, which on AMD CPUs runs its
generic code path, and in bf16 at fp32 speed. The C++ kernel tiles the scores in registers with
AVX-512 FMAs (fp32) or VDPBF16PS (bf16 pairs summed in fp32), stacks the query heads that share a
KV head (GQA) so each key is read once for all of them, and reads keys and values where they lie
(the cache's blocks, or this step's projections). One layer of the embedded model, 2,048 tokens,
2 threads: fp32 30 ms against SDPA's 45 ms, bf16 18 ms against 45 ms (docs/benchmarks.md).

What it serves: fp32 on AVX-512 CPUs, bf16 on AVX-512 BF16 ones (Zen 4, Sapphire Rapids and
later), head sizes 64 and 128, no logit soft-capping; sliding windows yes. Anything else keeps
torch's SDPA (attention.py). Sums are in float32 in another order than SDPA's, so outputs agree
with it to float32 rounding, not bit for bit; exactness is checked against transformers.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .kv_quant import dequantize
from .native_build import LazyModule
from .paged_metadata import PagedMetadata, PrefillChunk
from .sdpa import attend as sdpa_attend, attend_after_prefix, merge_by_lse, split_prefix_supported


SOURCE = Path(__file__).with_name("prefill_attention.cpp")
HEAD_SIZES = (64, 128)
# OpenMP: at::parallel_for, a header template, splits work only where the extension is built with it.
_KERNEL = LazyModule("jupyter_pagedkv_prefill_attention", SOURCE, "the C++ prefill attention kernel",
                     "prefill_attention='torch'", ["-O3", "-fopenmp"], ["-fopenmp"])


def load_kernel():
    """The compiled module (built on first use, cached by torch for later processes); raises
    NativeBuildError with one line on why not."""
    return _KERNEL.load()


def problem(device: torch.device, backend: str, dtype: torch.dtype, head_dim: int | None) -> str | None:
    """Why the kernel cannot serve this engine, or None (worker/plan.py decides with it)."""
    if device.type != "cpu" or backend != "torch":
        return "the kernel is for the CPU's torch backend"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"the kernel serves float32 and bfloat16, not {str(dtype).removeprefix('torch.')}"
    if head_dim not in HEAD_SIZES:
        return f"the kernel serves head sizes 64 and 128, not {head_dim}"
    return None


def attend(module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, offset: int,
           window: int | None, k_scale: torch.Tensor | None = None,
           v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`q [n, heads, d]` over `k/v [L, kv_heads, d]`: query i sees key j when j <= i + offset
    (and j > i + offset - window). Returns (out [n, heads, d], lse [heads, n] float32). k/v may
    be a quantized cache's int8 / float8_e4m3fn codes with their fp16 scales `[L, kv_heads]`:
    the kernel dequantizes them as it packs its key and value blocks."""
    return module.attend(q, k, v, scale, offset, window or 0, k_scale, v_scale)


def _scales(chunk: PrefillChunk, scale: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
    """A quantized cache's scales `[blocks, block_size, kv_heads]` for the chunk's blocks lo .. hi - 1,
    as `[(hi - lo) * block_size, kv_heads]` (None for a cache in the model's dtype)."""
    return None if scale is None else chunk.keys(scale.unsqueeze(-1), lo, hi).squeeze(-1)


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata,
                      scale: float, window: int | None = None, new_k: torch.Tensor | None = None,
                      new_v: torch.Tensor | None = None, softcap: float | None = None,
                      out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Every prefill chunk of the step: `query [T, heads, d]` (the whole step's rows); returns
    `out` (`[T, heads, d]`, new when None) with each chunk's rows filled. `new_k`/`new_v` (this
    step's keys and values) let a chunk read its own keys in place instead of gathering them
    back; only the prefix before a chunk is read from the blocks (a quantized cache's with its
    scales `k_scale`/`v_scale`: dequantized as gathered for SDPA, by the kernel as it packs them)."""
    out = torch.empty_like(query) if out is None else out
    kernel = meta.prefill_kernel if softcap is None else None
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    for chunk in meta.prefills:
        s, n = chunk.q_start, chunk.q_len
        if new_k is not None:      # the chunk's own keys and values, read in place
            own_k, own_v = new_k[s:s + n], new_v[s:s + n]
        else:
            slots = meta.slot_mapping[s:s + n]
            own_k = dequantize(k_cache.view(-1, kvh, d)[slots], None if k_scale is None
                               else k_scale.reshape(-1, kvh)[slots], query.dtype)
            own_v = dequantize(v_cache.view(-1, kvh, d)[slots], None if v_scale is None
                               else v_scale.reshape(-1, kvh)[slots], query.dtype)
        cut = window if window is not None and chunk.ctx_len > window else None
        if kernel is not None:
            out[s:s + n] = _native_chunk(kernel, query[s:s + n], own_k, own_v, chunk, k_cache, v_cache, scale, cut,
                                         k_scale, v_scale)
        else:
            out[s:s + n] = _sdpa_chunk(query[s:s + n], own_k, own_v, chunk, k_cache, v_cache, scale, cut, softcap,
                                       k_scale, v_scale)
    return out


def _native_chunk(kernel, q: torch.Tensor, own_k: torch.Tensor, own_v: torch.Tensor, chunk: PrefillChunk,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, window: int | None,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """A prefill chunk through the C++ kernel: its own keys causally, then (if the chunk follows a
    prefix) the prefix's keys read where they lie, the two parts merged by their log-sum-exps.
    Under a sliding window only the prefix blocks some query of the chunk can see are read. A
    quantized cache's prefix goes to the kernel as codes with its scales; the chunk's own keys go as
    computed (unquantized: docs/design.md, "Quantized KV cache")."""
    n, ctx, bs = chunk.q_len, chunk.ctx_len, k_cache.shape[1]
    start = ctx - n
    o, lse = attend(kernel, q, own_k, own_v, scale, 0, window)
    first_visible = 0 if window is None else max(0, start - window + 1)
    if start == 0 or first_visible >= start:
        return o
    lo = first_visible // bs * bs
    hi = -(-start // bs)
    pk = chunk.keys(k_cache, lo // bs, hi)[:start - lo]
    pv = chunk.keys(v_cache, lo // bs, hi)[:start - lo]
    ks, vs = (None if c is None else _scales(chunk, c, lo // bs, hi)[:start - lo] for c in (k_scale, v_scale))
    o1, lse1 = attend(kernel, q, pk, pv, scale, start - lo, window, ks, vs)
    return merge_by_lse(o1, lse1.t(), o, lse.t())       # the kernel's lse is [heads, n]


def _sdpa_chunk(query: torch.Tensor, own_k: torch.Tensor, own_v: torch.Tensor, chunk: PrefillChunk,
                k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, window: int | None,
                softcap: float | None, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """A prefill chunk through torch: `query [n, heads, d]` -> `[n, heads, d]`; prefix rows of a
    quantized cache are dequantized to the query's dtype as they are read."""
    n, ctx, bs = chunk.q_len, chunk.ctx_len, k_cache.shape[1]
    gqa = query.shape[1] != k_cache.shape[2]
    q = query.transpose(0, 1).unsqueeze(0)      # [1, heads, n, d]
    if window is None and ctx == n:
        # The chunk starts the sequence: its own keys are the whole context.
        o = sdpa_attend(q, own_k.transpose(0, 1).unsqueeze(0), own_v.transpose(0, 1).unsqueeze(0), scale,
                        is_causal=True, enable_gqa=gqa, softcap=softcap)
    elif window is None and softcap is None and split_prefix_supported(query, own_v):
        # After a prefix: every query sees every prefix key, and its own chunk causally.
        start = ctx - n
        pk = chunk.keys(k_cache, 0, -(-start // bs), k_scale, query.dtype)[:start].transpose(0, 1).unsqueeze(0)
        pv = chunk.keys(v_cache, 0, -(-start // bs), v_scale, query.dtype)[:start].transpose(0, 1).unsqueeze(0)
        o = attend_after_prefix(q, pk, pv, own_k.transpose(0, 1).unsqueeze(0), own_v.transpose(0, 1).unsqueeze(0),
                                scale)
    else:
        # A window that cuts, logit soft-capping, or no flash kernel with its log-sum-exp:
        # a dense [n, keys] mask over the keys some query of the chunk can see.
        lo = 0 if window is None else max(0, ctx - n - window + 1) // bs * bs
        hi = len(chunk.block_ids)
        k = chunk.keys(k_cache, lo // bs, hi, k_scale, query.dtype)[:ctx - lo]
        v = chunk.keys(v_cache, lo // bs, hi, v_scale, query.dtype)[:ctx - lo]
        if k_scale is not None:     # the chunk attends its own keys as computed, not as stored
            k = torch.cat([k[:ctx - lo - n], own_k.to(k.dtype)])
            v = torch.cat([v[:ctx - lo - n], own_v.to(v.dtype)])
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        qpos = torch.arange(ctx - n, ctx, device=query.device).view(-1, 1)
        kpos = torch.arange(lo, ctx, device=query.device).view(1, -1)
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        o = sdpa_attend(q, k, v, scale, attn_mask=mask, enable_gqa=gqa, softcap=softcap)
    return o[0].transpose(0, 1)
