"""Cache operations on the paged KV cache: write new K/V into slots, copy blocks, swap blocks.

Layouts: a layer's cache is `[num_blocks, block_size, kv_heads, head_dim]`; the whole cache
(what `KVCache` holds for K and for V) is `[layers, num_blocks, block_size, kv_heads, head_dim]`.
Offsets are int64 (token x stride, slot, block x stride, layer x stride): a cache passes 2**31
elements long before it fills a large GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import KernelLaunch


@triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr"])   # a view into staged step inputs
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch,
                     KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr):
    """One program per token: copy its `[kv_heads, head_dim]` key and value into its slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    idx = tl.arange(0, BLOCK)
    head = idx // HEAD_DIM
    dim = idx % HEAD_DIM
    ok = idx < KV_HEADS * HEAD_DIM
    dst = block * stride_cb + offset * stride_cs + head * stride_ch + dim
    k = tl.load(key_ptr + token * stride_kt + head * stride_kh + dim, mask=ok)
    v = tl.load(value_ptr + token * stride_vt + head * stride_vh + dim, mask=ok)
    tl.store(k_cache_ptr + dst, k, mask=ok)
    tl.store(v_cache_ptr + dst, v, mask=ok)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Store `key`/`value [T, kv_heads, head_dim]` at flat slots `slot_mapping [T]` (-1 skips).

    Slot s is position s % block_size of block s // block_size. Inputs may be strided along
    tokens and heads (e.g. a transposed view); the last dimension must be contiguous. Like the
    torch path (`index_copy_`), rows must already have the cache's dtype, unless the cache is
    quantized (int8 / float8_e4m3fn codes with `k_scale`/`v_scale`, fp16 `[blocks, block_size,
    kv_heads]`): then each row is quantized per KV head as it is stored (docs/design.md).
    """
    if key.shape[0] == 0:
        return
    write_kv_launch(k_cache, v_cache, key, value, slot_mapping, k_scale, v_scale).run()


def write_kv_launch(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> KernelLaunch:
    """The one launch `write_kv` makes, argument for argument (also built on meta tensors)."""
    num_tokens, kv_heads, head_dim = key.shape
    block_size = k_cache.shape[1]
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert key.stride(-1) == 1 and value.stride(-1) == 1
    if k_cache.dtype in QUANT_LIMIT:
        assert k_scale is not None and v_scale is not None and k_scale.stride() == v_scale.stride()
        assert k_scale.dtype == torch.float16 and k_scale.stride(-1) == 1 and key.dtype == value.dtype
        return KernelLaunch(
            _write_kv_quant_kernel, (num_tokens, kv_heads),
            (key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping,
             key.stride(0), key.stride(1), value.stride(0), value.stride(1),
             k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_scale.stride(0), k_scale.stride(1)),
            dict(HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
                 LIMIT=QUANT_LIMIT[k_cache.dtype], INT8=k_cache.dtype == torch.int8),
            dict(num_warps=1))          # one row of 64-256: one warp, its reductions stay in registers
    assert key.dtype == value.dtype == k_cache.dtype, "K/V must already be in the cache dtype"
    return KernelLaunch(
        _write_kv_kernel, (num_tokens,),
        (key, value, k_cache, v_cache, slot_mapping,
         key.stride(0), key.stride(1), value.stride(0), value.stride(1),
         k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)),
        dict(KV_HEADS=kv_heads, HEAD_DIM=head_dim,
             BLOCK=triton.next_power_of_2(kv_heads * head_dim), BLOCK_SIZE=block_size),
        dict(num_warps=4))


# Quantized caches (kv_cache_dtype "int8" / "fp8_e4m3"): the largest code, and the torch dtypes.
QUANT_LIMIT = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
# 1.5 * 2**23: adding and taking it away rounds an fp32 to an integer, half to even (a constexpr:
# the compiler reads no other globals)
_RNE_MAGIC = tl.constexpr(12582912.0)
# fp8's candidate scales per row: worker/kv_quant.SCALE_STEPS (a constexpr, as above)
SCALE_STEPS = tl.constexpr(16)


@triton.jit
def _round_e4m3(y):
    """`y` (|y| <= 448) rounded to the nearest e4m3 value, ties to even, still in fp32: Triton
    3.9's interpreter mis-rounds an fp32 -> fp8 cast whose mantissa carries into the exponent
    (124.98 -> 64), so the kernel rounds first and the cast is exact everywhere. Normal values keep
    3 mantissa bits (the carry rounds into the exponent as it should); below 2**-6 the grid is 2**-9."""
    bits = y.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & ~0xFFFFF).to(tl.float32, bitcast=True)
    tiny = (tl.abs(y) + 24576.0) - 24576.0    # 1.5 * 2**14: rounds to multiples of 2**-9
    tiny = (tiny.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)  # sign (-0 too)
    return tl.where(tl.abs(y) < 0.015625, tiny, normal)


@triton.jit
def _quantize_rows(x, LIMIT: tl.constexpr, INT8: tl.constexpr):
    """`x [heads, d]` (fp32) -> (codes, fp16 scales [heads]): worker/kv_quant.py's `quantize`, op
    for op. int8: scale = amax / LIMIT kept within float16's normal range (a row of zeros gets the
    smallest normal, 2**-14), codes = x / scale clamped to +-LIMIT, rounded half to even. fp8: the
    same for each of SCALE_STEPS scales amax / LIMIT * (1 + j / SCALE_STEPS), codes rounded to the
    e4m3 grid, and each row keeps the first scale whose codes read back nearest it (squared error
    summed in fp64: every term is exact, so only two errors agreeing to ~2^-50 could part the
    picks of this kernel's and torch's summation orders)."""
    a = tl.abs(x)
    # torch's amax propagates a NaN, a GPU's max.f32 drops it: a row holding one gets a NaN scale
    # (and NaN fp8 codes), so it reads back NaN in every path instead of as finite values
    amax = tl.where(tl.max((a != a).to(tl.int32), 1) > 0, float("nan"), tl.max(a, 1))
    unit = tl.div_rn(amax, LIMIT)                      # div_rn: `/` is approximate on a GPU
    if INT8:
        y, scale = _scaled(x, unit, 1.0, LIMIT)
        codes = ((y + _RNE_MAGIC) - _RNE_MAGIC).to(tl.int8)
    else:
        grid, scale, error = _e4m3_candidate(x, unit, 1.0, LIMIT)
        for j in tl.static_range(1, SCALE_STEPS):
            grid_j, scale_j, error_j = _e4m3_candidate(x, unit, 1.0 + j / SCALE_STEPS, LIMIT)
            better = error_j < error
            grid = tl.where(better[:, None], grid_j, grid)
            scale = tl.where(better, scale_j, scale)
            error = tl.where(better, error_j, error)
        codes = grid.to(tl.float8e4nv)
    return codes, scale


@triton.jit
def _scaled(x, unit, STEP: tl.constexpr, LIMIT: tl.constexpr):
    """The scale `unit * STEP` within float16's normal range, rounded to fp16, and x / scale
    clamped to +-LIMIT (float16's rounding may push a row's largest value past it). Both clamps
    keep a NaN, as torch's clamp does."""
    scale = tl.minimum(tl.maximum(unit * STEP, 6.103515625e-05, propagate_nan=tl.PropagateNan.ALL),
                       65504.0, propagate_nan=tl.PropagateNan.ALL).to(tl.float16)
    y = tl.div_rn(x, scale.to(tl.float32)[:, None])
    return tl.minimum(tl.maximum(y, -LIMIT, propagate_nan=tl.PropagateNan.ALL), LIMIT,
                      propagate_nan=tl.PropagateNan.ALL), scale


