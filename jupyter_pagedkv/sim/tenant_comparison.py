"""The noisy neighbour, FCFS against fair share (`bench tenants`, notebook 08): both policies on
one seeded workload through the simulator, the two acceptance figures of a comparison, the
wrapper that sends a real engine's requests under their tenants, and the comparison figure."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ..core.tenancy import TenantSpec
from .summary import RequestTiming
from .tail_sweep import style_panels
from .tenant_workload import (NOISY, QUIET, SHARED, BlockSeries, TenantMix, block_series, blocks_by_owner,
                              noisy_neighbour, tenant_figures)

POLICIES = ("fcfs", "fair")
POLICY_COLOURS = {"fcfs": "#D55E00", "fair": "#0072B2"}     # Okabe-Ito vermillion and blue
TENANT_COLOURS = {QUIET: "#009E73", NOISY: "#E69F00"}       # Okabe-Ito green and orange
RATIO_TARGET_SIM = 1 / 3      # the quiet tenant's TTFT tail under fair share / under FCFS, simulated


@dataclass
class PolicyRun:
    """One policy's run: per-request timings (with tenants), the pool over time, preemptions."""

    policy: str
    timings: list[RequestTiming]
    series: BlockSeries
    num_blocks: int
    preemptions: int

    def figures(self) -> dict:
        q, n = tenant_figures(self.timings, QUIET), tenant_figures(self.timings, NOISY)
        return {"quiet": q.as_dict(), "noisy": n.as_dict(), "pool_utilisation": self.series.utilisation(self.num_blocks),
                "noisy_block_share": self.series.share(NOISY), "preemptions": self.preemptions,
                "steps": len(self.series.durations),
                "mean_step_ms": 1e3 * sum(self.series.durations) / max(1, len(self.series.durations))}


def compare(runs: dict[str, PolicyRun], weights: dict[str, float]) -> dict:
    """The two acceptance figures of one workload: the quiet TTFT tail ratio, and the noisy tokens/s
    under fair against what its weight entitles it to of FCFS's."""
    fig = {p: r.figures() for p, r in runs.items()}
    ratio = fig["fair"]["quiet"]["ttft_tail_s"] / fig["fcfs"]["quiet"]["ttft_tail_s"]
    entitled = weights[NOISY] / (weights[QUIET] + weights[NOISY])
    floor = entitled * fig["fcfs"]["noisy"]["tokens_per_s"]
    fair_noisy = fig["fair"]["noisy"]["tokens_per_s"]
    return {**fig, "quiet_ttft_tail_ratio": ratio,
            "noisy_throughput": {"fcfs_tokens_per_s": fig["fcfs"]["noisy"]["tokens_per_s"],
                                 "fair_tokens_per_s": fair_noisy, "share": entitled, "floor_tokens_per_s": floor,
                                 "kept": fair_noisy / fig["fcfs"]["noisy"]["tokens_per_s"], "ok": fair_noisy >= floor}}


def sim_runs(mix: TenantMix, seed: int, weights: dict[str, float], **preset) -> dict[str, PolicyRun]:
    """Both policies on one seeded workload through `Simulator.for_gpu(**preset)`."""
    from .simulator import Simulator

    requests = noisy_neighbour(mix, seed)
    tenants = tuple(TenantSpec(t, w) for t, w in weights.items())
    runs = {}
    for policy in POLICIES:
        sim = Simulator.for_gpu(scheduling_policy=policy, tenants=tenants, **preset)
        res = sim.run(requests, f"sim {policy} seed {seed}", record_trace=True)
        series, finish = block_series(res.trace, requests, sim.config.block_size)
        assert all(math.isclose(finish[t.request_id], t.finish_s) for t in res.summary.requests), "replay drifted"
        runs[policy] = PolicyRun(policy, res.summary.requests, series, sim.config.num_blocks,
                                 res.summary.num_preemptions)
    return runs


