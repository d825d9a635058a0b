"""block_map_plot: notebook 07's map of a scattered pool draws each held block once, numbered by
its logical index, ignores table padding, and reads (labelled axes, text >= 8 pt)."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from figure_checks import check_figure  # noqa: E402
from jupyter_pagedkv.widgets.block_map_plot import block_map_figure  # noqa: E402


def test_each_held_block_is_drawn_once_with_its_logical_index_and_padding_is_not():
    tables = [[5, 2, 7, -1], [0, 3, -1, -1], [6, 1, 4, 8]]
    fig = block_map_figure(tables, seq_lens=[40, 17, 64], block_size=16, num_blocks=10)
    try:
        check_figure(fig, expect_labels=("physical block id", "context length"))
        ax = fig.axes[0]
        numbers = {(round(t.get_position()[0]), round(t.get_position()[1])): t.get_text() for t in ax.texts}
        assert numbers == {(5, 0): "0", (2, 0): "1", (7, 0): "2", (0, 1): "0", (3, 1): "1",
                           (6, 2): "0", (1, 2): "1", (4, 2): "2", (8, 2): "3"}
        assert [t.get_text() for t in ax.get_yticklabels()] == ["0: 40 tokens", "1: 17 tokens", "2: 64 tokens"]
    finally:
        plt.close(fig)
