"""pool_figure and PoolRecorder: still pictures of the pool that agree with the engine and the widget."""
from __future__ import annotations

import re

import matplotlib
import pytest

matplotlib.use("Agg")

from conftest import tiny_model
from figure_checks import check_figure
from jupyter_pagedkv import SamplingParams
from jupyter_pagedkv.widgets import PoolRecorder, pool_figure
from jupyter_pagedkv.widgets.pool_figure import STATIC, state_colours

MODEL = tiny_model("llama", seed=6)
PROMPT = list(range(3, 30))          # 27 tokens: 6 full blocks of 4 and a partial one


def test_colours_are_the_widget_table():
    js = (STATIC / "palette.js").read_text()
    names = re.findall(r"^\s+(\w+): \[\d+, \d+, \d+\],$", js.split("export const COLORS")[1].split("};")[0], re.M)
    assert set(state_colours()) == set(names) >= {"free", "cached", "used", "shared", "swapped", "speculative"}
    assert state_colours()["used"] == (0 / 255, 158 / 255, 115 / 255)


def test_recorder_keeps_the_busiest_step_and_detaches(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=64)
    with PoolRecorder(engine) as rec:
        engine.generate([PROMPT], SamplingParams(n=4, max_tokens=6, temperature=0.8, seed=3, ignore_eos=True))
    assert engine._step_listeners == []                     # no hook left behind
    assert len(rec.timeline) >= 6
    peak = rec.peak_stats
    # 4 samples over 6 full prompt blocks + one copied partial block each (+ growth): sharing shows.
    assert peak.num_used == rec.max_used == rec.timeline[rec.peak_index].used
    assert peak.num_shared >= 6 and peak.num_block_refs > peak.num_used
    assert rec.peak["states"].count("shared") == peak.num_shared
    assert rec.timeline[-1].used == 0                        # everything returned by the end
    fig = rec.figure("n=4")
    assert len(fig.axes) == 2
    legend = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    assert f"shared {peak.num_shared}" in legend
    # shared blocks are labelled with their ref count in the map
    marks = [t.get_text() for t in fig.axes[1].texts]
    assert len(marks) == peak.num_shared and set(marks) <= {"2", "3", "4"}


def test_figure_of_an_unknown_state_and_bad_arguments():
    snap = {"states": ["free", "used", "teleported"], "ref_counts": [0, 1, 1], "block_size": 16}
    fig = pool_figure(snap, columns=2)
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["free 1", "used 1", "teleported 1"]
    with pytest.raises(ValueError, match="at least 1"):
        pool_figure(snap, columns=0)


def test_figure_before_recording_says_what_to_do(make_engine):
    rec = PoolRecorder(make_engine(MODEL, block_size=4, num_blocks=16))
    with pytest.raises(RuntimeError, match="inside `with PoolRecorder"):
        rec.figure()


def test_shared_and_swapped_blocks_carry_the_maps_second_cues():
    """Shared blocks get the corner mark, swapped ones the stripes: in the squares, in the legend,
    and in the rendered pixels (so a reader who cannot tell the hues apart still can)."""
    import numpy as np
    from matplotlib.patches import Polygon, Rectangle

    from jupyter_pagedkv.widgets.pool_figure import cue_colours

    snap = {"states": ["used", "shared", "shared", "swapped", "free", "cached"],
            "ref_counts": [1, 2, 3, 1, 0, 0], "block_size": 16}
    fig = pool_figure(snap, columns=3)
    ax = fig.axes[0]
    marks = [p for p in ax.patches if isinstance(p, Polygon) and p.get_gid() == "shared-mark"]
    assert len(marks) == 2
    hatched = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_hatch()]
    assert len(hatched) == 1 and hatched[0].get_facecolor()[:3] == pytest.approx(state_colours()["swapped"])
    assert [t.get_text() for t in ax.texts] == ["2", "3"]
    legend = ax.get_legend()
    assert [h.get_hatch() for h in legend.legend_handles] == [None, None, None, None, "////"]
    fig.set_dpi(100)
    fig.canvas.draw()
    image = np.asarray(fig.canvas.buffer_rgba())[..., :3].astype(int)

    def near(rgb, patch=None) -> int:
        """Pixels within 8 levels of `rgb`, in the whole figure or inside `patch`'s box."""
        px = image
        if patch is not None:
            box = patch.get_window_extent()
            top = image.shape[0]
            px = image[int(top - box.y1) + 1:int(top - box.y0) - 1, int(box.x0) + 1:int(box.x1) - 1]
        return int((np.abs(px - np.array(rgb) * 255).max(axis=-1) <= 8).sum())

    assert near(cue_colours()["STRIPE"], hatched[0]) > 20      # the stripes are drawn, not only declared
    shared_square = next(p for p in ax.patches if isinstance(p, Rectangle)
                         and p.get_facecolor()[:3] == pytest.approx(state_colours()["shared"]))
    assert near(cue_colours()["MARK"], shared_square) > 10      # the corner mark, inside the square
    assert near(state_colours()["shared"], shared_square) > 20


