"""The kernel launches one model can hit: every compiled variant, each built once on dummy data.

A variant is what Triton compiles separately: the kernel with its constexprs and the
specialisation of its runtime arguments. After the split count, batch size, window and GQA group
became unspecialised runtime values (paged_attention.py), what remains per model is fixed by its
shape and cache: the decode tile and the prefill tile, each split or not, the split merge,
`write_kv` and `copy_blocks` (and a quantized cache's scales copied by a second `copy_blocks`). `model_launches` builds exactly those launches with the launchers'
own argument builders, so the same list serves the compile check (on meta tensors, nothing
allocated) and the engine's warm-up (on the device, launched once so nothing compiles later).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache_ops import copy_blocks_launch, write_kv_launch
from .launch import KernelLaunch
from .paged_attention import attention_launches


@dataclass(frozen=True)
class AttentionShape:
    """What decides a model's variants: its attention shape, compute dtype, the cache's storage
    dtype (`kv_dtype`: None for the compute dtype; int8 / float8_e4m3fn for a quantized cache,
    whose write and attention kernels are their own variants) and block size."""
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    window: int | None = None
    kv_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.heads} query heads do not split into {self.kv_heads} KV heads")


# (role, query tokens, sequences, split count): decode rows are one token per sequence (the 16-row
# tile), a prefill chunk makes the 64-row tile; split launches use 2 parts (any count > 1 is the
# same compiled kernel: the count is a runtime argument).
_ATTENTION_CASES = (("decode", 2, 2, 1), ("decode split", 2, 2, 2),
                    ("prefill", 5, 2, 1), ("prefill split", 5, 2, 2))


def model_launches(shape: AttentionShape, device: torch.device | str = "meta", *,
                   interpreted: bool | None = None) -> list[tuple[str, KernelLaunch]]:
    """(role, launch) for every variant `shape` can hit, on dummy tensors on `device`.

    The tensors are zeros laid out as the engine's (int32 block tables, sequence lengths and
    query offsets, int64 slot mapping and copy pairs), so running a launch is harmless: every
    sequence has no queries, every slot is -1, and the one block copy goes to a spare block.
    The zeros make the attention programs return at once; the merge reads its own partials.
    """
    device = torch.device(device)
    s = shape
    blocks = 3
    k_cache = torch.zeros(blocks, s.block_size, s.kv_heads, s.head_dim, dtype=s.kv_dtype or s.dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    scales = {}
    if s.kv_dtype not in (None, s.dtype):       # a quantized cache: fp16 scales per token and KV head
        scales = dict(k_scale=torch.zeros(blocks, s.block_size, s.kv_heads, dtype=torch.float16, device=device))
        scales["v_scale"] = torch.zeros_like(scales["k_scale"])
    table = torch.zeros(4, 2, dtype=torch.int32, device=device)
    out: list[tuple[str, KernelLaunch]] = []
    for role, tokens, seqs, splits in _ATTENTION_CASES:
        query = torch.zeros(tokens, s.heads, s.head_dim, dtype=s.dtype, device=device)
        seq_lens = torch.zeros(seqs, dtype=torch.int32, device=device)
        query_start_loc = torch.zeros(seqs + 1, dtype=torch.int32, device=device)
        rows = {}
        if scales:      # as the engine calls it: this step's keys and values, for prefill chunks
            rows = dict(new_k=torch.zeros(tokens, s.kv_heads, s.head_dim, dtype=s.dtype, device=device))
            rows["new_v"] = torch.zeros_like(rows["new_k"])
        launches = attention_launches(
            query, k_cache, v_cache, table[:seqs], seq_lens, query_start_loc, s.head_dim ** -0.5,
            torch.empty_like(query), max_seq_len=2 * s.block_size, sliding_window=s.window,
            num_splits=splits, interpreted=interpreted, **scales, **rows)
        out.append((role, launches[0]))
        if splits > 1 and role == "decode split":
            out.append(("merge", launches[1]))
    key = torch.zeros(2, s.kv_heads, s.head_dim, dtype=s.dtype, device=device)
    slots = torch.full((2,), -1, dtype=torch.int64, device=device)
    out.append(("write_kv", write_kv_launch(k_cache, v_cache, key, key, slots, *scales.values())))
    whole_k = k_cache.unsqueeze(0)                  # [layers, blocks, ...]; one layer is enough
    pairs = torch.tensor([[1, 2]], dtype=torch.int64, device=device)
    out.append(("copy_blocks", copy_blocks_launch(whole_k, v_cache.unsqueeze(0), pairs)))
    if scales:      # copy-on-write and fork copy a quantized block's scales with its codes
        out.append(("copy_blocks scales", copy_blocks_launch(scales["k_scale"].unsqueeze(0),
                                                             scales["v_scale"].unsqueeze(0), pairs)))
    return out


def warm_up(shape: AttentionShape, device: torch.device | str) -> list[str]:
    """Launch every variant of `shape` once on `device` (compiling it); returns the roles run."""
    roles = []
    for role, launch in model_launches(shape, device):
        launch.run()
        roles.append(role)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return roles
