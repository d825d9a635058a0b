"""The notebook front: the magics, the kernel session (one engine, chat sessions, jobs), streaming
cell output, text views and the terminal demo."""
from __future__ import annotations


def register(ip) -> None:
    """Register the magics and, in a kernel, the monitor comm channel (`%load_ext jupyter_pagedkv`)."""
    from ..monitor.channel import register as register_channel
    from .magics import PagedKVMagics
    from .session import current

    ip.register_magics(PagedKVMagics)
    register_channel(ip, lambda: current().engine)
