"""The quantized KV cache's format written out in torch, for the kernels' tests: the agreed
definition (docs/design.md, kv_cache_dtype), not the engine's code, so a kernel is checked against
the format itself. One fp16 scale per token and KV head; a stored value is code * scale."""
from __future__ import annotations

import torch

DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
LIMIT = {"int8": 127.0, "fp8_e4m3": 448.0}


def quantize(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> (codes [..., d], float16 scales [...]). int8: scale = amax / 127 within
    float16's normal range (2**-14 where amax is 0), codes = x / scale clamped to the code range and
    rounded. fp8: of the 16 scales amax / 448 * (1 + j / 16), the first whose codes (x / scale
    clamped and cast) read back with the least squared error, summed in float64."""
    amax = x.float().abs().amax(-1)
    if kind == "int8":
        return _codes(x, (amax / LIMIT[kind]).clamp(2.0 ** -14, 65504.0).to(torch.float16), kind)
    best = None
    for j in range(16):
        codes, scale = _codes(x, (amax / LIMIT[kind] * (1 + j / 16)).clamp(2.0 ** -14, 65504.0).to(torch.float16), kind)
        error = (dequantize(codes, scale).double() - x.double()).square().sum(-1)
        if best is None:
            best = codes, scale, error
            continue
        better = error < best[2]
        best = (torch.where(better.unsqueeze(-1), codes.view(torch.uint8), best[0].view(torch.uint8)).view(codes.dtype),
                torch.where(better, scale, best[1]), torch.where(better, error, best[2]))
    return best[0], best[1]


def _codes(x: torch.Tensor, scale: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    y = (x.float() / scale.float().unsqueeze(-1)).clamp(-LIMIT[kind], LIMIT[kind])
    return (y.round().to(torch.int8) if kind == "int8" else y.to(torch.float8_e4m3fn)), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values of `codes [..., d]` with their `scale [...]`."""
    return codes.float() * scale.float().unsqueeze(-1)


def quantized_cache(k: torch.Tensor, v: torch.Tensor, kind: str):
    """(k codes, v codes, k scales, v scales) of a layer's cache [blocks, block_size, kv_heads, d]."""
    kq, ks = quantize(k, kind)
    vq, vs = quantize(v, kind)
    return kq, vq, ks, vs
