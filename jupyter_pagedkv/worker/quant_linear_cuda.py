"""GGUF blocks on CUDA: the GPU's packed layers (weights="packed" with device="cuda").

Why: the same bytes-read argument as on the CPU (quant_linear.py), with the GEMM in Triton
(kernels/quant_matmul.py): each projection keeps its file's Q4_0/Q4_1/Q8_0 blocks, split once at
load into codes, scales and minimums, and a kernel dequantizes a tile at a time into the
activations' dtype, the values transformers' dequantized model holds. The embedding looks rows up
and dequantizes them in torch; a tied output layer reads the embedding's very tensors.

Under Triton's interpreter (TRITON_INTERPRET=1) the same modules run on CPU tensors: that is how
the CPU tests prove them against the dequantized model.
"""
from __future__ import annotations

import torch
from torch import nn

from .kernels_bridge import kernel_module


def _kernels():
    return kernel_module("quant_matmul")


def _hold_blocks(layer: nn.Module, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> None:
    """A packed layer's three tensors, as buffers (they move with the module, never re-rounded)."""
    layer.register_buffer("codes", codes)
    layer.register_buffer("scales", scales)
    layer.register_buffer("mins", mins)


def _split(rows: torch.Tensor, type_name: str, device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(device) for t in _kernels().split_blocks(rows, type_name))


class CudaQuantLinear(nn.Module):
    """`x @ W^T (+ bias)` with W as GGUF blocks on the GPU, in the activations' dtype."""

    def __init__(self, rows: torch.Tensor | None, type_name: str, in_features: int, bias: torch.Tensor | None,
                 device: torch.device, dtype: torch.dtype, *, share: CudaQuantEmbedding | None = None) -> None:
        """`rows`: the file's uint8 rows of blocks; or `share`: an embedding whose blocks this
        layer reads (a tied output layer)."""
        super().__init__()
        self.type_name, self.in_features = type_name, in_features
        codes, scales, mins = (share.codes, share.scales, share.mins) if share is not None else \
            _split(rows, type_name, device)
        if scales.shape[1] * 32 != in_features:
            raise ValueError(f"{type_name} blocks for {in_features} inputs hold {scales.shape[1] * 32}")
        self.out_features = scales.shape[0]
        _hold_blocks(self, codes, scales, mins)
        self.bias = None if bias is None else nn.Parameter(bias.to(device, dtype), requires_grad=False)

    @property
    def blocks(self) -> torch.Tensor:
        """The codes: what identifies this layer's weights (a tied layer shares its embedding's)."""
        return self.codes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device != self.codes.device:
            raise RuntimeError(f"this layer's {self.type_name} blocks are on {self.codes.device}; it got an "
                               f"input on {x.device}")
        return _kernels().quant_matmul(x, self.codes, self.scales, self.mins, self.type_name, self.bias)

    def dequantized(self) -> torch.Tensor:
        """The fp32 [out, in] weight the blocks stand for."""
        return _kernels().dequantize(self.codes, self.scales, self.mins, self.type_name)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, blocks={self.type_name} (CUDA)"


class CudaQuantEmbedding(nn.Module):
    """Rows of a packed table, looked up and dequantized into `dtype`."""

    def __init__(self, rows: torch.Tensor, type_name: str, embedding_dim: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.type_name, self.embedding_dim, self.dtype = type_name, embedding_dim, dtype
        codes, scales, mins = _split(rows, type_name, device)
        self.num_embeddings = scales.shape[0]
        _hold_blocks(self, codes, scales, mins)

    @property
    def blocks(self) -> torch.Tensor:
        return self.codes

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        mins = self.mins[flat] if self.mins.numel() else self.mins
        rows = _kernels().dequantize(self.codes[flat], self.scales[flat], mins, self.type_name)
        return rows.to(self.dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, blocks={self.type_name} (CUDA)"
