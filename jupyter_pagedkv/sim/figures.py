"""figures: run-long measurements of the two allocators, drawn for notebook 04 and the docs.

* `waste_figure`: one stacked bar per allocator, the pool's slots split into stored, reservation,
  internal, external and free (`WasteMeter`);
* `sweep_figure`: a latency tail against request rate for each allocator, with the rate each
  sustains under a bound read off by interpolation (`capacity_at`), not from the sweep's ends.

The moment-by-moment picture of the same runs is `widgets.comparison_figures.arena_figure`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

from ..widgets.comparison_figures import ALLOCATOR_COLOURS, OWNER_COLOURS
from ..widgets.paging_figures import FONT, INK
from .summary import capacity_at

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from .waste import WasteBreakdown

WASTE_STYLE = {            # category: (label, colour, hatch)
    "stored": ("tokens stored", "#009E73", None),
    "reservation": ("reservation waste (filled later)", "#E69F00", None),
    "internal": ("internal waste (never filled)", "#D55E00", "xx"),
    "external": ("external waste (free, unusable)", "#CC79A7", "\\\\"),
    "free": ("free", "#DDDDDD", None),
}


def waste_figure(breakdowns: Sequence[WasteBreakdown], title: str | None = None) -> Figure:
    """A horizontal stacked bar per allocator: the pool's token slots, averaged over the run's
    engine steps, split into stored / reservation / internal / external / free, with each share
    written on its segment when it is wide enough to hold the text."""
    import matplotlib.pyplot as plt

    if not breakdowns:
        raise ValueError("no breakdowns: pass WasteMeter(...).breakdown() of each run")
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(breakdowns) + 1.5))
    for y, b in enumerate(breakdowns):
        left = 0.0
        for category, (label, colour, hatch) in WASTE_STYLE.items():
            share = 100 * b.fraction(category)
            ax.barh(y, share, left=left, height=0.6, color=colour, hatch=hatch, edgecolor="white", lw=0.8,
                    label=label if y == 0 else None, gid=f"{b.label}:{category}")
            if share >= 6:
                ax.text(left + share / 2, y, f"{share:.0f}%", ha="center", va="center", fontsize=FONT, color=INK,
                        bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none", alpha=0.8))
            left += share
    ax.set(xlim=(0, 100), ylim=(len(breakdowns) - 0.5, -0.5), yticks=range(len(breakdowns)))
    ax.set_yticklabels([b.label for b in breakdowns], fontsize=FONT)
    ax.set_xlabel("share of the pool's token slots, mean over the run's engine steps (%)", fontsize=FONT)
    ax.set_ylabel("allocator", fontsize=FONT)
    ax.tick_params(labelsize=FONT)
    fig.legend(loc="lower center", ncol=3, fontsize=FONT, frameon=False)
    if title:
        ax.set_title(title, fontsize=9, loc="left")
    fig.tight_layout(rect=(0, 0.5 / fig.get_figheight(), 1, 1))
    return fig


def sweep_figure(rates: Sequence[float], series: Mapping[str, Sequence[float]], bound: float,
                 ylabel: str, title: str = "") -> Figure:
    """`series[allocator]` (a latency in seconds) against request rate, the bound as a dashed
    line, and where each allocator's curve crosses it marked and labelled with the rate."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for k, (name, values) in enumerate(series.items()):
        colour = ALLOCATOR_COLOURS.get(name, OWNER_COLOURS[k % len(OWNER_COLOURS)])
        ax.plot(rates, values, "o-", ms=3, color=colour, label=name)
        cap = capacity_at(rates, values, bound)
        if cap is not None and cap < max(rates):
            ax.plot([cap, cap], [0, bound], color=colour, lw=1, ls=":")
            # Below the bound, right of the crossing: curves that cross it rise above the line there.
            ax.annotate(f"{cap:.2f} req/s", (cap, bound), xytext=(4, -6), textcoords="offset points",
                        fontsize=FONT, color=colour, va="top",
                        bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.9))
    ax.axhline(bound, color=INK, lw=0.8, ls="--", label=f"bound: {bound:g} s")
    ax.set_xlabel("request rate (requests/s)", fontsize=FONT)
    ax.set_ylabel(ylabel, fontsize=FONT)
    ax.set_ylim(bottom=0)
    ax.tick_params(labelsize=FONT)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=FONT, frameon=False)
    if title:
        ax.set_title(title, fontsize=9, loc="left")
    fig.tight_layout()
    return fig
