"""Unified paged attention in Triton: prefill chunks and decode tokens in one varlen launch.

One program owns a tile of query rows of one sequence for one KV head. With grouped-query
attention the rows are (token, query head) pairs that share that KV head, so each K/V tile read
through the block table serves the whole group. Keys are visited in tiles of `TILE_N` positions
(any multiple or divisor of the paged block size); every key position looks up its physical block,
so the tile size is independent of the cache's block size. Softmax is online, accumulation fp32.

Split-K (flash-decoding): when few programs would run over long contexts, a third grid axis cuts
each sequence's key range into `num_splits` parts; each part writes an unnormalised partial result
with its running max and sum, and a small reduction kernel merges them.

Bounded variants. Every value that moves from step to step is a *runtime* argument that Triton is
told not to specialise (`do_not_specialize`: otherwise an int equal to 1 becomes a constant and a
multiple of 16 gets a divisibility hint, each a separate compile): the split count, the batch size,
the block-table width, the window, the GQA group with its row tile (`group`, `block_q`), and the
cache's block size (as a shift: blocks are powers of two, so a runtime shift and mask cost what
constant ones do). The window is on for every step of a windowed model (a no-op mask while the
context is shorter). So one model compiles a fixed handful of variants -- decode tile and prefill
tile, each split or not (`SPLIT`, a constexpr boolean that keeps the unsplit path free of
partial-buffer code), one merge kernel -- whatever the batch and context, and `variants.warm_up`
compiles them all before a timed run (docs/kernels.md: 7 per model, from 52-97 before).

Why a runtime count rather than vLLM's fixed segment count: the split heuristic below stays (few
programs over long contexts split more, big batches not at all), and a runtime count costs one
integer division per program, nothing in the key loop. A runtime group costs a division and a
modulo of the row index once per program, not per key tile. Neither was measured on a GPU (none
lent yet); the compile check reports each variant's registers, none spilling. The
merge kernel takes the count at run time, padded to `MAX_SPLITS` for its max/sum vectors, and
walks the partial outputs in a loop.

Offsets that can pass 2**31 elements are computed in int64: token x stride (queries, outputs),
block x stride (the cache), sequence x table stride, and the partial-buffer indices.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from .launch import KernelLaunch
from .tiles import MAX_SPLITS, choose_num_splits, interpreting, launch_config, num_warps  # noqa: F401 (re-exported)

LOG2E = 1.4426950408889634
# Arguments that change from step to step (or between models sharing a kernel): never specialised.
_ATTENTION_RUNTIME = ["num_seqs", "window", "stride_bt", "num_heads", "group", "block_q", "num_splits",
                      "block_shift", "fresh"]
# Step inputs may be views at any 4-byte offset of one staging buffer (worker/input_staging.py):
# their addresses' alignment must not pick a variant either.
# This step's keys and values (`new_k_ptr`, `new_v_ptr`) are slices of the layer's projections,
# at whatever offset the fused projection puts them.
STEP_INPUTS = ["block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr", "new_k_ptr", "new_v_ptr"]


@triton.jit
def _sequence_of_program(query_start_loc_ptr, pid, num_seqs, block_q):
    """Sequence i owns programs [qsl[i] // block_q + i, qsl[i+1] // block_q + i + 1): find i."""
    lo = num_seqs * 0       # an int32 scalar, like hi (a plain 0 would not type the loop)
    hi = num_seqs
    while lo < hi:          # first sequence whose first program lies after pid
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // block_q + mid <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=_ATTENTION_RUNTIME, do_not_specialize_on_alignment=STEP_INPUTS)
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, new_k_ptr, new_v_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr,
    scale_log2, num_seqs, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss,
    stride_nkt, stride_nkh, stride_nvt, stride_nvh, fresh,
    stride_bt, num_heads, group, block_q, num_splits, block_shift,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    SPLIT: tl.constexpr, USE_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr, QUANT: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _sequence_of_program(query_start_loc_ptr, pid, num_seqs, block_q)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    q_tile = pid - (q_begin // block_q + seq)
    if q_tile * block_q >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + seq)
    first_pos = ctx_len - q_len                      # position of the sequence's first query

    rows = tl.arange(0, BLOCK_M)
    tok = q_tile * block_q + rows // group           # token index inside the sequence's chunk
    head = kv_head * group + rows % group
    row_ok = (rows < block_q * group) & (tok < q_len)
    q_pos = first_pos + tok
    q_row = (q_begin + tok).to(tl.int64)             # row of the [T, heads, d] query / output
    head64 = head.to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + q_row[:, None] * stride_qt + head64[:, None] * stride_qh
                + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if DOT_FP32:    # the interpreter's tl.dot mishandles bf16: same rounding, fp32 operands
        q = q.to(tl.float32)

    # Keys this tile needs: [kv_lo, kv_hi), causal bound from its last query row.
    last_tok = tl.minimum(q_len, (q_tile + 1) * block_q) - 1
    kv_hi = first_pos + last_tok + 1
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(first_pos + q_tile * block_q - window + 1, 0)
        kv_lo = (kv_lo // TILE_N) * TILE_N
    num_tiles = tl.cdiv(kv_hi - kv_lo, TILE_N)
    tile_lo = num_tiles * 0
    tile_hi = num_tiles
    if SPLIT:
        tiles_per_split = tl.cdiv(num_tiles, num_splits)
        tile_lo = split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if QUANT:   # a chunk of 2+ tokens attends its own keys as computed (`fresh`), the rest as stored
        own_lo = tl.where((q_len > 1).to(tl.int32) * fresh != 0, first_pos, kv_hi)
    for t in range(tile_lo, tile_hi):
        k_pos = kv_lo + t * TILE_N + tl.arange(0, TILE_N)
        k_ok = k_pos < kv_hi
        block = tl.load(table + (k_pos >> block_shift), mask=k_ok, other=0).to(tl.int64)
        slot = k_pos & ((1 << block_shift) - 1)
        if QUANT:
            own = k_ok & (k_pos >= own_lo)
            cached = k_ok & (k_pos < own_lo)
        else:
            cached = k_ok
        k = tl.load(k_cache_ptr + block[None, :] * stride_kb + slot[None, :] * stride_ks
                    + kv_head * stride_kh + dims[:, None],
                    mask=cached[None, :] & dim_ok[:, None], other=0.0)        # [D, N]
        v = tl.load(v_cache_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs
                    + kv_head * stride_vh + dims[None, :],
                    mask=cached[:, None] & dim_ok[None, :], other=0.0)        # [N, D]
        p_type = v.dtype
        if QUANT:   # codes widen exactly to the query's dtype; each key's scale is applied in fp32
            at = block * stride_sb + slot * stride_ss + kv_head
            k_scale = tl.load(k_scale_ptr + at, mask=cached, other=0.0).to(tl.float32)
            v_scale = tl.load(v_scale_ptr + at, mask=cached, other=0.0).to(tl.float32)
            p_type = out_ptr.dtype.element_ty      # the query's dtype (q may be fp32 in DOT_FP32)
            row = (q_begin + k_pos - first_pos).to(tl.int64)   # the own keys' rows of this step
            k_new = tl.load(new_k_ptr + row[None, :] * stride_nkt + kv_head * stride_nkh + dims[:, None],
                            mask=own[None, :] & dim_ok[:, None], other=0.0)
            v_new = tl.load(new_v_ptr + row[:, None] * stride_nvt + kv_head * stride_nvh + dims[None, :],
                            mask=own[:, None] & dim_ok[None, :], other=0.0)
            # Codes widen exactly to the query's dtype; under DOT_FP32 (the interpreter's bf16,
            # whose integer-to-bf16 conversion it gets wrong) straight to fp32, as exactly.
            w_type = tl.float32 if DOT_FP32 else p_type
            k = tl.where(own[None, :], k_new.to(w_type), k.to(w_type))
            v = tl.where(own[:, None], v_new.to(w_type), v.to(w_type))
            k_scale = tl.where(own, 1.0, k_scale) * scale_log2
            v_scale = tl.where(own, 1.0, v_scale)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if QUANT:
            s = tl.dot(q, k, input_precision=PRECISION) * k_scale[None, :]
        else:
            s = tl.dot(q, k, input_precision=PRECISION) * scale_log2
        allowed = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows with nothing seen yet
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if QUANT:
            p_v = (p * v_scale[None, :]).to(p_type).to(v.dtype)
        else:
            p_v = p.to(p_type).to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p_v, v, input_precision=PRECISION)
        m_i = m_new

    store_ok = row_ok[:, None] & dim_ok[None, :]
    if SPLIT:
        part = (q_row * num_heads + head64) * num_splits + split              # [T, H, S] index
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=store_ok)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + q_row[:, None] * stride_ot + head64[:, None] * stride_oh
                 + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=store_ok)


