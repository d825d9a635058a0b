"""MonitorFeed: an engine's block pool as a stream of small frames for live monitors.

One feed per engine (`feed_for(engine)`, also `engine.monitor_feed`), shared by every monitor: the
notebook widget and the JupyterLab side panel. A subscriber first gets a full frame, then diffs
that carry only the blocks whose state, ref count, owners or tenants changed. The feed reads its engine
only through `EngineClient.observe()`: the gauges (computed once, in `core.stats`) and the blocks
touched since the last look (O(changes), not O(num_blocks)). The stepping thread does nothing but
set an Event after each step (`add_step_listener`); the feed's own thread builds and sends the
frames, at most once per `interval` (10 Hz), so a slow front end never holds up a step. After
`resync_interval` seconds of activity (longer for big pools) a full comparison also catches
states that change without a ref-count change. A server client has no steps and reports no
touched blocks: its feed polls every `interval` and compares everything.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    from ..core.stats import EngineStats
    from ..protocol import EngineClient

logger = logging.getLogger(__name__)

# Known states get fixed codes, so colours stay put; any other state name a snapshot reports
# (new engine features) is appended to the legend on first sight and drawn generically.
KNOWN_STATES = ("free", "cached", "used", "shared", "swapped", "speculative")
ARRAYS = ("ids", "codes", "refs")


@dataclass(slots=True)
class Frame:
    """One update: a full picture (`full`) or the changes since frame `prev`.

    ids (uint32), codes (uint8, an index into `legend`) and refs (uint8, ref count capped at 255)
    are parallel arrays over the listed blocks; `owners` maps each listed block that has owners
    (or lost them) to its request ids, and `tenants` the same blocks to the tenants whose requests
    hold them (core.stats.UNNAMED for none; two names: shared across tenants); `gauges` are the
    pool and scheduler numbers of this moment (per-tenant ones under "tenants"); `why` maps request
    ids first seen holding blocks (a full frame: every owner) to why their prompt blocks hit the
    prefix cache or not (`engine.why`, one paragraph), which the view's hover shows."""

    seq: int
    prev: int
    full: bool
    num_blocks: int
    block_size: int
    legend: list[str]
    ids: np.ndarray
    codes: np.ndarray
    refs: np.ndarray
    owners: dict[int, list[str]]
    tenants: dict[int, list[str]]
    gauges: dict[str, Any]
    history: list[float] = field(default_factory=list)
    why: dict[str, str] = field(default_factory=dict)

    def header(self) -> dict[str, Any]:
        """The JSON part of the frame (everything but the three arrays)."""
        return {"seq": self.seq, "prev": self.prev, "full": self.full, "num_blocks": self.num_blocks,
                "block_size": self.block_size, "legend": list(self.legend),
                "owners": {str(k): v for k, v in self.owners.items()},
                "tenants": {str(k): v for k, v in self.tenants.items()}, "gauges": self.gauges,
                "history": self.history, "why": self.why}

    def buffers(self) -> list[bytes]:
        return [self.ids.astype("<u4").tobytes(), self.codes.tobytes(), self.refs.tobytes()]

    def to_message(self) -> tuple[dict[str, Any], list[bytes]]:
        """For a comm: JSON data plus binary buffers named in data["buffers"]."""
        return {"response": "frame", **self.header(), "buffers": list(ARRAYS)}, self.buffers()

    def to_state(self) -> dict[str, Any]:
        """For a widget trait: the arrays inline as bytes (ipywidgets sends them as buffers)."""
        return {**self.header(), **dict(zip(ARRAYS, self.buffers()))}

    @property
    def nbytes(self) -> int:
        """Wire size estimate: arrays plus the owner and tenant lists (what grows with the changes)."""
        header = self.header()
        lists = sum(len(k) + sum(len(r) + 3 for r in v)
                    for key in ("owners", "tenants") for k, v in header[key].items())
        return sum(len(b) for b in self.buffers()) + lists


Subscriber = Callable[[Frame | None], None]   # None: the engine is gone, no more frames


