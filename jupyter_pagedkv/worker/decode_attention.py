"""Decode rows' attention on the torch backend: each of a step's first `num_decode` query rows is
one sequence's next token. Where the execution plan chose the C++ kernel (decode_attention.cpp,
`PagedMetadata.decode_kernel`) each row reads its own blocks in place; otherwise SDPA runs over the
rows' blocks gathered into one padded batch and masked to each row's length (a quantized cache's
blocks dequantized as gathered, kv_quant.py)."""
from __future__ import annotations

import torch

from .kv_quant import dequantize
from .paged_metadata import PagedMetadata, additive_mask
from .sdpa import attend


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMetadata,
                     scale: float, window: int | None = None, softcap: float | None = None,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`query [num_decode, heads, d]` over one layer's cache (quantized: with its scales
    `[blocks, block_size, kv_heads]`); returns the same shape. The kernel does not soft-cap, so a
    soft-capped model keeps SDPA's written-out form."""
    if meta.decode_kernel is not None and softcap is None:     # a quantized cache: codes and scales read as they lie
        return meta.decode_kernel(query, k_cache, v_cache, meta.decode_block_tables, meta.seq_lens, scale, window or 0,
                                  k_scale, v_scale)
    nd, heads, d = query.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    bt = meta.decode_block_tables
    length = bt.shape[1] * bs
    # index_select copies whole blocks (~4x faster than advanced indexing on the CPU).
    k = k_cache.index_select(0, bt.view(-1)).view(nd, length, kvh, d).transpose(1, 2)
    v = v_cache.index_select(0, bt.view(-1)).view(nd, length, kvh, d).transpose(1, 2)
    if k_scale is not None:
        k = dequantize(k, k_scale.index_select(0, bt.view(-1)).view(nd, length, kvh).transpose(1, 2), query.dtype)
        v = dequantize(v, v_scale.index_select(0, bt.view(-1)).view(nd, length, kvh).transpose(1, 2), query.dtype)
    bias = meta.decode_masks()[1] if window is None else decode_window_bias(meta, window, query.dtype)
    # GQA folded: the query heads sharing a KV head become that head's query rows, so each
    # KV head is read once and no `enable_gqa` broadcast is needed (same sums, same order).
    q = query.view(nd, kvh, heads // kvh, d)
    return attend(q, k, v, scale, attn_mask=bias.to(query.dtype), softcap=softcap).reshape(nd, heads, d)


def decode_window_bias(meta: PagedMetadata, window: int, dtype: torch.dtype) -> torch.Tensor:
    """The decode rows' additive mask when a sliding window cuts: a key is visible if it is in
    the sequence and among its last `window` positions."""
    mask = meta.decode_masks()[0]
    nd, length = mask.shape[0], mask.shape[-1]
    lens = meta.seq_lens[:nd].to(torch.int64).view(nd, 1, 1, 1)
    visible = mask & (torch.arange(length, device=lens.device).view(1, 1, 1, -1) > lens - 1 - window)
    return additive_mask(visible, dtype)
