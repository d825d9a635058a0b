"""Errors of the server client."""
from __future__ import annotations

from ..protocol import EngineUnavailable


class RemoteError(EngineUnavailable):
    """A server-side or network failure, worded as one line that says what to do."""


class UnsupportedByServer(RemoteError, ValueError):
    """An argument this server would not honour (tenant= below vLLM 0.9), refused before anything
    is sent; a ValueError too, so front ends show it as the user's one-line mistake."""
