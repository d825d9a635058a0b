"""comparison_figures and FrameAt: the side-by-side pools, the waste bars and the rate sweep, drawn
from real toy runs and checked for what they show and how they read (tests/figure_checks.py)."""
from __future__ import annotations

import matplotlib
import pytest

matplotlib.use("Agg")

from conftest import tiny_model  # noqa: E402
from figure_checks import check_figure  # noqa: E402
from jupyter_pagedkv import SamplingParams  # noqa: E402
from jupyter_pagedkv.sim.plan import figure as plan_figure, plan  # noqa: E402
from jupyter_pagedkv.sim.waste import WasteMeter, describe_refusal, refused_by_layout  # noqa: E402
from jupyter_pagedkv.sim.figures import sweep_figure, waste_figure  # noqa: E402
from jupyter_pagedkv.sim.summary import capacity_at  # noqa: E402
from jupyter_pagedkv.widgets.comparison_figures import arena_figure  # noqa: E402
from jupyter_pagedkv.widgets.frames import FrameAt  # noqa: E402

MODEL = tiny_model("llama", seed=6)
PLAN = (("A", 5, 7), ("B", 3, 3), ("C", 6, 14), ("D", 4, 8))   # fragments a 12 x 4 contiguous pool


@pytest.fixture(scope="module")
def runs():
    """Both allocators over the same four requests; the contiguous run's first external refusal
    and the paged run at the same step are kept as frames."""
    from jupyter_pagedkv import Engine

    out, moment = {}, None
    for allocator in ("contiguous", "paged"):
        engine = Engine(MODEL, None, block_size=4, num_blocks=12, allocator=allocator,
                        enable_prefix_caching=False, seed=0)
        at = (FrameAt(engine, when=refused_by_layout, note=describe_refusal) if moment is None
              else FrameAt(engine, step=moment))
        with WasteMeter(engine) as meter, at:
            for k, (rid, prompt, m) in enumerate(PLAN):
                engine.add_request(list(range(20 + 20 * k, 20 + 20 * k + prompt)),
                                   SamplingParams(max_tokens=m, temperature=0, ignore_eos=True), rid)
            while engine.has_unfinished_requests():
                engine.step()
        engine.check_invariants()
        assert engine.stats().num_used == 0
        moment = moment or at.frame.step
        out[allocator] = (at.frame, meter.breakdown())
    return out


def test_frame_at_takes_the_asked_moment(runs):
    contiguous, paged = runs["contiguous"][0], runs["paged"][0]
    assert contiguous.step == paged.step
    assert contiguous.note.startswith("D waits for 3 adjacent blocks")
    assert {t.request_id for t in contiguous.tables if not t.block_ids} == {"D"}   # waiting, holding nothing
    assert all(t.block_ids for t in paged.tables)                                  # paging admitted D
    with pytest.raises(ValueError, match="either step= .* or when="):
        FrameAt(object())


def test_arena_figure_draws_every_block_once_and_reads_well(runs):
    frames = {"paged": runs["paged"][0], "contiguous": runs["contiguous"][0]}
    fig = arena_figure(frames)
    check_figure(fig, expect_labels=("token slots",))
    ax_p, ax_c = fig.axes
    for ax, frame in ((ax_p, frames["paged"]), (ax_c, frames["contiguous"])):
        gids = [p.get_gid() or "" for p in ax.patches]
        held = {b for t in frame.tables for b in t.block_ids}
        assert sum(g.startswith("free:") for g in gids) == frame.num_blocks - len(held)
        stored = sum(int(g.rsplit(":", 1)[1]) for g in gids if g.startswith("stored:"))
        empty = sum(int(g.rsplit(":", 1)[1]) for g in gids if g.startswith("empty:"))
        assert stored == sum(min(t.num_tokens, len(t.block_ids) * 4) for t in frame.tables)
        assert stored + empty == 4 * len(held)
        assert sorted(t.get_text() for t in ax.texts) == sorted(
            t.label for t in frame.tables for _ in t.block_ids)
    assert "D waits" in ax_c.get_title(loc="left") and "1 waiting" in ax_c.get_title(loc="left")
    assert "0 waiting" in ax_p.get_title(loc="left")
    with pytest.raises(ValueError, match="no frames"):
        arena_figure({})


def test_waste_figure_stacks_to_the_whole_pool(runs):
    bds = [runs["paged"][1], runs["contiguous"][1]]
    fig = waste_figure(bds, title="toy")
    check_figure(fig, expect_labels=("(%)",))
    ax = fig.axes[0]
    for b in bds:
        widths = [p.get_width() for p in ax.patches if (p.get_gid() or "").startswith(b.label + ":")]
        assert len(widths) == 5 and sum(widths) == pytest.approx(100)
    assert runs["paged"][1].external == 0 < runs["contiguous"][1].external
    with pytest.raises(ValueError, match="no breakdowns"):
        waste_figure([])


