"""PoolRecorder: what the block pool did during a run, kept for a still picture.

The live monitor shows the pool *now*; a notebook saved to a repository page, or a reader who
looks after the cell finished, needs the run's history instead. The recorder listens to engine
steps (the same hook the monitor feed uses) and keeps, per step, the block counts, plus the full
block map at the busiest moment (most block references: the most sharing and the most memory
held), then draws both with `pool_figure`'s colours.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .pool_figure import cue_colours, pool_figure, state_colours

if TYPE_CHECKING:
    from ..core.stats import EngineStats
    from ..protocol import EngineClient


@dataclass(frozen=True)
class PoolPoint:
    """The pool after one engine step."""

    t: float            # seconds since recording started
    used: int           # blocks with ref >= 1 (shared included)
    shared: int         # blocks with ref >= 2
    cached: int         # ref 0, holding a reusable prefix
    block_refs: int     # sum of ref counts: the blocks the same sequences would hold unshared
    running: int
    waiting: int        # not yet admitted, or preempted and waiting to be recomputed
    preempted: int      # preempted and not yet resumed (waiting to recompute, or swapped out)


class PoolRecorder:
    """`with PoolRecorder(engine) as rec: ...` then `rec.figure()`, `rec.peak`, `rec.timeline`."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine
        self.timeline: list[PoolPoint] = []
        self.peak: dict | None = None           # pool_snapshot() at the most block references
        self.peak_stats: EngineStats | None = None
        self._t0 = 0.0

    def __enter__(self) -> PoolRecorder:
        self._t0 = time.perf_counter()
        self.engine.add_step_listener(self._on_step)
        return self

    def __exit__(self, *exc) -> None:
        self.engine.remove_step_listener(self._on_step)

    def _on_step(self) -> None:
        # Runs in the stepping thread under the engine's (re-entrant) lock, so the counts and the
        # snapshot describe the same instant. Cheap for the pools a notebook draws.
        s = self.engine.stats()
        self.timeline.append(PoolPoint(time.perf_counter() - self._t0, s.num_used, s.num_shared, s.num_cached,
                                       s.num_block_refs, s.num_running, s.num_waiting, s.num_preempted))
        if self.peak_stats is None or s.num_block_refs > self.peak_stats.num_block_refs:
            self.peak, self.peak_stats = self.engine.pool_snapshot(), s

    @property
    def max_used(self) -> int:
        return max((p.used for p in self.timeline), default=0)

    def figure(self, title: str | None = None, columns: int = 32):
        """Blocks over the run (left) and the block map at the busiest step (right)."""
        import matplotlib.pyplot as plt

        if not self.timeline:
            raise RuntimeError("nothing recorded: run requests inside `with PoolRecorder(engine):`")
        colours = state_colours()
        fig, (a, b) = plt.subplots(1, 2, figsize=(12, 3.4), gridspec_kw={"width_ratios": [1, 1.2]})
        t = [p.t for p in self.timeline]
        private = [p.used - p.shared for p in self.timeline]
        shared = [p.shared for p in self.timeline]
        cached = [p.cached for p in self.timeline]
        areas = a.stackplot(t, private, shared, cached,
                            colors=[colours["used"], colours["shared"], colours["cached"]],
                            labels=["used (1 owner)", "shared (2+ owners)", "cached (reusable)"])
        # Shared is also hatched in the mark's colour: told apart from used without hue.
        areas[1].set_hatch("..")
        areas[1].set_edgecolor(cue_colours()["MARK"])
        areas[1].set_linewidth(0)
        a.plot(t, [p.block_refs for p in self.timeline], color="black", lw=1, ls="--",
               label="blocks if nothing were shared")
        a.set(xlabel="seconds", ylabel="blocks", title="the pool, step by step")
        a.grid(alpha=0.3)
        a.legend(fontsize=7, loc="upper left")
        peak = self.peak_stats
        pool_figure(self.peak, ax=b, columns=columns,
                    title=f"busiest step: {peak.num_used} blocks held, {peak.num_block_refs} references, "
                          f"{peak.num_running} running")
        if title:
            fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        return fig
