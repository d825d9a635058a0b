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
same input (q/k/v, gate/up) share one GEMM on their stacked weights (`PackedGroup`, packed_weights.py).

fp32 always; bf16 where oneDNN computes it (AVX-512 and AMX machines: 1.5x faster decode steps
than stock bf16 GEMMs on an AMX Xeon). With `hold=True` (a model the engine loaded itself) each
weight is held once, packed: see held_weights.py.
"""
from __future__ import annotations

import os
import threading
import types
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from . import held_weights
from .packed_weights import PackedGroup, PackedWeight, WeightStamp, changed_held_weight
from .quant_linear import QuantStack

_ACTIVE = threading.local()


def packing_available() -> bool:
    """True when this torch build has the oneDNN packed-linear ops (x86 and Arm CPU wheels do)."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """fp32, and bf16 where this CPU's oneDNN has bf16 GEMMs (AVX-512 or newer; elsewhere stock
    bf16 GEMMs are as good as anything packing offers)."""
    bf16 = packing_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)


def should_pack(device: torch.device, dtype: torch.dtype, requested: bool | None = None) -> bool:
    """The engine's choice: `requested` if given (True where packing cannot run is an error),
    else pack on the CPU in a packable dtype. The packed copies cost as much memory as the
    weights they copy unless the engine holds the weights once (see held_weights.py)."""
    dtypes = packable_dtypes()
    possible = torch.device(device).type == "cpu" and dtype in dtypes and packing_available()
    if requested and not possible:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"pack_weights=True needs a CPU model in {names} and a torch with oneDNN "
                         f"(this one: device {device}, dtype {dtype}): pass pack_weights=None")
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


def _runs_packed(layer: nn.Linear, x: torch.Tensor) -> bool:
    """Whether this call computes through the packed weight: always for a held layer (refusing
    what it cannot do), else only inside `packed_gemms` on a CPU input of the weight's dtype."""
    if layer.__dict__.get("_pagedkv_held", False):
        _check_held_call(layer, x)
        return True
    return (getattr(_ACTIVE, "on", False) and x.device.type == "cpu" and x.dtype == layer.weight.dtype
            and not torch.is_grad_enabled())


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    held = self.__dict__.get("_pagedkv_held", False)
    if not _runs_packed(self, x):
        return F.linear(x, weight, self.bias)
    x = x.contiguous()
    recorder = getattr(_ACTIVE, "recorder", None)
    if recorder is not None and not held:     # the learning pass: stock GEMMs, packing comes after
        recorder.append((self, x))
        return F.linear(x, weight, self.bias)
    group, index = self.__dict__.get("_pagedkv_group", (None, 0))
    if group is not None:
        if index == 0:
            return group.lead(x)
        out = group.take(index, x)
        if out is not None:
            return out
        if held:
            return group.alone(index, x)
    packed = self._pagedkv_packed
    if packed is None or not packed.copies(weight):
        if held:
            raise changed_held_weight(self)
        packed = self._pagedkv_packed = PackedWeight.of(weight)
    return torch.ops.mkldnn._linear_pointwise(x, packed.weight, self.bias, "none", [], "")


def _check_held_call(layer: nn.Linear, x: torch.Tensor) -> None:
    """A held layer computes only through its packed weight, anywhere: say so where it cannot."""
    if torch.is_grad_enabled() and (x.requires_grad or layer.weight.requires_grad):
        raise RuntimeError("this model's weights are held packed by an engine, for inference only: run "
                           "it under torch.no_grad(), or build the engine with keep_plain_weights=True")
    if x.device.type != "cpu" or x.dtype != layer.weight.dtype:
        raise RuntimeError(f"this layer's weights are held packed by an engine in {layer.weight.dtype} on "
                           f"the CPU; it got a {x.dtype} input on {x.device}")


