"""pool_figure: a still picture of the block pool (matplotlib), for notebooks and docs.

The live monitor is an anywidget, which a repository page or a PDF export cannot run; a figure of a
`pool_snapshot()` can be saved with the notebook. Colours are read from the widget's own module
(`static/blockmap.js`), so the picture and the live map always agree on what a colour means.
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

STATIC = Path(__file__).resolve().parent / "static"
ORDER = ("free", "cached", "used", "shared", "swapped", "speculative")


@lru_cache(maxsize=1)
def state_colours() -> dict[str, tuple[float, float, float]]:
    """The monitor's `COLORS` table from blockmap.js, as matplotlib RGB triples."""
    source = (STATIC / "blockmap.js").read_text()
    table = re.search(r"export const COLORS = \{(.*?)\};", source, re.S)
    if table is None:
        raise RuntimeError("blockmap.js has no `export const COLORS = {...}` table")
    return {name: (int(r) / 255, int(g) / 255, int(b) / 255)
            for name, r, g, b in re.findall(r"(\w+): \[(\d+), (\d+), (\d+)\]", table.group(1))}


def pool_figure(snapshot: dict, title: str | None = None, columns: int = 32, ax=None):
    """Draw `snapshot` (from `engine.pool_snapshot()`): one square per block, coloured by state,
    shared blocks marked with their ref count. Returns the matplotlib Figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    if columns < 1:
        raise ValueError(f"columns={columns}: give at least 1 block per row")
    states, refs = snapshot["states"], snapshot["ref_counts"]
    colours = state_colours()
    rows = -(-len(states) // columns)
    if ax is None:
        _, ax = plt.subplots(figsize=(min(12, 0.3 * columns + 1), 0.3 * rows + 1.1))
    for i, (state, ref) in enumerate(zip(states, refs)):
        x, y = i % columns, rows - 1 - i // columns
        ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, color=colours.get(state, (0.4, 0.4, 0.4))))
        if state == "shared":
            ax.text(x + 0.5, y + 0.5, str(ref), ha="center", va="center", fontsize=6, color="white")
    ax.set(xlim=(0, columns), ylim=(0, rows), aspect="equal", xticks=[], yticks=[])
    for side in ax.spines.values():
        side.set_visible(False)
    present = [s for s in ORDER if s in states] + sorted(set(states) - set(ORDER))
    counts = {s: states.count(s) for s in present}
    ax.legend(handles=[Patch(color=colours.get(s, (0.4, 0.4, 0.4)), label=f"{s} {counts[s]}") for s in present],
              loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=len(present), fontsize=7, frameon=False)
    ax.set_title(title or f"{len(states)} blocks x {snapshot['block_size']} tokens", fontsize=9)
    return ax.figure
