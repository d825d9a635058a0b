"""jupyter-pagedkv: a paged KV-cache LLM engine inside the Jupyter kernel.

Importing the package is cheap: torch and transformers load only when an engine is built.

The package is layered (docs/design.md): `core` (blocks, tables, scheduler, gauges) < `worker`
(model runner, attention, KV tensors) < `decoding` (speculative, beams) < `engine`; above them,
`monitor`, `widgets`, `remote`, `notebook`, `sim` and `bench` use an engine only through
`protocol.EngineClient`; `testing` (models built in code, the oracle) and `gpucheck` serve the tests
and the GPU check. This module is the composition root: it names the public API and plugs
the views that live above the engine into it (`Engine.monitor()`, `Engine.connect()`), so the
engine itself never imports them.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .core.sampling_params import BeamSearchParams, SamplingParams
from .core.structured_outputs import StructuredOutputsParams
from .engine import extensions as _extensions

__version__ = "0.1.0"
__all__ = ["Engine", "EngineConfig", "SamplingParams", "BeamSearchParams", "BeamSearchOutput",
           "RequestOutput", "EngineStats", "StructuredOutputsParams"]

if TYPE_CHECKING:
    from .config import EngineConfig
    from .core.stats import EngineStats
    from .engine.engine import Engine
    from .engine.outputs import RequestOutput

_LAZY = {
    "Engine": ("engine.engine", "Engine"),
    "EngineConfig": ("config", "EngineConfig"),
    "RequestOutput": ("engine.outputs", "RequestOutput"),
    "CompletionOutput": ("engine.outputs", "CompletionOutput"),
    "StreamDelta": ("engine.outputs", "StreamDelta"),
    "EngineStats": ("core.stats", "EngineStats"),
    "BeamSearchOutput": ("decoding.beam_search", "BeamSearchOutput"),
    "BeamSequence": ("decoding.beam_search", "BeamSequence"),
}


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    raise AttributeError(f"module 'jupyter_pagedkv' has no attribute {name!r}")


def load_ipython_extension(ip) -> None:
    """`%load_ext jupyter_pagedkv`: register the magics and, in a kernel, the monitor channel.

    Cheap on purpose: the model (and torch) load only at `%pagedkv load`."""
    from .notebook import register
    register(ip)


# -- extensions of the engine that live above it (the engine names them, never imports them) ----
def _monitor_feed(engine, **kwargs):
    from .monitor.feed import feed_for
    return feed_for(engine, **kwargs)


def _monitor(engine, **kwargs):
    from .widgets.block_pool_monitor import BlockPoolMonitor
    return BlockPoolMonitor(engine, **kwargs)


def _connect(url, **kwargs):
    from .remote.client import RemoteEngine
    return RemoteEngine(url, **kwargs)


_extensions.register("monitor_feed", _monitor_feed)
_extensions.register("monitor", _monitor)
_extensions.register("connect", _connect)
