"""pool_figure: a still picture of the block pool (matplotlib), for notebooks and docs.

The live monitor is an anywidget, which a repository page or a PDF export cannot run; a figure of a
`pool_snapshot()` can be saved with the notebook. Colours are read from the widget's own palette
(`static/palette.js`, which `static/blockmap.js` imports), so the picture and the live map always
agree on what a colour means.
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

FONT = 8    # the smallest text any committed figure draws, in points (tests/figure_checks.py checks it)

STATIC = Path(__file__).resolve().parent / "static"
PALETTE = STATIC / "palette.js"           # the live monitor's colour tables
ORDER = ("free", "cached", "used", "shared", "swapped", "speculative")


def _rgb(r: str, g: str, b: str) -> tuple[float, float, float]:
    return int(r) / 255, int(g) / 255, int(b) / 255


@lru_cache(maxsize=1)
def state_colours() -> dict[str, tuple[float, float, float]]:
    """The monitor's `COLORS` table from palette.js, as matplotlib RGB triples."""
    source = PALETTE.read_text()
    table = re.search(r"export const COLORS = \{(.*?)\};", source, re.S)
    if table is None:
        raise RuntimeError("palette.js has no `export const COLORS = {...}` table")
    return {name: _rgb(r, g, b) for name, r, g, b in re.findall(r"(\w+): \[(\d+), (\d+), (\d+)\]", table.group(1))}


@lru_cache(maxsize=1)
def cue_colours() -> dict[str, tuple[float, float, float]]:
    """The second cues of palette.js (`MARK` on shared blocks, `STRIPE` on swapped ones), so a
    figure tells those states apart without hue, as the live map does."""
    source = PALETTE.read_text()
    found = dict((name, _rgb(r, g, b)) for name, r, g, b in
                 re.findall(r"export const (MARK|STRIPE) = \[(\d+), (\d+), (\d+)\];", source))
    if set(found) != {"MARK", "STRIPE"}:
        raise RuntimeError("palette.js lacks `export const MARK = [r, g, b];` or `STRIPE`")
    return found


@lru_cache(maxsize=1)
def tenant_colours() -> list[tuple[float, float, float]]:
    """palette.js's `TENANT_COLORS`, in the order tenants are listed (by name, unnamed last)."""
    source = PALETTE.read_text()
    table = re.search(r"export const TENANT_COLORS = \[(.*?)\];", source, re.S)
    if table is None:
        raise RuntimeError("palette.js has no `export const TENANT_COLORS = [...]` table")
    return [_rgb(r, g, b) for r, g, b in re.findall(r"\[(\d+), (\d+), (\d+)\]", table.group(1))]


def tenant_order(snapshot: dict) -> list[str]:
    """The tenants holding blocks in `snapshot`, as the monitor lists them: by name, unnamed last."""
    names = {t for ts in snapshot.get("tenants", {}).values() for t in ts}
    return sorted(names, key=lambda n: (n == "(unnamed)", n))


def _tenant_colour(i: int) -> tuple[float, float, float]:
    colours = tenant_colours()
    if i < len(colours):
        return colours[i]
    import matplotlib
    return matplotlib.colormaps["tab10"](i % 10)[:3]


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


