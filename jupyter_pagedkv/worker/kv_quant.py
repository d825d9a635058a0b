"""The quantized KV cache's number format: one quantize function that defines every cache write
(on the CPU, where the C++ decode kernel is loaded, kv_quantize.cpp writes the same bits faster),
and one dequantize that the torch attention paths and the tests read with.

Format (docs/design.md, "Quantized KV cache"): K and V are stored as float8 e4m3 or int8, each token's
each KV head with its own float16 scale; value = q.float() * scale. Why per token and head, not per
block: blocks fill one token at a time, so a per-block scale would re-quantize a block whenever a
later token raised its absmax; a token's scale is written once, with the token, and travels with
its block on copy-on-write, fork and swap. The scales cost 2 bytes per head_dim elements (66 bytes
against bf16's 128 per token and head at head_dim 64: 1.94x the blocks in the same memory).

fp8's scale is searched, int8's is not: e4m3 is a float, so whatever the scale, each element keeps
3 mantissa bits; what the scale moves is where the row's values fall on that grid. Of SCALE_STEPS
scales from absmax / 448 up to just under twice it (none clips, beyond what float16's rounding of
the scale may push past 448, as before), a row keeps the first whose codes read back nearest the
row (least squared error; every term is exact and the sum is taken in float64, so implementations
that sum in another order pick the same one unless two errors agree to ~2^-50). Measured by a
scratch script on the embedded model's own K/V, it cuts the squared error by 27%; top-1 agreement with
the bf16 model over four cuts of `bench kvquant`'s text went from 96.80-96.94% to 97.21-97.43%
(docs/benchmarks.md). int8 keeps the absmax's scale: its grid is uniform, so a larger scale only
coarsens it for every element (and a smaller one clips the largest).
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
# fp8's candidate scales: absmax / 448 times 1, 1 + 1/16, ..., 1 + 15/16 (exact in float32, so a
# kernel can build them with the same two roundings: the division, then the product).
SCALE_STEPS = 16


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the cache's K/V tensors hold for an engine option value ("auto": the model's)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in STORAGE:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
                         f"got {kv_cache_dtype!r}")
    return STORAGE[kv_cache_dtype][0]


def quantize(x: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [..., head_dim]` -> (q [..., head_dim] in the storage dtype, scale [...] float16).
    int8: `scale = absmax / 127` per row. fp8: the best of SCALE_STEPS scales from `absmax / 448`
    (module docstring). A scale is rounded to float16 *before* dividing, so that
    `dequantize(q, scale)` is exactly what the cache holds (the error is q's rounding alone)."""
    dtype, qmax = STORAGE[kv_cache_dtype]
    xf = x.float()
    unit = xf.abs().amax(dim=-1) / qmax
    if dtype == torch.int8:
        scale = _scale(unit, 1.0)
        return _codes(xf, scale, qmax).round().to(dtype), scale
    codes, scale, error = _fp8_candidate(xf, unit, 1.0)
    for j in range(1, SCALE_STEPS):        # one candidate at a time: ~3x the row's memory, not 16x
        c, s, e = _fp8_candidate(xf, unit, 1.0 + j / SCALE_STEPS)
        better = e < error              # strictly: the first of equals stays, as in every implementation
        codes = torch.where(better.unsqueeze(-1), c.view(torch.uint8), codes.view(torch.uint8)).view(c.dtype)
        scale, error = torch.where(better, s, scale), torch.where(better, e, error)
    return codes, scale


def _scale(unit: torch.Tensor, multiplier: float) -> torch.Tensor:
    """`unit * multiplier` within float16's normal range, rounded to float16."""
    return (unit * multiplier).clamp(_TINY, _HUGE).to(SCALE_DTYPE)


def _codes(xf: torch.Tensor, scale: torch.Tensor, qmax: float) -> torch.Tensor:
    """`xf / scale`, clamped to the codes' range (float16 rounding may push a scale's row past it)."""
    return (xf / scale.float().unsqueeze(-1)).clamp(-qmax, qmax)


def _fp8_candidate(xf: torch.Tensor, unit: torch.Tensor, multiplier: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One fp8 candidate: (codes, scale, each row's squared error read back, in float64)."""
    dtype, qmax = STORAGE["fp8_e4m3"]
    scale = _scale(unit, multiplier)
    codes = _codes(xf, scale, qmax).to(dtype)
    return codes, scale, (dequantize(codes, scale, torch.float32).double() - xf.double()).square().sum(-1)


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