@triton.jit(do_not_specialize=["num_heads", "num_splits"])
def _merge_splits_kernel(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
                         stride_ot, stride_oh, num_heads, num_splits,
                         HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                         MAX_SPLITS: tl.constexpr):
    """Merge the split partials of one (token, head): rescale each by exp2(m_s - max m).

    The maxima and sums load as one vector padded to MAX_SPLITS; the partial outputs are walked
    in a runtime loop, so one compiled kernel serves every split count."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    splits = tl.arange(0, MAX_SPLITS)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    base = (token * num_heads + head) * num_splits
    ok = splits < num_splits
    m = tl.load(part_max_ptr + base + splits, mask=ok, other=float("-inf"))
    l = tl.load(part_sum_ptr + base + splits, mask=ok, other=0.0)
    m_all = tl.max(m, 0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.where(m == float("-inf"), 0.0, tl.math.exp2(m - m_all))
    total = tl.sum(w * l, 0)
    acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
    for s in range(0, num_splits):
        m_s = tl.load(part_max_ptr + base + s)
        w_s = tl.where(m_s == float("-inf"), 0.0, tl.math.exp2(m_s - m_all))
        acc += w_s * tl.load(part_acc_ptr + (base + s) * HEAD_DIM + dims, mask=dim_ok, other=0.0)
    out = acc / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dim_ok)


def attention_launches(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       query_start_loc: torch.Tensor, scale: float, out: torch.Tensor, *,
                       max_seq_len: int, sliding_window: int | None = None,
                       num_splits: int | None = None, block_m: int | None = None,
                       tile_n: int | None = None, interpreted: bool | None = None,
                       k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None, new_k: torch.Tensor | None = None,
                       new_v: torch.Tensor | None = None) -> list[KernelLaunch]:
    """The launches `paged_attention` makes (attention, then the merge when split), argument for
    argument. Allocates the split partials on the query's device (a meta device allocates nothing:
    the compile check builds these on meta tensors). A quantized cache (int8 / float8_e4m3fn
    codes) comes with its fp16 scales `[blocks, block_size, kv_heads]` (`QUANT`: the tiles' codes
    widen to the query's dtype, each key's scale multiplies its score and its value's weight), and
    with `new_k`/`new_v` (this step's keys and values `[T, kv_heads, head_dim]` in the query's
    dtype) a chunk of two or more tokens attends its own keys from them, unquantized; without
    them every key is read from the cache (a runtime switch: no extra variant)."""
    if interpreted is None:
        interpreted = interpreting()
    num_tokens, heads, head_dim = query.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"the Triton kernels need a power-of-two block size, got {block_size}")
    num_seqs = seq_lens.shape[0]
    group = heads // kv_heads
    block_m, block_q, tile_n, num_splits = launch_config(
        num_tokens, num_seqs, heads, kv_heads, query.element_size(), max_seq_len, query.device,
        block_m=block_m, tile_n=tile_n, num_splits=num_splits, interpreted=interpreted,
        quant=k_scale is not None, head_dim=head_dim)
    grid_q = triton.cdiv(num_tokens, block_q) + num_seqs
    # fp32 inputs get exact fp32 products (TF32 would cost ~1e-3 relative error); 16-bit inputs
    # multiply natively with fp32 accumulation.
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    # A model's window is on for every step, short or long (the mask is then a no-op), so the
    # window never doubles the variants of one model.
    use_window = sliding_window is not None
    split = num_splits > 1
    if split:
        part_acc = torch.empty(num_tokens, heads, num_splits, head_dim, dtype=torch.float32,
                               device=query.device)
        part_max = torch.empty(num_tokens, heads, num_splits, dtype=torch.float32,
                               device=query.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out       # never touched
    head_dim_pad = triton.next_power_of_2(head_dim)
    quant = k_cache.dtype != query.dtype
    if quant:
        assert k_cache.dtype in (torch.int8, torch.float8_e4m3fn) and v_cache.dtype == k_cache.dtype
        assert k_scale is not None and v_scale is not None and k_scale.dtype == torch.float16
        assert k_scale.stride() == v_scale.stride() and k_scale.stride(-1) == 1
    else:
        k_scale = v_scale = k_cache                # never touched
    fresh = quant and new_k is not None
    if fresh:
        assert new_k.dtype == new_v.dtype == query.dtype and new_k.shape == (num_tokens, kv_heads, head_dim)
        assert new_k.stride(-1) == 1 and new_v.stride(-1) == 1
    else:
        new_k = new_v = query                      # never touched (fresh = 0)
    launches = [KernelLaunch(
        _paged_attention_kernel, (grid_q, kv_heads, num_splits),
        (out, query, k_cache, v_cache, k_scale, v_scale, new_k, new_v, block_tables, seq_lens, query_start_loc,
         part_acc, part_max, part_sum,
         scale * LOG2E, num_seqs, sliding_window if use_window else 0,
         query.stride(0), query.stride(1), out.stride(0), out.stride(1),
         k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
         v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
         k_scale.stride(0) if quant else 0, k_scale.stride(1) if quant else 0,
         new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1), int(fresh),
         block_tables.stride(0), heads, group, block_q, num_splits, block_size.bit_length() - 1),
        dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
             BLOCK_M=block_m, TILE_N=tile_n, SPLIT=split, USE_WINDOW=use_window,
             PRECISION=precision, DOT_FP32=interpreted and query.dtype == torch.bfloat16, QUANT=quant),
        dict(num_warps=num_warps(block_m, query.element_size(), head_dim, quant), num_stages=2))]
    if split:
        launches.append(KernelLaunch(
            _merge_splits_kernel, (num_tokens, heads),
            (out, part_acc, part_max, part_sum, out.stride(0), out.stride(1), heads, num_splits),
            dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, MAX_SPLITS=MAX_SPLITS),
            dict(num_warps=4)))
    return launches


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, *,
                    max_seq_len: int | None = None, sliding_window: int | None = None,
                    num_splits: int | None = None, block_m: int | None = None,
                    tile_n: int | None = None, out: torch.Tensor | None = None,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    new_k: torch.Tensor | None = None, new_v: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of `query [T, heads, head_dim]` over a paged cache `[blocks, block_size, kv_heads,
    head_dim]`, quantized or not (`k_scale`/`v_scale`, and `new_k`/`new_v` for the chunks' own
    keys); same contract as `reference.paged_attention`.

    `max_seq_len` (a host int) sizes the split-K decision without a device sync; `num_splits`,
    `block_m` and `tile_n` override the heuristics (tests use them to reach every path).
    """
    num_tokens, heads, head_dim = query.shape
    num_blocks, block_size, kv_heads, cache_dim = k_cache.shape
    assert cache_dim == head_dim and heads % kv_heads == 0, "shape mismatch"
    assert query.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride()
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())           # a device sync: callers pass it when known
    for launch in attention_launches(query, k_cache, v_cache, block_tables, seq_lens,
                                     query_start_loc, scale, out, max_seq_len=max_seq_len,
                                     sliding_window=sliding_window, num_splits=num_splits,
                                     block_m=block_m, tile_n=tile_n, k_scale=k_scale, v_scale=v_scale,
                                     new_k=new_k, new_v=new_v):
        launch.run()
    return out
