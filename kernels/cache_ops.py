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
             slot_mapping: torch.Tensor) -> None:
    """Store `key`/`value [T, kv_heads, head_dim]` at flat slots `slot_mapping [T]` (-1 skips).

    Slot s is position s % block_size of block s // block_size. Inputs may be strided along
    tokens and heads (e.g. a transposed view); the last dimension must be contiguous. Like the
    torch path (`index_copy_`), rows must already have the cache's dtype.
    """
    if key.shape[0] == 0:
        return
    write_kv_launch(k_cache, v_cache, key, value, slot_mapping).run()


def write_kv_launch(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, slot_mapping: torch.Tensor) -> KernelLaunch:
    """The one launch `write_kv` makes, argument for argument (also built on meta tensors)."""
    num_tokens, kv_heads, head_dim = key.shape
    block_size = k_cache.shape[1]
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert key.stride(-1) == 1 and value.stride(-1) == 1
    assert key.dtype == value.dtype == k_cache.dtype, "K/V must already be in the cache dtype"
    return KernelLaunch(
        _write_kv_kernel, (num_tokens,),
        (key, value, k_cache, v_cache, slot_mapping,
         key.stride(0), key.stride(1), value.stride(0), value.stride(1),
         k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)),
        dict(KV_HEADS=kv_heads, HEAD_DIM=head_dim,
             BLOCK=triton.next_power_of_2(kv_heads * head_dim), BLOCK_SIZE=block_size),
        dict(num_warps=4))


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
