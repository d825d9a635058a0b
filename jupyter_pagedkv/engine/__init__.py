"""The engine: intake, the step loop, output processing, and the generate / chat / stream front."""
from .engine import Engine

__all__ = ["Engine"]
