"""The engine's door to the Triton kernels: where they can run, and `PagedMetadata` adapters
(which backend runs is worker/plan.py's decision).

The kernels live in `kernels/` at the repository root and install as `jupyter_pagedkv_kernels`.
From a plain source checkout (nothing installed) that name is not importable, so `load_kernels`
registers the directory under it by path. The directory has no `__init__.py`, so even with the
checkout on sys.path it never shadows an installed `kernels` distribution (kernels/README.md).
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

KERNELS_PACKAGE = "jupyter_pagedkv_kernels"


def load_kernels() -> ModuleType:
    """Import the kernels package (imports Triton). The `kernels/` folder beside this package's
    source wins over an installed copy, so a checkout (a worktree, `PYTHONPATH=.` over another
    checkout's editable install) runs its own kernels with its own engine; an installed wheel has
    no such folder and imports `jupyter_pagedkv_kernels` as installed."""
    if KERNELS_PACKAGE in sys.modules:
        return sys.modules[KERNELS_PACKAGE]
    source = Path(__file__).resolve().parents[2] / "kernels"
    if not (source / "paged_attention.py").exists():
        try:
            return importlib.import_module(KERNELS_PACKAGE)
        except ModuleNotFoundError as err:
            if err.name != KERNELS_PACKAGE:
                raise
        raise ModuleNotFoundError(f"{KERNELS_PACKAGE} is not installed and {source} is missing",
                                  name=KERNELS_PACKAGE)
    # kernels/ has no __init__.py (see kernels/README.md): a bare package whose path is the folder
    spec = importlib.machinery.ModuleSpec(KERNELS_PACKAGE, None, is_package=True)
    spec.submodule_search_locations = [str(source)]
    module = importlib.util.module_from_spec(spec)
    sys.modules[KERNELS_PACKAGE] = module
    return module


def kernel_module(name: str) -> ModuleType:
    """A submodule of the kernels package: "paged_attention", "cache_ops", "reference", "bench",
    "variants", "compile_check"."""
    return importlib.import_module(f"{load_kernels().__name__}.{name}")


def triton_available(device: torch.device | str) -> bool:
    """Can the Triton kernels run on `device`? CUDA with Triton installed, or any device while
    Triton's interpreter is on (TRITON_INTERPRET=1, how the CPU tests run them)."""
    device = torch.device(device)
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if device.type != "cuda" and not (interpret and device.type == "cpu"):
        return False
    if device.type == "cuda" and not torch.cuda.is_available():
        return False
    return importlib.util.find_spec("triton") is not None


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta, scale: float, window: int | None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, new_k: torch.Tensor | None = None,
                           new_v: torch.Tensor | None = None) -> torch.Tensor:
    """`q [T, heads, head_dim]` over one layer's cache, described by a `PagedMetadata` (a quantized
    cache with its scales, `KVCache.layer_scales`, and this step's keys and values `new_k`/`new_v`,
    which prefill chunks attend unquantized)."""
    max_seq_len = meta.max_seq_len or None
    return kernel_module("paged_attention").paged_attention(
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
        max_seq_len=max_seq_len, sliding_window=window, k_scale=k_scale, v_scale=v_scale,
        new_k=new_k, new_v=new_v)


def write_kv_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    """Same contract as `attention.write_kv` (-1 skips a row), one kernel launch, no host sync; a
    quantized cache's rows are quantized per KV head as they are stored, scales beside them."""
    kernel_module("cache_ops").write_kv(k_cache, v_cache, key, value, slot_mapping, k_scale, v_scale)


def copy_blocks_triton(k: torch.Tensor, v: torch.Tensor, pairs) -> None:
    """Same contract as `KVCache.copy_blocks` on the whole-cache tensors `[layers, blocks, ...]`."""
    kernel_module("cache_ops").copy_blocks(k, v, pairs)


def _attention_shape(kv_spec, num_heads: int, block_size: int, window: int | None):
    return kernel_module("variants").AttentionShape(num_heads, kv_spec.num_kv_heads, kv_spec.head_dim,
                                                    kv_spec.dtype, block_size, window, kv_spec.cache_dtype)


def kernel_variants(kv_spec, num_heads: int, block_size: int, window: int | None) -> list[str]:
    """One line per compiled kernel variant an engine with this cache can launch (what
    `warm_up_kernels` compiles): its role and constexprs. The split count, batch size, context,
    GQA group and block size are runtime arguments, so this list does not grow with the load."""
    shape = _attention_shape(kv_spec, num_heads, block_size, window)
    return [f"{role}: {launch.name} " + " ".join(f"{k}={v}" for k, v in launch.constexprs.items())
            for role, launch in kernel_module("variants").model_launches(shape, "meta", interpreted=False)]


def warm_up_kernels(kv_spec, num_heads: int, block_size: int, window: int | None,
                    device: torch.device | str) -> list[str]:
    """Launch every kernel variant the engine can hit once, on dummy data on `device`, so none
    compiles inside a timed run: decode and prefill tiles, each split and not, the split merge,
    write_kv and copy_blocks. Returns the roles launched. The engine's real tensors need nothing
    else compiled: every per-step value is an unspecialised runtime argument (paged_attention.py)."""
    shape = _attention_shape(kv_spec, num_heads, block_size, window)
    return kernel_module("variants").warm_up(shape, device)


def warm_up_model_kernels(model, kv_cache, device: torch.device) -> list[str]:
    """`warm_up_kernels` for each window the model's layers use (None: unwindowed), then
    copy_blocks once on the real cache, whose layer stride alone may need 64 bits."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    # Layers pass their window as an attribute (Qwen2, Gemma) or from the config (Mistral).
    windows = {getattr(m, "sliding_window", None) for m in model.modules() if hasattr(m, "layer_idx")}
    if getattr(text, "use_sliding_window", True) is not False:
        windows.add(getattr(text, "sliding_window", None))
    windows = {w if isinstance(w, int) and w > 0 else None for w in windows} | {None}
    roles = [role for w in sorted(windows, key=lambda w: w or 0)
             for role in warm_up_kernels(kv_cache.spec, text.num_attention_heads, kv_cache.block_size, w, device)]
    copy_blocks_triton(kv_cache.k, kv_cache.v, [(0, 0)])    # block 0 onto itself: no change
    if kv_cache.k_scale is not None:
        copy_blocks_triton(kv_cache.k_scale, kv_cache.v_scale, [(0, 0)])
    return roles + ["copy_blocks on the cache"]


if __name__ == "__main__":      # from a source checkout: python -m jupyter_pagedkv.worker.kernels_bridge --smoke
    sys.exit(kernel_module("bench").main(sys.argv[1:]))
