"""RemoteInspection: what monitors, tables and status lines read off a server client, as they
read it off a local engine (`EngineClient`): the server's /metrics as `EngineStats`, its KV-event
block map as a pool snapshot, request rows, the client's identity; a server has no steps, so
monitors poll it (`info().polled`)."""
from __future__ import annotations

import http.client
import time
from typing import TYPE_CHECKING, Callable

from ..core.stats import latency_percentiles
from ..engine.outputs import EngineInfo, Observation, RequestRow
from .errors import RemoteError, UnsupportedByServer
from .server_metrics import (FINISHED, GENERATED, KV_USAGE, PREEMPTIONS, PREFIX_HITS, PREFIX_QUERIES,
                             RUNNING, WAITING, RemoteStats, ServerMetrics, parse_prometheus)

if TYPE_CHECKING:
    from .remote_request import RemoteRequest


class RemoteInspection:
    """Mixed into `RemoteEngine`; reads the server and the client's own request records."""

    def metrics(self) -> ServerMetrics:
        """One scrape of the server's Prometheus /metrics, filtered to the served model."""
        status, body = self._get("/metrics", "/metrics")
        if status != 200:
            raise self._http_error(status, body)
        return ServerMetrics(parse_prometheus(body.decode("utf-8", "replace")), self.model)

    def stats(self) -> RemoteStats:
        """The server's gauges as EngineStats (plus the block count its KV events imply)."""
        m = self.metrics()
        info = m.cache_info()
        num_blocks = int(float(info.get("num_gpu_blocks") or 0))
        block_size = int(float(info.get("block_size") or 0))
        usage = m.value(KV_USAGE)
        num_used = round(usage * num_blocks)
        generated = m.value(GENERATED)
        now = time.perf_counter()
        with self._lock:
            new = 0 if self._last_generated is None else max(0, int(generated - self._last_generated))
            self._last_generated = generated
            self._throughput.record(now, new)
            tps = self._throughput.rate(now)
        event_blocks = None
        notes = []
        if self.events is not None:
            snap = self.events.snapshot()
            event_blocks = snap.num_blocks
            if self.events.error:
                notes.append(self.events.error)
            elif self.events.last_drop:
                notes.append(f"{self.events.last_drop} ({self.events.num_reconnects} so far)")
        else:
            notes.append("KV events: off (connect with --kv-events tcp://HOST:PORT for the block map)")
        if not m.has(KV_USAGE):
            notes.append("this server's /metrics has no KV-cache usage gauge")
        num_cached = max(0, event_blocks - num_used) if event_blocks is not None else 0
        num_free = max(0, num_blocks - num_used - num_cached)
        states = {k: v for k, v in (("free", num_free), ("cached", num_cached), ("used", num_used)) if v}
        return RemoteStats(
            num_blocks=num_blocks, block_size=block_size, num_free=num_free, num_used=num_used,
            num_cached=num_cached, num_shared=0, kv_cache_usage=usage,
            tokens_stored=0, slots_allocated=num_used * block_size, internal_waste=0,
            prefix_cache_queries=int(m.value(PREFIX_QUERIES)), prefix_cache_hits=int(m.value(PREFIX_HITS)),
            num_running=int(m.value(RUNNING)), num_waiting=int(m.value(WAITING)), num_preempted=0,
            num_preemptions=int(m.value(PREEMPTIONS)), num_swapped_blocks=0,
            tokens_per_s=tps, num_generated_tokens=int(generated), num_finished=int(m.value(FINISHED)),
            latency_percentiles=latency_percentiles(r.metrics for r in list(self.finished_requests)
                                                    if r.error is None),
            source=f"{self.name}" + (f" (vLLM {self.version})" if self.version else ""),
            states=states, kv_event_blocks=event_blocks, notes=notes)

    def pool_snapshot(self, block_ids=None, stats: RemoteStats | None = None) -> dict:
        """The local engine's snapshot shape, from the server's KV events and usage gauge (`stats`:
        a scrape already made, so a monitor polls /metrics once, not twice).

        Block positions are ours (events carry hashes, not physical ids): full blocks published by
        the server come first as 'cached' (reusable prefix), then the blocks /metrics says are in
        use beyond those (partly filled, never published) as 'used'; ref counts are not published.
        """
        stats = stats or self.stats()
        if block_ids is not None:
            raise ValueError("a server's block map has no stable block ids: ask for the whole pool")
        stored = stats.kv_event_blocks or 0
        n = max(stats.num_blocks, stored)
        states = ["free"] * n
        if self.events is not None:
            snap = self.events.snapshot()
            for slot in snap.slots.values():
                if slot < n:
                    states[slot] = "cached"
        extra = max(0, stats.num_used - stored)
        for i in range(n):
            if extra == 0:
                break
            if states[i] == "free":
                states[i] = "used"
                extra -= 1
        return {"num_blocks": n, "block_size": stats.block_size, "states": states,
                "ref_counts": [1 if s == "used" else 0 for s in states], "owners": {},
                "source": "kv-events" if self.events is not None else "metrics"}

    def check_invariants(self) -> None:
        """The server owns the blocks; here only: no request left live without its thread."""
        with self._lock:
            for req in self._requests.values():
                assert req.thread is not None and req.thread.is_alive(), \
                    f"{req.request_id} is live without a reader thread"

    def reset_prefix_cache(self) -> int:
        """Ask the server to drop its prefix cache (vLLM: only with VLLM_SERVER_DEV_MODE=1).

        Returns the full blocks the KV events knew of (0 without events: the server does not say)."""
        known = self.events.snapshot().num_blocks if self.events is not None else 0
        conn = self._connection()
        try:
            conn.request("POST", self.prefix + "/reset_prefix_cache", headers=self._headers())
            resp = conn.getresponse()
            body = resp.read()
        except (OSError, http.client.HTTPException) as err:
            raise self._network_error(err, "reset_prefix_cache") from None
        finally:
            conn.close()
        if resp.status == 404:
            raise RemoteError(f"{self.url} has no /reset_prefix_cache: start vLLM with "
                              f"VLLM_SERVER_DEV_MODE=1 to allow it")
        if resp.status != 200:
            raise self._http_error(resp.status, body)
        return known

    def info(self) -> EngineInfo:
        s = self.stats()
        summary = (f"{self.name}" + (f" (vLLM {self.version})" if self.version else "") +
                   f": {s.num_blocks:,} blocks × {s.block_size} = {s.num_blocks * s.block_size:,} tokens "
                   f"of KV on the server" + (", KV events on" if self.events is not None else ""))
        # Before the server reports its cache config the map is one block wide, not zero.
        return EngineInfo(self.name, "remote", "server", max(1, s.num_blocks), s.block_size or 16,
                          summary, polled=True)

    def observe(self, full: bool = True) -> Observation:
        """One scrape of /metrics plus the KV-event block map: a server reports no touched blocks,
        so every observation is a full one."""
        stats = self.stats()
        with self._lock:
            self._num_polls += 1
            polls = self._num_polls
        return Observation(polls, stats, None, self.pool_snapshot(stats=stats))

    def request_rows(self, finished: int = 20) -> list[RequestRow]:
        def row(req: RemoteRequest, state: str) -> RequestRow:
            return RequestRow(req.request_id, state, len(req.prompt_token_ids), req.num_output_tokens, 0,
                              req.num_cached_tokens, req.metrics.ttft, req.finish.get(0), req.error,
                              req.tenant)
        with self._lock:
            return ([row(r, "running") for r in self._requests.values()]
                    + [row(r, "failed" if r.error is not None else "done")
                       for r in (list(self.finished_requests)[-finished:] if finished > 0 else [])])

    def block_tables(self) -> list:
        raise UnsupportedByServer(f"{self.url} reports its pool (KV events), not its block tables: read "
                                  "block tables on the kernel's engine (%pagedkv disconnect)")

    def why(self, request_id: str | None = None):
        raise UnsupportedByServer(f"{self.url} reports no per-request prefix-cache lookups, so why a prompt "
                                  "missed is not available from a server: ask the kernel's engine "
                                  "(%pagedkv disconnect)")

    def prefix_ledger(self, previous=None):
        """A server's prefix cache is its own: nothing to hand over, nothing to remember."""
        from ..core.miss_report import PrefixLedger
        return PrefixLedger(self.name, ())

    def set_tenant(self, name: str, weight: float = 1.0, max_blocks: int | None = None) -> None:
        raise UnsupportedByServer(f"{self.url} takes no tenant weights or caps (a server applies its own "
                                  "policy): use the kernel's engine (%pagedkv disconnect)")

    def add_step_listener(self, listener: Callable[[], None]) -> None:
        """A server sends no step events: monitors poll (`info().polled`)."""

    def remove_step_listener(self, listener: Callable[[], None]) -> None:
        pass

    def add_shutdown_listener(self, listener: Callable[[], None]) -> None:
        with self._lock:
            self._shutdown_listeners.append(listener)

    @property
    def monitor_feed(self):
        """The one monitor feed of this client (created on first use), shared by every monitor."""
        from ..monitor.feed import feed_for
        return feed_for(self)

    def monitor(self, **kwargs):
        """The live block-pool widget, drawn from the server's /metrics and KV events."""
        from ..widgets import BlockPoolMonitor
        return BlockPoolMonitor(self, **kwargs)

