"""Paged attention behind transformers' AttentionInterface, on a flat varlen batch.

The model runs on one flat row of tokens (`[1, num_tokens]`) mixing decode tokens and prefill
chunks of many sequences. Every attention layer receives the same per-step `PagedMetadata`
(through the `paged=` keyword the runner passes to `model(...)`): it writes the new K/V into their
slots and attends over each sequence's blocks. On the CPU this is pure torch; the Triton kernels
in `kernels/` and this torch path are both checked against `kernels/reference.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .kv_cache import KVCache

ATTN_IMPLEMENTATION = "jupyter_pagedkv"


@dataclass(slots=True)
class PrefillChunk:
    """Query rows [q_start, q_start + q_len) attend to context positions [0, ctx_len)."""

    q_start: int
    q_len: int
    ctx_len: int
    block_ids: torch.Tensor          # physical blocks holding positions [0, ctx_len)
    mask: torch.Tensor | None        # [q_len, ctx_len] bool, None when the chunk starts at 0


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
    prefills: list[PrefillChunk] = field(default_factory=list)
    max_seq_len: int = 0
    backend: str = "torch"


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean visibility mask as the 0 / -inf bias SDPA adds to the scores."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store key/value rows `[num_tokens, kv_heads, head_dim]` into their slots (-1 skips a row)."""
    kvh, d = k_cache.shape[-2:]
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, value)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, attn_mask=None,
           is_causal: bool = False, enable_gqa: bool = False, softcap: float | None = None) -> torch.Tensor:
    """SDPA, or, with logit soft-capping (Gemma 2, Cohere 2...), the same sums written out in
    transformers' eager order: scores * scale, softcap * tanh(scores / softcap), mask, float32
    softmax, weights @ V. `attn_mask` is boolean (True = visible) or additive."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        n, ctx = scores.shape[-2:]
        attn_mask = _causal_mask(ctx - n, n, ctx).to(q.device)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def paged_attention_torch(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: PagedMetadata, scale: float, sliding_window: int | None = None,
                          new_k: torch.Tensor | None = None,
                          new_v: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention for `query [num_tokens, heads, head_dim]` over the paged cache of one layer.

    `new_k`/`new_v` (this step's keys and values, `[num_tokens, kv_heads, head_dim]`) let a
    chunk that starts its sequence read its keys in place instead of gathering them back.
    """
    num_tokens, heads, d = query.shape
    if sliding_window is not None and meta.max_seq_len <= sliding_window:
        sliding_window = None   # no sequence is long enough for the window to cut anything
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    gqa = heads != kvh
    out = torch.empty_like(query)
    nd = meta.num_decode
    if nd:
        bt = meta.decode_block_tables
        length = bt.shape[1] * bs
        # index_select copies whole blocks (~4x faster than advanced indexing on the CPU).
        k = k_cache.index_select(0, bt.view(-1)).view(nd, length, kvh, d).transpose(1, 2)
        v = v_cache.index_select(0, bt.view(-1)).view(nd, length, kvh, d).transpose(1, 2)
        bias = meta.decode_bias
        if sliding_window is not None:
            lens = meta.seq_lens[:nd].to(torch.int64).view(nd, 1, 1, 1)
            visible = meta.decode_mask & (torch.arange(length, device=query.device).view(1, 1, 1, -1)
                                          > lens - 1 - sliding_window)
            bias = additive_mask(visible, query.dtype)
        # GQA folded: the query heads sharing a KV head become that head's query rows, so each
        # KV head is read once and no `enable_gqa` broadcast is needed (same sums, same order).
        q = query[:nd].view(nd, kvh, heads // kvh, d)
        o = attend(q, k, v, scale, attn_mask=bias.to(query.dtype), softcap=softcap)
        out[:nd] = o.reshape(nd, heads, d)
    for chunk in meta.prefills:
        s, n = chunk.q_start, chunk.q_len
        q = query[s:s + n].transpose(0, 1).unsqueeze(0)      # [1, heads, n, d]
        if chunk.mask is None and sliding_window is None:
            # The chunk starts the sequence: its own keys are the whole context, read in place.
            if new_k is not None:
                k, v = new_k[s:s + n], new_v[s:s + n]
            else:
                k = k_cache.view(-1, kvh, d)[meta.slot_mapping[s:s + n]]
                v = v_cache.view(-1, kvh, d)[meta.slot_mapping[s:s + n]]
            o = attend(q, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), scale,
                       is_causal=True, enable_gqa=gqa, softcap=softcap)
        else:
            ctx = chunk.ctx_len
            k = k_cache.index_select(0, chunk.block_ids).view(-1, kvh, d)[:ctx].transpose(0, 1).unsqueeze(0)
            v = v_cache.index_select(0, chunk.block_ids).view(-1, kvh, d)[:ctx].transpose(0, 1).unsqueeze(0)
            mask = chunk.mask if chunk.mask is not None else _causal_mask(ctx - n, n, ctx).to(query.device)
            if sliding_window is not None:
                qpos = torch.arange(ctx - n, ctx, device=query.device).view(-1, 1)
                mask = mask & (torch.arange(ctx, device=query.device).view(1, -1) > qpos - sliding_window)
            o = attend(q, k, v, scale, attn_mask=mask, enable_gqa=gqa, softcap=softcap)
        out[s:s + n] = o[0].transpose(0, 1)
    return out


def _causal_mask(ctx_start: int, q_len: int, ctx_len: int) -> torch.Tensor:
    """Query i (at position ctx_start + i) may see keys 0 .. ctx_start + i."""
    return torch.arange(ctx_len).view(1, -1) <= torch.arange(ctx_start, ctx_start + q_len).view(-1, 1)


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """The AttentionInterface entry: `query [1, heads, T, d]`, `key/value [1, kv_heads, T, d]`.

    Without a `paged=` keyword (a plain `model.generate`), it is ordinary SDPA, so a model whose
    attention we replaced still works outside the engine.
    """
    meta: PagedMetadata | None = kwargs.pop("paged", None)
    if meta is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    softcap = kwargs.get("softcap")
    k_cache, v_cache = meta.kv_cache.layer(module.layer_idx)
    q = query[0].transpose(0, 1)                    # [T, heads, d]
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    if meta.backend == "triton":
        if softcap is not None:   # Engine refuses this pairing at build time; a guard for direct use
            raise NotImplementedError("the Triton kernels do not soft-cap attention logits: use the torch backend")
        from .kernels_bridge import paged_attention_triton, write_kv_triton
        write_kv_triton(k_cache, v_cache, k, v, meta.slot_mapping)
        out = paged_attention_triton(q, k_cache, v_cache, meta, scale, window)
    else:
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        out = paged_attention_torch(q, k_cache, v_cache, meta, scale, window, k, v, softcap)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
