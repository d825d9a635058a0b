"""BlockPoolMonitor: the live block map of one engine as an anywidget.

The drawing lives in `jupyter_pagedkv/static/blockmap.js`, the same module the JupyterLab side
panel imports. State travels in two traits: `base` (a full frame, set on creation and when a view
asks for one) and `frame` (the latest diff). Each diff names the frame it applies on, so a view
that missed one asks for a full frame instead of drawing a wrong picture.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import anywidget
import traitlets

from ..monitor.feed import feed_for

if TYPE_CHECKING:
    from ..monitor.feed import Frame
    from ..protocol import EngineClient

STATIC = Path(__file__).resolve().parent / "static"


class BlockPoolMonitor(anywidget.AnyWidget):
    """One canvas cell per KV block (coloured by state), gauges and a usage sparkline, live."""

    _esm = STATIC / "blockmap.js"
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
        super().__init__(title=f"KV cache · {name} · {n:,} blocks × {bs} tokens", height=height, **kwargs)
        self._label = f"BlockPoolMonitor({name!r}: {n:,} blocks × {bs} tokens)"
        self._feed = feed
        self.on_msg(self._on_request)
        self._token = self._feed.subscribe(self._receive)

    def _receive(self, frame: Frame | None) -> None:
        """Called by the feed (its own thread): a full frame becomes `base`, a diff `frame`."""
        if frame is None:
            self.frame = {"closed": True}
        elif frame.full:
            self.base = frame.to_state()
        else:
            self.frame = frame.to_state()

    def _on_request(self, widget, content, buffers) -> None:
        if isinstance(content, dict) and content.get("request") == "resync":
            self._receive(self._feed.full_frame())

    def close(self) -> None:
        """Stop receiving frames (the feed's thread stops with its last subscriber)."""
        feed = getattr(self, "_feed", None)   # absent when __init__ refused its arguments
        if feed is not None:
            feed.unsubscribe(self._token)
        super().close()

    def _repr_mimebundle_(self, **kwargs):
        """The live view, plus a still image of the pool as it is now: a notebook shown where no
        widget runs (GitHub, nbviewer, an export) gets a picture instead of the text repr."""
        bundle = super()._repr_mimebundle_(**kwargs)
        still = self.still_png()
        if still is not None and isinstance(bundle, dict):
            bundle["image/png"] = still
        elif isinstance(bundle, tuple) and still is not None:
            bundle[0]["image/png"] = still
        return bundle

    def still_png(self, max_blocks: int = 4096) -> str | None:
        """The pool now as a base64 PNG (pool_figure), or None for a pool too big to draw block by
        block (the live map groups blocks; a still image of 100,000 squares says nothing)."""
        import base64
        import io

        engine = self._feed.engine if hasattr(self._feed, "engine") else None
        if engine is None:
            return None
        snap = engine.pool_snapshot()
        if len(snap["states"]) > max_blocks:
            return None
        from matplotlib.figure import Figure

        from .pool_figure import pool_figure
        columns = max(16, min(64, int(len(snap["states"]) ** 0.5 * 2)))
        rows = -(-len(snap["states"]) // columns)
        fig = Figure(figsize=(min(12, 0.2 * columns + 1), 0.2 * rows + 1.2))
        pool_figure(snap, title=f"{self.title} (still, at display time)", columns=columns, ax=fig.add_subplot())
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
        return base64.b64encode(buf.getvalue()).decode()

    def __repr__(self) -> str:
        # Deterministic on purpose: nbval compares the text/plain of a widget output.
        return self._label