def test_capacity_is_interpolated_not_read_off_the_sweep_ends():
    rates = [1, 2, 3, 4]
    assert capacity_at(rates, [10, 20, 30, 40], 25) == pytest.approx(2.5)
    assert capacity_at(rates, [10, 20, 30, 40], 20) == pytest.approx(2.0)
    assert capacity_at(rates, [30, 40, 50, 60], 25) is None       # over the bound from the start
    assert capacity_at(rates, [1, 2, 3, 4], 25) == 4               # never over it: the sweep's end
    assert capacity_at([3, 1, 2], [30, 10, 20], 15) == pytest.approx(1.5)   # order does not matter
    with pytest.raises(ValueError, match="same length"):
        capacity_at([1, 2], [1], 5)


def test_sweep_figure_marks_each_crossing():
    rates = [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]
    fig = sweep_figure(rates, {"paged": [10, 12, 15, 20, 40, 80], "contiguous": [20, 60, 120, 200, 260, 300]},
                       bound=50, ylabel="P99 end-to-end latency (s)", title="test")
    check_figure(fig, expect_labels=("(s)", "(requests/s)"))
    marks = sorted(t.get_text() for t in fig.axes[0].texts)
    assert marks == ["0.88 req/s", "2.62 req/s"]


def test_planner_figure_reads_well():
    fig = plan_figure(plan("Llama-3-70B", "H100-80GB", 2))
    check_figure(fig)
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert ticks[:3] == ["256", "512", "1k"] and ticks[-1] == "8k"


def test_bench_tail_figure_reads_well_and_names_its_tail():
    """bench tail's four panels (its PNGs are committed in docs/): labelled, >= 8 pt, legends off
    the data, plain log ticks; a sweep of 12-request runs calls its tail "max"."""
    from jupyter_pagedkv.sim.tail_sweep import max_rate_under, tail_figure
    from jupyter_pagedkv.sim.summary import RequestTiming, RunSummary

    def run(n: int, slow: float) -> RunSummary:
        timings = [RequestTiming(str(i), 0.0, slow * (1 + i % 3), slow * (5 + i), 10) for i in range(n)]
        return RunSummary("x", timings, 10.0, 0.9 / slow, n)

    rates = [0.5, 1.0, 2.0, 3.0]
    for n, name in ((12, "max"), (40, "P99")):
        scale = {"label": "test", "rates": rates, "bound": 30.0, "ttft_bound": 5.0,
                 "runs": {"paged": [run(n, s) for s in (1, 1.2, 1.5, 2)],
                          "contiguous": [run(n, s) for s in (0.5, 3, 6, 9)]}}
        fig = tail_figure(scale)
        check_figure(fig, expect_labels=("(s)", "(requests/s)", "(%)"))
        legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        assert f"paged {name}" in legend
        lat = [s.latency_tail() for s in scale["runs"]["contiguous"]]
        assert 0.5 < max_rate_under(scale["runs"]["contiguous"], rates, 30.0) == pytest.approx(
            capacity_at(rates, lat, 30.0))


def test_bench_tail_says_when_a_sweep_never_reaches_the_bound(capsys):
    """A curve that stays under its bound at every swept rate has no measured capacity: the report
    says ">=" and, when neither crosses, that the sweep must go higher, instead of a ratio."""
    from jupyter_pagedkv.sim.tail_sweep import report
    from jupyter_pagedkv.sim.summary import RequestTiming, RunSummary

    def run(slow: float, ttft: float) -> RunSummary:    # 12 requests: max e2e 13 x slow, TTFT ttft
        return RunSummary("x", [RequestTiming(str(i), 0.0, ttft, slow * (2 + i), 10) for i in range(12)], 10.0, 0.9, 4)

    rates = [1.0, 2.0]
    scale = {"label": "test", "rates": rates, "bound": 60.0, "ttft_bound": 5.0,
             "runs": {"paged": [run(1, 1), run(2, 2)], "contiguous": [run(1, 1), run(4, 6)]},
             "preempt": {"recompute": run(1, 1), "swap": run(1, 1)}, "pressure_rate": 2.0}
    out = report(scale)
    text = capsys.readouterr().out
    assert "max end-to-end latency reaches 60 s" in text and "sweep higher rates to tell them apart" in text
    assert "paged >= 2.00 req/s, contiguous 1.80 req/s -> >= 1.1x (paged never crossed the bound)" in text
    assert out["ttft"]["paged_never_crossed"] and not out["ttft"]["contiguous_never_crossed"]
