"""The quantized KV cache's number format: one quantize function that every cache write in torch
goes through, and one dequantize that the torch attention paths and the tests read with.

Format (docs/design.md, "Quantized KV cache"): K and V are stored as float8 e4m3 or int8, each token's
each KV head with its own float16 scale; value = q.float() * scale. Why per token and head, not per
block: blocks fill one token at a time, so a per-block scale would re-quantize a block whenever a
later token raised its absmax; a token's scale is written once, with the token, and travels with
its block on copy-on-write, fork and swap. The scales cost 2 bytes per head_dim elements (66 bytes
against bf16's 128 per token and head at head_dim 64: 1.94x the blocks in the same memory).
"""
from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "int8")
# Storage dtype and the largest magnitude it holds (the scale maps each row's absmax onto it).
STORAGE: dict[str, tuple[torch.dtype, float]] = {
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
    "int8": (torch.int8, 127.0),
}
SCALE_DTYPE = torch.float16
# A row of zeros (absmax 0) gets this scale, so it quantizes to zeros and reads back as zeros; it
# is also the floor of every scale, which float16 could otherwise round to 0.
_TINY = torch.finfo(SCALE_DTYPE).tiny
_HUGE = torch.finfo(SCALE_DTYPE).max


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the cache's K/V tensors hold for an engine option value ("auto": the model's)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in STORAGE:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
                         f"got {kv_cache_dtype!r}")
    return STORAGE[kv_cache_dtype][0]


def quantize(x: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [..., head_dim]` -> (q [..., head_dim] in the storage dtype, scale [...] float16), with
    `scale = absmax / qmax` per row, rounded to float16 *before* dividing, so that
    `dequantize(q, scale)` is exactly what the cache holds (the error is q's rounding alone)."""
    dtype, qmax = STORAGE[kv_cache_dtype]
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = (amax / qmax).clamp(_TINY, _HUGE).to(SCALE_DTYPE)
    scaled = (xf / scale.float().unsqueeze(-1)).clamp(-qmax, qmax)   # float16 rounding may push past qmax
    q = scaled.round().to(dtype) if dtype == torch.int8 else scaled.to(dtype)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """`q [..., head_dim]` with `scale [...]` back to `dtype`; a model-dtype cache (scale None)
    passes through untouched, so the "auto" path does no extra work."""
    if scale is None:
        return q
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def write_quantized(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                    key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, kv_cache_dtype: str) -> None:
    """Quantize `key/value [n, kv_heads, d]` into their slots (every slot valid) with their scales.
    (The step's prefill chunks attend these rows as computed, not as stored: worker/attention.py.)"""
    kvh, d = k_cache.shape[-2:]
    for cache, scales, x in ((k_cache, k_scale, key), (v_cache, v_scale, value)):
        q, s = quantize(x, kv_cache_dtype)
        # index_copy_ has no float8 kernel on the CPU: copy the bytes (a bit-exact move).
        cache.view(-1, kvh, d).view(torch.uint8).index_copy_(0, slot_mapping, q.view(torch.uint8))
        scales.view(-1, kvh).index_copy_(0, slot_mapping, s)
