"""QuantLinear and QuantEmbedding: layers that compute from GGUF's packed blocks (quant_gemm.cpp).

Why: decode of one sequence reads every weight once per token, so its speed is the bytes read.
The embedded model's Q4_1 blocks are 5 bits a weight against fp32's 32: kept packed, a token reads
~6x fewer bytes, and the model's memory is about the GGUF file's size instead of 5x it.

Which GEMM, by measurement (`python -m jupyter_pagedkv.bench single --gemms`: one activation row,
the embedded model's 1536x576 gate projection, 2-core AVX2 EPYC, one thread, a loaded machine,
2026-12-02): this kernel 1.9 ms median, oneDNN's fp32 GEMM on the dequantized weight 2.2 ms, torch's
`_weight_int8pack_mm` 11.6 ms and `_weight_int4pack_mm_for_cpu` 25.4 ms (their fast paths want
AVX-512). So a small C++ kernel here reads the blocks in place. For decode (fewer than
DENSE_FROM_ROWS rows) it quantizes each activation row to int8 per 32-element block, as llama.cpp
does, and multiplies with the blocks' quants by integer dot products (quant_dot.cpp): the result
is the dequantized weights times the int8-rounded activations, each activation off by at most
half its block's step. Prefill keeps fp32 activations: the dequantized model's GEMM up to fp32
rounding (quant_gemm.cpp says which path runs when, and why).

Supported block types: Q4_0, Q4_1, Q8_0 (`SUPPORTED`). The weight is a uint8 buffer `blocks`
[out_features, in_features / 32 * block bytes], not a parameter: nothing trains it. It holds the
file's blocks with each group of eight output features interleaved (quant_layout.h: the layout and
why; made once here, at construction), the same bytes in the same eight rows.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..config import format_bytes
from .native_build import LazyModule
from .quant_linear_cuda import CudaQuantEmbedding, CudaQuantLinear

# GGML's type numbers and bytes per block of 32 weights.
SUPPORTED: dict[str, tuple[int, int]] = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34)}
# From this many activation rows on (a prefill chunk, a batched decode step) the weight is
# dequantized once per call, a cache-sized tile of output features at a time, and ATen's fp32 GEMM
# runs on each tile: re-reading the blocks per 4-row tile loses there. Chosen by CPU time (one
# thread, the embedded model's four projections as Q4_1, `time.process_time`, a loaded 2-core
# AVX-512 machine, 2026-12-02; ms per layer, streaming / tiled): 4 rows 0.83 / 1.25, 8 rows
# 1.70 / 1.47, 16 rows 3.42 / 2.03, 42 rows 7.6 / 4.4 (the whole fp32 weight dequantized first,
# the path before tiles: 12.6, of which writing the weight out took 6.6; fp32 GEMM on dense
# weights: 4.6).
DENSE_FROM_ROWS = 8

_EXTENSION = LazyModule("jupyter_pagedkv_quant_gemm",
                        [Path(__file__).with_name(n) for n in ("quant_gemm_module.cpp", "quant_gemm.cpp", "quant_dot.cpp")],
                        "the packed-weight GEMM", "weights='dense'", ["-O3", "-ffp-contract=off", "-fopenmp"],
                        ["-fopenmp"])


def load_extension():
    """The compiled kernel (built on first use; NativeBuildError says why not in one line)."""
    return _EXTENSION.load()


def block_kind(type_name: str) -> tuple[int, int]:
    """(GGML type number, bytes per block) of a supported type name, else one line naming them."""
    if type_name not in SUPPORTED:
        raise ValueError(f"packed weights compute {', '.join(SUPPORTED)} blocks, not {type_name}: "
                         f"load with weights='dense' (--weights dense)")
    return SUPPORTED[type_name]


class QuantLinear(nn.Module):
    """`x @ W^T (+ bias)` with W held as GGUF blocks; fp32 in, fp32 out (int8 activations inside
    for fewer than DENSE_FROM_ROWS rows)."""

    def __init__(self, blocks: torch.Tensor, type_name: str, in_features: int,
                 bias: torch.Tensor | None = None, *, already_interleaved: bool = False) -> None:
        """`blocks`: the file's rows of blocks, rearranged here into the kernels' layout; with
        `already_interleaved`, blocks in that layout already, taken as they are (a tied output
        layer over its embedding's buffer)."""
        super().__init__()
        self.kind, size = block_kind(type_name)
        self.type_name = type_name
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] * 32 != in_features * size:
            raise ValueError(f"{type_name} blocks for {in_features} inputs are [out, {in_features // 32 * size}] "
                             f"uint8, got {tuple(blocks.shape)} {blocks.dtype}")
        self.in_features, self.out_features = in_features, blocks.shape[0]
        self._ops = load_extension()
        self.register_buffer("blocks", blocks.contiguous() if already_interleaved
                             else self._ops.quant_interleave(blocks, self.kind))
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.stack: QuantStack | None = None      # set when stacked with its siblings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise RuntimeError(f"this layer's weights are packed {self.type_name} blocks computed in fp32 on "
                               f"the CPU; it got a {x.dtype} input on {x.device}")
        return self._ops.quant_linear(x, self.blocks, self.kind, self.bias, DENSE_FROM_ROWS)

    def dequantized(self) -> torch.Tensor:
        """The fp32 [out, in] weight this layer computes with."""
        return self._ops.quant_dequantize(self.blocks, self.kind, self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, blocks={self.type_name}"


class QuantStack:
    """Sibling layers reading one input (q/k/v, gate/up) whose blocks lie in one tensor, each
    layer's buffer a row view of it: one kernel call computes them all, and memory holds them once.
    Every member's rows are whole groups of eight (stack_siblings), so the stacked tensor and each
    view are in the kernels' layout."""

    def __init__(self, members: list[QuantLinear]) -> None:
        if not whole_groups(members):
            # A member's last out % 8 rows are GGUF's layout: in the middle of a stack the kernels
            # would read them as a group of eight, and compute garbage without an error.
            raise ValueError(f"a stack takes layers of whole groups of eight output features, got "
                             f"{[m.out_features for m in members]}: use stack_siblings, which leaves others unstacked")
        self.members = tuple(members)
        self.blocks = torch.cat([m.blocks for m in members])
        self.kind = members[0].kind
        start = 0
        for m in members:
            m.blocks = self.blocks[start:start + m.out_features]
            m.stack = self
            start += m.out_features

    @staticmethod
    def of(linears: tuple[nn.Module, ...]) -> QuantStack | None:
        """The stack that is exactly `linears`, in order, or None."""
        stack = getattr(linears[0], "stack", None)
        if stack is None or len(stack.members) != len(linears) or any(a is not b for a, b in zip(stack.members, linears)):
            return None
        return stack

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.members[0]._ops.quant_linear(x, self.blocks, self.kind, None, DENSE_FROM_ROWS)


def whole_groups(members: list[QuantLinear]) -> bool:
    """Every layer's rows whole groups of eight features (quant_layout.h), as a stack needs."""
    return all(m.out_features % 8 == 0 for m in members)


def stack_siblings(members: list[nn.Module]) -> QuantStack | None:
    """Stack layers of one block type, no bias and whole groups of eight features (others are left
    as they are)."""
    if (all(isinstance(m, QuantLinear) and m.bias is None for m in members) and whole_groups(members)
            and len({(m.kind, m.in_features) for m in members}) == 1):
        return QuantStack(members)
    return None


class QuantEmbedding(nn.Module):
    """Rows of a packed table, dequantized as looked up (a tied output layer shares the blocks)."""

    def __init__(self, blocks: torch.Tensor, type_name: str, embedding_dim: int) -> None:
        super().__init__()
        self.kind, _ = block_kind(type_name)
        self.type_name = type_name
        self.num_embeddings, self.embedding_dim = blocks.shape[0], embedding_dim
        self._ops = load_extension()
        self.register_buffer("blocks", self._ops.quant_interleave(blocks, self.kind))   # the kernels' layout

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int32, torch.int64) or ids.device.type != "cpu":
            raise RuntimeError(f"this embedding's rows are packed {self.type_name} blocks looked up on the CPU by "
                               f"int64 or int32 ids; it got {ids.dtype} ids on {ids.device}")
        rows = self._ops.quant_dequantize_rows(self.blocks, self.kind, self.embedding_dim, ids.reshape(-1).long())
        return rows.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, blocks={self.type_name}"


