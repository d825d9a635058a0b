"""Paged attention behind transformers' AttentionInterface, on a flat varlen batch.

The model runs on one flat row of tokens (`[1, num_tokens]`) mixing decode tokens and prefill
chunks of many sequences. Every attention layer receives the same per-step `PagedMetadata`
(through the `paged=` keyword the runner passes to `model(...)`): it writes the new K/V into their
slots and attends over each sequence's blocks. On the CPU this is pure torch; the Triton kernels
in `kernels/` and this torch path are both checked against `kernels/reference.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from . import prefill_attention
from .kv_cache import KVCache

ATTN_IMPLEMENTATION = "jupyter_pagedkv"


@dataclass(slots=True)
class PrefillChunk:
    """Query rows [q_start, q_start + q_len) attend to context positions [0, ctx_len); they are
    its last q_len positions, so query i sees keys 0 .. ctx_len - q_len + i (bottom-right causal)."""

    q_start: int
    q_len: int
    ctx_len: int
    block_ids: torch.Tensor          # physical blocks holding positions [0, ctx_len)
    first_block: int | None = None   # set when those blocks are consecutive, first_block, +1, ...

    def keys(self, cache: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """`cache`'s rows for this chunk's blocks lo .. hi - 1, as `[(hi - lo) * block_size,
        kv_heads, head_dim]`. Consecutive blocks are a view of the cache: no copy of the prefix
        (a long cached prefix was otherwise copied out once per layer and step)."""
        kvh, d = cache.shape[-2:]
        if self.first_block is not None:
            return cache[self.first_block + lo:self.first_block + hi].view(-1, kvh, d)
        return cache.index_select(0, self.block_ids[lo:hi]).view(-1, kvh, d)


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
    all_slots_valid: bool = False     # no -1 in slot_mapping (the runner checks once per step)
    prefill_kernel: object | None = None   # the C++ prefill attention module, where it serves (prefill_attention.py)
    # The C++ paged decode attention (decode_attention.cpp) on the CPU where it builds: decode
    # rows then read their blocks in place instead of a padded gathered copy.
    decode_kernel: Callable | None = None


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean visibility mask as the 0 / -inf bias SDPA adds to the scores."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def decode_window_bias(meta: PagedMetadata, window: int, dtype: torch.dtype) -> torch.Tensor:
    """The decode rows' additive mask when a sliding window cuts: a key is visible if it is in
    the sequence and among its last `window` positions."""
    nd, length = meta.decode_mask.shape[0], meta.decode_mask.shape[-1]
    lens = meta.seq_lens[:nd].to(torch.int64).view(nd, 1, 1, 1)
    visible = meta.decode_mask & (torch.arange(length, device=lens.device).view(1, 1, 1, -1) > lens - 1 - window)
    return additive_mask(visible, dtype)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, all_valid: bool = False) -> None:
    """Store key/value rows `[num_tokens, kv_heads, head_dim]` into their slots (-1 skips a row;
    `all_valid` says the caller knows there is none, sparing a check and a sync per layer)."""
    kvh, d = k_cache.shape[-2:]
    if not all_valid and bool((slot_mapping < 0).any()):
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
    prefill chunk read its own keys in place instead of gathering them back; only the prefix
    before a chunk is gathered from the blocks.
    """
    num_tokens, heads, d = query.shape
    if sliding_window is not None and meta.max_seq_len <= sliding_window:
        sliding_window = None   # no sequence is long enough for the window to cut anything
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    gqa = heads != kvh
    out = torch.empty_like(query)
    nd = meta.num_decode
    kernel = meta.prefill_kernel if softcap is None else None
    if nd and meta.decode_kernel is not None and softcap is None:
        out[:nd] = meta.decode_kernel(query[:nd], k_cache, v_cache, meta.decode_block_tables, meta.seq_lens,
                                      scale, sliding_window or 0)
    elif nd:
        bt = meta.decode_block_tables
        length = bt.shape[1] * bs
        # index_select copies whole blocks (~4x faster than advanced indexing on the CPU).
        k = k_cache.index_select(0, bt.view(-1)).view(nd, length, kvh, d).transpose(1, 2)
        v = v_cache.index_select(0, bt.view(-1)).view(nd, length, kvh, d).transpose(1, 2)
        bias = meta.decode_bias if sliding_window is None else decode_window_bias(meta, sliding_window, query.dtype)
        # GQA folded: the query heads sharing a KV head become that head's query rows, so each
        # KV head is read once and no `enable_gqa` broadcast is needed (same sums, same order).
        q = query[:nd].view(nd, kvh, heads // kvh, d)
        o = attend(q, k, v, scale, attn_mask=bias.to(query.dtype), softcap=softcap)
        out[:nd] = o.reshape(nd, heads, d)
    for chunk in meta.prefills:
        s, n, ctx = chunk.q_start, chunk.q_len, chunk.ctx_len
        q = query[s:s + n].transpose(0, 1).unsqueeze(0)      # [1, heads, n, d]
        window = sliding_window if sliding_window is not None and ctx > sliding_window else None
        if new_k is not None:      # the chunk's own keys and values, read in place
            own_k, own_v = new_k[s:s + n], new_v[s:s + n]
        else:
            own_k = k_cache.view(-1, kvh, d)[meta.slot_mapping[s:s + n]]
            own_v = v_cache.view(-1, kvh, d)[meta.slot_mapping[s:s + n]]
        if kernel is not None:
            out[s:s + n] = _native_chunk(kernel, query[s:s + n], own_k, own_v, chunk, k_cache, v_cache, scale, window)
            continue
        if window is None and ctx == n:
            # The chunk starts the sequence: its own keys are the whole context.
            o = attend(q, own_k.transpose(0, 1).unsqueeze(0), own_v.transpose(0, 1).unsqueeze(0), scale,
                       is_causal=True, enable_gqa=gqa, softcap=softcap)
        elif window is None and softcap is None and _split_prefix_supported(query, own_v):
            # After a prefix: every query sees every prefix key, and its own chunk causally.
            start = ctx - n
            pk = chunk.keys(k_cache, 0, -(-start // bs))[:start].transpose(0, 1).unsqueeze(0)
            pv = chunk.keys(v_cache, 0, -(-start // bs))[:start].transpose(0, 1).unsqueeze(0)
            o = attend_after_prefix(q, pk, pv, own_k.transpose(0, 1).unsqueeze(0),
                                    own_v.transpose(0, 1).unsqueeze(0), scale)
        else:
            # A window that cuts, logit soft-capping, or no flash kernel with its log-sum-exp:
            # a dense [n, keys] mask over the keys some query of the chunk can see.
            lo = 0 if window is None else max(0, ctx - n - window + 1) // bs * bs
            hi = len(chunk.block_ids)
            k = chunk.keys(k_cache, lo // bs, hi)[:ctx - lo].transpose(0, 1).unsqueeze(0)
            v = chunk.keys(v_cache, lo // bs, hi)[:ctx - lo].transpose(0, 1).unsqueeze(0)
            qpos = torch.arange(ctx - n, ctx, device=query.device).view(-1, 1)
            kpos = torch.arange(lo, ctx, device=query.device).view(1, -1)
            mask = kpos <= qpos
            if window is not None:
                mask &= kpos > qpos - window
            o = attend(q, k, v, scale, attn_mask=mask, enable_gqa=gqa, softcap=softcap)
        out[s:s + n] = o[0].transpose(0, 1)
    return out


def _native_chunk(kernel, q: torch.Tensor, own_k: torch.Tensor, own_v: torch.Tensor, chunk: PrefillChunk,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """A prefill chunk through the C++ kernel: its own keys causally, then (if the chunk follows a
    prefix) the prefix's keys read where they lie, the two parts merged by their log-sum-exps.
    Under a sliding window only the prefix blocks some query of the chunk can see are read."""
    n, ctx, bs = chunk.q_len, chunk.ctx_len, k_cache.shape[1]
    start = ctx - n
    o, lse = prefill_attention.attend(kernel, q, own_k, own_v, scale, 0, window)
    first_visible = 0 if window is None else max(0, start - window + 1)
    if start == 0 or first_visible >= start:
        return o
    lo = first_visible // bs * bs
    hi = -(-start // bs)
    pk = chunk.keys(k_cache, lo // bs, hi)[:start - lo]
    pv = chunk.keys(v_cache, lo // bs, hi)[:start - lo]
    o1, lse1 = prefill_attention.attend(kernel, q, pk, pv, scale, start - lo, window)
    return merge_by_lse(o1, lse1.t(), o, lse.t())       # the kernel's lse is [heads, n]


# The kernel F.scaled_dot_product_attention runs on a CPU, called directly because it also returns
# each row's log-sum-exp (public SDPA does not). A torch without it takes the masked path.
_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _split_prefix_supported(query: torch.Tensor, value: torch.Tensor) -> bool:
    """The split path needs that CPU kernel (never called with an empty prefix: it crashes)."""
    return _FLASH_WITH_LSE is not None and query.device.type == "cpu" and value.shape[-1] == query.shape[-1]


def attend_after_prefix(q: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor,
                        own_k: torch.Tensor, own_v: torch.Tensor, scale: float) -> torch.Tensor:
    """A chunk of `n` queries that follows a non-empty prefix: `q [1, heads, n, d]` sees all of
    `prefix_k/v [1, kv_heads, P, d]` and, causally, the chunk's own `own_k/v [1, kv_heads, n, d]`.

    Two flash calls, no mask: the prefix unmasked, the chunk with top-left causal alignment (square,
    so exact). Each returns its rows' softmax normalisers as log-sum-exps l1, l2; the full softmax
    weighs the two partial outputs by e^l1 and e^l2, i.e. o = o2 + sigmoid(l1 - l2) * (o1 - o2),
    merged in fp32. Same sums as one masked softmax; no [n, P + n] score or mask tensor exists.
    """
    o1, l1 = _FLASH_WITH_LSE(q, prefix_k, prefix_v, scale=scale)
    o2, l2 = _FLASH_WITH_LSE(q, own_k, own_v, is_causal=True, scale=scale)
    return merge_by_lse(o1, l1, o2, l2)


def merge_by_lse(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Two partial attentions of the same queries over disjoint keys, as one: `o [..., d]` with
    each row's log-sum-exp `lse [...]`. The full softmax weighs each part by e^lse, so o = o2 +
    sigmoid(lse1 - lse2) * (o1 - o2), in fp32 for 16-bit outputs; a part that saw no key (lse -inf)
    gets weight 0."""
    share = torch.sigmoid(lse1 - lse2).unsqueeze(-1)      # the first part's share of each row
    if o1.dtype.itemsize >= 4:
        return torch.lerp(o2, o1, share.to(o1.dtype))
    return torch.lerp(o2.float(), o1.float(), share).to(o1.dtype)


def _causal_mask(ctx_start: int, q_len: int, ctx_len: int) -> torch.Tensor:
    """Query i (at position ctx_start + i) may see keys 0 .. ctx_start + i."""
    return torch.arange(ctx_len).view(1, -1) <= torch.arange(ctx_start, ctx_start + q_len).view(-1, 1)  # host: callers .to() it


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
    q = query[0].transpose(0, 1)                    # [T, heads, d]
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    out = paged_attention(module.layer_idx, q, k, v, meta, scale, window, kwargs.get("softcap"))
    return out.unsqueeze(0), None


def paged_attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PagedMetadata,
                    scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """One layer's step: store this step's `k`/`v` `[T, kv_heads, d]` in their slots and attend
    `q [T, heads, d]` over the paged cache; returns `[T, heads, d]`. Shared by the AttentionInterface
    entry above and the lean forward loop (lean_forward.py)."""
    k_cache, v_cache = meta.kv_cache.layer(layer_idx)
    if meta.backend == "triton":
        if softcap is not None:   # Engine refuses this pairing at build time; a guard for direct use
            raise NotImplementedError("the Triton kernels do not soft-cap attention logits: use the torch backend")
        from .kernels_bridge import paged_attention_triton, write_kv_triton
        write_kv_triton(k_cache, v_cache, k, v, meta.slot_mapping)
        return paged_attention_triton(q, k_cache, v_cache, meta, scale, window)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping, meta.all_slots_valid)
    return paged_attention_torch(q, k_cache, v_cache, meta, scale, window, k, v, softcap)


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
