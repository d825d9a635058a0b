"""RemoteMonitorFeed: the live monitor's frames for a server client (`Engine.connect`).

A server sends this kernel no step events and owns its blocks, so instead of waking on steps and
re-reading touched blocks, this feed's thread polls: every `interval` one /metrics scrape (the
gauges) plus the block map the KV-event listener keeps current, folded into the same arrays,
diffs and gauges as the local engine's feed. The widget and the JupyterLab panel draw it unchanged.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..monitor.feed import Frame, MonitorFeed

if TYPE_CHECKING:
    from .client import RemoteEngine
    from .server_metrics import RemoteStats


class RemoteMonitorFeed(MonitorFeed):
    """MonitorFeed over a RemoteEngine: polled, full comparison each time (no touched set)."""

    def __init__(self, client: RemoteEngine, interval: float = 0.5, threaded: bool = True) -> None:
        super().__init__(client, interval=interval, resync_interval=0.0, idle_poll=interval, threaded=threaded)

    def _pool_shape(self) -> tuple[int, int]:
        stats = self.engine.stats()
        # Before the server reports its cache config the map is one block wide, not zero.
        return max(1, stats.num_blocks), stats.block_size or 16

    def _read(self) -> tuple[RemoteStats, dict]:
        stats = self.engine.stats()
        snap = self.engine.pool_snapshot(stats)
        n = len(self.codes)
        if len(snap["states"]) != n:      # the map keeps its first size; extra blocks are not drawn
            snap = {**snap, "states": (snap["states"] + ["free"] * n)[:n],
                    "ref_counts": (snap["ref_counts"] + [0] * n)[:n]}
        return stats, snap

    def _prime(self) -> None:
        stats, snap = self._read()
        self._compare(snap, None)
        self.gauges = self._gauges(self._live(stats))

    def _listen(self, on: bool) -> None:
        """Nothing to listen to: the thread wakes every `idle_poll` (= interval) and polls."""

    def publish(self, full_scan: bool = True) -> Frame | None:
        t0 = time.perf_counter()
        stats, snap = self._read()           # network I/O outside the mutex
        with self._mutex:
            frame = self._emit(self._compare(snap, None), self._live(stats))
        self.publish_times.append(time.perf_counter() - t0)
        return frame

    @staticmethod
    def _live(stats: RemoteStats) -> dict[str, Any]:
        """The gauge inputs a server reports; what it does not (waste inside blocks, drafts) is 0."""
        return {"partial_slots": 0,
                "prefix_cache_queries": stats.prefix_cache_queries, "prefix_cache_hits": stats.prefix_cache_hits,
                "num_running": stats.num_running, "num_waiting": stats.num_waiting,
                "num_preempted": stats.num_preempted, "num_preemptions": stats.num_preemptions,
                "num_swapped_blocks": 0, "num_generated_tokens": stats.num_generated_tokens,
                "spec_proposed_tokens": 0, "spec_accepted_tokens": 0, "spec_acceptance_rate": 0.0,
                "spec_mean_accepted_length": 0.0}
