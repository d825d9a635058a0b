"""Attention sums on torch: SDPA, its soft-capped form written out, and a chunk after a prefix as
two flash calls merged by their log-sum-exps. What the decode and prefill paths (decode_attention.py,
prefill_attention.py) compute with when the execution plan chose torch over a C++ kernel."""
from __future__ import annotations

import torch
import torch.nn.functional as F


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


def _causal_mask(ctx_start: int, q_len: int, ctx_len: int) -> torch.Tensor:
    """Query i (at position ctx_start + i) may see keys 0 .. ctx_start + i."""
    return torch.arange(ctx_len).view(1, -1) <= torch.arange(ctx_start, ctx_start + q_len).view(-1, 1)  # host: callers .to() it


# The kernel F.scaled_dot_product_attention runs on a CPU, called directly because it also returns
# each row's log-sum-exp (public SDPA does not). A torch without it takes the masked path.
_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def split_prefix_supported(query: torch.Tensor, value: torch.Tensor) -> bool:
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
