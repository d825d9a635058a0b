"""KVCache: per-layer K and V tensors of shape [num_blocks, block_size, num_kv_heads, head_dim], in
the model's dtype or quantized (kv_quant.py) with a float16 scale per token and KV head."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_quant import SCALE_DTYPE, storage_dtype


@dataclass(frozen=True)
class KVSpec:
    """The shape facts that decide KV memory: see docs/design.md, 'Memory arithmetic'."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype              # the compute dtype: what attention reads the cache as
    kv_cache_dtype: str = "auto"    # the engine option: "auto" (stored as `dtype`), "fp8_e4m3", "int8"

    @property
    def cache_dtype(self) -> torch.dtype:
        """The storage dtype of K and V."""
        return storage_dtype(self.kv_cache_dtype, self.dtype)

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x (head_dim x bytes per element + a float16 scale when
        quantized)."""
        per_head = self.head_dim * self.cache_dtype.itemsize + (SCALE_DTYPE.itemsize if self.quantized else 0)
        return 2 * self.num_layers * self.num_kv_heads * per_head

    @property
    def dtype_name(self) -> str:
        """How info() and the monitor name the cache's dtype: 'bfloat16', 'fp8_e4m3', 'int8'."""
        return self.kv_cache_dtype if self.quantized else str(self.dtype).removeprefix("torch.")

    @classmethod
    def from_config(cls, config, dtype: torch.dtype) -> KVSpec:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        return cls(text.num_hidden_layers, kv_heads, head_dim, dtype)


class KVCache:
    """The device memory behind the BlockPool: one K and one V tensor spanning all layers."""

    def __init__(self, spec: KVSpec, num_blocks: int, block_size: int,
                 device: torch.device | str = "cpu", scratch: bool = False) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        # One block past the pool's, never handed out: padding rows of a padded decode step
        # (worker/padded_decode.py) write and read their K/V there.
        self.scratch_block = num_blocks if scratch else None
        shape = (spec.num_layers, num_blocks + int(scratch), block_size, spec.num_kv_heads, spec.head_dim)
        # Zeros, not empty: padded gathers read unused slots and 0 * NaN would poison attention.
        self.k = torch.zeros(shape, dtype=spec.cache_dtype, device=device)
        self.v = torch.zeros(shape, dtype=spec.cache_dtype, device=device)
        # float16 [layers, blocks(+scratch), block_size, kv_heads]: value = q.float() * scale.
        self.k_scale = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device) if spec.quantized else None
        self.v_scale = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device) if spec.quantized else None

    @property
    def bytes_per_block(self) -> int:
        return self.spec.bytes_per_token * self.block_size

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._tensors())

    def _tensors(self) -> list[torch.Tensor]:
        """K, V and (quantized) their scales: what a whole-block copy moves."""
        return [self.k, self.v] + ([self.k_scale, self.v_scale] if self.k_scale is not None else [])

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer_idx], self.v[layer_idx]

    def layer_scales(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One layer's (k_scale, v_scale) `[blocks, block_size, kv_heads]`, or (None, None)."""
        if self.k_scale is None:
            return None, None
        return self.k_scale[layer_idx], self.v_scale[layer_idx]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write, fork)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.k.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.k.device)
        for t in self._tensors():
            t[:, dst] = t[:, src]

    def allocate_swap(self, num_slots: int) -> None:
        """Host buffers of `num_slots` whole blocks (pinned when the cache lives on a GPU)."""
        pin = self.k.device.type == "cuda"
        self.host = [torch.zeros((t.shape[0], num_slots) + t.shape[2:], dtype=t.dtype,  # host: swap space
                                 pin_memory=pin) for t in self._tensors()]
        self.host_k, self.host_v = self.host[0], self.host[1]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host slots: pairs of (block, slot)."""
        if pairs:
            blocks = torch.tensor([p[0] for p in pairs], device=self.k.device)
            slots = torch.tensor([p[1] for p in pairs])  # host: indexes host_k
            for host, t in zip(self.host, self._tensors()):
                host[:, slots] = t[:, blocks].to("cpu")

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host slots back into device blocks: pairs of (slot, block)."""
        if pairs:
            slots = torch.tensor([p[0] for p in pairs])  # host: indexes host_k
            blocks = torch.tensor([p[1] for p in pairs], device=self.k.device)
            for host, t in zip(self.host, self._tensors()):
                t[:, blocks] = host[:, slots].to(t.device, non_blocking=True)

    def release(self) -> None:
        """Drop the tensors so their memory returns to the allocator (unload)."""
        self.k = self.v = self.host_k = self.host_v = torch.empty(0)  # host: an empty placeholder
        self.k_scale = self.v_scale = None
        self.host = []
