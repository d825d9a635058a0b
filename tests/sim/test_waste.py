"""WasteMeter: the four-way split of a pool's slots, checked against arithmetic done by hand for
one request, against the arena's own refusal counter, and for the rules it must refuse."""
from __future__ import annotations

import pytest

from conftest import tiny_model
from jupyter_pagedkv import SamplingParams
from jupyter_pagedkv.sim.waste import CATEGORIES, WasteMeter, describe_refusal, refused_by_layout

MODEL = tiny_model("llama", seed=6)
BS, BLOCKS = 4, 12


def ceil_to(n: int, k: int) -> int:
    return -(-n // k) * k


@pytest.mark.parametrize("allocator", ["contiguous", "paged"])
def test_one_request_matches_the_arithmetic(make_engine, allocator):
    """Prompt P, M tokens, EOS ignored: after step j (1..M-1) it stores P + j - 1 slots; its last
    sampled token is never written, so it fills P + M - 1 slots in all; it is gone after step M.
    Contiguous holds ceil(P + M) from the start, paging the blocks of what it stores."""
    P, M = 6, 9
    engine = make_engine(MODEL, block_size=BS, num_blocks=BLOCKS, allocator=allocator, enable_prefix_caching=False)
    with WasteMeter(engine) as meter:
        engine.generate([list(range(3, 3 + P))], SamplingParams(max_tokens=M, temperature=0, ignore_eos=True))
    b = meter.breakdown()
    final, cap = P + M - 1, BLOCKS * BS
    expect = dict.fromkeys(CATEGORIES, 0.0)
    for j in range(1, M):
        stored = P + j - 1
        held = ceil_to(P + M, BS) if allocator == "contiguous" else ceil_to(stored, BS)
        expect["stored"] += stored
        expect["reservation"] += min(held, final) - stored
        expect["internal"] += held - max(stored, min(held, final))
        expect["free"] += cap - held
    expect["free"] += cap                                 # step M: finished, all free
    assert b.num_steps == M and b.capacity == cap and b.label == allocator
    for c in CATEGORIES:
        assert getattr(b, c) == pytest.approx(expect[c] / M), c
    assert b.external == 0 and b.external_steps == 0
    assert sum(b.fraction(c) for c in CATEGORIES) == pytest.approx(1.0)
    assert list(meter.admitted_at.values()) == [1]


def test_external_fragmentation_is_counted_when_it_happens(make_engine):
    """A, B, C reserve 3 + 2 + 5 of the 12 blocks; D (3 blocks) waits. When B ends, 4 blocks are
    free, in runs of 2 and 2: D still waits, now for want of adjacent blocks, and every step it so
    waits is external waste. All requests arrive before the first step, so the meter's reading
    after each step is what the next admission sees: its count must equal the arena's own."""
    engine = make_engine(MODEL, block_size=BS, num_blocks=BLOCKS, allocator="contiguous",
                         enable_prefix_caching=False)
    plan = (("A", 5, 7), ("B", 3, 3), ("C", 6, 14), ("D", 4, 8))
    captions = []
    with WasteMeter(engine) as meter:
        for k, (rid, prompt, m) in enumerate(plan):
            engine.add_request(list(range(20 + 20 * k, 20 + 20 * k + prompt)),
                               SamplingParams(max_tokens=m, temperature=0, ignore_eos=True), rid)
        while engine.has_unfinished_requests():
            engine.step()
            if refused_by_layout(engine):
                captions.append(describe_refusal(engine))
    b = meter.breakdown()
    arena = engine._scheduler.kv.arena
    assert arena.num_refused_external > 0
    assert b.external_steps == arena.num_refused_external == len(captions)
    assert b.external > 0 and b.fraction("external") < 1
    assert captions[0] == "D waits for 3 adjacent blocks (prompt + max_tokens); 4 blocks are free, in runs of 2, 2"
    assert meter.admitted_at[("D", 0)] > meter.admitted_at[("C", 0)] == 1
    engine.check_invariants()


def test_paged_never_counts_external_waste(make_engine):
    engine = make_engine(MODEL, block_size=BS, num_blocks=BLOCKS, enable_prefix_caching=False)
    with WasteMeter(engine) as meter:
        engine.generate([list(range(3, 12)), list(range(40, 50)), list(range(60, 66))],
                        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    b = meter.breakdown()
    assert engine.stats().num_preemptions > 0          # the pool was under pressure, and yet
    assert b.external == 0 and b.external_steps == 0
    assert b.reservation + b.internal < b.num_steps and b.utilisation > 0.7


def test_bad_uses_say_what_to_do(make_engine):
    shared = make_engine(MODEL, block_size=BS, num_blocks=BLOCKS)
    with pytest.raises(RuntimeError, match="enable_prefix_caching=False and run n=1"):
        with WasteMeter(shared):
            shared.generate([list(range(3, 12))], SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=1))
    assert shared.stats().num_used == 0 and not shared.has_unfinished_requests()    # nothing leaked
    idle = make_engine(MODEL, block_size=BS, num_blocks=BLOCKS, enable_prefix_caching=False)
    with pytest.raises(RuntimeError, match="inside `with WasteMeter"):
        WasteMeter(idle).breakdown()
    with pytest.raises(ValueError, match="choose one of stored"):
        with WasteMeter(idle) as m:
            idle.generate([list(range(3, 8))], SamplingParams(max_tokens=2, temperature=0))
        m.breakdown().fraction("wasted")
