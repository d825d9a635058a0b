"""comparison_figures: paging beside the contiguous baseline, at one moment of a real run.

`arena_figure` draws the same step of the same requests in both allocators, every physical block
with the request that holds it, its stored tokens solid and its held-but-empty slots hatched: paging's
scattered, nearly full blocks above the baseline's long, mostly empty runs and the holes between
them. Drawn from `PagingFrame`s (`FrameAt`), never by hand. The run-long measurements that go with
it (waste bars, rate sweeps) are drawn by `sim.figures`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from .frames import PagingFrame
from .paging_figures import EMPTY_HATCH, FONT, INK
from .pool_figure import state_colours

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Requests are told apart by the id written on each block; colour only groups a request's blocks.
# Twelve distinguishable hues (tab20's saturated half plus two from tab20b), reused beyond twelve.
OWNER_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                 "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939")
ALLOCATOR_COLOURS = {"paged": "#0072B2", "contiguous": "#D55E00"}   # Okabe-Ito blue and vermillion


def _owners(frame: PagingFrame) -> dict[str, str]:
    """A colour per request, in the order requests appear (ids sorted naturally: q2 before q10)."""
    import re

    ids = sorted({t.request_id for t in frame.tables},
                 key=lambda r: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", r)])
    return {rid: OWNER_COLOURS[i % len(OWNER_COLOURS)] for i, rid in enumerate(ids)}


def _draw_arena(ax, frame: PagingFrame, columns: int, colours: Mapping[str, str]) -> None:
    """Blocks in id order, `columns` per row, each a strip of slots: solid where KV is stored,
    hatched in the owner's colour where held but empty, grey where free."""
    from matplotlib.patches import Rectangle

    bs = frame.block_size
    free = state_colours()["free"]
    owner = {b: (t, i) for t in frame.tables for i, b in enumerate(t.block_ids)}
    rows = -(-frame.num_blocks // columns)
    gap = 0.12 * bs                                     # between neighbouring blocks, in slots
    for b in range(frame.num_blocks):
        x0, y = (b % columns) * (bs + gap), b // columns
        held = owner.get(b)
        if held is None:
            ax.add_patch(Rectangle((x0, y - 0.35), bs, 0.7, facecolor=free, edgecolor=(0.6, 0.6, 0.6), lw=0.6,
                                   gid=f"free:{b}"))
            continue
        table, index = held
        colour = colours[table.request_id]
        fill = table.fill(index, bs)
        if fill:
            ax.add_patch(Rectangle((x0, y - 0.35), fill, 0.7, facecolor=colour, edgecolor="none", lw=0,
                                   gid=f"stored:{table.label}:{b}:{fill}"))
        if fill < bs:
            ax.add_patch(Rectangle((x0 + fill, y - 0.35), bs - fill, 0.7, facecolor="white", edgecolor=colour,
                                   hatch=EMPTY_HATCH, lw=0, gid=f"empty:{table.label}:{b}:{bs - fill}"))
        ax.add_patch(Rectangle((x0, y - 0.35), bs, 0.7, facecolor="none", edgecolor=colour, lw=1.2))
        ax.text(x0 + bs / 2, y, table.label, fontsize=FONT, ha="center", va="center", color=INK,
                bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.9))
    ax.set(xlim=(-gap, columns * (bs + gap)), ylim=(rows - 0.5, -0.5),
           yticks=range(rows), xticks=[c * (bs + gap) + bs / 2 for c in range(columns)])
    ax.set_yticklabels([str(r * columns) for r in range(rows)], fontsize=FONT)
    ax.set_xticklabels([f"+{c}" for c in range(columns)], fontsize=FONT)
    ax.set_ylabel("first block id of the row", fontsize=FONT)
    ax.set_xlabel(f"block id offset in the row (each block: {bs} token slots, left to right)", fontsize=FONT)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)


def arena_figure(frames: Mapping[str, PagingFrame], notes: Mapping[str, str] | None = None,
                 columns: int = 8) -> Figure:
    """One panel per allocator (say {"paged": f1, "contiguous": f2}, frames of the same step of
    the same requests), the pool drawn block by block; a line under each title says the frame's
    note, or `notes[allocator]` instead."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not frames:
        raise ValueError("no frames: pass {allocator: PagingFrame}, e.g. from FrameAt")
    first = next(iter(frames.values()))
    rows = -(-first.num_blocks // columns)
    fig, axes = plt.subplots(len(frames), 1, figsize=(9, len(frames) * (0.32 * rows + 1.3) + 0.5), squeeze=False)
    colours: dict[str, str] = {}
    for frame in frames.values():
        for rid, c in _owners(frame).items():
            colours.setdefault(rid, c)
    for ax, (name, frame) in zip(axes[:, 0], frames.items()):
        _draw_arena(ax, frame, columns, colours)
        running = sum(t.state == "running" for t in frame.tables)
        waiting = sum(t.state != "running" for t in frame.tables)
        held = len({b for t in frame.tables for b in t.block_ids})
        head = (f"{name} (step {frame.step}): {running} running, {waiting} waiting; "
                f"{held} of {frame.num_blocks} blocks held")
        note = (notes or {}).get(name, frame.note)
        ax.set_title(head + (f"\n{note}" if note else ""), fontsize=9, loc="left")
    handles = [Patch(facecolor=OWNER_COLOURS[0], label="stored KV (colour and label: the request)"),
               Patch(facecolor="white", edgecolor=OWNER_COLOURS[0], hatch=EMPTY_HATCH, label="held, empty"),
               Patch(facecolor=state_colours()["free"], edgecolor=(0.6, 0.6, 0.6), label="free")]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=FONT, frameon=False)
    fig.tight_layout(rect=(0, 0.45 / fig.get_figheight(), 1, 1), h_pad=1.2)
    return fig