@triton.jit
def _e4m3_candidate(x, unit, STEP: tl.constexpr, LIMIT: tl.constexpr):
    """One fp8 candidate scale `unit * STEP` (fp16): the codes' values on the e4m3 grid (fp32),
    the scale, and the rows' squared error read back (fp64)."""
    y, scale = _scaled(x, unit, STEP, LIMIT)
    grid = _round_e4m3(y)
    back = grid * scale.to(tl.float32)[:, None]
    diff = back.to(tl.float64) - x.to(tl.float64)
    return grid, scale, tl.sum(diff * diff, 1)


@triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr"])
def _write_kv_quant_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                           slot_mapping_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                           stride_cb, stride_cs, stride_ch, stride_sb, stride_ss,
                           HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                           LIMIT: tl.constexpr, INT8: tl.constexpr):
    """Grid (token, KV head): quantize one head's key and value row and store codes and scales.
    (One row a program: fp8's scale search holds 16 candidates' errors, which a program holding
    every head of a token spilled at 8 heads of 128.)"""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) + tl.arange(0, 1)           # a [1] row block: _quantize_rows takes rows
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dim = tl.arange(0, DIM_PAD)
    ok = (dim < HEAD_DIM)[None, :]
    dst = block * stride_cb + offset * stride_cs + head[:, None] * stride_ch + dim[None, :]
    at = block * stride_sb + offset * stride_ss + head
    k = tl.load(key_ptr + token * stride_kt + head[:, None] * stride_kh + dim[None, :], mask=ok, other=0.0)
    codes, scale = _quantize_rows(k.to(tl.float32), LIMIT, INT8)
    tl.store(k_cache_ptr + dst, codes, mask=ok)
    tl.store(k_scale_ptr + at, scale)
    v = tl.load(value_ptr + token * stride_vt + head[:, None] * stride_vh + dim[None, :], mask=ok, other=0.0)
    codes, scale = _quantize_rows(v.to(tl.float32), LIMIT, INT8)
    tl.store(v_cache_ptr + dst, codes, mask=ok)
    tl.store(v_scale_ptr + at, scale)