class TenantedEngine:
    """The engine as `sim.serve.serve` drives it, sending each request under the tenant its id
    names ("quiet-3" -> quiet) and recording each tenant's blocks after every step."""

    def __init__(self, engine, tenants: tuple[str, ...], first_arrival: float) -> None:
        self.engine, self.tenants, self._first_arrival = engine, tenants, first_arrival
        self.t0: float | None = None
        self.series = BlockSeries([], [], {t: [] for t in (*tenants, SHARED)})
        self._step_s: float | None = None

    def add_request(self, prompt, params, request_id: str, priority: int = 0) -> str:
        if self.t0 is None:   # serve adds the first request at its arrival: align our clock to serve's
            self.t0 = time.perf_counter() - self._first_arrival
        return self.engine.add_request(prompt, params, request_id, priority, tenant=request_id.split("-")[0])

    def step(self):
        s0 = time.perf_counter()
        outs = self.engine.step()
        self._step_s = time.perf_counter() - s0
        return outs

    def stats(self):
        s = self.engine.stats()
        if self._step_s is not None:   # serve reads stats once after each step
            held = blocks_by_owner(self.engine.pool_snapshot()["tenants"])
            self.series.append(time.perf_counter() - self.t0, self._step_s, held)
            self._step_s = None
        return s

    def __getattr__(self, name):
        return getattr(self.engine, name)


def tenants_figure(runs: dict[str, PolicyRun], label: str, clock: str = "time (s)"):
    """The quiet tenant's TTFT by arrival time under each run, then one panel per run (an
    allocator or a scheduling policy: the keys of `runs`) of the blocks each tenant held over time
    (% of the pool), blocks several tenants share drawn once, in their own band. Every panel
    shares one time axis, `clock` (seconds, or engine steps for a run counted in steps)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 1 + len(runs), figsize=(5.3 * (1 + len(runs)), 4.4), sharex=True)
    ax = axes[0]
    first = next(iter(runs.values()))
    tail = tenant_figures(first.timings, QUIET).tail_name
    unit = clock[clock.find("(") + 1:clock.find(")")] if "(" in clock else clock
    for (p, run), marker in zip(runs.items(), "o^sDv"):
        quiet = sorted((t for t in run.timings if t.tenant == QUIET), key=lambda t: t.arrival_s)
        ax.plot([t.arrival_s for t in quiet], [t.ttft for t in quiet], marker, ms=3.5,
                color=POLICY_COLOURS.get(p, "#CC79A7"),
                label=f"{p}: {tail} {tenant_figures(run.timings, QUIET).ttft_tail_s:.3g} {unit}")
    burst = min(t.arrival_s for t in first.timings if t.tenant == NOISY)
    ax.axvline(burst, color="grey", lw=0.8, ls=":", label="noisy burst arrives")
    ax.set(xlabel=f"quiet request's arrival ({unit})", ylabel=f"time to first token ({unit})", yscale="log",
           title="quiet tenant: waiting for the first token")
    for ax, (p, run) in zip(axes[1:], runs.items()):
        s = runs[p].series
        bands = [b for b in (QUIET, NOISY, SHARED) if b in s.blocks]
        ys = [[100 * b / run.num_blocks for b in s.blocks[t]] for t in bands]
        colours = {**TENANT_COLOURS, SHARED: "#999999"}
        ax.stackplot(s.times, *ys, colors=[colours[b] for b in bands], step="pre",
                     labels=[f"{t} ({100 * s.share(t):.0f}% of held)" for t in bands])
        ax.axvline(burst, color="grey", lw=0.8, ls=":")
        ax.set(xlabel=clock, ylabel="KV blocks held (% of pool)", ylim=(0, 105),
               title=f"{p}: the pool by tenant ({run.preemptions} preemptions)")
    style_panels(axes)
    fig.suptitle(label + ("" if tail == "P99" else " (tail = max: fewer than 20 quiet requests)"), fontsize=10)
    fig.tight_layout()
    return fig