def packed_bytes(model: nn.Module) -> int:
    """Bytes of every tensor the model holds (parameters and buffers, shared ones once)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def block_bytes(layer: nn.Module) -> int:
    """The bytes a packed layer's weight takes (on CUDA: codes, scales and minimums apart)."""
    return sum(t.nbytes for t in (layer.codes, layer.scales, layer.mins)) if hasattr(layer, "codes") else layer.blocks.nbytes


def logical_parameters(model: nn.Module) -> tuple[int, int]:
    """(parameters as the dense model counts them, of which in GGUF blocks): a packed layer's
    weight is a uint8 buffer, not a parameter, so `model.parameters()` alone leaves it out. A
    tied output layer reads its embedding's very tensor and is counted once, as tied weights are."""
    dense = sum(p.numel() for p in model.parameters())
    seen, packed = set(), 0
    for m in model.modules():
        if isinstance(m, PACKED_LAYERS) and m.blocks.data_ptr() not in seen:
            seen.add(m.blocks.data_ptr())
            packed += m.blocks.shape[0] * (m.in_features if hasattr(m, "in_features") else m.embedding_dim)
    return dense + packed, packed


def describe_blocks(model: nn.Module) -> str | None:
    """'weights in GGUF blocks (Q4_1, Q8_0; 92.10 MiB)' for a model with packed layers, else None."""
    layers = [m for m in model.modules() if isinstance(m, PACKED_LAYERS)]
    if not layers:
        return None
    kinds = sorted({m.type_name for m in layers})
    unique = {m.blocks.data_ptr(): block_bytes(m) for m in layers}
    return f"weights in GGUF blocks ({', '.join(kinds)}; {format_bytes(sum(unique.values()))})"


# Every layer that computes from GGUF blocks: the CPU's (C++) and CUDA's (Triton).
PACKED_LAYERS = (QuantLinear, QuantEmbedding, CudaQuantLinear, CudaQuantEmbedding)