@dataclass
class PackedLinears:
    """The layers of one model that run packed; `release()` restores them and frees the copies.

    The first forward run under `packed_gemms(handle)` (stock GEMMs) records which layers read the
    same input tensor; then each such set is packed once as one `PackedGroup` and every other layer on
    its own, so each weight is packed exactly once. A layer used before that packs itself lazily.
    With `hold_weights`, each plain weight is dropped as soon as its packed copy exists, so the
    model's memory never holds much more than one copy (held_weights.py). Engines sharing one
    model share its packed layers; the last one to release them restores them."""

    layers: list[nn.Linear] = field(default_factory=list)
    groups: list[PackedGroup] = field(default_factory=list)
    learned: bool = False
    hold_weights: bool = False
    model: weakref.ref | None = None      # with hold_weights: whose other tensors leave the file map

    @property
    def nbytes(self) -> int:
        """Memory held by the packed copies (held layers' plain weights are gone)."""
        copies = [m._pagedkv_packed.weight for m in self.layers if m.__dict__.get("_pagedkv_packed")]
        copies += [g.weight for g in self.groups if g.weight is not None]
        return sum(c.numel() * c.element_size() for c in copies)

    @property
    def extra_bytes(self) -> int:
        """What packing costs on top of the plain weights: the packed copies of layers that also
        keep their plain weight."""
        return sum(m.weight.numel() * m.weight.element_size() for m in self.layers
                   if not m.__dict__.get("_pagedkv_held") and (
                       m.__dict__.get("_pagedkv_packed") or m.__dict__.get("_pagedkv_group")))

    def fused(self, linears: tuple[nn.Linear, ...], x: torch.Tensor) -> torch.Tensor:
        """`torch.cat([m(x) for m in linears], -1)`: one GEMM when they are exactly one learned
        group (q/k/v, gate/up), the same values either way."""
        group, index = linears[0].__dict__.get("_pagedkv_group", (None, 0))
        if (group is not None and index == 0 and len(group.members) == len(linears)
                and all(a is b for a, b in zip(group.members, linears)) and _runs_packed(linears[0], x)):
            return group.gemm(x.contiguous())
        stack = QuantStack.of(linears)          # GGUF blocks stacked at load (weights="packed")
        if stack is not None:
            return stack(x)
        return torch.cat([m(x) for m in linears], dim=-1)

    def packed_weight(self, linears: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The packed weight and bias of the one GEMM that computes `linears` (a learned group, in
        its order, or one packed layer), re-packed first if a plain weight changed; None if they
        are not packed as such. For callers that run the GEMM themselves (native_decode.py)."""
        first = linears[0]
        group, index = first.__dict__.get("_pagedkv_group", (None, 0))
        if group is not None:
            if index != 0 or len(group.members) != len(linears) or any(a is not b for a, b in zip(group.members, linears)):
                return None
            group.refresh()
            return group.weight, group.bias
        if len(linears) != 1 or "_pagedkv_packed" not in first.__dict__:
            return None
        packed = first._pagedkv_packed
        if packed is None or not packed.copies(first.weight):
            if first.__dict__.get("_pagedkv_held"):
                raise changed_held_weight(first)
            packed = first._pagedkv_packed = PackedWeight.of(first.weight)
        return packed.weight, first.bias

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
        scratch = torch.empty(size, dtype=sets[0][0].weight.dtype) if sets else None  # host: CPU-only packing
        for members in sets:
            group = PackedGroup(members)
            group.repack(scratch)
            for i, m in enumerate(members):
                m._pagedkv_group = (group, i)
                m._pagedkv_packed = None          # re-created only if it must compute alone
            self.groups.append(group)
            if self.hold_weights and all(m.__dict__.get("_pagedkv_holdable") for m in members):
                for i, m in enumerate(members):
                    held_weights.hold(m, lambda g=group, i=i: g.plain()[i])
                group.stamps = [WeightStamp.of(m.weight) for m in members]
        for m in self.layers:
            if "_pagedkv_group" not in m.__dict__ and m._pagedkv_packed is None:
                packed = m._pagedkv_packed = PackedWeight.of(m.weight)
                if self.hold_weights and m.__dict__.get("_pagedkv_holdable"):
                    held_weights.hold(m, lambda p=packed, k=m.in_features: held_weights.unpack(p.weight, k))
                    packed.stamp = WeightStamp.of(m.weight)
        if self.hold_weights:
            model = self.model() if self.model is not None else None
            if model is not None:
                held_weights.own_storage(model)
            from .host_memory import return_freed_memory
            return_freed_memory()          # the dropped plain weights, out of the resident set now

    def release(self, restore: bool = True) -> None:
        """Let go of the layers; the last engine using a layer unpacks it. A held weight comes back
        exactly when `restore`, else (an unloaded model its engine owned) the layer is left unusable
        and its memory is freed at once."""
        last = []
        for m in self.layers:
            users = m.__dict__.get("_pagedkv_users", 1) - 1
            m._pagedkv_users = users
            if users <= 0:
                last.append(m)
        plain: dict[int, list[torch.Tensor]] = {}      # a group's members, unpacked once
        for m in last:
            if m.__dict__.get("_pagedkv_held"):
                group, index = m.__dict__.get("_pagedkv_group", (None, 0))
                if restore and group is not None:
                    if id(group) not in plain:
                        plain[id(group)] = group.plain()
                    weight = plain[id(group)][index]
                elif restore:
                    weight = held_weights.unpack(m._pagedkv_packed.weight, m.in_features)
                else:
                    weight = None
                held_weights.restore(m, weight)
            for name in ("_pagedkv_packed", "_pagedkv_group", "_pagedkv_users", "_pagedkv_holdable"):
                m.__dict__.pop(name, None)
            if m.__dict__.get("forward") is not held_weights._unloaded:
                m.__dict__.pop("forward", None)
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


def pack_linears(model: nn.Module, hold: bool = False) -> PackedLinears:
    """Route every CPU `nn.Linear` of `model` whose dtype oneDNN packs through the packed path;
    others are left alone. The copies are made by the handle's learning pass (or lazily).

    `hold`: drop each plain weight once packed (held_weights.py). A layer whose weight another
    module also reads (a tied embedding) is then not packed: it would cost a second copy.
    Packing twice is harmless: a layer already packed is shared, not copied again.
    """
    handle = PackedLinears(hold_weights=hold, model=weakref.ref(model) if hold else None)
    if not packing_available():
        return handle
    bound_primitive_caches()
    dtypes = packable_dtypes()
    shared = held_weights.shared_weights(model) if hold else set()
    for module in model.modules():
        if type(module) is not nn.Linear:
            continue          # subclasses (quantised layers, LoRA) compute something else
        weight = module.weight
        if weight.device.type != "cpu" or weight.dtype not in dtypes or weight.is_meta:
            continue
        if "forward" not in module.__dict__:
            if hold and id(weight) in shared:
                continue      # tied: the other reader needs the plain weight, a copy would double it
            module._pagedkv_packed = None
            module._pagedkv_holdable = hold and held_weights.can_hold(weight)
            module.forward = types.MethodType(_packed_forward, module)
        elif module.__dict__["forward"] is held_weights._unloaded:
            continue
        module._pagedkv_users = module.__dict__.get("_pagedkv_users", 0) + 1
        handle.layers.append(module)
    return handle
