"""Paged attention behind transformers' AttentionInterface, on a flat varlen batch.

The model runs on one flat row of tokens (`[1, num_tokens]`) mixing decode tokens and prefill
chunks of many sequences. Every attention layer receives the same per-step `PagedMetadata`
(through the `paged=` keyword the runner passes to `model(...)`): it writes the new K/V into their
slots and attends over each sequence's blocks, on the backend the execution plan chose
(worker/plan.py): the Triton kernels (`kernels/`), or torch, where decode rows
(decode_attention.py) and prefill chunks (prefill_attention.py) each take their own path. Both
backends are checked against `kernels/reference.py`.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .decode_attention import decode_attention
from .kv_quant import write_quantized
from .paged_metadata import PagedMetadata
from .prefill_attention import prefill_attention

ATTN_IMPLEMENTATION = "jupyter_pagedkv"


def valid_rows(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
               all_valid: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows to store: those whose slot is not -1 (padding). `all_valid` says the caller knows
    there is none, sparing a check and a sync per layer."""
    if all_valid or not bool((slots < 0).any()):
        return key, value, slots
    keep = slots >= 0
    return key[keep], value[keep], slots[keep]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, all_valid: bool = False) -> None:
    """Store key/value rows `[num_tokens, kv_heads, head_dim]` into their slots (-1 skips a row:
    `valid_rows`)."""
    kvh, d = k_cache.shape[-2:]
    key, value, slot_mapping = valid_rows(key, value, slot_mapping, all_valid)
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, value)


def paged_attention_torch(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: PagedMetadata, scale: float, sliding_window: int | None = None,
                          new_k: torch.Tensor | None = None,
                          new_v: torch.Tensor | None = None, softcap: float | None = None,
                          k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention for `query [num_tokens, heads, head_dim]` over the paged cache of one layer: the
    decode rows first, then the prefill chunks (`new_k`/`new_v`, this step's keys and values
    `[num_tokens, kv_heads, head_dim]`, let a chunk read its own keys in place). A quantized cache
    comes with its scales (`KVCache.layer_scales`); what is read is dequantized to the query's dtype."""
    if sliding_window is not None and meta.max_seq_len <= sliding_window:
        sliding_window = None   # no sequence is long enough for the window to cut anything
    nd = meta.num_decode
    if nd == query.shape[0]:        # a decode-only step: the kernel's output is the layer's
        return decode_attention(query, k_cache, v_cache, meta, scale, sliding_window, softcap, k_scale, v_scale)
    out = torch.empty_like(query)
    if nd:
        out[:nd] = decode_attention(query[:nd], k_cache, v_cache, meta, scale, sliding_window, softcap,
                                    k_scale, v_scale)
    return prefill_attention(query, k_cache, v_cache, meta, scale, sliding_window, new_k, new_v, softcap, out,
                             k_scale, v_scale)


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
    k_scale, v_scale = meta.kv_cache.layer_scales(layer_idx)
    if meta.backend == "triton":
        if softcap is not None:   # Engine refuses this pairing at build time; a guard for direct use
            raise NotImplementedError("the Triton kernels do not soft-cap attention logits: use the torch backend")
        from .kernels_bridge import paged_attention_triton, write_kv_triton
        # A quantized cache: the write kernel quantizes (kv_quant.quantize's ops), attention reads codes.
        write_kv_triton(k_cache, v_cache, k, v, meta.slot_mapping, k_scale, v_scale)
        return paged_attention_triton(q, k_cache, v_cache, meta, scale, window, k_scale, v_scale, k, v)
    if k_scale is None:
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping, meta.all_slots_valid)
    else:
        write_kv_quantized(k_cache, v_cache, k_scale, v_scale, k, v, meta)
    # A quantized cache: prefill chunks attend their own keys as computed (`k`, `v`), decode rows
    # read theirs back from the cache (docs/design.md, "Quantized KV cache").
    return paged_attention_torch(q, k_cache, v_cache, meta, scale, window, k, v, softcap, k_scale, v_scale)


def write_kv_quantized(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                       key: torch.Tensor, value: torch.Tensor, meta: PagedMetadata) -> None:
    """`write_kv` for a quantized cache (kv_quant.py): rows with slot -1 are not written; in C++
    where the plan loaded it (the same codes and scales)."""
    key, value, slots = valid_rows(key, value, meta.slot_mapping, meta.all_slots_valid)
    if meta.kv_write is not None:
        meta.kv_write(k_cache, k_scale, key, slots)
        meta.kv_write(v_cache, v_scale, value, slots)
        return
    write_quantized(k_cache, v_cache, k_scale, v_scale, key, value, slots, meta.kv_cache.spec.kv_cache_dtype)


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
