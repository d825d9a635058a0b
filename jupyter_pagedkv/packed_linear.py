"""Linear layers on the CPU through weights pre-packed once for oneDNN, inside engine steps only.

Why: on the CPU a decode step is GEMM-bound, and `torch.nn.functional.linear` hands MKL a
plain row-major weight that it re-packs on every call. Re-laying each weight out once in
oneDNN's blocked format (the path torch's own inductor uses, and vLLM's CPU build with its own
copy of oneDNN) makes the same fp32 GEMMs ~1.5-1.9x faster at 8-64 rows on this machine
(`python -m jupyter_pagedkv.bench gemm`). Results differ from MKL's by fp32 reduction order only.

How: each `nn.Linear` keeps its type, parameters and state dict; only its instance `forward` is
replaced. The packed path runs while `packed_gemms()` is active in the calling thread (the
ModelRunner's forward); anywhere else, e.g. a plain `model.generate` in a notebook cell, the
layer computes exactly what stock transformers does. A weight changed in place or reassigned
is re-packed on its next use, so a packed copy is never stale.
"""
from __future__ import annotations

import threading
import types
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVE = threading.local()
PACKABLE_DTYPES = (torch.float32,)


def packing_available() -> bool:
    """True when this torch build has the oneDNN packed-linear ops (x86 and Arm CPU wheels do)."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def should_pack(device: torch.device, dtype: torch.dtype, requested: bool | None = None) -> bool:
    """The engine's choice: `requested` if given (True where packing cannot run is an error),
    else pack on the CPU in a packable dtype. The packed copies cost as much memory as the
    weights they copy; pass `pack_weights=False` to trade that memory for GEMM speed."""
    possible = torch.device(device).type == "cpu" and dtype in PACKABLE_DTYPES and packing_available()
    if requested and not possible:
        raise ValueError(f"pack_weights=True needs a CPU model in {PACKABLE_DTYPES[0]} and a torch "
                         f"with oneDNN (this one: device {device}, dtype {dtype}): pass pack_weights=None")
    return possible if requested is None else bool(requested)


@contextmanager
def packed_gemms() -> Iterator[None]:
    """Let packed layers use their packed weights in this thread for the duration."""
    previous = getattr(_ACTIVE, "on", False)
    _ACTIVE.on = True
    try:
        yield
    finally:
        _ACTIVE.on = previous


@dataclass(slots=True)
class _Packed:
    """A packed copy of one layer's weight and what identifies the weight it copies: the object,
    its in-place version counter and its storage (`.data` swapped by `module.to()` keeps both)."""

    source: torch.Tensor
    version: int
    data_ptr: int
    weight: torch.Tensor

    @classmethod
    def of(cls, weight: torch.Tensor) -> _Packed:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        return cls(weight, weight._version, weight.data_ptr(), packed)

    def copies(self, weight: torch.Tensor) -> bool:
        return (self.source is weight and self.version == weight._version
                and self.data_ptr == weight.data_ptr())


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    if (getattr(_ACTIVE, "on", False) and x.device.type == "cpu" and x.dtype == weight.dtype
            and not torch.is_grad_enabled()):
        packed: _Packed = self._pagedkv_packed
        if not packed.copies(weight):
            packed = self._pagedkv_packed = _Packed.of(weight)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed.weight, self.bias,
                                                  "none", [], "")
    return F.linear(x, weight, self.bias)


@dataclass
class PackedLinears:
    """The layers of one model that run packed; `release()` restores them and frees the copies."""

    layers: list[nn.Linear] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Memory held by the packed copies (the original weights stay where they were)."""
        return sum(m._pagedkv_packed.weight.numel() * m._pagedkv_packed.weight.element_size()
                   for m in self.layers if hasattr(m, "_pagedkv_packed"))

    def release(self) -> None:
        for m in self.layers:
            m.__dict__.pop("forward", None)
            m.__dict__.pop("_pagedkv_packed", None)
        self.layers.clear()


def pack_linears(model: nn.Module) -> PackedLinears:
    """Pack every CPU `nn.Linear` of `model` whose dtype oneDNN packs (fp32); others are left alone.

    Packing twice is harmless: a layer already packed is shared, not copied again.
    """
    handle = PackedLinears()
    if not packing_available():
        return handle
    for module in model.modules():
        if type(module) is not nn.Linear:
            continue          # subclasses (quantised layers, LoRA) compute something else
        weight = module.weight
        if weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES or weight.is_meta:
            continue
        if "_pagedkv_packed" not in module.__dict__:
            module._pagedkv_packed = _Packed.of(weight)
            module.forward = types.MethodType(_packed_forward, module)
        handle.layers.append(module)
    return handle
