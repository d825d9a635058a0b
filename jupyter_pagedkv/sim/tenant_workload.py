"""The noisy-neighbour workload and what it is judged by, for `bench tenants`.

Two tenants share one pool: a quiet one sending short chat turns at a steady Poisson rate for the
whole run, and a noisy one whose burst of long generations arrives a little after the start and
alone needs more KV than the pool holds. The same seeded requests are served once per policy, so
the policy is the only difference. Per tenant: TTFT and end-to-end latency (P99, or the maximum
below 20 requests: `core.stats.tail_name`) and output tokens per second over the tenant's own span
(first arrival to last finish). Per run: the pool each tenant held over time, reconstructed from
the simulator's step trace (`block_series`, checked against `SimResult.block_steps`).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ..core.stats import tail_name
from .summary import RequestTiming, percentile, tail
from .workload import SimRequest, _tokens, arrivals

QUIET, NOISY = "quiet", "noisy"
SHARED = "shared"      # a BlockSeries band: blocks several tenants hold, counted once


@dataclass(frozen=True)
class TenantMix:
    """The two tenants' traffic. Lengths are drawn uniformly from the (low, high) ranges."""

    quiet_requests: int = 200
    quiet_rate: float = 1.0                        # requests/s, Poisson, from t = 0
    quiet_prompt: tuple[int, int] = (64, 256)      # a chat turn with a little history
    quiet_output: tuple[int, int] = (16, 128)
    quiet_max_tokens: int = 256
    noisy_requests: int = 16
    noisy_at: float = 10.0                         # the burst starts here (s) ...
    noisy_rate: float = 8.0                        # ... with Poisson gaps at this rate
    noisy_prompt: tuple[int, int] = (512, 1024)
    noisy_output: tuple[int, int] = (1536, 2048)   # long generations, run to their length
    noisy_max_tokens: int = 2048


def noisy_neighbour(mix: TenantMix, seed: int = 0, vocab: int = 32000) -> list[SimRequest]:
    """The seeded requests of both tenants, quiet ones named quiet-i, noisy ones noisy-i."""
    rng = random.Random(seed)
    out = []
    for tenant, n, rate, at, prompt, output, cap in (
            (QUIET, mix.quiet_requests, mix.quiet_rate, 0.0, mix.quiet_prompt, mix.quiet_output, mix.quiet_max_tokens),
            (NOISY, mix.noisy_requests, mix.noisy_rate, mix.noisy_at, mix.noisy_prompt, mix.noisy_output,
             mix.noisy_max_tokens)):
        for i, t in enumerate(arrivals(n, rate, rng)):
            p, o = rng.randint(*prompt), min(cap, rng.randint(*output))
            out.append(SimRequest(f"{tenant}-{i}", at + t, _tokens(rng, p, vocab), _tokens(rng, o, vocab), cap,
                                  tenant=tenant))
    return sorted(out, key=lambda r: r.arrival_s)


@dataclass(frozen=True)
class TenantFigures:
    """One tenant's side of one run."""

    requests: int
    ttft_p50_s: float
    ttft_tail_s: float
    e2e_tail_s: float
    tokens_per_s: float    # its output tokens / (its last finish - its first arrival)
    tail_name: str

    def as_dict(self) -> dict:
        return {"requests": self.requests, "ttft_p50_s": self.ttft_p50_s, "ttft_tail_s": self.ttft_tail_s,
                "e2e_tail_s": self.e2e_tail_s, "tokens_per_s": self.tokens_per_s, "tail": self.tail_name}


def tenant_figures(timings: list[RequestTiming], tenant: str) -> TenantFigures:
    mine = [t for t in timings if t.tenant == tenant]
    if not mine:
        nan = math.nan
        return TenantFigures(0, nan, nan, nan, nan, tail_name(0))
    span = max(t.finish_s for t in mine) - min(t.arrival_s for t in mine)
    return TenantFigures(len(mine), percentile([t.ttft for t in mine], 50), tail(t.ttft for t in mine),
                         tail(t.latency for t in mine),
                         sum(t.num_output_tokens for t in mine) / span if span > 0 else math.nan,
                         tail_name(len(mine)))


