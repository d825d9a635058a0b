"""The torch path's prefill attention equals the plain definition (`kernels/reference.py`) for
chunks that start a sequence and chunks that follow a prefix, at random shapes; a chunk after a
prefix is attended without a mask (prefix and chunk apart, merged by log-sum-exp) unless a
sliding window cuts its keys or logits are soft-capped."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from jupyter_pagedkv.worker import prefill_attention, sdpa
from jupyter_pagedkv.worker.attention import paged_attention_torch
from jupyter_pagedkv.worker.paged_metadata import PagedMetadata, PrefillChunk

_spec = importlib.util.spec_from_file_location(
    "prefill_reference", Path(__file__).resolve().parents[2] / "kernels" / "reference.py")
reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reference)

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}


def prefill_batch(chunks, heads, kv_heads, head_dim, block_size, dtype, g):
    """Prefill chunks `(start, q_len)` of separate sequences over a cache whose blocks are
    shuffled; returns (query, k_cache, v_cache, meta, new_k, new_v) as the runner would pass them."""
    ctx_lens = [start + n for start, n in chunks]
    num_blocks = sum(-(-c // block_size) for c in ctx_lens) + 3
    perm = torch.randperm(num_blocks, generator=g)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    tables = torch.zeros(len(chunks), max(-(-c // block_size) for c in ctx_lens), dtype=torch.int32)
    prefills, slots, used = [], [], 0
    for i, ((start, n), ctx) in enumerate(zip(chunks, ctx_lens)):
        blocks = perm[used:used + -(-ctx // block_size)]
        used += len(blocks)
        tables[i, :len(blocks)] = blocks
        pos = torch.arange(start, ctx)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        prefills.append(PrefillChunk(sum(q for _, q in chunks[:i]), n, ctx, blocks))
    slot_mapping = torch.cat(slots)
    q_loc = torch.tensor([0] + [n for _, n in chunks]).cumsum(0).to(torch.int32)
    meta = PagedMetadata(kv_cache=None, slot_mapping=slot_mapping, query_start_loc=q_loc,
                         seq_lens=torch.tensor(ctx_lens, dtype=torch.int32), block_tables=tables,
                         prefills=prefills, max_seq_len=max(ctx_lens))
    query = torch.randn(int(q_loc[-1]), heads, head_dim, generator=g).to(dtype)
    new_k, new_v = k_cache.view(-1, kv_heads, head_dim)[slot_mapping], v_cache.view(-1, kv_heads, head_dim)[slot_mapping]
    return query, k_cache, v_cache, meta, new_k, new_v


def laid_out_consecutively(k_cache, v_cache, meta, block_size):
    """The same batch with each chunk's blocks moved to consecutive places in the cache, the
    layout a fresh pool gives a long prompt: chunks then carry `first_block` and read in place."""
    remap, order = torch.arange(k_cache.shape[0]), []
    for chunk in meta.prefills:
        for b in chunk.block_ids.tolist():
            remap[b] = len(order)
            order.append(b)
    rest = [b for b in range(k_cache.shape[0]) if b not in set(order)]
    remap[rest] = torch.arange(len(order), len(order) + len(rest))
    order += rest
    k, v = k_cache[order].clone(), v_cache[order].clone()
    prefills = [PrefillChunk(c.q_start, c.q_len, c.ctx_len, remap[c.block_ids], int(remap[c.block_ids[0]]))
                for c in meta.prefills]
    slots = remap[meta.slot_mapping // block_size] * block_size + meta.slot_mapping % block_size
    tables = remap[meta.block_tables.long()].to(torch.int32)
    moved = PagedMetadata(kv_cache=None, slot_mapping=slots, query_start_loc=meta.query_start_loc,
                          seq_lens=meta.seq_lens, block_tables=tables, prefills=prefills,
                          max_seq_len=meta.max_seq_len)
    return k, v, moved


def expected(query, k_cache, v_cache, meta, scale, window):
    return reference.paged_attention(query.float(), k_cache.float(), v_cache.float(), meta.block_tables,
                                     meta.seq_lens, meta.query_start_loc, scale, sliding_window=window)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_chunks_match_the_reference_at_random_shapes(seed, dtype, monkeypatch):
    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))   # noqa: E731
    kv_heads = [1, 2, 4][seed % 3]
    heads = kv_heads * [1, 3, 4][seed // 3 % 3]
    head_dim, block_size = [16, 64][seed % 2], [4, 16, 5][seed % 3]
    # a chunk that starts its sequence, chunks after block-aligned and unaligned prefixes, a
    # two-token chunk after a long prefix, and a chunk as long as its prefix
    chunks = [(0, draw(2, 90)), (block_size * draw(1, 20), draw(2, 120)), (draw(1, 300), draw(2, 64)),
              (draw(100, 400), 2), (70, 70)]
    window = [None, None, draw(8, 60), draw(60, 200)][seed % 4]
    merged = []
    monkeypatch.setattr(prefill_attention, "attend_after_prefix",
                        lambda *a, **kw: merged.append(1) or _attend_after_prefix(*a, **kw))
    query, k_cache, v_cache, meta, new_k, new_v = prefill_batch(chunks, heads, kv_heads, head_dim, block_size,
                                                                dtype, g)
    scale = head_dim ** -0.5
    want = expected(query, k_cache, v_cache, meta, scale, window)
    k2, v2, meta2 = laid_out_consecutively(k_cache, v_cache, meta, block_size)
    for layout in ((k_cache, v_cache, meta), (k2, v2, meta2)):    # blocks gathered, or read in place
        for keys in ((new_k, new_v), (None, None)):    # own keys read in place, or gathered back
            out = paged_attention_torch(query, *layout, scale, window, *keys)
            assert out.dtype == dtype
            assert (out.float() - want).abs().max().item() <= TOLERANCE[dtype]
    if window is None:
        assert len(merged) == 2 * 2 * 4      # every chunk after a prefix, every time, without a mask
    chunk = meta2.prefills[1]
    assert chunk.keys(k2, 0, 2).data_ptr() == k2[chunk.first_block].data_ptr()     # a view, no copy


_attend_after_prefix = sdpa.attend_after_prefix


def test_a_window_that_cuts_and_soft_capping_keep_the_masked_path(monkeypatch):
    g = torch.Generator().manual_seed(5)
    query, k_cache, v_cache, meta, new_k, new_v = prefill_batch([(200, 30)], 4, 2, 16, 4, torch.float32, g)
    monkeypatch.setattr(prefill_attention, "attend_after_prefix", lambda *a, **kw: pytest.fail("split path taken"))
    out = paged_attention_torch(query, k_cache, v_cache, meta, 0.25, 64, new_k, new_v)
    assert (out - expected(query, k_cache, v_cache, meta, 0.25, 64)).abs().max().item() <= 1e-5
    capped = paged_attention_torch(query, k_cache, v_cache, meta, 0.25, None, new_k, new_v, softcap=2.0)
    keys = k_cache[meta.prefills[0].block_ids].reshape(-1, 2, 16)[:230].repeat_interleave(2, 1)
    values = v_cache[meta.prefills[0].block_ids].reshape(-1, 2, 16)[:230].repeat_interleave(2, 1)
    scores = torch.tanh(torch.einsum("qhd,khd->hqk", query, keys) * 0.25 / 2.0) * 2.0
    visible = torch.arange(230).view(1, -1) <= torch.arange(200, 230).view(-1, 1)
    want = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), values)
    assert (capped - want).abs().max().item() <= 1e-5


def test_the_merge_by_log_sum_exp_equals_one_softmax_over_prefix_and_chunk():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 6, 9, 32, generator=g)
    k = torch.randn(1, 2, 40, 32, generator=g)
    v = torch.randn(1, 2, 40, 32, generator=g)
    out = sdpa.attend_after_prefix(q, k[:, :, :31], v[:, :, :31], k[:, :, 31:], v[:, :, 31:], 0.2)
    visible = torch.arange(40).view(1, -1) <= torch.arange(31, 40).view(-1, 1)
    kr, vr = k.double().repeat_interleave(3, 1), v.double().repeat_interleave(3, 1)
    scores = (q.double() @ kr.transpose(-1, -2) * 0.2).masked_fill(~visible, float("-inf"))
    assert (out.double() - scores.softmax(-1) @ vr).abs().max().item() < 1e-6
