"""The kernel side of the monitor channel: a comm target that answers snapshot requests.

A front end (the JupyterLab side panel) opens a comm to target "jupyter_pagedkv.monitor" and sends
{"request": "snapshot"}; the kernel answers with the engine's stats and block-pool snapshot as
plain JSON. Comm messages are handled by the kernel's main thread, so they wait while a cell runs;
{"request": "subscribe", "interval_ms": N} therefore makes a kernel thread push a snapshot every
N ms (at least 100) until {"request": "unsubscribe"} or the comm closes, long cells included.
{"request": "subscribe", "diffs": true} instead attaches the comm to the engine's MonitorFeed
(the one the notebook widget uses): a full frame, then only the changed blocks, at most 10 a
second; frames are {"response": "frame", ...} with the arrays as binary buffers, and
{"response": "frame", "loaded": false} when no engine is (or stays) loaded.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

from ..notebook.session import KernelSession, current

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
    return {"response": "error",
            "error": 'unknown request: send {"request": "snapshot" | "subscribe" | "unsubscribe"}'}


class Pusher:
    """Sends a snapshot on one comm every `interval` seconds from a daemon thread until stopped."""

    def __init__(self, comm, interval: float, get_session: Callable[[], KernelSession]) -> None:
        self.comm, self.interval, self.get_session = comm, interval, get_session
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="pagedkv-monitor")
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                self.comm.send({"response": "snapshot", **snapshot(self.get_session())})
            except Exception:   # the comm is gone: nobody to push to
                return

    def stop(self) -> None:
        """Stop and wait for the thread, so nothing is pushed after the caller's next message."""
        self.stopped.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=2.0)


class FeedSubscription:
    """One comm attached to an engine's MonitorFeed: every frame goes out as it is published."""

    def __init__(self, comm, engine) -> None:
        self.comm, self.engine = comm, engine
        self.feed = engine.monitor_feed
        self.token = self.feed.subscribe(self._send)

    def _send(self, frame) -> None:
        if frame is None:   # the engine shut down
            self.comm.send({"response": "frame", "loaded": False})
            return
        data, buffers = frame.to_message()
        data.update(loaded=True, model=self.engine.name, device=self.engine.device.type)
        self.comm.send(data, buffers=buffers)

    def stop(self) -> None:
        self.feed.unsubscribe(self.token)


def open_comm(comm, open_msg: dict, get_session: Callable[[], KernelSession] = current) -> None:
    """Comm target callback: answer every message on this comm; push snapshots when subscribed."""
    pusher: list[Pusher | FeedSubscription] = []

    def stop() -> None:
        while pusher:
            pusher.pop().stop()

    @comm.on_msg
    def _answer(msg: dict) -> None:
        data = msg["content"]["data"]
        request = data.get("request") if isinstance(data, dict) else None
        if request == "subscribe" and data.get("diffs"):
            stop()
            engine = get_session().engine
            if engine is None:
                comm.send({"response": "frame", "loaded": False})
            else:
                pusher.append(FeedSubscription(comm, engine))
        elif request == "subscribe":
            stop()
            interval = max(0.1, float(data.get("interval_ms", 500)) / 1000)
            pusher.append(Pusher(comm, interval, get_session))
            comm.send({"response": "subscribed", "interval_ms": round(interval * 1000)})
        elif request == "unsubscribe":
            stop()
            comm.send({"response": "unsubscribed"})
        else:
            comm.send(handle_message(data, get_session()))

    comm.on_close(lambda msg: stop())


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
