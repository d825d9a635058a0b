"""jupyter-pagedkv: a paged KV-cache LLM engine inside the Jupyter kernel.

Importing the package is cheap: torch and transformers load only when an engine is built.

The package is layered (docs/design.md): `core` (blocks, tables, scheduler, gauges) < `worker`
(model runner, attention, KV tensors) < `decoding` (speculative, beams) < `engine`; above them,
`monitor`, `widgets`, `remote`, `notebook`, `sim` and `bench` use an engine only through
`protocol.EngineClient`. This module is the composition root: it names the public API and plugs
the views that live above the engine into it (`Engine.monitor()`, `Engine.connect()`), so the
engine itself never imports them.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
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


# -- modules that moved when the package got its subpackages: the old paths keep working -------
MOVED = {
    "block_pool": "core.block_pool", "block_table": "core.block_table", "sequence": "core.sequence",
    "scheduler": "core.scheduler", "contiguous": "core.contiguous", "swap_space": "core.swap_space",
    "sampling_params": "core.sampling_params", "model_runner": "worker.model_runner",
    "kv_cache": "worker.kv_cache", "attention": "worker.attention", "packed_linear": "worker.packed_linear",
    "sampler": "worker.sampler", "loader": "worker.loader", "kernels_bridge": "worker.kernels_bridge",
    "speculative": "decoding.speculative", "drafters": "decoding.drafters",
    "verification": "decoding.verification", "beam_search": "decoding.beam_search",
    "outputs": "engine.outputs", "remote": "remote.client", "server_metrics": "remote.server_metrics",
    "kv_events": "remote.kv_events", "peer_server": "remote.peer_server",
    "monitor_feed": "monitor.feed", "monitor_channel": "monitor.channel", "magics": "notebook.magics",
    "session": "notebook.session", "streaming": "notebook.streaming", "text_views": "notebook.text_views",
    "demo": "notebook.demo", "plan": "sim.plan",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import jupyter_pagedkv.block_pool` yields `jupyter_pagedkv.core.block_pool` itself (the
    same module object, not a copy), with a DeprecationWarning naming the new path."""

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, name = fullname.rpartition(".")
        if prefix == __name__ and name in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        new = f"{__name__}.{MOVED[module.__name__.rpartition('.')[2]]}"
        warnings.warn(f"{module.__name__} moved to {new}", DeprecationWarning, stacklevel=2)
        # The import system returns whatever sys.modules holds under the name once this returns.
        sys.modules[module.__name__] = importlib.import_module(new)


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
