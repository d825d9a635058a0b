"""PoolRecorder: what the block pool did during a run, kept for a still picture.

The live monitor shows the pool *now*; a notebook saved to a repository page, or a reader who
looks after the cell finished, needs the run's history instead. The recorder listens to engine
steps (the same hook the monitor feed uses) and keeps, per step, the block counts, plus the full
block map at the busiest step, then draws both with `pool_figure`'s colours.

The busiest step is the one with the most blocks *held* (ref >= 1): that is the memory the run
needed. Ties go to the step with the most references (the most sharing), then to the first. Picking
by references instead would choose the step right after a fork, before copy-on-write has copied
anything, and so overstate what sharing saves.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..protocol import StepObserver
from .pool_figure import FONT, cue_colours, pool_figure, state_colours

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ..core.stats import EngineStats
    from ..protocol import EngineClient



@dataclass(frozen=True)
class PoolPoint:
    """The pool after one engine step."""

    t: float            # seconds since recording started
    used: int           # blocks held: ref >= 1 (shared included)
    shared: int         # blocks with ref >= 2
    cached: int         # ref 0, holding a reusable prefix: held by no sequence
    block_refs: int     # sum of ref counts: the blocks the same sequences would hold unshared
    running: int
    waiting: int        # not yet admitted, or preempted and waiting to be recomputed
    preempted: int      # preempted and not yet resumed (waiting to recompute, or swapped out)


def busier(s: EngineStats, than: EngineStats | None) -> bool:
    """Whether step `s` beats the busiest so far: more blocks held, or as many with more references."""
    return than is None or (s.num_used, s.num_block_refs) > (than.num_used, than.num_block_refs)


class PoolRecorder(StepObserver):
    """`with PoolRecorder(engine) as rec: ...` then `rec.figure()`, `rec.peak`, `rec.timeline`.

    `peak_stats` is the engine's stats at the busiest step (most blocks held, see the module
    docstring), `peak` its `pool_snapshot()` and `peak_index` its place in `timeline`."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine
        self.timeline: list[PoolPoint] = []
        self.peak: dict | None = None           # pool_snapshot() at the busiest step
        self.peak_stats: EngineStats | None = None
        self.peak_index: int | None = None
        self.block_size: int | None = None
        self._t0 = 0.0

    def __enter__(self) -> PoolRecorder:
        self._t0 = time.perf_counter()
        return super().__enter__()

    def _on_step(self) -> None:
        # Runs in the stepping thread under the engine's (re-entrant) lock, so the counts and the
        # snapshot describe the same instant. Cheap for the pools a notebook draws.
        s = self.engine.stats()
        self.block_size = s.block_size
        self.timeline.append(PoolPoint(time.perf_counter() - self._t0, s.num_used, s.num_shared, s.num_cached,
                                       s.num_block_refs, s.num_running, s.num_waiting, s.num_preempted))
        if busier(s, self.peak_stats):
            self.peak, self.peak_stats, self.peak_index = self.engine.pool_snapshot(), s, len(self.timeline) - 1

    @property
    def max_used(self) -> int:
        return max((p.used for p in self.timeline), default=0)

    def figure(self, title: str | None = None, columns: int = 32) -> Figure:
        """Blocks over the run (left) and the block map at the busiest step (right)."""
        import matplotlib.pyplot as plt

        if not self.timeline:
            raise RuntimeError("nothing recorded: run requests inside `with PoolRecorder(engine):`")
        fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [1, 1.2]})
        self._draw_timeline(a)
        peak = self.peak_stats
        pool_figure(self.peak, ax=b, columns=columns,
                    title=f"busiest step (t = {self.timeline[self.peak_index].t:.2f} s): {peak.num_used} blocks "
                          f"held for {peak.num_block_refs} references, {peak.num_running} running")
        if title:
            fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        return fig

    def _draw_timeline(self, ax) -> None:
        """Held blocks stacked (one owner, shared), against the blocks the same sequences would hold
        as private copies; cached blocks, which no sequence holds, as a line of their own."""
        colours, step = state_colours(), "post"
        t = [p.t for p in self.timeline]
        used = [p.used for p in self.timeline]
        private = [p.used - p.shared for p in self.timeline]
        ax.fill_between(t, 0, private, step=step, color=colours["used"], lw=0, label="held, 1 owner")
        # Shared is also hatched in the mark's colour: told apart from used without hue.
        ax.fill_between(t, private, used, step=step, facecolor=colours["shared"], hatch="..",
                        edgecolor=cue_colours()["MARK"], lw=0, label="held, shared (2+ owners)")
        ax.step(t, [p.block_refs for p in self.timeline], where=step, color="black", lw=1.2, ls="--",
                label="private copies: blocks if nothing were shared")
        if any(p.cached for p in self.timeline):
            # Markers: the cached count after the last step (the run's leftovers) is a point, not a span.
            cached = [p.cached for p in self.timeline]
            ax.step(t, cached, where=step, color=colours["cached"], lw=2, ls=":", marker="o", ms=3,
                    markevery=[i for i, c in enumerate(cached) if c], label="cached: ref 0, held by no sequence")
        ax.axvline(t[self.peak_index], color=(0.3, 0.3, 0.3), lw=0.8, ls="-.", label="busiest step (map at right)")
        ax.set_xlabel("time since recording started (s)", fontsize=FONT + 1)
        ax.set_ylabel(f"blocks ({self.block_size} tokens each)", fontsize=FONT + 1)
        ax.set_title("the pool, step by step", fontsize=9)
        ax.set_ylim(0, max(max(p.block_refs for p in self.timeline), max(p.cached for p in self.timeline), 1) * 1.08)
        ax.tick_params(labelsize=FONT)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=FONT, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
