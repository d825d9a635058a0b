"""speculation_plots: per-pass rollback and repeated-timing speed figures, drawn from a real
speculative run on a tiny model and checked for what they show and how they read."""
from __future__ import annotations

import matplotlib
import pytest

matplotlib.use("Agg")

from conftest import tiny_model  # noqa: E402
from figure_checks import check_figure  # noqa: E402
from jupyter_pagedkv import SamplingParams  # noqa: E402
from jupyter_pagedkv.widgets.speculation_plots import (  # noqa: E402
    ROLLED_BACK_HATCH, SpecStep, rollback_figure, speed_figure, spread)

MODEL = tiny_model("llama", seed=6)


def trace(engine, prompt: list[int], max_tokens: int) -> list[SpecStep]:
    """Step one ngram-speculative request by hand, keeping what each step did with its drafts."""
    rid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, speculative="ngram"))
    steps, produced = [], 0
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.request_id == rid), None)
        s = engine.pool_snapshot()["speculative"]
        made = len(out.token_ids) if out is not None else produced
        steps.append(SpecStep(s["last_step_draft_slots"], s["last_step_rolled_back_slots"],
                              len(s["last_step_freed_blocks"]), made - produced))
        produced = made
    return steps


@pytest.fixture(scope="module")
def steps() -> list[SpecStep]:
    from jupyter_pagedkv import Engine

    engine = Engine(MODEL, None, block_size=4, num_blocks=64, kv_cache_memory="64MiB")
    # A repetitive prompt: the random model tends to repeat it, so ngram drafts get checked often.
    result = trace(engine, [5, 6, 7, 8, 9] * 6, 24)
    engine.check_invariants()
    return result


def test_rollback_figure_shows_each_pass_and_reads_well(steps):
    assert sum(s.drafted for s in steps) > 0, "the run must draft something to draw"
    fig = rollback_figure({"repeat": steps, "again": steps[:5]})
    check_figure(fig, expect_labels=("tokens per pass", "forward pass"))
    ax = fig.axes[0]
    hatched = [p for p in ax.patches if p.get_hatch() == ROLLED_BACK_HATCH]
    assert len(hatched) == len(steps)
    assert sum(p.get_height() for p in hatched) == sum(s.rolled_back for s in steps)
    # every bar stack tops out at tokens out + rolled back
    legend = [t.get_text() for t in fig.axes[-1].get_legend().get_texts()]
    assert "rejected guesses (slots rolled back)" in legend and "the model's own token" in legend
    assert sum(s.tokens_out for s in steps) == 24


def test_speed_figure_draws_every_run_with_its_spread():
    runs = {"edit": {"plain": [20.0, 21.5, 19.0], "ngram": [40.0, 44.0, 38.5]},
            "chat": {"plain": [21.0, 22.0, 20.5], "ngram": [21.5, 19.5, 23.0]}}
    fig = speed_figure(runs)
    labels = check_figure(fig, expect_labels=("tokens/s", "3 runs"))
    assert any("request" in label for label in labels)
    ax = fig.axes[0]
    dots = sum(len(c.get_offsets()) for c in ax.collections if c.get_offsets().shape[0] == 3)
    assert dots == 12                                  # every run drawn
    assert spread([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    texts = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "min to max of the runs" in texts and "one run" in texts


def test_empty_inputs_say_what_to_pass():
    with pytest.raises(ValueError, match="SpecStep"):
        rollback_figure({})
    with pytest.raises(ValueError, match="plain"):
        speed_figure({})
