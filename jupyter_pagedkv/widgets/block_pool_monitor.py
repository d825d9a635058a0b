"""BlockPoolMonitor: the live block map of one engine as an anywidget.

The drawing lives in `jupyter_pagedkv/widgets/static/blockmap.js` (and the modules it imports), the
same module the JupyterLab side panel imports. State travels in two traits: `base` (a full frame, set on creation and when a view
asks for one) and `frame` (the latest diff). Each diff names the frame it applies on, so a view
that missed one asks for a full frame instead of drawing a wrong picture.

A view drawn anew (the output re-rendered when the still image is refreshed after a cell, a
notebook reopened, a second display) starts from `base`, so `base` is kept fresh: it is set again
before every display update, and every `_base_every` seconds while diffs flow (BASE_REFRESH_S,
longer for a big pool) — a view's request for a
full frame is only answered once the kernel is idle, so without that a view re-rendered during a
long cell would show the pool as it was when the monitor was made until the cell ends.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import anywidget
import traitlets

from ..monitor.feed import feed_for
from .esm import inlined_module

if TYPE_CHECKING:
    from ..monitor.feed import Frame
    from ..protocol import EngineClient

STATIC = Path(__file__).resolve().parent / "static"
MAX_STILL_BLOCKS = 4096
BASE_REFRESH_S = 5.0   # how stale a view drawn anew during a busy cell can be, at most (small pools)


def occupancy(snap: dict) -> tuple[int, int]:
    """(blocks in use, blocks not free): in use first, then cached ones break ties, so a pool whose
    requests all finished within a step still shows the prefixes they left cached."""
    states = snap["states"]
    used = sum(state not in ("free", "cached") for state in states)
    return used, used + sum(state == "cached" for state in states)


class Busiest:
    """The pool at its busiest (`occupancy`) since the monitor was made, recorded by the feed's
    thread and taken by the kernel's after a cell (hence the lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.key = (0, 0)                 # the peak's occupancy
        self._snap: dict | None = None    # a peak not yet shown

    def record(self, snap: dict) -> None:
        key = occupancy(snap)
        with self._lock:
            if key > self.key:
                self.key, self._snap = key, snap

    def reset_to_now(self) -> None:
        """A new display shows the pool now: only a busier moment than the frames so far refreshes it."""
        with self._lock:
            self._snap = None

    def take_new(self) -> dict | None:
        with self._lock:
            snap, self._snap = self._snap, None
            return snap


