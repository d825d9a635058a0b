"""The engine's gauges: one definition of every number that a monitor, `%pagedkv status`, the
JupyterLab panel or a benchmark shows, computed in one place.

`engine_stats` reads the pool's O(1) block counters, the scheduler's queues and the engine's
counters; the engine calls it under its lock, so every gauge describes the same instant, and
every view (monitor feed, status line, panel) shows that one object. Nothing here is O(num_blocks):
a monitor may ask ten times a second of a 100,000-block pool.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence as Seq

if TYPE_CHECKING:
    from .block_pool import BlockPool
    from .scheduler import Scheduler
    from .sequence import Sequence

# Generated tokens per second are averaged over the steps of the last this-many seconds.
THROUGHPUT_WINDOW_S = 10.0
BLOCK_STATES = ("free", "cached", "used", "shared")


@dataclass
class EngineStats:
    """Gauges and counters, defined precisely (blocks and tokens are physical, counted once).

    num_free: blocks holding nothing reusable; num_cached: ref 0 but holding a reusable prefix;
    num_used: ref >= 1; num_shared: ref >= 2; kv_cache_usage = num_used / num_blocks;
    num_block_refs: sum of ref counts, so num_block_refs - num_used blocks are saved by sharing.
    tokens_stored: distinct slots holding KV of live sequences; slots_allocated = num_used x
    block_size; internal_waste = slots_allocated - tokens_stored.
    prefix_cache_queries / _hits: prompt tokens looked up / found in the cache at admission.
    spec_proposed_tokens / spec_accepted_tokens: draft tokens verified / kept (speculative
    decoding); spec_acceptance_rate = accepted / proposed; spec_num_verifications: sequence-steps
    that verified drafts; spec_mean_accepted_length = accepted / verifications (drafts kept per
    verification, the target's own token not counted: tokens per forward = 1 + this).
    """

    num_blocks: int
    block_size: int
    num_free: int
    num_used: int
    num_cached: int
    num_shared: int
    kv_cache_usage: float
    tokens_stored: int
    slots_allocated: int
    internal_waste: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_running: int
    num_waiting: int
    num_preempted: int
    num_preemptions: int
    num_swapped_blocks: int
    tokens_per_s: float
    num_generated_tokens: int
    num_finished: int
    latency_percentiles: dict[str, dict[str, float]] = field(default_factory=dict)
    # Sum of ref counts = blocks the live sequences would hold if none were shared (private copies).
    num_block_refs: int = 0
    spec_num_verifications: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_acceptance_rate: float = 0.0
    spec_mean_accepted_length: float = 0.0
    # Blocks per state ("free", "cached", "used", "shared", ...), for legends and block maps.
    states: dict[str, int] = field(default_factory=dict)
    num_steps: int = 0
    # Decode-only steps run padded to a bucket size, and of those, replayed from a CUDA graph.
    num_padded_steps: int = 0
    num_graph_replays: int = 0
    num_swap_outs: int = 0            # preemptions that swapped a sequence's blocks to the host
    # Per tenant (the unnamed tenant as UNNAMED), once any request named one or a tenant was set.
    tenants: dict[str, TenantStats] = field(default_factory=dict)
    scheduling_policy: str = "fcfs"
    # The contiguous baseline's admissions refused for want of a run of adjacent free blocks, and
    # of them those refused although enough blocks were free in total (external fragmentation).
    num_refused_admissions: int = 0
    num_refused_external: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def summary(self) -> str:
        """A few human lines, for the terminal demo and `%pagedkv status`."""
        lines = [
            f"blocks: {self.num_used} used ({self.num_shared} shared), {self.num_cached} cached, "
            f"{self.num_free} free of {self.num_blocks} x {self.block_size} tokens "
            f"(KV usage {self.kv_cache_usage:.1%})",
            f"waste: {self.internal_waste} of {self.slots_allocated} allocated slots unused "
            f"({self.tokens_stored} tokens stored)",
            f"prefix cache: {self.prefix_cache_hits} / {self.prefix_cache_queries} prompt tokens hit "
            f"({self.prefix_hit_rate:.1%})",
            f"requests: {self.num_running} running, {self.num_waiting} waiting, "
            f"{self.num_finished} finished, {self.num_preemptions} preemptions",
            f"recent throughput: {self.tokens_per_s:.1f} generated tokens/s (last {THROUGHPUT_WINDOW_S:.0f} s of steps)",
        ]
        if self.spec_proposed_tokens:
            lines.append(f"speculative: {self.spec_accepted_tokens} / {self.spec_proposed_tokens} draft "
                         f"tokens accepted ({self.spec_acceptance_rate:.1%}), "
                         f"{self.spec_mean_accepted_length:.2f} per verification")
        latency = latency_line(self.latency_percentiles)
        if latency:
            lines.append(f"latency: {latency}")
        if self.tenants:
            lines.append(f"tenants ({self.scheduling_policy}):")
            lines.extend(f"  {t.line()}" for t in self.tenants.values())
        return "\n".join(lines)


UNNAMED = "(unnamed)"
"""The name figures give the requests that named no tenant (internally, tenant None)."""


@dataclass
class TenantStats:
    """One tenant's slice of the gauges. blocks_used: distinct blocks its requests reference (a
    block two tenants share counts for both); blocks_shared: of those, referenced more than once;
    share: its weighted fair share of the pool in blocks among the tenants with live work (or
    itself alone); cached_tokens: its prompt tokens found in the prefix cache."""

    name: str
    weight: float
    max_blocks: int | None
    share: float
    blocks_used: int
    blocks_shared: int
    cached_tokens: int
    num_running: int
    num_waiting: int
    num_preempted: int
    num_finished: int
    ttft_p50: float | None
    ttft_p99: float | None
    e2e_p99: float | None
    tail_name: str
    tokens_per_s: float

    def line(self) -> str:
        cap = f" (cap {self.max_blocks})" if self.max_blocks is not None else ""
        tail = self.tail_name.lower()
        lat = (f", TTFT p50 {self.ttft_p50 * 1e3:.0f} ms / {tail} {self.ttft_p99 * 1e3:.0f} ms, end-to-end "
               f"{tail} {self.e2e_p99:.2f} s" if self.ttft_p50 is not None and self.e2e_p99 is not None else "")
        return (f"{self.name}: {self.blocks_used} blocks{cap} ({self.blocks_shared} shared, share "
                f"{self.share:.0f}, weight {self.weight:g}), {self.cached_tokens} cached tokens, "
                f"{self.num_running} running / {self.num_waiting} waiting / {self.num_preempted} preempted, "
                f"{self.num_finished} finished, {self.tokens_per_s:.1f} tok/s{lat}")


def tenant_stats(pool: BlockPool, scheduler: Scheduler, counters: EngineCounters,
                 finished: Iterable[Any], now: float | None = None) -> dict[str, TenantStats]:
    """Every tenant's gauges, O(tenants + queued sequences + finished requests kept); {} while no
    request named a tenant and none was set. `finished` holds finished requests (their `tenant`
    and `metrics`)."""
    tenancy = scheduler.tenancy
    live = scheduler.live
    names = set(tenancy.specs) | set(pool.held) | {s.tenant for s in live} | set(counters.finished_by_tenant)
    if not names - {None}:
        return {}
    finished = list(finished)
    active = {s.tenant for s in live}
    result = {}
    for name in sorted(names, key=lambda n: (n is None, n or "")):
        spec = tenancy.spec(name)
        mine = [r.metrics for r in finished if r.tenant == name]
        p = latency_percentiles(mine)
        ttft, lat = p.get("ttft", {}), p.get("latency", {})
        rate = counters.tenant_throughput.get(name)
        result[UNNAMED if name is None else name] = TenantStats(
            name=UNNAMED if name is None else name, weight=spec.weight, max_blocks=spec.max_blocks,
            share=tenancy.share(name, active), blocks_used=pool.num_held(name),
            blocks_shared=pool.held_shared.get(name, 0),
            cached_tokens=scheduler.kv.prefix_hits_by_tenant.get(name, 0),
            num_running=sum(1 for s in scheduler.running if s.tenant == name),
            num_waiting=sum(1 for s in scheduler.waiting if s.tenant == name),
            num_preempted=sum(1 for s in scheduler.waiting if s.tenant == name and s.num_preemptions)
            + sum(1 for s in scheduler.swapped if s.tenant == name),
            num_finished=counters.finished_by_tenant.get(name, 0),
            ttft_p50=ttft.get("p50"), ttft_p99=ttft.get("p99"), e2e_p99=lat.get("p99"),
            tail_name=tail_name(int(ttft.get("count", 0))), tokens_per_s=rate.rate(now) if rate else 0.0)
    return result


class Throughput:
    """Generated tokens per second over the steps of the last `window` seconds."""

    def __init__(self, window: float = THROUGHPUT_WINDOW_S) -> None:
        self.window = window
        self._steps: deque[tuple[float, int]] = deque()

    def record(self, now: float, tokens: int) -> None:
        self._steps.append((now, tokens))
        while self._steps and now - self._steps[0][0] > self.window:
            self._steps.popleft()

    def rate(self, now: float | None = None) -> float:
        now = time.perf_counter() if now is None else now
        steps = [(t, n) for t, n in self._steps if now - t <= self.window]
        if len(steps) < 2:
            return 0.0
        span = steps[-1][0] - steps[0][0]
        return sum(n for _, n in steps[1:]) / span if span > 0 else 0.0


@dataclass
class EngineCounters:
    """What the engine counts as it steps (everything else is read off the pool and queues)."""

    num_steps: int = 0
    num_generated_tokens: int = 0
    num_finished: int = 0
    step_time_s: float = 0.0
    forward_time_s: float = 0.0
    throughput: Throughput = field(default_factory=Throughput)
    tenant_throughput: dict[str | None, Throughput] = field(default_factory=dict)
    finished_by_tenant: dict[str | None, int] = field(default_factory=dict)

    def record_step(self, now: float, tokens: int, step_s: float, forward_s: float,
                    by_tenant: dict[str | None, int] | None = None) -> None:
        self.num_steps += 1
        self.num_generated_tokens += tokens
        self.step_time_s += step_s
        self.forward_time_s += forward_s
        self.throughput.record(now, tokens)
        for tenant, rate in self.tenant_throughput.items():
            rate.record(now, (by_tenant or {}).get(tenant, 0))
        for tenant, n in (by_tenant or {}).items():
            if tenant not in self.tenant_throughput:
                self.tenant_throughput[tenant] = rate = Throughput(self.throughput.window)
                rate.record(now, n)

    def record_finish(self, tenant: str | None) -> None:
        self.num_finished += 1
        self.finished_by_tenant[tenant] = self.finished_by_tenant.get(tenant, 0) + 1


MIN_TAIL_SAMPLES = 20
"""Below this many samples a 99th percentile is the maximum (nearest rank) or nearly (interpolated),
so every figure and status line calls it what it is: "max"."""


def tail_name(num_samples: int, q: float = 99) -> str:
    """The honest name of the q-th percentile of `num_samples` values: "P99", or "max" when too few
    samples stand behind it to call it a percentile."""
    return f"P{q:g}" if num_samples >= MIN_TAIL_SAMPLES else "max"


def percentiles(samples: dict[str, Iterable[float | None]]) -> dict[str, dict[str, float]]:
    """p50 / p90 / p99 of each named sample (None values skipped), nearest rank, and the count
    behind them (a status line names the p99 of fewer than MIN_TAIL_SAMPLES "max")."""
    result = {}
    for name, values in samples.items():
        ordered = sorted(v for v in values if v is not None)
        if ordered:
            pick = lambda q: ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]
            result[name] = {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "count": len(ordered)}
    return result


def latency_line(p: dict[str, dict[str, float]]) -> str | None:
    """ "TTFT p50 .. ms / p99 .. ms, end-to-end p50 .. s / p99 .. s" (with "max" for "p99" below
    MIN_TAIL_SAMPLES requests), or None before any request finished."""
    ttft, lat = p.get("ttft"), p.get("latency")
    if not ttft or not lat:
        return None
    t = tail_name(int(ttft.get("count", 0))).lower()
    return (f"TTFT p50 {ttft['p50']*1e3:.0f} ms / {t} {ttft['p99']*1e3:.0f} ms, "
            f"end-to-end p50 {lat['p50']:.2f} s / {t} {lat['p99']:.2f} s")


def latency_percentiles(metrics: Iterable[Any]) -> dict[str, dict[str, float]]:
    """TTFT, TPOT and end-to-end percentiles over finished requests' metrics."""
    metrics = list(metrics)
    return percentiles({name: [getattr(m, name) for m in metrics] for name in ("ttft", "tpot", "latency")})


