"""How an engine's parts are sized from its config: KV blocks from memory, the swap space, the
model's end-of-sequence ids; and how they are released at shutdown."""
from __future__ import annotations

import torch

from ..config import EngineConfig, format_bytes, parse_size
from ..core.swap_space import SwapSpace
from ..worker.host_memory import available_bytes as host_available_bytes
from ..worker.kv_cache import KVCache, KVSpec


def served_as(model, config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """The device and dtype of a model an engine is built on. An engine serves the model as it is:
    a device, dtype or weights option that contradicts it (options that act when loading, which
    `Engine.from_pretrained` honours) is one line, rather than a config that describes another engine."""
    from ..worker.loader import choose_dtype
    from ..worker.quant_linear import PACKED_LAYERS

    first = next(model.parameters())
    device, dtype = first.device, first.dtype
    asked = torch.device(config.device) if config.device != "auto" else None
    if asked is not None and (asked.type != device.type or asked.index not in (None, device.index)):
        raise ValueError(f"device={config.device!r}, but the model passed in is on {device}: load it there "
                         f"with Engine.from_pretrained(..., device={config.device!r}) or move it first")
    if config.dtype != "auto" and choose_dtype(device, config.dtype).dtype != dtype:
        raise ValueError(f"dtype={config.dtype!r}, but the model passed in holds {str(dtype).replace('torch.', '')}: "
                         f"load it with Engine.from_pretrained(..., dtype={config.dtype!r}) or convert it first")
    if config.weights == "packed" and not any(isinstance(m, PACKED_LAYERS) for m in model.modules()):
        raise ValueError("weights='packed', but the model passed in holds dense weights: packed weights are "
                         "read from a GGUF file by Engine.from_pretrained(path_or_None, weights='packed')")
    return device, dtype


def default_kv_bytes(device: torch.device) -> int:
    """CPU: a modest 1 GiB. CUDA: 90% of what is free after weights, minus an activation reserve."""
    if device.type != "cuda":
        return 1 << 30
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * 0.9) - (1 << 30)


def available_bytes(device: torch.device) -> int | None:
    """Memory free for the KV cache now: the GPU's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return host_available_bytes()


def num_blocks(config: EngineConfig, spec: KVSpec, device: torch.device) -> int:
    """`num_blocks`, or as many blocks as the KV memory (given or default) holds; a cache larger
    than the memory available is refused here, before the allocation meets the OOM killer."""
    n = config.num_blocks
    block_bytes = spec.bytes_per_token * config.block_size
    if n is None:
        budget = parse_size(config.kv_cache_memory) if config.kv_cache_memory is not None \
            else default_kv_bytes(device)
        n = budget // block_bytes
    if n < 1:
        raise ValueError("the KV cache holds no block: give more kv_cache_memory or num_blocks")
    free = available_bytes(device)
    if free is not None and n * block_bytes > free:
        raise ValueError(f"a KV cache of {format_bytes(n * block_bytes)} does not fit: {device.type} has "
                         f"{format_bytes(free)} available; give a smaller kv_cache_memory or num_blocks")
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


def release(kv_cache: KVCache, runner, drafters, owns_model: bool) -> None:
    """Give back the KV memory, the packed weights (a model passed in gets its plain ones back),
    the padded decode buffers and the drafters' memory; the runner drops the model."""
    kv_cache.release()
    runner.packed.release(restore=not owns_model)
    if runner.padded is not None:
        runner.padded.release()
    for drafter in drafters:
        if hasattr(drafter, "release"):
            drafter.release()
    runner.model = None