@dataclass
class BlockSeries:
    """Blocks each tenant held after each step, on the run's clock (busy steps only)."""

    times: list[float]                 # the clock at the end of each step
    durations: list[float]             # each step's length
    blocks: dict[str, list[int]]       # tenant -> blocks held after each step

    def append(self, time_s: float, duration_s: float, held: dict[str, int]) -> None:
        """One step: the clock after it, its length, and the blocks each band held (0 if absent)."""
        self.times.append(time_s)
        self.durations.append(duration_s)
        for band, series in self.blocks.items():
            series.append(held.get(band, 0))

    def utilisation(self, num_blocks: int) -> float:
        """Blocks held / pool, time-weighted over the steps."""
        total = sum(self.durations)
        held = sum(d * sum(b[i] for b in self.blocks.values()) for i, d in enumerate(self.durations))
        return held / (num_blocks * total) if total else math.nan

    def share(self, tenant: str) -> float:
        """`tenant`'s part of all the blocks held, time-weighted."""
        weigh = lambda b: sum(d * x for d, x in zip(self.durations, b))
        total = sum(weigh(b) for b in self.blocks.values())
        return weigh(self.blocks.get(tenant, [])) / total if total else math.nan


def blocks_by_owner(block_tenants: dict[int, list[str]]) -> dict[str, int]:
    """Each block in use counted once: under its one tenant, or under SHARED when several tenants
    hold it (`pool_snapshot()["tenants"]`), so the bands of a stacked plot add up to the blocks in
    use and never pass the pool. (EngineStats.tenants counts a shared block for every holder.)"""
    held: dict[str, int] = {}
    for names in block_tenants.values():
        band = names[0] if len(names) == 1 else SHARED
        held[band] = held.get(band, 0) + 1
    return held


def block_series(trace, requests: list[SimRequest], block_size: int) -> tuple[BlockSeries, dict[str, float]]:
    """Replay a simulator trace (`Simulator.run(..., record_trace=True)`) to the blocks each tenant
    held after every step and the clock at each step, the way the simulator's loop advances it
    (an idle pool jumps to the next arrival). Also returns each request's finish time, so a caller
    can check the replay against the run's own timings. Assumes no sharing between requests
    (each holds ceil(tokens / block_size) blocks), which random prompts give."""
    by_id = {r.request_id: r for r in requests}
    pending = sorted(requests, key=lambda r: r.arrival_s)
    tenants = sorted({r.tenant for r in requests})
    held: dict[str, int] = {}           # request id -> blocks, while it holds any
    live: set[str] = set()              # arrived and not finished
    finish: dict[str, float] = {}
    series = BlockSeries([], [], {t: [] for t in tenants})
    clock, i = 0.0, 0
    for step in trace:
        while i < len(pending) and pending[i].arrival_s <= clock:
            live.add(pending[i].request_id)
            i += 1
        if not live:
            clock = pending[i].arrival_s
            while i < len(pending) and pending[i].arrival_s <= clock:
                live.add(pending[i].request_id)
                i += 1
        clock += step.duration_s
        for rid in step.preempted:
            held.pop(rid, None)
        for rid, _, start, n, samples in step.chunks:
            r = by_id[rid]
            held[rid] = -(-(start + n) // block_size)
            if samples and start + n == r.prompt_len + r.output_len - 1:
                held.pop(rid)
                live.discard(rid)
                finish[rid] = clock
        series.times.append(clock)
        series.durations.append(step.duration_s)
        for t in tenants:
            series.blocks[t].append(sum(b for rid, b in held.items() if by_id[rid].tenant == t))
    return series, finish
