"""check_figure: the rules every committed figure keeps, checked on the drawn figure.

A figure teaches only if it can be read: every axes that plots data names both axes (with a unit
where the quantity has one: the caller lists the labels it expects), no text is smaller than 8 pt
at the figure's own size, no two tick labels of one axis overlap, and no legend covers a data
point, a bar or a line vertex. Checked on the rendered figure (Agg), so what is measured is what
a reader sees.
"""
from __future__ import annotations

from typing import Iterable

MIN_POINTS = 8.0


def _data_boxes(ax):
    """Display-space boxes of the axes' data: each line vertex as a point, each patch's extent."""
    import numpy as np
    from matplotlib.transforms import Bbox

    boxes = []
    for line in ax.get_lines():
        if not line.get_visible() or line.get_label() == "_nolegend_" and not len(line.get_xydata()):
            continue
        xy = line.get_transform().transform(np.asarray(line.get_xydata(), float))
        boxes += [Bbox.from_extents(x, y, x, y) for x, y in xy if np.isfinite(x) and np.isfinite(y)]
    for patch in ax.patches:
        if patch.get_visible() and patch.get_alpha() != 0:
            boxes.append(patch.get_window_extent())
    for coll in ax.collections:
        if coll.get_visible():
            offsets = coll.get_offsets()
            if len(offsets) and coll.get_offset_transform() is not None:
                pts = coll.get_offset_transform().transform(np.asarray(offsets, float))
                boxes += [Bbox.from_extents(x, y, x, y) for x, y in pts if np.isfinite(x) and np.isfinite(y)]
    return boxes


def _overlap(a, b, pad: float = 0.5) -> bool:
    return (a.x0 + pad < b.x1 and b.x0 + pad < a.x1 and a.y0 + pad < b.y1 and b.y0 + pad < a.y1)


def check_figure(fig, expect_labels: Iterable[str] = (), min_points: float = MIN_POINTS,
                 legend_may_cover: bool = False) -> list[str]:
    """Assert the rules above on `fig`; `expect_labels` are substrings some axis label must hold
    (units, say "(s)"). Returns every axis label seen, for further checks."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    if not hasattr(fig.canvas, "get_renderer"):      # a bare matplotlib.figure.Figure
        FigureCanvasAgg(fig)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    problems: list[str] = []
    for text in fig.findobj(Text):
        if text.get_visible() and text.get_text().strip() and text.get_fontsize() < min_points - 1e-6:
            problems.append(f"text {text.get_text()[:30]!r} is {text.get_fontsize():.1f} pt")
    labels: list[str] = []
    for ax in fig.axes:
        if not ax.axison or not ax.get_visible():
            continue
        has_data = bool(ax.get_lines() or ax.patches or ax.collections or ax.images)
        x, y = ax.get_xlabel(), ax.get_ylabel()
        labels += [x, y]
        if has_data and not (x.strip() and y.strip()):
            problems.append(f"axes {ax.get_title()[:30]!r}: x label {x!r}, y label {y!r}")
        for axis in (ax.xaxis, ax.yaxis):
            ticks = [t for t in axis.get_ticklabels() if t.get_visible() and t.get_text().strip()]
            boxes = [t.get_window_extent(renderer) for t in ticks]
            for i in range(len(boxes) - 1):
                for j in range(i + 1, len(boxes)):
                    if _overlap(boxes[i], boxes[j]):
                        problems.append(f"axes {ax.get_title()[:30]!r}: tick labels {ticks[i].get_text()!r} and "
                                        f"{ticks[j].get_text()!r} overlap")
        legend = ax.get_legend()
        if legend is not None and legend.get_visible() and not legend_may_cover:
            box = legend.get_window_extent(renderer)
            covered = [d for d in _data_boxes(ax) if _overlap(box, d, pad=0.0)]
            if covered:
                problems.append(f"axes {ax.get_title()[:30]!r}: its legend covers {len(covered)} data elements")
    for label in expect_labels:
        if not any(label in text for text in labels):
            problems.append(f"no axis label contains {label!r} (labels: {[t for t in labels if t]})")
    assert not problems, "; ".join(problems)
    return labels
