"""PagedMetadata: one step's batch description, built once by the ModelRunner and read by every
attention layer (the step's context object, instead of ten arguments threaded through)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .kv_cache import KVCache
from .kv_quant import dequantize


@dataclass(slots=True)
class PrefillChunk:
    """Query rows [q_start, q_start + q_len) attend to context positions [0, ctx_len); they are
    its last q_len positions, so query i sees keys 0 .. ctx_len - q_len + i (bottom-right causal)."""

    q_start: int
    q_len: int
    ctx_len: int
    block_ids: torch.Tensor          # physical blocks holding positions [0, ctx_len)
    first_block: int | None = None   # set when those blocks are consecutive, first_block, +1, ...

    def keys(self, cache: torch.Tensor, lo: int, hi: int, scale: torch.Tensor | None = None,
             dtype: torch.dtype | None = None) -> torch.Tensor:
        """`cache`'s rows for this chunk's blocks lo .. hi - 1, as `[(hi - lo) * block_size,
        kv_heads, head_dim]`. Consecutive blocks are a view of the cache: no copy of the prefix
        (a long cached prefix was otherwise copied out once per layer and step). A quantized
        cache's rows come dequantized to `dtype` with their `scale` `[blocks, block_size, kv_heads]`."""
        kvh, d = cache.shape[-2:]
        if self.first_block is not None:
            rows = cache[self.first_block + lo:self.first_block + hi].view(-1, kvh, d)
        else:
            rows = cache.index_select(0, self.block_ids[lo:hi]).view(-1, kvh, d)
        if scale is None:
            return rows
        return dequantize(rows, self.keys(scale.unsqueeze(-1), lo, hi).squeeze(-1), dtype)


@dataclass
class PagedMetadata:
    """Everything attention needs for one step; built once by the ModelRunner, shared by layers.

    The varlen description (`query_start_loc`, `seq_lens`, `block_tables`) is what a fused kernel
    consumes. The CPU path uses the pre-split form: the first `num_decode` sequences have exactly
    one query token and are attended as one padded batch; the rest are prefill chunks.
    """

    kv_cache: KVCache
    slot_mapping: torch.Tensor        # [num_tokens] int64, -1 = do not write
    query_start_loc: torch.Tensor     # [num_seqs + 1] int32
    seq_lens: torch.Tensor            # [num_seqs] int32, context length after this step
    block_tables: torch.Tensor        # [num_seqs, max_blocks] int32, padded with 0
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None   # [num_decode, max_blocks] int64
    decode_mask: torch.Tensor | None = None           # [num_decode, 1, 1, max_blocks*block_size] bool
    decode_bias: torch.Tensor | None = None           # the same as 0 / -inf, added to the scores
    # (both built on first use by `decode_masks`, or set up front by a static batch)
    prefills: list[PrefillChunk] = field(default_factory=list)
    max_seq_len: int = 0
    backend: str = "torch"
    all_slots_valid: bool = False     # no -1 in slot_mapping (the runner checks once per step)
    # The kernels the execution plan chose (worker/plan.py), None where it chose SDPA: the C++
    # prefill attention module, and the C++ paged decode attention (decode_attention.cpp), with
    # which decode rows read their blocks in place instead of a padded gathered copy.
    prefill_kernel: object | None = None
    decode_kernel: Callable | None = None
    kv_write: Callable | None = None    # a quantized cache's C++ write (plan.Kernels.kv_write)

    def decode_masks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode rows' visibility mask over their padded keys (`decode_block_tables` wide) and
        its additive bias, built on first use: only SDPA's padded decode reads them; the C++
        kernel reads the lengths, and building them cost ~55 us a step it did not use."""
        if self.decode_mask is None:
            nd = self.num_decode
            length = self.decode_block_tables.shape[1] * self.kv_cache.block_size
            lens = self.seq_lens[:nd].to(torch.int64).view(nd, 1)
            self.decode_mask = (torch.arange(length, device=lens.device).view(1, -1) < lens).view(nd, 1, 1, -1)
            self.decode_bias = additive_mask(self.decode_mask, self.kv_cache.spec.dtype)
        return self.decode_mask, self.decode_bias


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean visibility mask as the 0 / -inf bias SDPA adds to the scores."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))
