"""A model's linear layers as GGUF blocks, with its dense twin as the oracle: how the tests and the
GPU check prove the packed CUDA layers (worker/quant_linear_cuda.py) inside a whole engine without
a GGUF file (the GPU image has no gguf package to read one).

`quantize` encodes a weight in the GGUF block format (llama.cpp's layout; a valid encoding, not
necessarily llama.cpp's choice of scale) and returns what the blocks stand for, computed here from
the codes by the format's definition; `packed_twins` gives (dense, packed): the dense model's
weights set to those values, and a copy whose linears compute from the blocks instead.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from ..worker.quant_linear_cuda import CudaQuantLinear

TYPES = ("Q4_0", "Q4_1", "Q8_0")


def quantize(weight: torch.Tensor, type_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 rows of blocks [N, K / 32 * bytes per block], the fp32 [N, K] weight they stand for)."""
    w = weight.detach().float().cpu()
    n, k = w.shape
    blocks = w.reshape(n, k // 32, 32)
    if type_name == "Q4_1":
        low, high = blocks.amin(-1), blocks.amax(-1)
        d = ((high - low) / 15).half()
        m = low.half()
        q = torch.where(d.float()[..., None] > 0, (blocks - m.float()[..., None]) / d.float()[..., None], 0.0)
        q = q.round().clamp(0, 15)
        values = d.float()[..., None] * q + m.float()[..., None]
        heads = [d, m]
    else:
        top = 7 if type_name == "Q4_0" else 127
        d = (blocks.abs().amax(-1) / top).half()
        q = torch.where(d.float()[..., None] > 0, blocks / d.float()[..., None], 0.0).round().clamp(-top - (type_name == "Q4_0"), top)
        values = d.float()[..., None] * q
        q = q + 8 if type_name == "Q4_0" else q
        heads = [d]
    if type_name == "Q8_0":
        quants = q.to(torch.int8).view(torch.uint8)
    else:
        codes = q.to(torch.uint8)
        quants = codes[..., :16] | (codes[..., 16:] << 4)          # byte j: weight j low, j + 16 high
    parts = [h.contiguous().view(torch.uint8).reshape(n, k // 32, 2) for h in heads] + [quants]
    return torch.cat(parts, dim=-1).reshape(n, -1), values.reshape(n, k)


def packed_twins(model: nn.Module, type_name: str) -> tuple[nn.Module, nn.Module]:
    """(dense, packed) over `model` (changed in place into the dense twin): every nn.Linear of its
    decoder layers and its output layer quantized; the dense twin holds the blocks' values in its
    dtype, the packed one CudaQuantLinear layers on the model's device (biases kept)."""
    first = next(model.parameters())
    device, dtype = first.device, first.dtype
    targets = [name for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and (".layers." in name or name == "lm_head")]
    rows = {}
    with torch.no_grad():
        for name in targets:
            layer = model.get_submodule(name)
            rows[name], values = quantize(layer.weight, type_name)
            layer.weight.copy_(values.to(device, dtype))
    packed = copy.deepcopy(model)
    for name in targets:
        layer = packed.get_submodule(name)
        parent, _, leaf = name.rpartition(".")
        bias = None if layer.bias is None else layer.bias.detach()
        setattr(packed.get_submodule(parent) if parent else packed, leaf,
                CudaQuantLinear(rows[name], type_name, layer.in_features, bias, device, dtype))
    return model, packed
