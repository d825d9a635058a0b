"""paging_figures: teaching pictures drawn from a real toy run (12 blocks x 4 tokens), checked for
what they claim (arrows, fills, ref counts, hatching, stage order) and for how they read (labelled
axes, text >= 8 pt, no legend on the data, no text on text)."""
from __future__ import annotations

import itertools

import matplotlib
import pytest

matplotlib.use("Agg")

from matplotlib.patches import ConnectionPatch, Rectangle  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from conftest import tiny_model  # noqa: E402
from figure_checks import check_figure  # noqa: E402
from jupyter_pagedkv.engine.engine import Engine  # noqa: E402
from jupyter_pagedkv.widgets.paging_figures import (  # noqa: E402
    EMPTY_HATCH, FONT, STAGES, PagingFrame, block_table_figure, capture, contiguous_demo,
    contiguous_figure, paging_story, story_figure)

MODEL = tiny_model("llama", seed=6)


def toy(**kwargs) -> Engine:
    return Engine(MODEL, None, block_size=4, num_blocks=12, seed=0, **kwargs)


def assert_drained(engine: Engine) -> None:
    engine.check_invariants()
    stats = engine.stats()
    assert (stats.num_used, stats.num_running, stats.num_waiting) == (0, 0, 0), "blocks leaked"
    assert not engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def story() -> list[PagingFrame]:
    engine = toy()
    frames = paging_story(engine)
    assert_drained(engine)
    return frames


@pytest.fixture(scope="module")
def arena() -> PagingFrame:
    engine = toy(allocator="contiguous")
    frame = contiguous_demo(engine)
    assert_drained(engine)
    return frame


# -- readability, for every figure ------------------------------------------------------------------
def visible_texts(fig) -> list[Text]:
    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]


def assert_reads_well(fig) -> None:
    """The house rules (check_figure: labelled axes, text >= 8 pt, no tick or legend clash) and,
    stricter for these dense maps, legends off every axes' whole area and no text overlapping."""
    fig.set_dpi(100)
    check_figure(fig, min_points=FONT)
    renderer = fig.canvas.get_renderer()
    data_axes = [ax for ax in fig.axes if ax.axison and ax.patches]
    assert data_axes
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert legends
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in data_axes:
            assert not box.overlaps(ax.get_window_extent(renderer)), "a legend covers data"
            for label in (ax.xaxis.label, ax.yaxis.label):
                assert not box.overlaps(label.get_window_extent(renderer)), "a legend covers a label"
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in visible_texts(fig)]
    clashes = [(a, b) for (a, ba), (b, bb) in itertools.combinations(boxes, 2)
               if ba.overlaps(bb) and (min(ba.x1, bb.x1) - max(ba.x0, bb.x0)) > 1
               and (min(ba.y1, bb.y1) - max(ba.y0, bb.y0)) > 1]
    assert not clashes, f"overlapping text: {clashes[:5]}"


def arrows(fig, tag: str = "") -> list[ConnectionPatch]:
    return [a for ax in fig.axes for a in ax.get_children()
            if isinstance(a, ConnectionPatch) and (a.get_gid() or "").startswith(f"arrow{tag}:")]


def patches(fig, prefix: str) -> list[Rectangle]:
    return [p for ax in fig.axes for p in ax.patches if (p.get_gid() or "").startswith(prefix)]


# -- the story: real events, in order ---------------------------------------------------------------
def test_the_story_captures_each_stage_from_the_run_in_order(story):
    assert [f.stage for f in story] == list(STAGES)
    steps = [f.step for f in story]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    by = {f.stage: {t.label: t for t in f.tables} for f in story}
    frame = {f.stage: f for f in story}
    assert by["allocate"]["A"].block_ids == (0, 1, 2) and by["allocate"]["A"].num_tokens == 10
    assert len(by["grow"]["A"].block_ids) == 4
    b0, b1 = by["fork"]["B #0"], by["fork"]["B #1"]
    assert b0.block_ids == b1.block_ids and all(frame["fork"].ref_counts[b] == 2 for b in b0.block_ids)
    assert b0.num_tokens % 4, "the fork shares a partly filled block, so the next write must copy"
    c0, c1 = by["copy-on-write"]["B #0"], by["copy-on-write"]["B #1"]
    assert c0.block_ids[0] == c1.block_ids[0] and c0.block_ids[-1] != c1.block_ids[-1]
    assert frame["copy-on-write"].ref_counts[c0.block_ids[-1]] == 1
    a, c = by["cache hit"]["A"], by["cache hit"]["C"]
    assert c.block_ids[:2] == a.block_ids[:2] and c.block_ids[2] not in a.block_ids
    assert all(frame["cache hit"].states[b] == "shared" for b in c.block_ids[:2])
    preempted = [t for t in frame["preempt"].tables if t.state == "preempted"]
    assert preempted and all(not t.block_ids for t in preempted)
    assert not frame["free"].tables and set(frame["free"].states) <= {"free", "cached"}


def test_the_story_figure_has_one_panel_per_stage_in_order(story):
    fig = story_figure(story)
    titled = [ax for ax in fig.axes if ax.get_title(loc="left")]
    assert [ax.get_title(loc="left").split(" (")[0] for ax in titled] == \
        [f"{k + 1}. {stage}" for k, stage in enumerate(STAGES)]
    assert len(fig.axes) == 2 * len(STAGES) + 1            # table + pool per stage, one legend cell
    for k, f in enumerate(story):
        assert len(arrows(fig, f"@{k}")) == sum(len(t.block_ids) for t in f.tables)
    assert_reads_well(fig)
    with pytest.raises(ValueError, match="no frames"):
        story_figure([])


