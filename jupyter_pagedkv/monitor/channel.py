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

Which engine the channel shows is the caller's business (`get_engine`: the kernel session's,
passed in by the notebook layer that registers the target); the channel reads it only through
`EngineClient`.
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable

from .feed import feed_for, gauges

if TYPE_CHECKING:
    from ..protocol import EngineClient

TARGET = "jupyter_pagedkv.monitor"
logger = logging.getLogger(__name__)
GetEngine = Callable[[], "EngineClient | None"]


def snapshot(engine: EngineClient | None) -> dict[str, Any]:
    """JSON-ready state: {"loaded": False} without an engine, else model, stats and pool."""
    if engine is None:
        return {"loaded": False}
    stats = engine.stats()
    pool = dict(engine.pool_snapshot())
    for key in ("owners", "tenants"):   # JSON keys are strings; a server's pool has no tenants
        pool[key] = {str(k): v for k, v in pool.get(key, {}).items()}
    info = engine.info()
    return {"loaded": True, "model": info.name, "device": info.device, "dtype": info.dtype,
            "stats": gauges(stats), "pool": pool}


def handle_message(data: dict, engine: EngineClient | None) -> dict[str, Any]:
    """The answer to one message from the front end."""
    if isinstance(data, dict) and data.get("request") == "snapshot":
        return {"response": "snapshot", **snapshot(engine)}
    return {"response": "error",
            "error": 'unknown request: send {"request": "snapshot" | "subscribe" | "unsubscribe"}'}


class Pusher:
    """Sends a snapshot on one comm every `interval` seconds from a daemon thread until stopped."""

    def __init__(self, comm, interval: float, get_engine: GetEngine) -> None:
        self.comm, self.interval, self.get_engine = comm, interval, get_engine
        self.stopped = threading.Event()
        self._sending = threading.RLock()    # a send and stop() exclude each other
        self.thread = threading.Thread(target=self._run, daemon=True, name="pagedkv-monitor")
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                message = {"response": "snapshot", **snapshot(self.get_engine())}
                with self._sending:
                    if self.stopped.is_set():
                        return
                    self.comm.send(message)
            except Exception:   # the comm is gone: nobody to push to
                logger.info("monitor channel: stopped pushing snapshots (the comm failed)", exc_info=True)
                return

    def stop(self) -> None:
        """Stop: a send under way finishes first and none starts after, so nothing is pushed after
        the caller's next message however slow the thread is; then reap the thread."""
        with self._sending:
            self.stopped.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=2.0)


class FeedSubscription:
    """One comm attached to an engine's MonitorFeed: every frame goes out as it is published."""

    def __init__(self, comm, engine) -> None:
        self.comm, self.engine = comm, engine
        self.feed = feed_for(engine)
        self.token = self.feed.subscribe(self._send)

    def _send(self, frame) -> None:
        if frame is None:   # the engine shut down
            self.comm.send({"response": "frame", "loaded": False})
            return
        data, buffers = frame.to_message()
        info = self.engine.info()
        data.update(loaded=True, model=info.name, device=info.device)
        self.comm.send(data, buffers=buffers)

    def stop(self) -> None:
        self.feed.unsubscribe(self.token)


def open_comm(comm, open_msg: dict, get_engine: GetEngine) -> None:
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
            engine = get_engine()
            if engine is None:
                comm.send({"response": "frame", "loaded": False})
            else:
                pusher.append(FeedSubscription(comm, engine))
        elif request == "subscribe":
            stop()
            interval = max(0.1, float(data.get("interval_ms", 500)) / 1000)
            # The acknowledgement first: once the thread runs, a snapshot could overtake it.
            comm.send({"response": "subscribed", "interval_ms": round(interval * 1000)})
            pusher.append(Pusher(comm, interval, get_engine))
        elif request == "unsubscribe":
            stop()
            comm.send({"response": "unsubscribed"})
        else:
            comm.send(handle_message(data, get_engine()))

    comm.on_close(lambda msg: stop())


def register(ip, get_engine: GetEngine) -> bool:
    """Register the target when `ip` runs inside a kernel with comm support; False otherwise."""
    if getattr(ip, "kernel", None) is None:
        return False
    try:
        import comm
        manager = comm.get_comm_manager()
        manager.register_target(TARGET, lambda c, msg: open_comm(c, msg, get_engine))
    except Exception:   # a kernel without comms: the magics still work, the panel cannot connect
        logger.warning("monitor channel: this kernel has no comms; the JupyterLab panel cannot "
                       "connect", exc_info=True)
        return False
    return True
