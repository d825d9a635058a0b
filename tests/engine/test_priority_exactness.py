"""scheduling_policy="priority" on the real engine: greedy outputs stay token-identical to
transformers' `generate` while urgent requests preempt less urgent ones (recompute and swap,
n-sample forks, n-gram speculation), and the option's bad values are one line."""
from __future__ import annotations

import functools

import pytest

from conftest import assert_same_or_near_tie, hf_greedy, tiny_model
from jupyter_pagedkv import Engine, SamplingParams
from jupyter_pagedkv.testing.models import random_prompts

MODEL = tiny_model("llama", seed=8)
MAX_TOKENS = 24
PROMPTS = random_prompts(8, 256, seed=31, lo=8, hi=40)
PRIORITIES = [3, 3, 3, 3, 0, 2, 1, 0]   # four background requests, then four more urgent ones


@functools.cache
def ref(k: int) -> list[int]:
    return hf_greedy(MODEL, PROMPTS[k], MAX_TOKENS, stop_at_eos=False)


def run(engine, n_for=None):
    """Background first, the urgent ones two steps later; returns (outputs by index, steps)."""
    ids = {}
    for k in range(4):
        ids[engine.add_request(PROMPTS[k], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                            ignore_eos=True), priority=PRIORITIES[k])] = k
    done = {}
    for _ in range(2):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    for k in range(4, 8):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                n=2 if k == n_for else 1)
        ids[engine.add_request(PROMPTS[k], params, priority=PRIORITIES[k])] = k
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_invariants()
    return {ids[rid]: o for rid, o in done.items()}


@pytest.mark.parametrize("mode", ["recompute", "swap", "recompute-ngram"])
def test_greedy_is_identical_to_transformers_under_priority_preemption(mode, make_engine):
    swap = dict(preemption_mode="swap", swap_space="4MiB") if mode == "swap" else {}
    spec = dict(speculative="ngram", num_speculative_tokens=3) if mode.endswith("ngram") else {}
    engine = make_engine(MODEL, block_size=4, num_blocks=20, scheduling_policy="priority", **swap, **spec)
    sched, victims = engine._scheduler, []
    preempt = sched.preempt

    def spy(seq, out, swap=True):   # each victim is the last running request in queue order
        victims.append(seq.priority)
        assert seq is max(sched.running, key=lambda s: (s.priority, s.arrival_time, s.seq_id))
        preempt(seq, out, swap)

    sched.preempt = spy
    outs = run(engine, n_for=6)
    for k, o in outs.items():
        assert len(o.outputs) == (2 if k == 6 else 1)
        for c in o.outputs:
            assert_same_or_near_tie(MODEL, PROMPTS[k], c.token_ids, ref(k))
    assert engine.stats().num_preemptions > 0 and victims[0] == 3   # background work goes first
    assert (engine._scheduler.num_swap_outs > 0) == (mode == "swap")


def test_an_unknown_policy_is_one_line_naming_the_choices():
    with pytest.raises(ValueError) as err:
        Engine(MODEL, None, scheduling_policy="lifo")
    msg = str(err.value)
    assert "\n" not in msg and all(p in msg for p in ("fcfs", "fair", "priority", "lifo"))


def test_a_non_integer_priority_is_refused_and_nothing_is_queued(make_engine):
    engine = make_engine(MODEL, block_size=4, scheduling_policy="priority")
    for bad in (1.5, "0", None, True):
        with pytest.raises(ValueError, match="priority must be an integer"):
            engine.add_request(PROMPTS[0], SamplingParams(max_tokens=2), priority=bad)
    assert not engine.has_unfinished_requests()
