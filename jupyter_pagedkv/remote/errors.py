"""Errors of the server client."""
from __future__ import annotations


class RemoteError(RuntimeError):
    """A server-side or network failure, worded as one line that says what to do."""