def internal_waste(seqs: Iterable[Sequence], block_size: int) -> int:
    """Slots held but not filled: each partly filled last block (once, however many sequences
    share it) plus, for the contiguous baseline, reserved blocks beyond a sequence's tokens.

    O(sequences): a block is partly filled only at the end of a table (copy-on-write gives a
    writer its own copy before it fills a shared block further)."""
    partial: dict[int, int] = {}
    waste = 0
    for seq in seqs:
        table = seq.block_table
        if not table.blocks:
            continue
        filled = -(-table.num_slots // block_size)
        waste += (len(table.blocks) - filled) * block_size
        used = table.num_slots % block_size
        if used:
            block_id = table.blocks[filled - 1].block_id
            partial[block_id] = max(partial.get(block_id, 0), used)
    return waste + sum(block_size - used for used in partial.values())


def occupancy(pool: BlockPool, seqs: Iterable[Sequence]) -> tuple[int, int]:
    """(token slots filled, slots held) by the sequences holding the pool's blocks; a shared
    block counts once, so sharing shows as higher utilisation, never above 100%."""
    held = pool.num_used * pool.block_size
    return held - internal_waste(seqs, pool.block_size), held


def num_preempted(scheduler: Scheduler) -> int:
    """Sequences preempted and not yet running again: waiting to recompute, or swapped out."""
    return sum(1 for s in scheduler.waiting if s.num_preemptions) + len(scheduler.swapped)


def engine_stats(pool: BlockPool, scheduler: Scheduler, counters: EngineCounters, *,
                 num_swapped_blocks: int = 0, speculative: Any = None, padded: Any = None,
                 finished: Iterable[Any] = (), now: float | None = None) -> EngineStats:
    """Every gauge at this instant (call it under the engine's lock). `speculative` is the
    speculator's counters (drafts proposed / kept); `finished` the finished requests (their
    `metrics` and `tenant`)."""
    finished = list(finished)
    tenants = tenant_stats(pool, scheduler, counters, finished, now)
    n, bs = pool.num_blocks, pool.block_size
    live = scheduler.live
    tokens_stored, slots = occupancy(pool, live)
    spec = {}
    if speculative is not None:
        spec = dict(spec_num_verifications=speculative.num_verifications,
                    spec_proposed_tokens=speculative.num_proposed,
                    spec_accepted_tokens=speculative.num_accepted,
                    spec_acceptance_rate=speculative.acceptance_rate,
                    spec_mean_accepted_length=speculative.mean_accepted_length)
    num_free = n - pool.num_used - pool.num_cached
    refused, refused_external = scheduler.kv.refusals()
    states = {"free": num_free, "cached": pool.num_cached, "used": pool.num_used - pool.num_shared,
              "shared": pool.num_shared}
    return EngineStats(
        num_blocks=n, block_size=bs, num_free=num_free, num_used=pool.num_used,
        num_cached=pool.num_cached, num_shared=pool.num_shared, kv_cache_usage=pool.num_used / n,
        tokens_stored=tokens_stored, slots_allocated=slots, internal_waste=slots - tokens_stored,
        prefix_cache_queries=pool.prefix_cache_queries, prefix_cache_hits=pool.prefix_cache_hits,
        num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
        num_preempted=num_preempted(scheduler), num_preemptions=scheduler.num_preemptions,
        num_swapped_blocks=num_swapped_blocks, tokens_per_s=counters.throughput.rate(now),
        num_generated_tokens=counters.num_generated_tokens, num_finished=counters.num_finished,
        latency_percentiles=latency_percentiles(r.metrics for r in finished), num_block_refs=pool.num_refs,
        states={k: v for k, v in states.items() if v}, num_steps=counters.num_steps,
        num_padded_steps=padded.num_steps if padded is not None else 0,
        num_graph_replays=padded.num_replays if padded is not None else 0,
        num_swap_outs=scheduler.num_swap_outs, tenants=tenants, scheduling_policy=scheduler.tenancy.policy,
        num_refused_admissions=refused, num_refused_external=refused_external, **spec)


def block_state(block) -> str:
    """'shared' (ref > 1), 'used' (ref 1), 'cached' (ref 0, holds a reusable prefix) or 'free'."""
    if block.ref_count > 1:
        return "shared"
    if block.ref_count == 1:
        return "used"
    return "cached" if block.block_hash is not None else "free"


def pool_snapshot(pool: BlockPool, seqs: Seq[Sequence], block_ids: Iterable[int] | None = None) -> dict:
    """Per-block state, ref count, owning request ids and tenants (all blocks, or `block_ids` in that
    order, echoed as "block_ids": then O(listed blocks + live table entries))."""
    blocks = pool.blocks if block_ids is None else [pool.blocks[i] for i in block_ids]
    wanted = None if block_ids is None else {b.block_id for b in blocks}
    owners: dict[int, list[str]] = {}
    for seq in seqs:
        for block in seq.block_table.blocks:
            if wanted is None or block.block_id in wanted:
                owners.setdefault(block.block_id, []).append(seq.request_id)
    # Which tenants reference each block (UNNAMED for requests that named none, listed last, as
    # EngineStats.tenants orders them); a block two tenants share lists both. Only blocks in use.
    tenants = {b.block_id: [UNNAMED if t is None else t for t in sorted(b.owners, key=lambda t: (t is None, t or ""))]
               for b in blocks if b.owners}
    snap = {"num_blocks": pool.num_blocks, "block_size": pool.block_size,
            "states": [block_state(b) for b in blocks], "ref_counts": [b.ref_count for b in blocks],
            "owners": owners, "tenants": tenants}
    if block_ids is not None:
        snap["block_ids"] = [b.block_id for b in blocks]
    return snap
