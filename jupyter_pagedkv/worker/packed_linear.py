"""Linear layers on the CPU through weights pre-packed once for oneDNN, inside engine steps only.

Why: on the CPU a decode step is GEMM-bound, and `torch.nn.functional.linear` hands MKL a
plain row-major weight that it re-packs on every call. Re-laying each weight out once in
oneDNN's blocked format (the path torch's own inductor uses, and vLLM's CPU build with its own
copy of oneDNN) makes the same fp32 GEMMs 1.3-2.3x faster at 4-64 rows on a 2-core AVX2 CPU
(`python -m jupyter_pagedkv.bench gemm`). Results differ from MKL's by fp32 reduction order only.

How: each `nn.Linear` keeps its type, parameters and state dict; only its instance `forward` is
replaced. The packed path runs while `packed_gemms()` is active in the calling thread (the
ModelRunner's forward); anywhere else, e.g. a plain `model.generate` in a notebook cell, the
layer computes exactly what stock transformers does. A weight changed in place or reassigned
is re-packed on its next use, so a packed copy is never stale. Layers found reading one and the
same input (q/k/v, gate/up) share one GEMM on their stacked weights (`_Group`).
"""
from __future__ import annotations

import os
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
def packed_gemms(handle: PackedLinears | None = None) -> Iterator[None]:
    """Let packed layers use their packed weights in this thread for the duration; the first
    time with a `handle`, also record which layers share inputs so that they can be fused."""
    previous = getattr(_ACTIVE, "on", False)
    record = handle is not None and handle.layers and not handle.learned
    _ACTIVE.on = True
    if record:
        _ACTIVE.recorder = []
    try:
        yield
        if record:
            handle.learn(_ACTIVE.recorder)
    finally:
        _ACTIVE.on = previous
        if record:
            _ACTIVE.recorder = None


@dataclass(slots=True)
class _Stamp:
    """What identifies the weight a packed copy was made from: the object, its in-place version
    counter and its storage (`.data` swapped by `module.to()` keeps the first two)."""

    source: torch.Tensor
    version: int
    data_ptr: int

    @classmethod
    def of(cls, weight: torch.Tensor) -> _Stamp:
        return cls(weight, weight._version, weight.data_ptr())

    def matches(self, weight: torch.Tensor) -> bool:
        return (self.source is weight and self.version == weight._version
                and self.data_ptr == weight.data_ptr())


@dataclass(slots=True)
class _Packed:
    """A packed copy of one layer's weight and the stamp of the weight it copies."""

    stamp: _Stamp
    weight: torch.Tensor

    @classmethod
    def of(cls, weight: torch.Tensor) -> _Packed:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        return cls(_Stamp.of(weight), packed)

    def copies(self, weight: torch.Tensor) -> bool:
        return self.stamp.matches(weight)


class _Group:
    """Sibling layers that read the same input tensor (q/k/v, gate/up): one GEMM on their
    concatenated weights serves all of them. Learned from the first engine forward, checked on
    every call: a member gets the shared result only for the very tensor object the first member
    was called with (and unmodified, where torch tracks versions: see `_version`); any other
    input it computes on its own, so a wrong grouping costs time, never results."""

    __slots__ = ("members", "stamps", "weight", "bias", "splits", "x", "x_version", "outs")

    def __init__(self, members: list[nn.Linear]) -> None:
        self.members = members
        self.splits = [m.out_features for m in members]
        self.stamps: list[_Stamp] = []
        self.weight: torch.Tensor | None = None          # packed, all members' rows stacked
        self.bias: torch.Tensor | None = None
        self.x: torch.Tensor | None = None
        self.x_version = -1
        self.outs: list[torch.Tensor | None] = []

    def _fresh(self) -> bool:
        return self.weight is not None and all(
            stamp.matches(m.weight) for m, stamp in zip(self.members, self.stamps))

    def _repack(self, scratch: torch.Tensor | None = None) -> None:
        """Stack the members' weights (into `scratch` when given: reusing one buffer for every
        group spares the page faults of fresh memory, most of the cost of packing) and pack."""
        with torch.no_grad():
            rows = sum(self.splits)
            out = None if scratch is None else scratch[:rows * self.members[0].in_features].view(rows, -1)
            weight = torch.cat([m.weight.detach() for m in self.members], out=out)
            biases = [m.bias for m in self.members]
            self.bias = None if all(b is None for b in biases) else torch.cat(
                [b.detach() if b is not None else weight.new_zeros(m.out_features)
                 for m, b in zip(self.members, biases)])
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.stamps = [_Stamp.of(m.weight) for m in self.members]

    def lead(self, x: torch.Tensor) -> torch.Tensor:
        """The first member's call: one GEMM for all, the others' columns kept for them."""
        if not self._fresh():
            self._repack()
        out = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        parts = list(out.split(self.splits, dim=-1))
        self.x, self.x_version, self.outs = x, _version(x), parts
        return parts[0]

    def take(self, index: int, x: torch.Tensor) -> torch.Tensor | None:
        """A later member's call: its columns if `x` is the leader's input, untouched since."""
        if self.x is not x or self.x_version != _version(x) or self.outs[index] is None:
            return None
        out, self.outs[index] = self.outs[index], None
        if all(o is None for o in self.outs[1:]):
            self.x, self.outs = None, []          # drop the reference to the input at once
        return out


