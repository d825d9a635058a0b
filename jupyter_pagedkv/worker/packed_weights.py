"""Packed copies of linear weights, each stamped with the weight it copies so it is never stale.

`PackedWeight` is one layer's weight in oneDNN's blocked layout; `PackedGroup` is the stacked
weights of sibling layers that read one input (q/k/v, gate/up), so that one GEMM serves them all.
packed_linear.py decides which layers run through them and when (see its docstring for why).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import held_weights


@dataclass(slots=True)
class WeightStamp:
    """What identifies the weight a packed copy was made from: the object, its in-place version
    counter and its storage (`.data` swapped by `module.to()` keeps the first two)."""

    source: torch.Tensor
    version: int
    data_ptr: int

    @classmethod
    def of(cls, weight: torch.Tensor) -> WeightStamp:
        return cls(weight, weight._version, weight.data_ptr())

    def matches(self, weight: torch.Tensor) -> bool:
        return (self.source is weight and self.version == weight._version
                and self.data_ptr == weight.data_ptr())


@dataclass(slots=True)
class PackedWeight:
    """A packed copy of one layer's weight and the stamp of the weight it copies."""

    stamp: WeightStamp
    weight: torch.Tensor

    @classmethod
    def of(cls, weight: torch.Tensor) -> PackedWeight:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        return cls(WeightStamp.of(weight), packed)

    def copies(self, weight: torch.Tensor) -> bool:
        return self.stamp.matches(weight)


class PackedGroup:
    """Sibling layers that read the same input tensor (q/k/v, gate/up): one GEMM on their
    concatenated weights serves all of them. Learned from the first engine forward, checked on
    every call: a member gets the shared result only for the very tensor object the first member
    was called with (and unmodified, where torch tracks versions: see `input_version`); any other
    input it computes on its own, so a wrong grouping costs time, never results."""

    __slots__ = ("members", "stamps", "weight", "bias", "splits", "x", "x_version", "outs")

    def __init__(self, members: list[nn.Linear]) -> None:
        self.members = members
        self.splits = [m.out_features for m in members]
        self.stamps: list[WeightStamp] = []
        self.weight: torch.Tensor | None = None          # packed, all members' rows stacked
        self.bias: torch.Tensor | None = None
        self.x: torch.Tensor | None = None
        self.x_version = -1
        self.outs: list[torch.Tensor | None] = []

    def _fresh(self) -> bool:
        return self.weight is not None and all(
            stamp.matches(m.weight) for m, stamp in zip(self.members, self.stamps))

    @property
    def held(self) -> bool:
        return bool(self.members[0].__dict__.get("_pagedkv_held"))

    def repack(self, scratch: torch.Tensor | None = None) -> None:
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
        self.stamps = [WeightStamp.of(m.weight) for m in self.members]

    def refresh(self) -> None:
        """Re-pack if a member's plain weight changed; a held group has no plain weight to re-pack
        from, so there the change is an error."""
        if not self._fresh():
            if self.held:
                raise changed_held_weight(self.members[0])
            self.repack()

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """All members' outputs side by side, `[..., sum of out_features]`, from one GEMM."""
        self.refresh()
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def _gemm(self, x: torch.Tensor) -> list[torch.Tensor]:
        return list(self.gemm(x).split(self.splits, dim=-1))

    def lead(self, x: torch.Tensor) -> torch.Tensor:
        """The first member's call: one GEMM for all, the others' columns kept for them."""
        parts = self._gemm(x)
        self.x, self.x_version, self.outs = x, input_version(x), parts
        return parts[0]

    def take(self, index: int, x: torch.Tensor) -> torch.Tensor | None:
        """A later member's call: its columns if `x` is the leader's input, untouched since."""
        if self.x is not x or self.x_version != input_version(x) or self.outs[index] is None:
            return None
        out, self.outs[index] = self.outs[index], None
        if all(o is None for o in self.outs[1:]):
            self.x, self.outs = None, []          # drop the reference to the input at once
        return out

    def alone(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """A held member called with its own input: only the stacked packed weight holds its
        values, so the whole group's GEMM runs and this member's columns are kept."""
        return self._gemm(x)[index].contiguous()

    def plain(self) -> list[torch.Tensor]:
        """Every member's exact plain weight, rebuilt from the stacked packed one."""
        return list(held_weights.unpack(self.weight, self.members[0].in_features).split(self.splits))


def input_version(x: torch.Tensor) -> int:
    """In-place version of `x`; tensors made under inference mode keep none (-1). Engine inputs are
    such tensors, so there the identity of the input object is the check: a model would have to
    modify its hidden state in place between two sibling projections to defeat it."""
    return -1 if x.is_inference() else x._version


def changed_held_weight(layer: nn.Linear) -> RuntimeError:
    """A held layer's weight was replaced: its packed copy is all there is, so nothing re-packs."""
    return RuntimeError("a weight of a model whose engine holds its weights packed was replaced: build "
                        "the engine with keep_plain_weights=True to change weights while it runs")
