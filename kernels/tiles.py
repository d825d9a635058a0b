"""Launch shapes for the paged-attention kernel (paged_attention.py): the row and key tiles, the
split-K count and the warps per program, decided on the host from ints alone (no device sync).
Every choice here was forced by a measurement: the compile check's register spills on sm_90 and
sm_80 under the GPU image's Triton (docs/kernels.md), or the interpreter's speed on the CPU."""
from __future__ import annotations

import os

import torch
import triton

MAX_SPLITS = 64                 # choose_num_splits never returns more; the merge kernel's pad


def interpreting() -> bool:
    """True when Triton runs kernels in its numpy interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def choose_num_splits(num_programs: int, max_seq_len: int, device: torch.device,
                      tile_n: int, *, num_sms: int | None = None) -> int:
    """Split the key range only when the grid would leave most SMs idle on long contexts.
    At most MAX_SPLITS. `num_sms` overrides the device's count (the compile check has no GPU)."""
    target = 2 * (num_sms or _num_sms(device))
    if num_programs >= target or max_seq_len < 8 * tile_n:
        return 1
    splits = min(triton.cdiv(target, num_programs), triton.cdiv(max_seq_len, 4 * tile_n), MAX_SPLITS)
    return max(1, splits)


def launch_config(num_tokens: int, num_seqs: int, heads: int, kv_heads: int, elem_size: int,
                  max_seq_len: int | None, device: torch.device, *, block_m: int | None = None,
                  tile_n: int | None = None, num_splits: int | None = None,
                  interpreted: bool | None = None, quant: bool = False,
                  head_dim: int = 64) -> tuple[int, int, int, int]:
    """(BLOCK_M, block_q, TILE_N, num_splits) for a launch; host ints only, no device sync.

    Decode-only batches use the smallest row tile (16 rows: one token times its query-head group,
    padded); batches with prefill chunks use 64 rows. Without `max_seq_len` there is no split.
    fp32 (exact IEEE products on CUDA cores, no tensor cores) always uses the 16-row tile and
    16-key tiles: the compile check found every larger fp32 tile spilling registers on sm_90 or
    sm_80 (64 rows x 32 keys: 400-5216 bytes per thread); fp32 serves exactness checks, not speed.
    A quantized cache (`quant`) widens its codes in registers: under the GPU image's Triton 3.6 its
    16-row tile over 64 keys at head 64 spilled (8 bytes per thread on sm_90, 16 on sm_80), and over
    32 keys still 8 on sm_90, so it takes 16 keys there (at head 128, 8 warps over 64 keys do not
    spill: `_num_warps`). Its prefill tile also loads this step's own rows beside the codes (a
    chunk attends them unquantized): at head 128 the 64-row tile then spilled on sm_80 (40-144
    bytes per thread, over 16, 32 or 64 keys alike), so there it takes 32 rows (none spill).
    `interpreted` (default: whether TRITON_INTERPRET is on) picks the interpreter's small tiles;
    the compile check passes False to get what a GPU launches.
    """
    if interpreted is None:
        interpreted = interpreting()
    group = heads // kv_heads
    if block_m is None:
        block_m = (16 if num_tokens == num_seqs or interpreted or elem_size > 2
                   else 32 if quant and head_dim > 64 else 64)
    block_m = max(block_m, triton.next_power_of_2(group), 16)
    block_q = block_m // group
    if tile_n is None:
        tile_n = (32 if interpreted else 16 if elem_size > 2
                  else 16 if quant and block_m == 16 and head_dim <= 64 else 64)
    if num_splits is None:
        grid = (triton.cdiv(num_tokens, block_q) + num_seqs) * kv_heads
        num_splits = 1 if max_seq_len is None else choose_num_splits(grid, max_seq_len, device, tile_n)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    return block_m, block_q, tile_n, num_splits


def num_warps(block_m: int, elem_size: int, head_dim: int = 64, quant: bool = False) -> int:
    """8 warps for the 64-row tile and for fp32, 4 otherwise: with 4, the compile check found
    the 64-row tile at head 128 spilling on sm_80 (48-64 bytes per thread) and the fp32 16-row
    tile at head 128 spilling 8 bytes; with 8 neither spills on sm_80 or sm_90. A quantized
    cache's 16-row bf16 tile at head 128 (split, int8 codes) spilled 8 bytes on sm_90 with 4: 8."""
    return 8 if block_m >= 64 or elem_size > 2 or (quant and head_dim > 64) else 4
