"""KVCache: per-layer K and V tensors of shape [num_blocks, block_size, num_kv_heads, head_dim]."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVSpec:
    """The shape facts that decide KV memory: see docs/design.md, 'Memory arithmetic'."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

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
        self.k = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.v = torch.zeros(shape, dtype=spec.dtype, device=device)

    @property
    def bytes_per_block(self) -> int:
        return self.spec.bytes_per_token * self.block_size

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer_idx], self.v[layer_idx]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write, fork)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.k.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.k.device)
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def allocate_swap(self, num_slots: int) -> None:
        """Host buffers of `num_slots` whole blocks (pinned when the cache lives on a GPU)."""
        pin = self.k.device.type == "cuda"
        shape = (self.spec.num_layers, num_slots, self.block_size, self.spec.num_kv_heads,
                 self.spec.head_dim)
        self.host_k = torch.zeros(shape, dtype=self.spec.dtype, pin_memory=pin)  # host: swap space
        self.host_v = torch.zeros(shape, dtype=self.spec.dtype, pin_memory=pin)  # host: swap space

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host slots: pairs of (block, slot)."""
        if pairs:
            blocks = torch.tensor([p[0] for p in pairs], device=self.k.device)
            slots = torch.tensor([p[1] for p in pairs])  # host: indexes host_k
            self.host_k[:, slots] = self.k[:, blocks].to("cpu")
            self.host_v[:, slots] = self.v[:, blocks].to("cpu")

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host slots back into device blocks: pairs of (slot, block)."""
        if pairs:
            slots = torch.tensor([p[0] for p in pairs])  # host: indexes host_k
            blocks = torch.tensor([p[1] for p in pairs], device=self.k.device)
            self.k[:, blocks] = self.host_k[:, slots].to(self.k.device, non_blocking=True)
            self.v[:, blocks] = self.host_v[:, slots].to(self.k.device, non_blocking=True)

    def release(self) -> None:
        """Drop the tensors so their memory returns to the allocator (unload)."""
        self.k = self.v = self.host_k = self.host_v = torch.empty(0)  # host: an empty placeholder