# -- one frame: tables, arrows, fills, ref counts -----------------------------------------------------
@pytest.mark.parametrize("stage", ["fork", "cache hit", "preempt"])
def test_block_table_figure_draws_what_the_frame_holds(story, stage):
    frame = next(f for f in story if f.stage == stage)
    fig = block_table_figure(frame)
    entries = [(t, i, b) for t in frame.tables for i, b in enumerate(t.block_ids)]
    drawn = arrows(fig)
    assert len(drawn) == len(entries) > 0
    assert {a.get_gid() for a in drawn} == {f"arrow:{t.label}:{i}" for t, i, _ in entries}
    fill = frame.block_fill()
    for b, state in enumerate(frame.states):
        solid, empty = patches(fig, f"phys:{b}:filled"), patches(fig, f"phys:{b}:empty")
        assert (len(solid), len(empty)) == (fill[b], 4 - fill[b]), f"block {b} drawn with the wrong fill"
    partial = [(t, i) for t, i, _ in entries if 0 < t.fill(i, 4) < 4]
    assert partial, "every frame here has a partly filled last block"
    for t, i in partial:
        bar = patches(fig, f"entryfill:{t.label}:{i}:")
        assert len(bar) == 1 and bar[0].get_width() == pytest.approx(0.9 * t.fill(i, 4) / 4)
    pool_ax = next(ax for ax in fig.axes if ax.get_ylabel() == "physical block id")
    ticks = [t.get_text() for t in pool_ax.get_yticklabels()]
    for b, state in enumerate(frame.states):
        shown = f"{b}  ref {frame.ref_counts[b]}" if state == "shared" else str(b)
        assert ticks[b] == shown
    assert sum("ref" in t for t in ticks) == frame.states.count("shared")
    assert len(patches(fig, "mark:")) == frame.states.count("shared")
    assert_reads_well(fig)


def test_the_cache_hit_frame_shows_readable_ref_counts(story):
    frame = next(f for f in story if f.stage == "cache hit")
    fig = block_table_figure(frame)
    fig.canvas.draw()
    pool_ax = next(ax for ax in fig.axes if ax.get_ylabel() == "physical block id")
    refs = [t for t in pool_ax.get_yticklabels() if "ref" in t.get_text()]
    assert len(refs) >= 3 and all(t.get_fontsize() >= FONT for t in refs)
    assert {t.get_text().split("ref ")[1] for t in refs} == {"2"}


def test_a_figure_of_an_idle_engine_and_capture_checks_the_invariants():
    engine = toy()
    frame = capture(engine, "empty")
    assert frame.tables == () and set(frame.states) == {"free"} and frame.block_fill() == [0] * 12
    fig = block_table_figure(engine, title="an empty pool")
    assert arrows(fig) == [] and fig.get_suptitle() == "an empty pool"
    assert_reads_well(fig)
    wrong = Engine(MODEL, None, block_size=4, num_blocks=16)
    with pytest.raises(ValueError, match="12 blocks x 4 tokens"):
        paging_story(wrong)
    with pytest.raises(ValueError, match="contiguous engine"):
        contiguous_demo(engine)                          # a paged engine cannot tell that story
    for e in (engine, wrong):
        assert_drained(e)


# -- the contiguous baseline ------------------------------------------------------------------------------
def test_contiguous_figure_hatches_reserved_slots_and_shows_the_holes(arena):
    live = {t.request_id: t for t in arena.tables}
    assert set(live) == {"A", "C", "D"} and live["D"].state == "waiting" and not live["D"].block_ids
    for t in (live["A"], live["C"]):
        assert list(t.block_ids) == list(range(t.block_ids[0], t.block_ids[0] + len(t.block_ids)))
    fig = contiguous_figure(arena)
    ax = fig.axes[0]
    hatched = [p for p in ax.patches if p.get_hatch() == EMPTY_HATCH]
    reserved_empty = sum(4 * len(t.block_ids) - t.num_tokens for t in arena.tables)
    assert reserved_empty > 0
    assert len(hatched) == 2 * reserved_empty            # in each request's row and in the whole arena
    assert all(p.get_gid().endswith(":empty") for p in hatched)
    filled = [p for p in ax.patches if (p.get_gid() or "").endswith(":filled")]
    assert len(filled) == 2 * sum(t.num_tokens for t in arena.tables)
    held = {b for t in arena.tables for b in t.block_ids}
    free = [b for b in range(12) if b not in held]
    assert free == [3, 4, 10, 11]                        # B's hole, and the tail: 2 + 2, D needs 3
    assert len({p.get_gid().split(":")[1] for p in ax.patches
                if (p.get_gid() or "").startswith("hole:")}) == len(free)
    labels = sorted(t.get_text() for t in ax.texts if t.get_gid() and t.get_gid().startswith("holelabel"))
    assert labels == ["hole: 2 blocks", "hole: 2 blocks"]
    assert "waiting: no reservation" in [t.get_text() for t in ax.texts]
    assert "D needs 3 in a row and waits" in arena.note
    assert_reads_well(fig)
