"""The rate sweep's reading, paged against contiguous (`bench tail`, notebook 04's numbers): the
rate each allocator sustains under a tail bound, interpolated between swept rates, the printed
report and the four-panel figure. Pure functions of `RunSummary` rows, simulated or measured."""
from __future__ import annotations

import math

from .summary import RunSummary, capacity_at


def tail_of(summary: RunSummary, metric: str) -> float:
    """P99 of `metric` ("latency": end to end, or "ttft"), or the maximum for a run of fewer than
    20 requests, where a 99th percentile is the maximum anyway (`RunSummary.tail_name`)."""
    return summary.latency_tail() if metric == "latency" else summary.ttft_tail()


def max_rate_under(rows: list[RunSummary], rates: list[float], bound: float, metric: str = "latency") -> float:
    """The rate at which the tail of `metric` reaches `bound` seconds, interpolated between the
    swept rates on either side (`capacity_at`); 0 if even the lowest rate is over the bound, the
    highest swept rate if none is."""
    return capacity_at(rates, [tail_of(s, metric) for s in rows], bound) or 0.0


def rate_ratio(paged: float, contiguous: float) -> float:
    return paged / contiguous if contiguous else (math.inf if paged else math.nan)


def report(scale: dict) -> dict:
    runs, rates = scale["runs"], scale["rates"]
    util = {a: sum(s.kv_utilisation for s in rs) / len(rs) for a, rs in runs.items()}
    conc = {a: max(s.max_concurrent for s in rs) for a, rs in runs.items()}
    rec, swp = scale["preempt"]["recompute"], scale["preempt"]["swap"]
    print(f"\n{scale['label']}:")
    print(f"  KV utilisation (mean over rates): paged {util['paged']:.1%}, contiguous {util['contiguous']:.1%}")
    print(f"  max concurrent requests: paged {conc['paged']}, contiguous {conc['contiguous']} "
          f"({conc['paged'] / max(1, conc['contiguous']):.1f}x)")
    out = {"utilisation": util, "max_concurrent": conc}
    for metric, key, what in (("latency", "bound", "end-to-end latency"), ("ttft", "ttft_bound", "TTFT")):
        bound = scale[key]
        paged = max_rate_under(runs["paged"], rates, bound, metric)
        contig = max_rate_under(runs["contiguous"], rates, bound, metric)
        ratio = rate_ratio(paged, contig)
        # A curve that never crosses the bound sustains at least the highest swept rate: say so,
        # rather than print a ratio the sweep cannot measure.
        never = {a: all(tail_of(s, metric) <= bound for s in runs[a]) for a in runs}
        shown = {a: (f">= {r:.2f}" if never[a] else f"{r:.2f}") for a, r in (("paged", paged), ("contiguous", contig))}
        verdict = ("both within the bound at every swept rate: sweep higher rates to tell them apart"
                   if never["paged"] and never["contiguous"] else
                   f">= {ratio:.1f}x (paged never crossed the bound)" if never["paged"] and math.isfinite(ratio) else
                   f"{ratio:.1f}x" if math.isfinite(ratio) else
                   "paged only: lower the rates to find contiguous's" if paged else
                   "neither: lower the rates or raise the bound")
        tail = runs["paged"][0].tail_name
        print(f"  rate at which {tail} {what} reaches {bound:g} s (interpolated between swept rates): "
              f"paged {shown['paged']} req/s, contiguous {shown['contiguous']} req/s -> {verdict}")
        out[metric] = {"bound_s": bound, "paged_max_rate": paged, "contiguous_max_rate": contig, "rate_ratio": ratio,
                       "paged_never_crossed": never["paged"], "contiguous_never_crossed": never["contiguous"]}
    print(f"  swap vs recompute at {scale['pressure_rate']:g} req/s: {swp.tail_name} latency "
          f"{swp.latency_tail():.2f} s vs {rec.latency_tail():.2f} s "
          f"({swp.latency_tail() / rec.latency_tail():.2f}x); preemptions {swp.num_preemptions} vs "
          f"{rec.num_preemptions}")
    out.update(swap_tail=swp.latency_tail(), recompute_tail=rec.latency_tail(), tail=swp.tail_name)
    return out


def tail_figure(scale: dict):
    """Four panels over the swept rates, paged against contiguous: end-to-end latency (tail and
    median), time to first token (tail), throughput and KV utilisation; each bound drawn, and the
    rate where a tail crosses it marked (interpolated). The tail is P99, or "max" for runs of
    fewer than 20 requests."""
    import matplotlib.pyplot as plt

    from ..widgets.comparison_figures import ALLOCATOR_COLOURS

    runs, rates = scale["runs"], scale["rates"]
    tail = runs["paged"][0].tail_name
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    for alloc, rs in runs.items():
        c = ALLOCATOR_COLOURS[alloc]
        axes[0].plot(rates, [s.latency_tail() for s in rs], "o-", ms=4, color=c, label=f"{alloc} {tail}")
        axes[0].plot(rates, [s.latency(50) for s in rs], "o--", ms=4, color=c, alpha=0.5, label=f"{alloc} median")
        axes[1].plot(rates, [s.ttft_tail() for s in rs], "o-", ms=4, color=c, label=f"{alloc} {tail}")
        axes[2].plot(rates, [s.throughput for s in rs], "o-", ms=4, color=c, label=alloc)
        axes[3].plot(rates, [100 * s.kv_utilisation for s in rs], "o-", ms=4, color=c, label=alloc)
    for ax, key, metric in ((axes[0], "bound", "latency"), (axes[1], "ttft_bound", "ttft")):
        bound = scale[key]
        ax.axhline(bound, color="grey", lw=0.8, ls=":", label=f"bound {bound:g} s")
        for alloc, rs in runs.items():
            cap = max_rate_under(rs, rates, bound, metric)
            if 0 < cap < max(rates):
                ax.axvline(cap, color=ALLOCATOR_COLOURS[alloc], lw=0.8, ls=":")
    axes[0].set(xlabel="request rate (requests/s)", ylabel="end-to-end latency (s)", yscale="log",
                title="latency vs load")
    axes[1].set(xlabel="request rate (requests/s)", ylabel="time to first token (s)", yscale="log",
                title="waiting for the first token")
    axes[2].set(xlabel="request rate (requests/s)", ylabel="generated tokens/s", title="throughput")
    axes[3].set(xlabel="request rate (requests/s)", ylabel="tokens stored / slots reserved (%)", ylim=(0, 105),
                title="KV utilisation")
    style_panels(axes)
    fig.suptitle(scale["label"] + ("" if tail == "P99" else f" (tail = max: fewer than 20 requests per run)"),
                 fontsize=10)
    fig.tight_layout()
    return fig


def style_panels(axes) -> None:
    """The benchmark plots' common look: a light grid, FONT-sized text, the legend below the axes
    (never on the data), and log axes ticked at 1-2-5 in plain numbers (no colliding
    "3x10^2 4x10^2" minor labels)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    from ..widgets.paging_figures import FONT
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=FONT)
        ax.xaxis.label.set_size(FONT + 1)
        ax.yaxis.label.set_size(FONT + 1)
        ax.title.set_size(FONT + 2)
        ax.legend(fontsize=FONT, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
        if ax.get_yscale() == "log":
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))   # 1 2 5 10 20 50 ...
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
