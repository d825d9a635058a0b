"""How an engine's parts are sized from its config: KV blocks from memory, the swap space, the
model's end-of-sequence ids."""
from __future__ import annotations

import torch

from ..config import EngineConfig, parse_size
from ..core.swap_space import SwapSpace
from ..worker.kv_cache import KVCache, KVSpec


def default_kv_bytes(device: torch.device) -> int:
    """CPU: a modest 1 GiB. CUDA: 90% of what is free after weights, minus an activation reserve."""
    if device.type != "cuda":
        return 1 << 30
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * 0.9) - (1 << 30)


def num_blocks(config: EngineConfig, spec: KVSpec, device: torch.device) -> int:
    """`num_blocks`, or as many blocks as the KV memory (given or default) holds."""
    n = config.num_blocks
    if n is None:
        budget = parse_size(config.kv_cache_memory) if config.kv_cache_memory is not None \
            else default_kv_bytes(device)
        n = budget // (spec.bytes_per_token * config.block_size)
    if n < 1:
        raise ValueError("the KV cache holds no block: give more kv_cache_memory or num_blocks")
    return n


def swap_space(size, kv_cache: KVCache) -> SwapSpace:
    """Host slots for `size` bytes of whole blocks (default 1 GiB), and the buffers behind them."""
    num_slots = parse_size(size if size is not None else "1GiB") // kv_cache.bytes_per_block
    if num_slots < 1:
        raise ValueError("swap_space holds no block: give at least one block's worth, e.g. '64MiB'")
    kv_cache.allocate_swap(num_slots)
    return SwapSpace(num_slots)


def eos_token_ids(model, tokenizer) -> set[int]:
    """End-of-sequence ids from the generation config and the tokenizer."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return ids