@triton.jit(do_not_specialize_on_alignment=["pairs_ptr"])
def _copy_blocks_kernel(k_ptr, v_ptr, pairs_ptr, stride_layer, stride_block,
                        BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr):
    """Grid (pair, layer): copy one block's K and V contents src -> dst, CHUNK elements at a time."""
    pair = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    src = tl.load(pairs_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(pairs_ptr + 2 * pair + 1).to(tl.int64)
    src_base = layer * stride_layer + src * stride_block
    dst_base = layer * stride_layer + dst * stride_block
    for start in range(0, BLOCK_NUMEL, CHUNK):
        idx = start + tl.arange(0, CHUNK)
        ok = idx < BLOCK_NUMEL
        tl.store(k_ptr + dst_base + idx, tl.load(k_ptr + src_base + idx, mask=ok), mask=ok)
        tl.store(v_ptr + dst_base + idx, tl.load(v_ptr + src_base + idx, mask=ok), mask=ok)


def copy_blocks(k: torch.Tensor, v: torch.Tensor, pairs: torch.Tensor | list[tuple[int, int]]) -> None:
    """Copy whole blocks src -> dst in every layer of `k`, `v [layers, num_blocks, ...]`.

    `pairs` is `[P, 2]` (src, dst). A destination must not also be a source in the same call
    (copy-on-write and fork never do that): programs run in no particular order.
    """
    if not isinstance(pairs, torch.Tensor):
        pairs = torch.tensor(pairs, dtype=torch.int64).view(-1, 2)
    if pairs.numel() == 0:
        return
    pairs = pairs.to(device=k.device, dtype=torch.int64).contiguous()
    copy_blocks_launch(k, v, pairs).run()


def copy_blocks_launch(k: torch.Tensor, v: torch.Tensor, pairs: torch.Tensor) -> KernelLaunch:
    """The one launch `copy_blocks` makes for int64 `pairs [P, 2]` on the cache's device."""
    assert k.is_contiguous() and v.is_contiguous() and k.shape == v.shape
    block_numel = k[0, 0].numel()
    chunk = min(triton.next_power_of_2(block_numel), 4096)
    return KernelLaunch(
        _copy_blocks_kernel, (pairs.shape[0], k.shape[0]),
        (k, v, pairs, k.stride(0), k.stride(1)),
        dict(BLOCK_NUMEL=block_numel, CHUNK=chunk), dict(num_warps=4))


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor | list[tuple[int, int]]) -> None:
    """Copy blocks `src[:, s] -> dst[:, d]` between caches `[layers, num_blocks, ...]` that may
    live on different devices (swap out: device -> host, swap in: host -> device).

    Blocks are gathered into one contiguous staging tensor so a device <-> host transfer is a
    single copy; the host side is pinned when CUDA is involved, and the call returns once the
    data has landed in `dst`.
    """
    if not isinstance(pairs, torch.Tensor):
        pairs = torch.tensor(pairs, dtype=torch.int64).view(-1, 2)
    if pairs.numel() == 0:
        return
    pairs = pairs.to(torch.int64)
    src_ids, dst_ids = pairs[:, 0], pairs[:, 1]
    staged = src.index_select(1, src_ids.to(src.device))
    if staged.device != dst.device:
        cuda_involved = staged.device.type == "cuda" or dst.device.type == "cuda"
        if cuda_involved and staged.device.type == "cpu":
            staged = staged.pin_memory()
        if cuda_involved and dst.device.type == "cpu":
            landing = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True)
            landing.copy_(staged, non_blocking=True)
            torch.cuda.current_stream(staged.device).synchronize()
            staged = landing
        else:
            staged = staged.to(dst.device, non_blocking=cuda_involved)
    dst.index_copy_(1, dst_ids.to(dst.device), staged)
