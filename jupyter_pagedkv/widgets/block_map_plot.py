"""block_map_plot: where each sequence's KV lives in the pool, as notebook 07 draws it.

One row per sequence, one column per physical block. A block a sequence holds is a filled square
with its *logical* index written in it, so the reader sees both the scatter (columns) and the
order the kernel walks them in (the numbers); lines joining blocks on one row would all be
collinear and show no order. Table entries past a sequence's length are padding and are not drawn.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from .pool_figure import FONT

if TYPE_CHECKING:
    from matplotlib.figure import Figure

COLOURS = ("#2a7ab9", "#d9552b", "#16a34a", "#7c3aed", "#b45309", "#0f766e")


def block_map_figure(tables: Sequence[Sequence[int]], seq_lens: Sequence[int], block_size: int,
                     num_blocks: int, title: str | None = None) -> Figure:
    """`tables[i][j]` is the physical block of sequence i's logical block j; only the first
    ceil(seq_lens[i] / block_size) entries are read, as the kernel reads them."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    rows = len(seq_lens)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.34 * num_blocks + 2.2), 0.55 * rows + 1.5))
    for b in range(num_blocks):
        for i in range(rows):
            ax.add_patch(Rectangle((b - 0.42, i - 0.38), 0.84, 0.76, facecolor="none", edgecolor="#d4d4d4", lw=0.8))
    for i, n in enumerate(seq_lens):
        colour = COLOURS[i % len(COLOURS)]
        for j in range(-(-int(n) // block_size)):
            block = int(tables[i][j])
            ax.add_patch(Rectangle((block - 0.42, i - 0.38), 0.84, 0.76, facecolor=colour, edgecolor="white"))
            ax.text(block, i, str(j), ha="center", va="center", color="white", fontsize=FONT + 1,
                    fontweight="bold")
    ax.set_xlim(-0.6, num_blocks - 0.4)
    ax.set_ylim(rows - 0.5, -0.5)
    step = 1 if num_blocks <= 32 else 2 if num_blocks <= 64 else 4
    ax.set_xticks(range(0, num_blocks, step))
    ax.set_yticks(range(rows), [f"{i}: {int(n)} tokens" for i, n in enumerate(seq_lens)])
    ax.tick_params(labelsize=FONT + 1, length=0)
    ax.set_xlabel("physical block id (position in the pool)", fontsize=FONT + 1)
    ax.set_ylabel("sequence: context length", fontsize=FONT + 1)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(title or "where each sequence's KV lives: the number in a block is its logical index",
                 fontsize=FONT + 2)
    fig.tight_layout()
    return fig