class BlockPoolMonitor(anywidget.AnyWidget):
    """One canvas cell per KV block (coloured by state), gauges and a usage sparkline, live."""

    _esm = inlined_module(STATIC / "blockmap.js")
    title = traitlets.Unicode("KV cache").tag(sync=True)
    height = traitlets.Int(220).tag(sync=True)
    base = traitlets.Dict().tag(sync=True)
    frame = traitlets.Dict().tag(sync=True)

    def __init__(self, engine: EngineClient, height: int = 220, **kwargs) -> None:
        if height < 40:
            raise ValueError(f"height={height} is too small to draw the pool: give at least 40 (pixels)")
        name = engine.name
        feed = feed_for(engine)           # a local engine's, or a server client's (same frames)
        n, bs = len(feed.codes), feed.block_size
        kv = engine.info().kv_phrase
        super().__init__(title=f"KV cache · {name} · {n:,} blocks × {bs} tokens" + (f" · {kv}" if kv else ""),
                         height=height, **kwargs)
        self._label = f"BlockPoolMonitor({name!r}: {n:,} blocks × {bs} tokens)"
        self._feed = feed
        self._busiest = Busiest()
        self._handles: list = []          # where this monitor was displayed (display ids)
        self._watching = None             # the IPython events this monitor listens to
        self.on_msg(self._on_request)
        self._base_at = 0.0               # when `base` was last set (time.monotonic())
        # A whole frame is ~6 bytes a block: a big pool's goes out less often (100,000 blocks: 25 s).
        self._base_every = max(BASE_REFRESH_S, n / 4000)
        self._token = self._feed.subscribe(self._receive)

    def _receive(self, frame: Frame | None) -> None:
        """Called by the feed (its own thread, under its mutex): a full frame becomes `base`, a
        diff `frame`, except that every `_base_every` seconds the pool as of this diff goes to `base`
        instead (a view applies whichever is newer)."""
        if frame is None:
            self.frame = {"closed": True}
            return
        now = time.monotonic()
        if frame.full:
            self._set_base(frame, now)
        elif now - self._base_at >= self._base_every:
            self._set_base(self._feed.full_frame(), now)
        else:
            self.frame = frame.to_state()
        used, cached = frame.gauges.get("num_used"), frame.gauges.get("num_cached", 0)
        if used is not None and (used, used + cached) > self._busiest.key and frame.num_blocks <= MAX_STILL_BLOCKS:
            engine = getattr(self._feed, "engine", None)
            if engine is not None:     # the pool now, as fresh as the frame (a step may have run since)
                self._busiest.record(engine.pool_snapshot())

    def _set_base(self, frame: Frame, now: float) -> None:
        self.base = frame.to_state()
        self._base_at = now

    def _on_request(self, widget, content, buffers) -> None:
        if isinstance(content, dict) and content.get("request") == "resync":
            self._receive(self._feed.full_frame())

    def close(self) -> None:
        """Stop receiving frames (the feed's thread stops with its last subscriber)."""
        feed = getattr(self, "_feed", None)   # absent when __init__ refused its arguments
        if feed is not None:
            feed.unsubscribe(self._token)
        if getattr(self, "_watching", None) is not None:
            self._watching.unregister("post_run_cell", self._refresh_still)
            self._watching = None
        super().close()

    def _repr_mimebundle_(self, **kwargs):
        """The live view, plus a still image of the pool as it is now: a notebook shown where no
        widget runs (GitHub, nbviewer, an export) gets a picture instead of the text repr."""
        return self._bundle(super()._repr_mimebundle_(**kwargs), None, "at display time")

    def _bundle(self, bundle, snap: dict | None, moment: str):
        """`bundle` with the still image of `snap` (None: the pool now) captioned with `moment`,
        and the blocks in use it shows in the output's metadata (the committed-notebook test
        reads them: a saved monitor must not be an empty pool)."""
        data, metadata = bundle if isinstance(bundle, tuple) else (bundle, {})
        if snap is None:
            engine = getattr(self._feed, "engine", None)
            snap = engine.pool_snapshot() if engine is not None else None
        still = self.still_png(snap=snap, moment=moment) if snap is not None else None
        if still is not None:
            data["image/png"] = still
            used, held = occupancy(snap)
            metadata = {**metadata, "jupyter_pagedkv": {"still": moment, "blocks_in_use": used,
                                                        "blocks_cached": held - used}}
        return (data, metadata) if isinstance(bundle, tuple) else data

    def _ipython_display_(self) -> None:
        """Display under a display id and, after every later cell that filled the pool more
        than any before, refresh the still image to that busiest moment: a monitor shown before
        the cells that use the pool would otherwise be saved as an empty grid."""
        from IPython import get_ipython
        from IPython.display import display

        data, metadata = self._bundle(super()._repr_mimebundle_(), None, "at display time")
        self._handles.append(display(data, metadata=metadata, raw=True, display_id=True))
        self._busiest.reset_to_now()
        shell = get_ipython()
        if shell is not None and self._watching is None:
            shell.events.register("post_run_cell", self._refresh_still)
            self._watching = shell.events

    def _refresh_still(self, result=None) -> None:
        """After a cell: if it took the pool to a new peak, show that peak in every display."""
        if not self._handles:
            return
        if not getattr(self._feed, "_closed", False):
            self._feed.publish()          # the cell's last steps, not yet sent by the feed's thread
        snap = self._busiest.take_new()
        if snap is None:
            return
        cell = getattr(result, "execution_count", None)
        where = f" during cell [{cell}]" if cell is not None else ""
        used, held = occupancy(snap)
        moment = (f"the busiest moment since shown{where}: {used} of {len(snap['states'])} blocks "
                  f"in use, {held - used} cached")
        data, metadata = self._bundle(super()._repr_mimebundle_(), snap, moment)
        # The update re-renders every view of this output from `base`: make it the pool now, or
        # the views would flash the pool as it was when `base` was last set until a resync. Under
        # the feed's lock, so the feed's thread cannot set a newer base in between.
        with self._feed.lock:
            self._set_base(self._feed.full_frame(), time.monotonic())
        for handle in self._handles:
            handle.update(data, metadata=metadata, raw=True)

    def still_png(self, max_blocks: int = MAX_STILL_BLOCKS, snap: dict | None = None,
                  moment: str = "at display time") -> str | None:
        """The pool (`snap`, or now) as a base64 PNG (pool_figure) titled with `moment`, or None
        for a pool too big to draw block by block (the live map groups blocks; a still image of
        100,000 squares says nothing)."""
        import base64
        import io

        if snap is None:
            snap = self._feed.engine.pool_snapshot()
        if len(snap["states"]) > max_blocks:
            return None
        from matplotlib.figure import Figure

        from .pool_figure import pool_figure
        columns = max(16, min(64, int(len(snap["states"]) ** 0.5 * 2)))
        rows = -(-len(snap["states"]) // columns)
        fig = Figure(figsize=(min(12, 0.2 * columns + 1), 0.2 * rows + 1.2))
        pool_figure(snap, title=f"{self.title}\n(still, {moment})", columns=columns, ax=fig.add_subplot())
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
        return base64.b64encode(buf.getvalue()).decode()

    def __repr__(self) -> str:
        # Deterministic on purpose: nbval compares the text/plain of a widget output.
        return self._label
