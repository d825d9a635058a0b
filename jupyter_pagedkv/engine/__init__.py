"""The engine: intake, the step loop, output processing, and the generate / chat / stream front.

`Engine` loads lazily (it imports torch); the output types in `engine.outputs` do not."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["Engine"]


def __getattr__(name: str):
    if name == "Engine":
        from .engine import Engine
        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
