"""Torch references for the kernels: the slow, obvious definitions the tests compare against."""
from __future__ import annotations

import torch


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """The engine's oracle (`jupyter_pagedkv.attention.paged_attention_reference`); with a
    sliding window, the same definition with keys older than `window` positions masked."""
    from jupyter_pagedkv.attention import paged_attention_reference
    if sliding_window is None:
        return paged_attention_reference(query, k_cache, v_cache, block_tables, seq_lens,
                                         query_start_loc, scale)
    return _windowed(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                     sliding_window)


def _windowed(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window):
    """Query at position p sees keys in (p - window, p]: the HF sliding-window rule."""
    heads, d = query.shape[1:]
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(query.shape, dtype=torch.float32)
    for i in range(len(seq_lens)):
        s, e, ctx = int(query_start_loc[i]), int(query_start_loc[i + 1]), int(seq_lens[i])
        if e == s:
            continue
        blocks = block_tables[i, :-(-ctx // bs)].long()
        k = k_cache[blocks].reshape(-1, kvh, d)[:ctx].float().repeat_interleave(heads // kvh, 1)
        v = v_cache[blocks].reshape(-1, kvh, d)[:ctx].float().repeat_interleave(heads // kvh, 1)
        q_pos = torch.arange(ctx - (e - s), ctx).view(-1, 1)
        k_pos = torch.arange(ctx).view(1, -1)
        allowed = (k_pos <= q_pos) & (k_pos > q_pos - window)
        scores = torch.einsum("qhd,khd->hqk", query[s:e].float(), k) * scale
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)
    return out.to(query.dtype)


def write_kv(k_cache, v_cache, key, value, slot_mapping) -> None:
    """The engine's torch path (`jupyter_pagedkv.attention.write_kv`)."""
    from jupyter_pagedkv.attention import write_kv as torch_write_kv
    torch_write_kv(k_cache, v_cache, key, value, slot_mapping)


def copy_blocks(k: torch.Tensor, v: torch.Tensor, pairs) -> None:
    """Per-pair slice assignment in every layer."""
    for src, dst in (pairs.tolist() if isinstance(pairs, torch.Tensor) else pairs):
        k[:, dst] = k[:, src]
        v[:, dst] = v[:, src]


def contiguous_attention(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Decode on dense per-sequence KV (`[B, kv_heads, ctx, d]`): the non-paged baseline."""
    return torch.nn.functional.scaled_dot_product_attention(
        query, k, v, scale=scale, enable_gqa=query.shape[1] != k.shape[1])
