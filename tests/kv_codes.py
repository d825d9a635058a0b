"""The quantized KV cache's format written out in torch, for the kernels' tests: the agreed
definition (docs/design.md, kv_cache_dtype), not the engine's code, so a kernel is checked against
the format itself. One fp16 scale per token and KV head; a stored value is code * scale."""
from __future__ import annotations

import torch

DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
LIMIT = {"int8": 127.0, "fp8_e4m3": 448.0}


def quantize(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> (codes [..., d], float16 scales [...]): scale = amax / limit within float16's
    normal range (2**-14 where amax is 0), codes = x / scale clamped to the code range, rounded
    (int8) or cast (fp8)."""
    amax = x.float().abs().amax(-1)
    scale = (amax / LIMIT[kind]).clamp(2.0 ** -14, 65504.0).to(torch.float16)
    y = (x.float() / scale.float().unsqueeze(-1)).clamp(-LIMIT[kind], LIMIT[kind])
    codes = y.round().to(torch.int8) if kind == "int8" else y.to(torch.float8_e4m3fn)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values of `codes [..., d]` with their `scale [...]`."""
    return codes.float() * scale.float().unsqueeze(-1)


def quantized_cache(k: torch.Tensor, v: torch.Tensor, kind: str):
    """(k codes, v codes, k scales, v scales) of a layer's cache [blocks, block_size, kv_heads, d]."""
    kq, ks = quantize(k, kind)
    vq, vs = quantize(v, kind)
    return kq, vq, ks, vs
