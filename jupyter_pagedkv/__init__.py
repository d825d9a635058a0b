"""jupyter-pagedkv: a paged KV-cache LLM engine inside the Jupyter kernel.

Importing the package is cheap: torch and transformers load only when an engine is built.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .sampling_params import BeamSearchParams, SamplingParams

__version__ = "0.1.0"
__all__ = ["Engine", "SamplingParams", "BeamSearchParams", "BeamSearchOutput", "RequestOutput", "EngineStats"]

if TYPE_CHECKING:
    from .engine import Engine
    from .outputs import EngineStats, RequestOutput


def __getattr__(name: str):
    if name == "Engine":
        from .engine import Engine
        return Engine
    if name in ("RequestOutput", "EngineStats", "CompletionOutput", "StreamDelta"):
        from . import outputs
        return getattr(outputs, name)
    if name in ("BeamSearchOutput", "BeamSequence"):
        from . import beam_search
        return getattr(beam_search, name)
    raise AttributeError(f"module 'jupyter_pagedkv' has no attribute {name!r}")


def load_ipython_extension(ip) -> None:
    """`%load_ext jupyter_pagedkv`: register the magics and, in a kernel, the monitor channel.

    Cheap on purpose: the model (and torch) load only at `%pagedkv load`."""
    from .magics import PagedKVMagics
    from .monitor_channel import register

    ip.register_magics(PagedKVMagics)
    register(ip)