class MonitorFeed:
    """Publishes the pool to subscribers: a full frame on subscribe, then throttled diffs."""

    def __init__(self, engine: EngineClient, interval: float = 0.1, resync_interval: float = 5.0,
                 idle_poll: float = 0.5, threaded: bool = True) -> None:
        """threaded=False: no thread; the owner calls `publish()` (tests, cost measurements)."""
        self.engine = engine
        self.threaded = threaded
        self.interval, self.resync_interval, self.idle_poll = interval, resync_interval, idle_poll
        self.legend: list[str] = list(KNOWN_STATES)
        self._code = {s: i for i, s in enumerate(self.legend)}
        self.owners: dict[int, list[str]] = {}
        self.tenants: dict[int, list[str]] = {}
        self.why: dict[str, str] = {}   # request id -> its miss report ("" where the engine cannot tell)
        self.seq = 0
        self.gauges: dict[str, Any] = {}
        self.history: deque[float] = deque(maxlen=240)
        # Seconds per publish after the engine's lock was had (the work), and seconds spent
        # waiting for that lock (a step in progress), kept apart for the benchmark.
        self.publish_times: deque[float] = deque(maxlen=1000)
        self.lock_wait_times: deque[float] = deque(maxlen=1000)
        self.num_frames = 0
        self._last_steps = -1
        self._mutex = threading.RLock()          # publish vs subscribe: a diff never precedes its base
        self._subscribers: dict[int, Subscriber] = {}
        self._ids = itertools.count()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        # The first picture, before any subscriber.
        obs = engine.observe(full=True)
        n = obs.stats.num_blocks
        self.block_size = obs.stats.block_size
        self.codes = np.zeros(n, dtype=np.uint8)
        self.refs = np.zeros(n, dtype=np.uint8)
        self._compare(obs.snapshot, None)
        self.gauges = gauges(obs.stats)
        self._last_steps = obs.num_steps
        self._next_full = time.monotonic() + resync_interval

    def _listen(self, on: bool) -> None:
        """Wake on engine steps (on) or stop (off); without them the thread polls every idle_poll."""
        if on:
            self.engine.add_step_listener(self._wake.set)
        else:
            self.engine.remove_step_listener(self._wake.set)

    # -- subscribers ----------------------------------------------------------------------------
    def subscribe(self, send: Subscriber) -> int:
        """Send a full frame now, then every diff; returns a token for `unsubscribe`."""
        with self._mutex:
            if self._closed:
                send(None)
                return -1
            token = next(self._ids)
            send(self.full_frame())
            self._subscribers[token] = send
            if self._thread is None and self.threaded:
                self._start()
        return token

    def unsubscribe(self, token: int) -> None:
        with self._mutex:
            self._subscribers.pop(token, None)
            thread = self._halt() if not self._subscribers else None
        self._join(thread)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def close(self) -> None:
        """The engine is shutting down: stop the thread and tell every subscriber."""
        with self._mutex:
            self._closed = True
            subscribers, self._subscribers = list(self._subscribers.values()), {}
            thread = self._halt()
        self._join(thread)
        for send in subscribers:
            try:
                send(None)
            except Exception:   # that front end is gone already
                logger.debug("monitor feed: a subscriber failed on close", exc_info=True)

    @property
    def lock(self) -> threading.RLock:
        """Held, the feed's thread sends nothing: a caller can take a full frame and act on it
        (a widget setting it as its base) before any newer frame goes out."""
        return self._mutex

    def full_frame(self) -> Frame:
        """Everything as last published (diffs continue from here)."""
        with self._mutex:
            n = len(self.codes)
            return Frame(self.seq, -1, True, n, self.block_size, list(self.legend),
                         np.arange(n, dtype=np.uint32), self.codes.copy(), self.refs.copy(),
                         {k: list(v) for k, v in self.owners.items()},
                         {k: list(v) for k, v in self.tenants.items()}, dict(self.gauges),
                         list(self.history), self._whys(self.owners))

    # -- the thread -------------------------------------------------------------------------------
    def _start(self) -> None:
        self._stop.clear()
        self._listen(True)
        self._thread = threading.Thread(target=self._run, daemon=True, name="pagedkv-monitor-feed")
        self._thread.start()

    def _halt(self) -> threading.Thread | None:
        """Stop the thread (called under the mutex); the caller joins it after releasing it."""
        self._listen(False)
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        return thread

    @staticmethod
    def _join(thread: threading.Thread | None) -> None:
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)

    def _run(self) -> None:
        last = 0.0
        while True:
            # Woken by a step, or every idle_poll to catch changes made outside steps (abort, reset).
            self._wake.wait(self.idle_poll)
            if self._stop.is_set():
                return
            wait = self.interval - (time.monotonic() - last)
            if wait > 0 and self._stop.wait(wait):
                return
            self._wake.clear()
            try:
                self.publish()
            except Exception:   # a monitor must never take the kernel down; try again next time
                logger.warning("monitor feed: publishing a frame failed; retrying", exc_info=True)
            last = time.monotonic()

    # -- building frames -------------------------------------------------------------------------
    def publish(self, full_scan: bool = False) -> Frame | None:
        """Build the diff since the last frame and send it; None when nothing changed."""
        t0 = time.perf_counter()
        with self._mutex:
            obs = self.engine.observe(full=full_scan)
            waited = obs.waited_s
            polled = obs.touched is None        # a server: no touched set, compare everything
            stepped = obs.num_steps != self._last_steps
            if not (polled or full_scan or obs.touched or stepped):
                return None
            now = time.monotonic()
            if not full_scan and not polled and now >= self._next_full:
                t_full = time.perf_counter()
                obs = self.engine.observe(full=True)
                waited += obs.waited_s
                # A full scan holds the engine lock for O(num_blocks) (tens of ms at 100,000
                # blocks): space them out so they take at most ~0.5% of the time.
                self._next_full = now + max(self.resync_interval, 200 * (time.perf_counter() - t_full))
            self._last_steps = obs.num_steps
            snap = obs.snapshot
            changed = [] if snap is None else self._compare(snap, snap.get("block_ids"))
            frame = self._emit(changed, obs.stats)
            self.publish_times.append(time.perf_counter() - t0 - waited)
            self.lock_wait_times.append(waited)
            return frame

    def _emit(self, changed: list[int], stats: EngineStats) -> Frame:
        """New gauges, then a diff frame of the `changed` blocks to everyone (called under the
        mutex, after `_compare` folded the new snapshot in)."""
        prev = self.seq
        self.gauges = gauges(stats)
        self.history.append(self.gauges["kv_cache_usage"])
        self.seq += 1
        ids = np.asarray(changed, dtype=np.uint32)
        frame = Frame(self.seq, prev, False, len(self.codes), self.block_size, list(self.legend),
                      ids, self.codes[ids], self.refs[ids],
                      {i: list(self.owners.get(i, ())) for i in changed},
                      {i: list(self.tenants.get(i, ())) for i in changed}, dict(self.gauges),
                      why=self._whys({i: self.owners[i] for i in changed if i in self.owners}, new_only=True))
        for token, send in list(self._subscribers.items()):
            try:
                send(frame)
            except Exception:   # that front end is gone
                logger.info("monitor feed: dropping a subscriber whose send failed", exc_info=True)
                self._subscribers.pop(token, None)
        self.num_frames += 1
        return frame

    def _whys(self, owners: dict[int, list[str]], new_only: bool = False) -> dict[str, str]:
        """Why each request holding these blocks missed the prefix cache; asked once per request
        (a server cannot tell: ""), the memo pruned to the current owners when it grows."""
        ids = {rid for names in owners.values() for rid in names}
        if len(self.why) > 1024:
            live = {rid for names in self.owners.values() for rid in names}
            self.why = {rid: text for rid, text in self.why.items() if rid in live}
        out = {}
        for rid in sorted(ids):
            known = rid in self.why
            if not known:
                try:
                    self.why[rid] = str(self.engine.why(rid))
                except ValueError:
                    self.why[rid] = ""
            if self.why[rid] and not (new_only and known):
                out[rid] = self.why[rid]
        return out

    def _compare(self, snap: dict, block_ids: list[int] | None) -> list[int]:
        """Fold a (partial) pool snapshot into the published arrays; return the ids that changed."""
        if block_ids is None and len(snap["states"]) != len(self.codes):
            # A server's map keeps its first size: extra blocks are not drawn, missing ones are free.
            n = len(self.codes)
            snap = {**snap, "states": (list(snap["states"]) + ["free"] * n)[:n],
                    "ref_counts": (list(snap["ref_counts"]) + [0] * n)[:n]}
        ids = np.arange(len(self.codes)) if block_ids is None else np.asarray(block_ids, dtype=np.int64)
        codes = np.fromiter((self._code_of(s) for s in snap["states"]), dtype=np.uint8, count=len(ids))
        refs = np.minimum(np.asarray(snap["ref_counts"], dtype=np.int64), 255).astype(np.uint8)
        differs = (self.codes[ids] != codes) | (self.refs[ids] != refs)
        self.codes[ids] = codes
        self.refs[ids] = refs
        changed = set(ids[differs].tolist())
        checked = set(ids.tolist()) if block_ids is not None else None
        # Owners (request ids) and tenants fold in alike; a server's snapshot has no tenants.
        for mine, theirs in ((self.owners, snap["owners"]), (self.tenants, snap.get("tenants", {}))):
            new = {int(k): sorted(set(v)) for k, v in theirs.items()}
            for i in list(mine):
                if (checked is None or i in checked) and i not in new:
                    del mine[i]
                    changed.add(i)
            for i, names in new.items():
                if mine.get(i) != names:
                    mine[i] = names
                    changed.add(i)
        return sorted(changed)

    def _code_of(self, state: str) -> int:
        code = self._code.get(state)
        if code is None:
            code = self._code[state] = len(self.legend)
            self.legend.append(state)
        return code


def gauges(stats: EngineStats) -> dict[str, Any]:
    """A frame's gauges: the engine's own stats object, as JSON (plus the prefix hit rate), so the
    widget, the panel and `%pagedkv status` show the same numbers for the same instant."""
    out = dataclasses.asdict(stats)
    out["prefix_hit_rate"] = stats.prefix_hit_rate
    return out


_feeds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_feeds_lock = threading.Lock()


def feed_for(engine: EngineClient, **kwargs) -> MonitorFeed:
    """The one feed of `engine`, created on first use (`kwargs` then apply) and closed when the
    engine shuts down. An engine without step events (a server) is polled every half second."""
    with _feeds_lock:
        feed = _feeds.get(engine)
        if feed is None or feed._closed:
            if engine.info().polled:
                kwargs = {"interval": 0.5, "idle_poll": 0.5, "resync_interval": 0.0, **kwargs}
            feed = _feeds[engine] = MonitorFeed(engine, **kwargs)
            engine.add_shutdown_listener(feed.close)
        return feed
