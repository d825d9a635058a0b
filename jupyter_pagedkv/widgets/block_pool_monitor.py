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

    def __repr__(self) -> str:
        # Deterministic on purpose: nbval compares the text/plain of a widget output.
        return self._label
