"""The replay's one table and one figure, every figure read off `RunSummary` (what `bench tail`
prints), `tenant_figures` (what `bench tenants` prints) and `WasteBreakdown` (sim/waste.py), so a
replay and a benchmark of the same workload print the same numbers.

Columns (one row per arm): where it ran and the clock's unit (engine steps, or simulated seconds),
requests, TTFT p50 and tail, end-to-end p50 and tail (tail = P99, or max below 20 requests),
output tokens per unit of time, KV utilisation (tokens stored / slots held, per step), max
concurrent, preemptions, the pool's slots split four ways (stored, reservation, internal, external
waste: sequences that share no block only), Jain's fairness index over the tenants, and per tenant
its TTFT tail and tokens per unit of time.
"""
from __future__ import annotations

import math

from .replay_run import ArmResult
from .waste import CATEGORIES

WASTE = CATEGORIES[:4]     # stored, reservation, internal, external (free is the rest)


def rows(results: list[ArmResult]) -> list[dict]:
    """One dict per arm, the table's columns by name."""
    out = []
    for r in results:
        s, u = r.summary, r.clock
        tail = s.tail_name
        row = {"arm": r.label, "where": r.where, "clock": u, "requests": len(s.requests),
               f"TTFT p50 ({u})": s.ttft(50), f"TTFT {tail} ({u})": s.ttft_tail(),
               f"e2e p50 ({u})": s.latency(50), f"e2e {tail} ({u})": s.latency_tail(),
               f"tokens/{u}": s.throughput, "KV util": s.kv_utilisation, "max concurrent": s.max_concurrent,
               "preemptions": s.num_preemptions}
        for c in WASTE:
            row[c] = r.waste.fraction(c) if r.waste is not None else math.nan
        row["Jain"] = r.jain()
        for name, f in r.tenants().items():
            row[f"{name} TTFT {f.tail_name} ({u})"] = f.ttft_tail_s
            row[f"{name} tokens/{u}"] = f.tokens_per_s
        out.append(row)
    return out


def table(results: list[ArmResult]):
    """The rows as a pandas DataFrame indexed by arm and where it ran."""
    import pandas as pd

    return pd.DataFrame(rows(results)).set_index(["arm", "where"])


def text(results: list[ArmResult]) -> str:
    """The table as fixed-width text (the magic prints it; no pandas needed)."""
    data = rows(results)
    cols = list(dict.fromkeys(k for row in data for k in row))
    cell = lambda v: "-" if isinstance(v, float) and math.isnan(v) else f"{v:.3g}" if isinstance(v, float) else str(v)
    shown = [[cell(row.get(c, math.nan)) for c in cols] for row in data]
    width = [max(len(c), *(len(r[i]) for r in shown)) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(vals, width)))
    return "\n".join([line(cols)] + [line(r) for r in shown])


def figure(results: list[ArmResult], title: str = ""):
    """Tails, throughput and the pool's split per arm in three panels, then each arm's block map at
    the same step (engine arms that took a snapshot)."""
    import matplotlib.pyplot as plt

    from ..widgets.pool_figure import pool_figure
    from .tail_sweep import style_panels

    maps = [r for r in results if r.snapshot is not None]
    cols = max(3, len(maps))
    fig, axes = plt.subplots(2 if maps else 1, cols, figsize=(4.6 * cols, 8.4 if maps else 4.4), squeeze=False)
    names = [f"{r.label}\n({r.where})" for r in results]
    x = range(len(results))
    tail = results[0].summary.tail_name
    unit = results[0].clock if len({r.clock for r in results}) == 1 else "unit"
    ax = axes[0][0]
    ax.bar([i - 0.2 for i in x], [r.summary.ttft_tail() for r in results], 0.4, label=f"TTFT {tail}", color="#0072B2")
    ax.bar([i + 0.2 for i in x], [r.summary.latency_tail() for r in results], 0.4, label=f"e2e {tail}", color="#D55E00")
    ax.set(ylabel=unit, title=f"tails ({tail})")
    ax = axes[0][1]
    ax.bar(list(x), [r.summary.throughput for r in results], 0.6, color="#009E73", label=f"tokens/{unit}")
    ax.set(ylabel=f"output tokens per {unit}", title="throughput")
    ax = axes[0][2]
    bottom = [0.0] * len(results)
    for c, colour in zip(WASTE, ("#0072B2", "#E69F00", "#CC79A7", "#D55E00")):
        vals = [100 * r.waste.fraction(c) if r.waste is not None else 0.0 for r in results]
        ax.bar(list(x), vals, 0.6, bottom=bottom, color=colour, label=c)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set(ylabel="% of the pool's slots (mean over steps)", title="where the pool went", ylim=(0, 105))
    for ax in axes[0][:3]:
        ax.set_xticks(list(x), names, fontsize=7)
    style_panels(axes[0][:3])
    for ax in axes[0][3:]:
        ax.axis("off")
    if maps:
        for ax, r in zip(axes[1], maps):
            pool_figure(r.snapshot, title=f"{r.label}: after step {r.snapshot_step}", columns=16, ax=ax)
        for ax in axes[1][len(maps):]:
            ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
