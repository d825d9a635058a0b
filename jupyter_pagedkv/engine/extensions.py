"""Extensions that live above the engine (views, clients), plugged in by the package root.

`Engine.monitor()`, `Engine.monitor_feed` and `Engine.connect()` are conveniences whose
implementations sit in higher layers (widgets, monitor, remote). The engine names them here and
never imports them; `jupyter_pagedkv/__init__.py` (always imported first) registers the factories.
"""
from __future__ import annotations

from typing import Any, Callable

_FACTORIES: dict[str, Callable[..., Any]] = {}


def register(name: str, factory: Callable[..., Any]) -> None:
    _FACTORIES[name] = factory


def create(name: str, *args: Any, **kwargs: Any) -> Any:
    """Build the view `name`; a clear error if nothing provides it (a stripped-down install)."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise RuntimeError(f"no {name!r} view is registered: import jupyter_pagedkv first")
    return factory(*args, **kwargs)
