"""Torch references for the kernels: the slow, obvious definitions the tests compare against.

Standalone (torch only): the package imports the kernels, never the reverse."""
from __future__ import annotations

import torch

# A quantized cache's largest code per storage dtype (kv_cache_dtype "int8" / "fp8_e4m3").
QUANT_LIMIT = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [..., d]` -> (codes [..., d] in `dtype`, float16 scales [...]), the format's definition.
    A scale `amax / limit * m` per row within float16's normal range (a row of zeros: 2**-14),
    codes = x / scale clamped to +-limit, rounded half to even (int8) or cast (fp8, nearest even).
    int8: m = 1. fp8: of m = 1, 1 + 1/16, ..., 1 + 15/16, the first whose codes read back with the
    least squared error (summed in float64)."""
    limit = QUANT_LIMIT[dtype]
    unit = x.float().abs().amax(-1) / limit
    best: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    for m in ([1.0] if dtype == torch.int8 else [1 + j / 16 for j in range(16)]):
        codes, scale = _codes(x, unit * m, dtype)
        error = (dequantize(codes, scale).double() - x.double()).square().sum(-1)
        if best is None:
            best = codes, scale, error
        else:
            better = error < best[2]
            best = (torch.where(better.unsqueeze(-1), codes.view(torch.uint8), best[0].view(torch.uint8)).view(dtype),
                    torch.where(better, scale, best[1]), torch.where(better, error, best[2]))
    return best[0], best[1]


def _codes(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of `x` under the scales `scale [...]` (float32, rounded to float16 here)."""
    limit = QUANT_LIMIT[dtype]
    fp16 = torch.finfo(torch.float16)
    scale = scale.clamp(fp16.tiny, fp16.max).to(torch.float16)
    y = (x.float() / scale.float().unsqueeze(-1)).clamp(-limit, limit)
    return (y.round() if dtype == torch.int8 else y).to(dtype), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 values a quantized cache holds: code * its row's scale."""
    return codes.float() * scale.float().unsqueeze(-1)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float,
                    sliding_window: int | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, new_k: torch.Tensor | None = None,
                    new_v: torch.Tensor | None = None) -> torch.Tensor:
    """The plain definition, one sequence at a time in fp32: the oracle for every faster path
    (the Triton kernel and the engine's torch path).

    Sequence i owns query rows [query_start_loc[i], query_start_loc[i+1]); its context has
    seq_lens[i] tokens whose KV sits in blocks block_tables[i, :]; its queries are the last
    tokens of that context. A query at position p sees keys 0 .. p, and with a sliding window
    only those in (p - window, p] (the Hugging Face rule). A quantized cache comes with its
    scales `[blocks, block_size, kv_heads]` and is read as its dequantized values, except that with
    `new_k`/`new_v` (this step's rows `[T, kv_heads, d]`) a sequence with two or more query rows
    (a prefill chunk) attends its own keys and values from them, as computed: a chunk's attention
    among its own tokens is the model dtype's, what it reads back from earlier steps is quantized.
    """
    if k_scale is not None:
        k_cache, v_cache = dequantize(k_cache, k_scale), dequantize(v_cache, v_scale)
    heads, d = query.shape[1:]
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(query.shape, dtype=torch.float32)
    for i in range(len(seq_lens)):
        s, e, ctx = int(query_start_loc[i]), int(query_start_loc[i + 1]), int(seq_lens[i])
        if e == s or ctx == 0:
            continue
        blocks = block_tables[i, :-(-ctx // bs)].long()
        k = k_cache[blocks].reshape(-1, kvh, d)[:ctx].float().repeat_interleave(heads // kvh, 1)
        v = v_cache[blocks].reshape(-1, kvh, d)[:ctx].float().repeat_interleave(heads // kvh, 1)
        if new_k is not None and k_scale is not None and e - s > 1:
            k[ctx - (e - s):] = new_k[s:e].float().repeat_interleave(heads // kvh, 1)
            v[ctx - (e - s):] = new_v[s:e].float().repeat_interleave(heads // kvh, 1)
        q_pos = torch.arange(ctx - (e - s), ctx).view(-1, 1)
        k_pos = torch.arange(ctx).view(1, -1)
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        scores = torch.einsum("qhd,khd->hqk", query[s:e].float(), k) * scale
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)
    return out.to(query.dtype)


def write_kv(k_cache, v_cache, key, value, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Row by row: token t goes to position slot % block_size of block slot // block_size; -1 skips.
    A quantized cache stores each row's codes and per-head scales (`quantize`)."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            at = (slot // block_size, slot % block_size)
            if k_scale is None:
                k_cache[at], v_cache[at] = key[t], value[t]
            else:
                k_cache[at], k_scale[at] = quantize(key[t], k_cache.dtype)
                v_cache[at], v_scale[at] = quantize(value[t], v_cache.dtype)


def copy_blocks(k: torch.Tensor, v: torch.Tensor, pairs) -> None:
    """Per-pair slice assignment in every layer."""
    for src, dst in (pairs.tolist() if isinstance(pairs, torch.Tensor) else pairs):
        k[:, dst] = k[:, src]
        v[:, dst] = v[:, src]


def contiguous_attention(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Decode on dense per-sequence KV (`[B, kv_heads, ctx, d]`): the non-paged baseline."""
    return torch.nn.functional.scaled_dot_product_attention(
        query, k, v, scale=scale, enable_gqa=query.shape[1] != k.shape[1])
