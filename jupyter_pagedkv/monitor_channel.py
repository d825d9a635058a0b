"""The kernel side of the monitor channel: a comm target that answers snapshot requests.

A front end (the JupyterLab side panel) opens a comm to target "jupyter_pagedkv.monitor" and sends
{"request": "snapshot"}; the kernel answers with the engine's stats and block-pool snapshot as
plain JSON. One request, one answer: the panel decides how often to ask.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from .session import KernelSession, current

TARGET = "jupyter_pagedkv.monitor"


def snapshot(session: KernelSession) -> dict[str, Any]:
    """JSON-ready state: {"loaded": False} without an engine, else model, stats and pool."""
    engine = session.engine
    if engine is None:
        return {"loaded": False}
    gauges = engine.stats()
    stats = dataclasses.asdict(gauges)
    stats["prefix_hit_rate"] = gauges.prefix_hit_rate
    pool = engine.pool_snapshot()
    pool["owners"] = {str(k): v for k, v in pool["owners"].items()}   # JSON keys are strings
    return {"loaded": True, "model": engine.name, "device": engine.device.type,
            "dtype": str(engine.dtype).replace("torch.", ""), "stats": stats, "pool": pool}


def handle_message(data: dict, session: KernelSession) -> dict[str, Any]:
    """The answer to one message from the front end."""
    if isinstance(data, dict) and data.get("request") == "snapshot":
        return {"response": "snapshot", **snapshot(session)}
    return {"response": "error", "error": 'unknown request: send {"request": "snapshot"}'}


def open_comm(comm, open_msg: dict, get_session: Callable[[], KernelSession] = current) -> None:
    """Comm target callback: answer every message on this comm."""
    @comm.on_msg
    def _answer(msg: dict) -> None:
        comm.send(handle_message(msg["content"]["data"], get_session()))


def register(ip) -> bool:
    """Register the target when `ip` runs inside a kernel with comm support; False otherwise."""
    if getattr(ip, "kernel", None) is None:
        return False
    try:
        import comm
        manager = comm.get_comm_manager()
        manager.register_target(TARGET, open_comm)
    except Exception:   # a kernel without comms: the magics still work, the panel cannot connect
        return False
    return True