def _label_grid(ax, columns: int, rows: int, most: int = 12) -> None:
    """Name the map's axes so a block can be found by id: each row by its first block id (left),
    each column by its offset (top, above the squares; the legend sits below). At most `most`
    labels per axis, so they never crowd."""
    row_step, col_step = -(-rows // most), -(-columns // most)
    if col_step > 1:
        col_step = next(s for s in (2, 4, 5, 8, 10, 16, 20, 25, 32, 50, 64, 100) + (columns,) if s >= col_step)
    ax.set_yticks([rows - 1 - r + 0.5 for r in range(0, rows, row_step)],
                  [str(r * columns) for r in range(0, rows, row_step)])
    ax.set_xticks([c + 0.5 for c in range(0, columns, col_step)], [f"+{c}" for c in range(0, columns, col_step)])
    ax.xaxis.tick_top()
    ax.xaxis.set_label_position("top")
    ax.tick_params(labelsize=FONT, length=0, pad=2)
    ax.set_xlabel("column: block id = row's first id + column", fontsize=FONT)
    ax.set_ylabel("row's first block id", fontsize=FONT)
    for side in ax.spines.values():
        side.set_visible(False)


def pool_figure(snapshot: dict, title: str | None = None, columns: int = 32, ax=None,
                color_by: str = "state"):
    """Draw `snapshot` (from `engine.pool_snapshot()`): one square per block, coloured by state.
    Shared blocks also get the live map's corner mark and their ref count, swapped blocks its
    stripes (a hatch), so neither rests on colour alone. `color_by="tenant"` colours held blocks
    by the tenant holding them, as the monitor's tenant mode (a block several tenants hold is
    split between the first two, corner to corner). Returns the matplotlib Figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Polygon, Rectangle

    if columns < 1:
        raise ValueError(f"columns={columns}: give at least 1 block per row")
    if color_by not in ("state", "tenant"):
        raise ValueError(f"color_by must be 'state' or 'tenant', got {color_by!r}")
    if color_by == "tenant":
        return _tenant_figure(snapshot, title, columns, ax)
    states, refs = snapshot["states"], snapshot["ref_counts"]
    colours, cues = state_colours(), cue_colours()
    rows = -(-len(states) // columns)
    alone = ax is None
    if alone:
        _, ax = plt.subplots(figsize=(max(4.5, min(12, 0.3 * columns + 1.6)), 0.3 * rows + 1.9))
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
            ax.text(x + 0.58, y + 0.42, str(ref), ha="center", va="center", fontsize=FONT, color=cues["MARK"])
    ax.set(xlim=(0, columns), ylim=(0, rows), aspect="equal")
    _label_grid(ax, columns, rows)
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
              ncol=len(present) if columns >= 12 else 3, fontsize=FONT, frameon=False)
    ax.set_title(title or f"{len(states)} blocks x {snapshot['block_size']} tokens", fontsize=9)
    if alone:
        ax.figure.tight_layout()
    return ax.figure


def _tenant_figure(snapshot: dict, title: str | None, columns: int, ax):
    """pool_figure's tenant mode: held blocks in their tenant's colour, free and cached as states."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Polygon, Rectangle

    states = snapshot["states"]
    held_by = {int(k): v for k, v in snapshot.get("tenants", {}).items()}
    order = tenant_order(snapshot)
    colour_of = {name: _tenant_colour(i) for i, name in enumerate(order)}
    colours, cues = state_colours(), cue_colours()
    rows = -(-len(states) // columns)
    alone = ax is None
    if alone:
        _, ax = plt.subplots(figsize=(max(4.5, min(12, 0.3 * columns + 1.6)), 0.3 * rows + 1.9))
    counts = dict.fromkeys(order, 0)
    several = 0
    for i, state in enumerate(states):
        x, y = i % columns, rows - 1 - i // columns
        names = held_by.get(i, [])
        if not names:
            ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, color=colours.get(state, (0.4, 0.4, 0.4))))
            continue
        for name in names:
            counts[name] += 1
        ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, color=colour_of[names[0]]))
        if len(names) > 1:
            several += 1
            ax.add_patch(Polygon([(x + 0.95, y + 0.05), (x + 0.95, y + 0.95), (x + 0.05, y + 0.05)],
                                 closed=True, lw=0, facecolor=colour_of[names[1]], gid="tenants-split"))
            ax.plot([x + 0.05, x + 0.95], [y + 0.05, y + 0.95], color=cues["STRIPE"], lw=0.8, ls="--")
    ax.set(xlim=(0, columns), ylim=(0, rows), aspect="equal")
    _label_grid(ax, columns, rows)
    handles = [Patch(color=colour_of[n], label=f"{n} {counts[n]}") for n in order]
    if several:
        handles.append(Patch(facecolor=(1, 1, 1), edgecolor=cues["STRIPE"], ls="--",
                             label=f"several tenants {several}"))
    for s in ("cached", "free"):
        if s in states:
            handles.append(Patch(color=colours[s], label=f"{s} {states.count(s)}"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0),
              ncol=min(len(handles), 4), fontsize=FONT, frameon=False)
    ax.set_title(title or f"{len(states)} blocks x {snapshot['block_size']} tokens, by tenant", fontsize=9)
    if alone:
        ax.figure.tight_layout()
    return ax.figure
