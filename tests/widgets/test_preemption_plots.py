"""preemption_plots: notebook 05's figures rendered on small runs (a tiny engine under pressure, a
short simulated sweep) and checked for how they read (labelled axes with units, text >= 8 pt,
legends off the data) and for what they claim (where the crossover is)."""
from __future__ import annotations

import dataclasses

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from conftest import tiny_model  # noqa: E402
from figure_checks import check_figure  # noqa: E402
from jupyter_pagedkv import SamplingParams  # noqa: E402
from jupyter_pagedkv.testing.models import random_prompts  # noqa: E402
from jupyter_pagedkv.sim import Simulator, synthetic  # noqa: E402
from jupyter_pagedkv.widgets import PoolRecorder  # noqa: E402
from jupyter_pagedkv.widgets.preemption_plots import (  # noqa: E402
    CrossoverSweep, crossover_figure, pool_timeline_figure)

MODEL = tiny_model("llama", seed=8)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_the_pool_timeline_of_a_preempting_run_has_labelled_axes_and_legends_off_the_data(make_engine):
    timelines, preempted = {}, {}
    for mode in ("recompute", "swap"):
        engine = make_engine(MODEL, block_size=4, num_blocks=16, preemption_mode=mode, swap_space="4MiB")
        with PoolRecorder(engine) as rec:
            engine.generate(random_prompts(6, 256, seed=21, hi=30), SamplingParams(max_tokens=16, temperature=0.0,
                                                                             ignore_eos=True))
        timelines[mode], preempted[mode] = rec.timeline, engine._scheduler.num_preemptions
    assert all(preempted.values()), "the run must preempt for the figure to show it"
    fig = pool_timeline_figure(timelines, pool_blocks=16, block_size=4)
    labels = check_figure(fig, expect_labels=("(s)", "blocks (4 tokens each)", "requests (count)"))
    assert labels.count("time since the batch started (s)") == 4
    assert any("preempted" in t.get_text() for t in fig.axes[-1].get_legend().get_texts())


@pytest.fixture(scope="module")
def sweep(bandwidths=(1.0, 4.0, 64.0), seeds=(0, 1)) -> CrossoverSweep:
    """The notebook's sweep at test size: 60 requests arriving at once (so they preempt), two
    seeds, two pool sizes."""
    recompute, swap = {}, {}
    for pool, frac in (("half", 0.5), ("a third", 0.35)):
        recompute[pool], swap[pool] = [], []
        for seed in seeds:
            reqs = synthetic(60, "sharegpt", float("inf"), seed=seed, vocab=128256, max_context=8192)
            runs = []
            for mode, gbps in [("recompute", None)] + [("swap", b) for b in bandwidths]:
                sim = Simulator.for_gpu("Llama-3-70B", "H100-80GB", 2, preemption_mode=mode)
                sim.config = dataclasses.replace(sim.config, num_blocks=int(sim.config.num_blocks * frac))
                if gbps:
                    sim.cost = dataclasses.replace(sim.cost, s_per_swap_byte=1 / (2 * gbps * 1e9))
                runs.append(sim.run(reqs).summary)
            recompute[pool].append(runs[0].latency_tail())
            swap[pool].append([r.latency_tail() for r in runs[1:]])
    return CrossoverSweep(tuple(bandwidths), recompute, swap, runs[0].tail_name)


def test_the_crossover_figure_has_units_error_bars_and_legends_off_the_data(sweep):
    fig = crossover_figure(sweep, title="small sweep", marks={"PCIe 4.0 x16": 25, "PCIe 5.0 x16": 50})
    check_figure(fig, expect_labels=("(GB/s", "latency (s)"))
    left, right = fig.axes
    assert left.get_ylabel() == f"end-to-end {sweep.tail_name} latency (s)"
    assert len(left.containers) == 1 and len(right.containers) == 2     # error bars: swap; one per pool


def test_a_slow_host_link_makes_swap_lose_and_a_fast_one_makes_it_win(sweep):
    for pool in sweep.recompute_s:
        r = sweep.ratios(pool)
        assert (r[:, 0] > 1).all() and (r[:, -1] < 1).all(), r
        assert 1 < sweep.crossover(pool) < 64


def test_crossover_interpolates_on_a_log_scale_and_is_none_without_one():
    sweep = CrossoverSweep((1.0, 4.0), {"p": [10.0]}, {"p": [[12.0, 8.0]]})
    assert sweep.crossover("p") == pytest.approx(2.0)
    assert CrossoverSweep((1.0, 4.0), {"p": [10.0]}, {"p": [[9.0, 8.0]]}).crossover("p") is None
