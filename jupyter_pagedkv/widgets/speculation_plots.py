"""speculation_plots: still pictures of speculative decoding, for notebook 06 and the docs.

Rollback is easy to state as a count and hard to believe from one: `rollback_figure` draws, per
forward pass, the guesses kept and the guesses rolled back, so a reader sees where drafts paid off
and where they were thrown away. `speed_figure` compares plain and speculative decoding from
repeated timings, with every run drawn and the spread as error bars: one CPU timing per mode can
not carry a speed-up by itself.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

from .pool_figure import FONT, state_colours

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ROLLED_BACK_HATCH = "xxx"                  # rolled-back slots: told apart from kept ones without hue
PLAIN, NGRAM = (0.61, 0.64, 0.69), (0.0, 0.45, 0.70)   # grey and Okabe-Ito blue


@dataclass(frozen=True)
class SpecStep:
    """What one engine step did with one request's drafts (from `pool_snapshot()["speculative"]`)."""

    drafted: int            # draft slots written for guesses
    rolled_back: int        # of them rejected and dropped from the block table
    freed_blocks: int       # blocks emptied by the rollback and returned to the pool
    tokens_out: int         # tokens the step produced: accepted guesses + the model's own token

    @property
    def accepted(self) -> int:
        return self.drafted - self.rolled_back


def rollback_figure(traces: Mapping[str, Sequence[SpecStep]], title: str | None = None) -> Figure:
    """One panel per traced request: per forward pass, the tokens it produced (the model's own
    token, plus the guesses verification accepted) with the guesses rolled back stacked on top,
    hatched, and a mark where a rollback freed a block."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if not traces:
        raise ValueError("no traces to draw: pass {name: [SpecStep, ...]}")
    fig, axes = plt.subplots(len(traces), 1, figsize=(9, 1.9 * len(traces) + 1.3), sharey=True, squeeze=False)
    top = max(s.tokens_out + s.rolled_back for steps in traces.values() for s in steps)
    colours = state_colours()
    for ax, (name, steps) in zip(axes[:, 0], traces.items()):
        x = range(len(steps))
        own = [min(1, s.tokens_out) for s in steps]
        accepted = [s.tokens_out - o for s, o in zip(steps, own)]
        ax.bar(x, own, 0.8, color=PLAIN, label="the model's own token")
        ax.bar(x, accepted, 0.8, bottom=own, color=colours["used"], label="accepted guesses (kept)")
        ax.bar(x, [s.rolled_back for s in steps], 0.8, bottom=[s.tokens_out for s in steps],
               facecolor=colours["speculative"], edgecolor=(0.35, 0.3, 0.0), hatch=ROLLED_BACK_HATCH, lw=0.5,
               label="rejected guesses (slots rolled back)")
        freed = [(i, s.tokens_out + s.rolled_back) for i, s in enumerate(steps) if s.freed_blocks]
        if freed:
            ax.scatter([i for i, _ in freed], [h + 0.6 for _, h in freed], marker="v", s=30, color="black",
                       zorder=3, label="rollback freed a block")
        made, passes = sum(s.tokens_out for s in steps), len(steps)
        ax.set_title(f"{name}: {made} tokens in {passes} forward passes, "
                     f"{sum(s.rolled_back for s in steps)} guessed slots rolled back", fontsize=9, loc="left")
        ax.set_ylabel("tokens per pass", fontsize=FONT + 1)
        ax.set_xlabel("forward pass (engine step; 0 is the prefill)", fontsize=FONT + 1)
        ax.set_ylim(0, top + 1.6)
        ax.set_xlim(-0.7, max(len(s) for s in traces.values()) - 0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3, axis="y")
        ax.tick_params(labelsize=FONT)
    handles: dict[str, object] = {}
    for ax in axes[:, 0]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    order = sorted(handles, key=lambda label: label.startswith("rollback freed"))   # the bars first
    axes[-1, 0].legend([handles[k] for k in order], order, loc="upper center", bbox_to_anchor=(0.5, -0.38),
                       ncol=2, fontsize=FONT, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max): what a handful of timings can say, with no percentile pretended."""
    return statistics.median(values), min(values), max(values)


def speed_figure(runs: Mapping[str, Mapping[str, Sequence[float]]], title: str | None = None) -> Figure:
    """`runs[task][mode]` are tokens/s of repeated runs ("plain" and "ngram"): a bar at the median,
    an error bar from min to max, and every run as a dot, so the spread behind a ratio is visible."""
    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("no timings to draw: pass {task: {'plain': [...], 'ngram': [...]}}")
    fig, ax = plt.subplots(figsize=(6, 3.6))
    modes = (("plain", PLAIN, "plain decoding"), ("ngram", NGRAM, "ngram speculation"))
    counts = set()
    for k, (mode, colour, label) in enumerate(modes):
        xs = [i + (k - 0.5) * 0.4 for i in range(len(runs))]
        stats = [spread(runs[task][mode]) for task in runs]
        counts |= {len(runs[task][mode]) for task in runs}
        med = [m for m, _, _ in stats]
        ax.bar(xs, med, 0.36, color=colour, label=f"{label}: median")
        ax.errorbar(xs, med, yerr=[[m - lo for m, lo, _ in stats], [hi - m for m, _, hi in stats]], fmt="none",
                    ecolor="black", capsize=4, lw=1, label="min to max of the runs" if k else None)
        for x, task in zip(xs, runs):
            ax.scatter([x] * len(runs[task][mode]), runs[task][mode], s=12, color="white", edgecolor="black",
                       lw=0.7, zorder=3, label="one run" if k == 0 and task == next(iter(runs)) else None)
    n = "/".join(str(c) for c in sorted(counts))
    ax.set_xticks(range(len(runs)), list(runs))
    ax.set_xlabel("request (greedy, one at a time)", fontsize=FONT + 1)
    ax.set_ylabel(f"generated tokens/s ({n} runs each)", fontsize=FONT + 1)
    ax.set_ylim(0, max(max(v) for modes_ in runs.values() for v in modes_.values()) * 1.12)
    ax.grid(alpha=0.3, axis="y")
    ax.tick_params(labelsize=FONT)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=FONT, frameon=False)
    ax.set_title(title or "speed on this machine", fontsize=9)
    fig.tight_layout()
    return fig