def _version(x: torch.Tensor) -> int:
    """In-place version of `x`; tensors made under inference mode keep none (-1). Engine inputs are
    such tensors, so there the identity of the input object is the check: a model would have to
    modify its hidden state in place between two sibling projections to defeat it."""
    return -1 if x.is_inference() else x._version


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    if (getattr(_ACTIVE, "on", False) and x.device.type == "cpu" and x.dtype == weight.dtype
            and not torch.is_grad_enabled()):
        x = x.contiguous()
        recorder = getattr(_ACTIVE, "recorder", None)
        if recorder is not None:          # the learning pass: stock GEMMs, packing comes after
            recorder.append((self, x))
            return F.linear(x, weight, self.bias)
        group, index = self.__dict__.get("_pagedkv_group", (None, 0))
        if group is not None:
            if index == 0:
                return group.lead(x)
            out = group.take(index, x)
            if out is not None:
                return out
        packed = self._pagedkv_packed
        if packed is None or not packed.copies(weight):
            packed = self._pagedkv_packed = _Packed.of(weight)
        return torch.ops.mkldnn._linear_pointwise(x, packed.weight, self.bias, "none", [], "")
    return F.linear(x, weight, self.bias)


@dataclass
class PackedLinears:
    """The layers of one model that run packed; `release()` restores them and frees the copies.

    The first forward run under `packed_gemms(handle)` (stock GEMMs) records which layers read the
    same input tensor; then each such set is packed once as one `_Group` and every other layer on
    its own, so each weight is packed exactly once. A layer used before that packs itself lazily."""

    layers: list[nn.Linear] = field(default_factory=list)
    groups: list[_Group] = field(default_factory=list)
    learned: bool = False

    @property
    def nbytes(self) -> int:
        """Memory held by the packed copies (the original weights stay where they were)."""
        copies = [m._pagedkv_packed.weight for m in self.layers if m.__dict__.get("_pagedkv_packed")]
        copies += [g.weight for g in self.groups if g.weight is not None]
        return sum(c.numel() * c.element_size() for c in copies)

    def learn(self, calls: list[tuple[nn.Linear, torch.Tensor]]) -> None:
        """Group layers called with one and the same input tensor (in call order)."""
        self.learned = True
        by_input: dict[int, list[nn.Linear]] = {}
        for module, x in calls:
            members = by_input.setdefault(id(x), [])
            if module not in members:
                members.append(module)
        sets = [members for members in by_input.values()
                if len(members) > 1 and not any("_pagedkv_group" in m.__dict__ for m in members)
                and len({(m.weight.dtype, m.in_features) for m in members}) == 1]
        size = max((sum(m.weight.numel() for m in members) for members in sets), default=0)
        scratch = torch.empty(size, dtype=sets[0][0].weight.dtype) if sets else None
        for members in sets:
            group = _Group(members)
            group._repack(scratch)
            for i, m in enumerate(members):
                m._pagedkv_group = (group, i)
                m._pagedkv_packed = None          # re-created only if it must compute alone
            self.groups.append(group)
        for m in self.layers:
            if "_pagedkv_group" not in m.__dict__ and m._pagedkv_packed is None:
                m._pagedkv_packed = _Packed.of(m.weight)

    def release(self) -> None:
        for m in self.layers:
            for name in ("forward", "_pagedkv_packed", "_pagedkv_group"):
                m.__dict__.pop(name, None)
        self.layers.clear()
        self.groups.clear()


# oneDNN (primitive cache) and ideep (its own LRU) each keep up to 1024 GEMM primitives by shape by
# default, and an engine's steps have many shapes (every token count up to the step budget): on a
# 2-layer test model the two caches grew RSS by ~700 MiB, without end in sight for hours of serving.
# 128 each bounds that; the 32-request throughput benchmark ran as fast either way (2026-11-30:
# 197.9 / 214.5 tokens/s default, 203.7 / 207.3 bounded).
PRIMITIVE_CACHE_CAPACITY = "128"


def bound_primitive_caches() -> None:
    """Cap oneDNN's and ideep's primitive caches (unless the user set them). They read these
    variables at their first use in the process, so this must run before the first packed GEMM."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", PRIMITIVE_CACHE_CAPACITY)
    os.environ.setdefault("LRU_CACHE_CAPACITY", PRIMITIVE_CACHE_CAPACITY)


def pack_linears(model: nn.Module) -> PackedLinears:
    """Route every CPU `nn.Linear` of `model` whose dtype oneDNN packs (fp32) through the packed
    path; others are left alone. The copies are made by the handle's learning pass (or lazily).

    Packing twice is harmless: a layer already packed is shared, not copied again.
    """
    handle = PackedLinears()
    if not packing_available():
        return handle
    bound_primitive_caches()
    for module in model.modules():
        if type(module) is not nn.Linear:
            continue          # subclasses (quantised layers, LoRA) compute something else
        weight = module.weight
        if weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES or weight.is_meta:
            continue
        if "forward" not in module.__dict__:
            module._pagedkv_packed = None
            module.forward = types.MethodType(_packed_forward, module)
        handle.layers.append(module)
    return handle