def test_busiest_step_is_by_blocks_held_after_copy_on_write(make_engine):
    """n=4 over a prompt whose last block is partial: the step after the fork has as many references
    as the next (no sample needs a new block yet), but only the next step's copy-on-write
    shows what the run holds. The peak is that later step: most blocks held, not most references."""
    engine = make_engine(MODEL, block_size=4, num_blocks=64)
    with PoolRecorder(engine) as rec:
        engine.generate([PROMPT], SamplingParams(n=4, max_tokens=3, temperature=0.8, seed=3, ignore_eos=True))
    fork = next(i for i, p in enumerate(rec.timeline) if p.shared)
    after_fork = rec.timeline[fork]
    assert after_fork.used == 7 and after_fork.block_refs == 28     # 7 prompt blocks, ref 4 each
    peak = rec.peak_stats
    assert rec.peak_index > fork
    assert peak.num_used == max(p.used for p in rec.timeline) > after_fork.used
    assert peak.num_block_refs == after_fork.block_refs             # a tie by references
    # the partial block was copied: the 6 full prompt blocks stay shared, each sample owns its last one
    assert (peak.num_shared, peak.num_used - peak.num_shared) == (6, 4)


def test_recorder_figure_reads_well(make_engine):
    """Axis labels with units, text >= 8 pt, no legend on the data; held blocks and private copies
    drawn on one footing, cached blocks (held by nobody) not stacked on top of held ones."""
    engine = make_engine(MODEL, block_size=4, num_blocks=64)
    engine.generate([PROMPT], SamplingParams(max_tokens=1))           # leaves cached prefix blocks
    with PoolRecorder(engine) as rec:
        engine.generate([PROMPT], SamplingParams(n=4, max_tokens=6, temperature=0.8, seed=3, ignore_eos=True))
    assert any(p.cached for p in rec.timeline)
    fig = rec.figure("n=4")
    labels = check_figure(fig, expect_labels=("(s)", "blocks (4 tokens each)", "block id"))
    assert "time since recording started (s)" in labels
    timeline = fig.axes[0]
    texts = [t.get_text() for t in timeline.get_legend().get_texts()]
    assert "private copies: blocks if nothing were shared" in texts
    assert "cached: ref 0, held by no sequence" in texts
    # the stacked area tops out at the blocks held, never above the private-copies line
    top = max(max(c.get_paths()[0].vertices[:, 1]) for c in timeline.collections)
    assert top == rec.max_used <= max(p.block_refs for p in rec.timeline)
    fig.clf()


def test_pool_figure_alone_reads_well():
    snap = {"states": ["free", "used", "shared", "cached"] * 40, "ref_counts": [0, 1, 2, 0] * 40, "block_size": 16}
    fig = pool_figure(snap, columns=32)
    check_figure(fig, expect_labels=("block id",))
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "32", "64", "96", "128"]


def test_tenant_mode_colours_blocks_by_their_tenant(make_engine):
    """Two tenants and an unnamed request over one prefix (global scope): each tenant's private
    blocks carry its colour from blockmap.js, the shared prefix blocks are split, the legend counts
    what the snapshot says."""
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Polygon, Rectangle

    from jupyter_pagedkv.widgets.pool_figure import tenant_colours, tenant_order

    engine = make_engine(MODEL, block_size=4, num_blocks=48)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for tenant, tail in (("bob", [60]), ("alice", [61]), (None, [62])):
        engine.add_request(PROMPT + tail, params, tenant=tenant)
    engine.step()
    snap = engine.pool_snapshot()
    assert tenant_order(snap) == ["alice", "bob", "(unnamed)"]
    fig = pool_figure(snap, columns=16, color_by="tenant")
    check_figure(fig, expect_labels=("block id",))
    ax = fig.axes[0]
    squares = [p for p in ax.patches if isinstance(p, Rectangle)]
    splits = [p for p in ax.patches if isinstance(p, Polygon) and p.get_gid() == "tenants-split"]
    colours = dict(zip(["alice", "bob", "(unnamed)"], tenant_colours()))
    for block_id, names in snap["tenants"].items():
        assert to_rgb(squares[int(block_id)].get_facecolor()) == pytest.approx(colours[names[0]])
    assert len(splits) == sum(1 for names in snap["tenants"].values() if len(names) > 1) == 6
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    held = {n: sum(n in v for v in snap["tenants"].values()) for n in colours}
    assert labels[:3] == [f"{n} {held[n]}" for n in colours] and "several tenants 6" in labels
    with pytest.raises(ValueError, match="color_by must be 'state' or 'tenant'"):
        pool_figure(snap, color_by="owner")
    for r in engine.live_requests():
        engine.abort(r.request_id)
    fig.clf()
