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


def _rgb(r: str, g: str, b: str) -> tuple[float, float, float]:
    return int(r) / 255, int(g) / 255, int(b) / 255


@lru_cache(maxsize=1)
def state_colours() -> dict[str, tuple[float, float, float]]:
    """The monitor's `COLORS` table from blockmap.js, as matplotlib RGB triples."""
    source = (STATIC / "blockmap.js").read_text()
    table = re.search(r"export const COLORS = \{(.*?)\};", source, re.S)
    if table is None:
        raise RuntimeError("blockmap.js has no `export const COLORS = {...}` table")
    return {name: _rgb(r, g, b) for name, r, g, b in re.findall(r"(\w+): \[(\d+), (\d+), (\d+)\]", table.group(1))}


@lru_cache(maxsize=1)
def cue_colours() -> dict[str, tuple[float, float, float]]:
    """The second cues of blockmap.js (`MARK` on shared blocks, `STRIPE` on swapped ones), so a
    figure tells those states apart without hue, as the live map does."""
    source = (STATIC / "blockmap.js").read_text()
    found = dict((name, _rgb(r, g, b)) for name, r, g, b in
                 re.findall(r"export const (MARK|STRIPE) = \[(\d+), (\d+), (\d+)\];", source))
    if set(found) != {"MARK", "STRIPE"}:
        raise RuntimeError("blockmap.js lacks `export const MARK = [r, g, b];` or `STRIPE`")
    return found


SWAPPED_HATCH = "////"


class _MarkedSquare:
    """Legend handler: the square of a shared block with its corner mark, as the map draws it."""

    def legend_artist(self, legend, orig_handle, fontsize, handlebox):
        from matplotlib.patches import Polygon, Rectangle

        x, y = handlebox.xdescent, handlebox.ydescent
        w = h = min(handlebox.width, handlebox.height)
        square = Rectangle((x, y), w, h, facecolor=orig_handle.get_facecolor(), lw=0,
                           transform=handlebox.get_transform())
        corner = Polygon([(x, y + h), (x + 0.45 * w, y + h), (x, y + 0.55 * h)], closed=True, lw=0,
                         facecolor=cue_colours()["MARK"], transform=handlebox.get_transform())
        handlebox.add_artist(square)
        handlebox.add_artist(corner)
        return square


def pool_figure(snapshot: dict, title: str | None = None, columns: int = 32, ax=None):
    """Draw `snapshot` (from `engine.pool_snapshot()`): one square per block, coloured by state.
    Shared blocks also get the live map's corner mark and their ref count, swapped blocks its
    stripes (a hatch), so neither rests on colour alone. Returns the matplotlib Figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Polygon, Rectangle

    if columns < 1:
        raise ValueError(f"columns={columns}: give at least 1 block per row")
    states, refs = snapshot["states"], snapshot["ref_counts"]
    colours, cues = state_colours(), cue_colours()
    rows = -(-len(states) // columns)
    if ax is None:
        _, ax = plt.subplots(figsize=(min(12, 0.3 * columns + 1), 0.3 * rows + 1.1))
    for i, (state, ref) in enumerate(zip(states, refs)):
        x, y = i % columns, rows - 1 - i // columns
        colour = colours.get(state, (0.4, 0.4, 0.4))
        if state == "swapped":
            ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, facecolor=colour, edgecolor=cues["STRIPE"],
                                   hatch=SWAPPED_HATCH, lw=0))
        else:
            ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, color=colour))
        if state == "shared":
            ax.add_patch(Polygon([(x + 0.05, y + 0.95), (x + 0.45, y + 0.95), (x + 0.05, y + 0.55)],
                                 closed=True, lw=0, facecolor=cues["MARK"], gid="shared-mark"))
            ax.text(x + 0.58, y + 0.42, str(ref), ha="center", va="center", fontsize=8, color=cues["MARK"])
    ax.set(xlim=(0, columns), ylim=(0, rows), aspect="equal", xticks=[], yticks=[])
    for side in ax.spines.values():
        side.set_visible(False)
    present = [s for s in ORDER if s in states] + sorted(set(states) - set(ORDER))
    counts = {s: states.count(s) for s in present}
    handles = []
    for s in present:
        colour = colours.get(s, (0.4, 0.4, 0.4))
        if s == "swapped":
            handles.append(Patch(facecolor=colour, edgecolor=cues["STRIPE"], hatch=SWAPPED_HATCH, lw=0,
                                 label=f"{s} {counts[s]}"))
        else:
            handles.append(Patch(color=colour, label=f"{s} {counts[s]}"))
    handler_map = {h: _MarkedSquare() for h, s in zip(handles, present) if s == "shared"}
    ax.legend(handles=handles, handler_map=handler_map, loc="upper center", bbox_to_anchor=(0.5, 0.0),
              ncol=len(present), fontsize=8, frameon=False)
    ax.set_title(title or f"{len(states)} blocks x {snapshot['block_size']} tokens", fontsize=9)
    return ax.figure
