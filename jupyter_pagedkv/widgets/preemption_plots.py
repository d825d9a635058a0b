"""preemption_plots: notebook 05's figures, drawn from plain numbers so a test can render them.

Two pictures. The pool over one real run per preemption mode: blocks held against the pool's
size, and requests running or preempted. And a simulated sweep of the host link's bandwidth that
shows where swapping beats recomputing and where it loses: a swap moves every preempted block over
the link twice, a recompute runs the preempted tokens through the model again, so which is cheaper
depends on link bandwidth against compute, not on the workload. Both take numbers, not engines or
simulators (widgets sit below `sim` in the layering).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

from .pool_figure import FONT

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from .pool_recorder import PoolPoint

MODE_COLOURS = {"recompute": "#d9552b", "swap": "#2a7ab9"}
POOL_COLOURS = ("#1f2937", "#7c3aed", "#0f766e")     # apart from the modes' colours


@dataclass(frozen=True)
class CrossoverSweep:
    """Tail latencies (s) of one simulated workload, per pool size and workload seed: recompute
    once (it never uses the link), swap once per host-link bandwidth."""

    bandwidths_gbps: tuple[float, ...]          # per GPU, ascending
    recompute_s: dict[str, list[float]]         # pool label -> [seed]
    swap_s: dict[str, list[list[float]]]        # pool label -> [seed][bandwidth]
    tail_name: str = "P99"

    def ratios(self, pool: str) -> np.ndarray:
        """swap / recompute tail latency, seeds x bandwidths (below 1: swap is faster)."""
        return np.asarray(self.swap_s[pool], float) / np.asarray(self.recompute_s[pool], float)[:, None]

    def crossover(self, pool: str) -> float | None:
        """The bandwidth where the median ratio crosses 1, interpolated on a log scale; None if
        one mode wins everywhere in the sweep."""
        r = np.median(self.ratios(pool), axis=0)
        x = np.log(np.asarray(self.bandwidths_gbps, float))
        for i in range(len(r) - 1):
            if (r[i] - 1) * (r[i + 1] - 1) <= 0 and r[i] != r[i + 1]:
                return float(np.exp(x[i] + (1 - r[i]) / (r[i + 1] - r[i]) * (x[i + 1] - x[i])))
        return None


def _series(points: Sequence[PoolPoint], name: str) -> list[float]:
    """One field of every point, in order: the y values of one line."""
    return [getattr(p, name) for p in points]


def _style(ax) -> None:
    ax.tick_params(labelsize=FONT + 1)
    ax.grid(alpha=0.3)


def _legend_below(ax, ncol: int = 3, offset: float = -0.28) -> None:
    """Legends sit under the axes, so they can cover no data."""
    ax.legend(fontsize=FONT + 1, loc="upper center", bbox_to_anchor=(0.5, offset), ncol=ncol, frameon=False)


def pool_timeline_figure(timelines: Mapping[str, Sequence[PoolPoint]], pool_blocks: int,
                         block_size: int = 16, titles: Mapping[str, str] | None = None) -> Figure:
    """One column per preemption mode: blocks held against the pool's size (top), requests
    running and preempted-not-yet-resumed (bottom), over the run's wall-clock time."""
    import matplotlib.pyplot as plt

    modes = list(timelines)
    fig, axes = plt.subplots(2, len(modes), figsize=(5.2 * len(modes), 5.4), sharey="row", squeeze=False)
    for col, mode in enumerate(modes):
        points = timelines[mode]
        t = _series(points, "t")
        top, bottom = axes[0, col], axes[1, col]
        top.step(t, _series(points, "used"), where="post", color="#16a34a", lw=1.6, label="blocks held")
        top.axhline(pool_blocks, color="grey", ls=":", lw=1.2, label=f"pool size ({pool_blocks} blocks)")
        top.set_ylim(0, pool_blocks * 1.15)
        top.set_title((titles or {}).get(mode, mode), fontsize=FONT + 2)
        bottom.step(t, _series(points, "running"), where="post", color="#2a7ab9", lw=1.6, label="running")
        bottom.step(t, _series(points, "preempted"), where="post", color="#d9552b", lw=1.6,
                    label="preempted, not yet resumed")
        bottom.set_ylim(0, max(_series(points, "running") + [1]) + 1)
        top.set_ylabel(f"blocks ({block_size} tokens each)", fontsize=FONT + 1)
        bottom.set_ylabel("requests (count)", fontsize=FONT + 1)
        for ax in (top, bottom):
            ax.set_xlabel("time since the batch started (s)", fontsize=FONT + 1)
            _style(ax)
    for ax in axes[:, -1]:
        ax.legend(fontsize=FONT + 1, loc="center left", bbox_to_anchor=(1.02, 0.5), frameon=False)
    fig.tight_layout()
    return fig


def crossover_figure(sweep: CrossoverSweep, title: str | None = None,
                     marks: Mapping[str, float] | None = None) -> Figure:
    """Left: the tail latency of both modes against host-link bandwidth, for the first pool size.
    Right: their ratio for every pool size. Points are medians over workload seeds, bars their
    range; `marks` names bandwidths to draw as vertical lines (real links, say)."""
    import matplotlib.pyplot as plt

    x = np.asarray(sweep.bandwidths_gbps, float)
    pools = list(sweep.recompute_s)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))

    first = pools[0]
    rec = np.asarray(sweep.recompute_s[first], float)
    left.fill_between(x, rec.min(), rec.max(), color=MODE_COLOURS["recompute"], alpha=0.15, lw=0)
    left.plot(x, np.full_like(x, np.median(rec)), color=MODE_COLOURS["recompute"], lw=1.6,
              label="recompute: no link traffic (band: seed range)")
    swap = np.asarray(sweep.swap_s[first], float)
    med = np.median(swap, axis=0)
    left.errorbar(x, med, yerr=[med - swap.min(axis=0), swap.max(axis=0) - med], color=MODE_COLOURS["swap"],
                  marker="o", ms=4, lw=1.6, capsize=3, label="swap (bars: seed range)")
    left.set_ylabel(f"end-to-end {sweep.tail_name} latency (s)", fontsize=FONT + 1)
    left.set_title(f"pool: {first}", fontsize=FONT + 2)

    for pool, colour in zip(pools, POOL_COLOURS):
        r = sweep.ratios(pool)
        med = np.median(r, axis=0)
        right.errorbar(x, med, yerr=[med - r.min(axis=0), r.max(axis=0) - med], color=colour, marker="o",
                       ms=4, lw=1.6, capsize=3, label=f"pool: {pool}")
    right.axhline(1.0, color="black", lw=0.9)
    right.set_ylabel(f"swap {sweep.tail_name} / recompute {sweep.tail_name}", fontsize=FONT + 1)
    right.set_title("below 1: swap is faster; above 1: recompute is", fontsize=FONT + 2)

    for ax in (left, right):
        for i, (name, gbps) in enumerate((marks or {}).items()):
            ax.axvline(gbps, color="grey", ls=(0, (1, 1 + 2 * i)), lw=1.2, label=f"{name} ({gbps:g} GB/s)")
        ax.set_xscale("log")
        ax.set_xticks(x, [f"{v:g}" for v in x])
        ax.minorticks_off()
        ax.set_xlabel("host-link bandwidth per GPU (GB/s, log scale)", fontsize=FONT + 1)
        _style(ax)
        _legend_below(ax, ncol=2, offset=-0.2)
    if title:
        fig.suptitle(title, fontsize=FONT + 3)
    fig.tight_layout()
    return fig
