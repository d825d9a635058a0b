"""A failure ends only the requests it touched: each ends with finish reason "error" ("abort" for
Ctrl-C) and the exception's one line, returns every block, and the engine goes on serving the
others and the next request exactly (against transformers' own greedy generate)."""
from __future__ import annotations

import queue
import time
from collections import Counter

import pytest
import torch

from conftest import hf_greedy, tiny_model
from jupyter_pagedkv import BeamSearchParams, SamplingParams
from jupyter_pagedkv.testing.models import random_prompts

MODEL = tiny_model("llama", seed=12)
NEW = 12
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
PROMPTS = random_prompts(4, 256, seed=31, lo=6, hi=30)
REFS = {tuple(p): hf_greedy(MODEL, p, NEW, stop_at_eos=False) for p in PROMPTS}
NEXT = [9, 8, 7, 6, 5, 4]


class Boom(RuntimeError):
    """The injected failure."""


def run_out(engine) -> dict[str, object]:
    """Step until nothing is left; the outputs of every request that finished meanwhile."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def finished(engine, rid: str):
    return next(r for r in engine._finished if r.request_id == rid)


def assert_failed(engine, rid: str, error: type, reason: str = "error") -> None:
    req = finished(engine, rid)
    assert isinstance(req.error, error), req.error
    assert all(s.finish_reason == reason for s in req.seqs)
    assert "\n" not in str(req.error)


def assert_exact(engine, rid: str, prompt: list[int]) -> None:
    assert finished(engine, rid).error is None
    assert engine._outputs.output(finished(engine, rid)).token_ids == REFS[tuple(prompt)]


def assert_clean_and_serving(engine) -> None:
    """No block referenced, invariants hold, and the next request is exact."""
    engine.check_invariants()
    assert engine.stats().num_used == 0 and not engine.has_unfinished_requests()
    out = engine.generate([NEXT], GREEDY)[0]
    assert out.token_ids == hf_greedy(MODEL, NEXT, NEW, stop_at_eos=False)
    engine.check_invariants()


def fail_on_call(obj, name: str, when, error: BaseException):
    """Make `obj.name` raise `error` once: on the first call for which `when(call_index, *args)`
    holds."""
    real = getattr(obj, name)
    calls = [0, False]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if not calls[1] and when(calls[0], *args):
            calls[1] = True
            raise error
        return real(*args, **kwargs)

    setattr(obj, name, wrapper)
    return calls


def test_a_failing_forward_ends_the_steps_requests_and_not_the_waiting_one(make_engine):
    engine = make_engine(MODEL, block_size=4, max_num_seqs=2)
    a, b, c = (engine.add_request(p, GREEDY) for p in PROMPTS[:3])
    engine.step()                                       # a and b prefill; c waits for a seat
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    fail_on_call(engine._runner, "execute", lambda i, *a: i == 1, oom)
    with pytest.raises(torch.OutOfMemoryError):
        engine.step()
    for rid in (a, b):
        assert_failed(engine, rid, torch.OutOfMemoryError)
    run_out(engine)
    assert_exact(engine, c, PROMPTS[2])
    assert_clean_and_serving(engine)


def test_a_failing_sampler_ends_only_the_rows_it_was_sampling(make_engine):
    """`a` decodes while `b`'s long prompt is still being prefilled in chunks: the sampler call
    that fails holds only `a`'s row."""
    long_prompt = random_prompts(1, 256, seed=5, lo=60, hi=61)[0]
    REFS[tuple(long_prompt)] = hf_greedy(MODEL, long_prompt, NEW, stop_at_eos=False)
    engine = make_engine(MODEL, block_size=4, max_num_batched_tokens=16)
    a = engine.add_request(PROMPTS[0], GREEDY)
    engine.step()                                       # a's prompt (< 16 tokens) computed
    b = engine.add_request(long_prompt, GREEDY)
    engine._stepping.sampler = FailingSampler(engine._sampler)     # the sampler the step calls
    outputs = engine.step()                             # a samples (and fails); b's first chunk
    assert {o.request_id for o in outputs} == {a, b}
    assert_failed(engine, a, Boom)
    run_out(engine)
    assert_exact(engine, b, long_prompt)
    assert_clean_and_serving(engine)


class FailingSampler:
    """The engine's sampler, raising on its first call."""

    def __init__(self, real) -> None:
        self.real, self.generator, self.calls = real, real.generator, 0
        self.grammar_mask = real.grammar_mask          # the step reads its mask time

    def __call__(self, logits, seqs):
        self.calls += 1
        if self.calls == 1:
            raise Boom("sampler broke")
        return self.real(logits, seqs)


class FailingDrafter:
    """A drafter that raises: speculation is optional, but a request that asked for it ends."""

    name = "failing"
    needs_slots = False

    def propose(self, seqs, ks, copies):
        raise Boom("drafter broke")

    def rolled_back(self, seq, num_computed):
        pass


def test_a_failing_drafter_ends_its_requests_and_the_plain_ones_finish_exactly(make_engine):
    engine = make_engine(MODEL, block_size=4)
    engine.add_drafter(FailingDrafter())
    spec = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, speculative="failing")
    a = engine.add_request(PROMPTS[0], spec)
    b = engine.add_request(PROMPTS[1], GREEDY)
    run_out(engine)
    assert_failed(engine, a, Boom)
    assert finished(engine, a).seqs[0].num_output_tokens >= 1     # it drafted from its second token
    assert_exact(engine, b, PROMPTS[1])
    assert_clean_and_serving(engine)


class Tokenizer:
    """Just enough tokenizer for stop strings; decoding `poison` raises."""

    eos_token_id = None

    def __init__(self, poison: int) -> None:
        self.poison = poison

    def decode(self, ids, skip_special_tokens=True, **kwargs):
        if self.poison in ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return " ".join(map(str, ids))

    def __call__(self, text):
        raise AssertionError("the tests pass token ids")


def test_a_failing_detokenisation_ends_only_that_request(make_engine):
    a_ref, b_ref = REFS[tuple(PROMPTS[0])], REFS[tuple(PROMPTS[1])]
    poison = next(t for t in a_ref if t not in b_ref)
    engine = make_engine(MODEL, Tokenizer(poison), block_size=4)
    a = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True,
                                                      stop=["never printed"]))
    b = engine.add_request(PROMPTS[1], GREEDY)
    run_out(engine)
    assert_failed(engine, a, UnicodeDecodeError)
    assert_exact(engine, b, PROMPTS[1])
    engine.tokenizer = engine._outputs.tokenizer = None
    assert_clean_and_serving(engine)


class GoneConsumer:
    """A listener whose reader went away: every put fails."""

    def put(self, delta):
        raise BrokenPipeError("the reader of this stream is gone")


def test_a_listener_whose_consumer_is_gone_ends_its_request(make_engine):
    engine = make_engine(MODEL, block_size=4)
    a = engine.add_request(PROMPTS[0], GREEDY, listener=GoneConsumer())
    alive: queue.SimpleQueue = queue.SimpleQueue()
    b = engine.add_request(PROMPTS[1], GREEDY, listener=alive)
    run_out(engine)
    assert_failed(engine, a, Exception)
    assert "gone" in str(finished(engine, a).error)
    assert_exact(engine, b, PROMPTS[1])
    deltas = []
    while not alive.empty():
        deltas.append(alive.get())
    assert deltas[-1].finished and sum(len(d.token_ids) for d in deltas) == NEW
    assert_clean_and_serving(engine)


def test_the_background_loop_dying_ends_every_live_request_and_a_restart_serves(make_engine):
    engine = make_engine(MODEL, block_size=4, max_num_seqs=1)
    fail_on_call(engine._runner, "execute", lambda i, *a: i == 3, SystemExit("the loop's thread was told to exit"))
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS[:3]]
    engine.start()
    assert all(engine._handle(rid).done.wait(timeout=600) for rid in ids)
    # The loop ends the requests, then its thread returns: wait for the thread, not for luck.
    deadline = time.monotonic() + 600
    while engine.is_running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.is_running
    for rid in ids:
        assert_failed(engine, rid, SystemExit)
    engine.start()                                      # serving again
    out = engine.generate([PROMPTS[3]], GREEDY)[0]
    assert out.token_ids == REFS[tuple(PROMPTS[3])]
    engine.stop()
    assert_clean_and_serving(engine)


# -- Ctrl-C -----------------------------------------------------------------------------------------
def test_ctrl_c_during_a_synchronous_generate_aborts_what_it_touched(make_engine):
    engine = make_engine(MODEL, block_size=4)
    fail_on_call(engine._runner, "execute", lambda i, *a: i == 4, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        engine.generate(PROMPTS[:2], GREEDY)            # no background thread: this call steps
    for req in list(engine._finished)[-2:]:
        assert req.seqs[0].finish_reason == "abort" and 0 < req.seqs[0].num_output_tokens < NEW
    assert_clean_and_serving(engine)


def test_ctrl_c_during_a_long_prefill_leaves_a_waiting_request_exact(make_engine):
    long_prompt = random_prompts(1, 256, seed=6, lo=90, hi=91)[0]
    engine = make_engine(MODEL, block_size=4, max_num_batched_tokens=32, max_num_seqs=1)
    victim = engine.add_request(long_prompt, GREEDY)
    waiting = engine.add_request(PROMPTS[2], GREEDY)    # no seat until the victim is gone
    engine.step()                                       # the victim's first 32 tokens
    fail_on_call(engine._runner, "execute", lambda i, *a: i == 1, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        engine.step()                                   # its second chunk is cut short
    assert_failed(engine, victim, KeyboardInterrupt, reason="abort")
    run_out(engine)
    assert_exact(engine, waiting, PROMPTS[2])
    assert_clean_and_serving(engine)


def test_ctrl_c_during_beam_search_returns_every_beam_block(make_engine):
    engine = make_engine(MODEL, block_size=4)
    plain = engine.add_request(PROMPTS[1], GREEDY)
    fail_on_call(engine._runner, "execute", lambda i, *a: i == 5, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        engine.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=3, max_tokens=10))
    beam = [r for r in engine._finished if r.beam is not None][0]
    assert all(s.is_finished for s in beam.seqs)
    run_out(engine)
    assert_clean_and_serving(engine)
    assert plain in {r.request_id for r in engine._finished}


def test_ctrl_c_during_speculation_keeps_the_engine_exact(make_engine):
    engine = make_engine(MODEL, block_size=4, speculative="ngram", num_speculative_tokens=3)
    prompts = [p + p for p in PROMPTS[:2]]             # repetition: the n-gram drafter proposes
    for p in prompts:
        REFS.setdefault(tuple(p), hf_greedy(MODEL, p, NEW, stop_at_eos=False))
    fail_on_call(engine._runner, "execute", lambda i, chunks, *a: any(c.num_logits > 1 for c in chunks),
                 KeyboardInterrupt())
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    with pytest.raises(KeyboardInterrupt):
        run_out(engine)
    for rid in ids:
        assert finished(engine, rid).seqs[0].finish_reason == "abort"
    assert_clean_and_serving(engine)


def test_ctrl_c_during_a_swap_fails_the_swapped_sequence_and_keeps_the_rest_exact(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=14, preemption_mode="swap", swap_space="4MiB")
    fail_on_call(engine._kv_cache, "swap_out", lambda i, pairs: bool(pairs), KeyboardInterrupt())
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS[:3]]
    with pytest.raises(KeyboardInterrupt):
        run_out(engine)
    aborted = [rid for rid in ids if finished_with_error(engine, rid)]
    assert aborted, "a swap happened and was interrupted"
    run_out(engine)
    for rid, p in zip(ids, PROMPTS):
        if rid not in aborted:
            assert_exact(engine, rid, p)
    assert engine._swap.num_used == 0
    assert_clean_and_serving(engine)


def finished_with_error(engine, rid: str) -> bool:
    req = next((r for r in engine._finished if r.request_id == rid), None)
    return req is not None and req.error is not None


# -- swap-in and allocation failures ----------------------------------------------------------------
def untouched_at_failure(engine, obj, name: str, when, error: BaseException) -> list[str]:
    """Make `obj.name` raise `error` once (as fail_on_call) and return the ids of the requests the
    failing step had not touched (waiting or swapped) at that moment: they must go on exactly."""
    untouched: list[str] = []

    def when_recorded(i, *args):
        if when(i, *args):
            sched = engine._scheduler
            planned = {id(s) for s in sched.plan.preempted}        # swapped out by the failing step
            untouched.extend(s.request_id for s in [*sched.waiting, *sched.swapped] if id(s) not in planned)
            return True
        return False

    fail_on_call(obj, name, when_recorded, error)
    return untouched


def test_a_failing_swap_in_fails_the_steps_requests_and_the_untouched_finish_exactly(make_engine):
    # Two seats, four requests: two wait while the running pair outgrow 14 blocks and swap.
    engine = make_engine(MODEL, block_size=4, num_blocks=14, max_num_seqs=2, preemption_mode="swap",
                         swap_space="4MiB")
    untouched = untouched_at_failure(engine, engine._kv_cache, "swap_in", lambda i, pairs: bool(pairs),
                                     Boom("the host-to-device copy failed"))
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    with pytest.raises(Boom):
        run_out(engine)
    resumed = engine._scheduler.plan.resumed
    assert resumed and untouched, "a swap-in happened while other requests waited"
    for rid in {s.request_id for s in resumed}:
        assert_failed(engine, rid, Boom)
        assert str(finished(engine, rid).error) == "the host-to-device copy failed"
    engine.check_invariants()
    run_out(engine)
    for rid, p in zip(ids, PROMPTS):
        if rid in untouched:
            assert_exact(engine, rid, p)
    assert engine._swap.num_used == 0
    assert_clean_and_serving(engine)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_an_allocation_failing_mid_step_ends_what_the_step_planned_and_returns_every_block(
        make_engine, preemption_mode):
    swap = dict(swap_space="4MiB") if preemption_mode == "swap" else {}
    engine = make_engine(MODEL, block_size=4, num_blocks=14, max_num_seqs=2, preemption_mode=preemption_mode,
                         **swap)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    for _ in range(4):
        engine.step()                                   # both seats decoding, two requests waiting
    # The next block a growing table asks for fails (the pool's allocate raises).
    untouched = untouched_at_failure(engine, engine._pool, "allocate", lambda i, *a: True,
                                     Boom("allocation failed"))
    free_before = engine._pool.num_free
    with pytest.raises(Boom):
        run_out(engine)
    plan = engine._scheduler.plan
    failed = [rid for rid in ids if finished_with_error(engine, rid)]
    assert plan.attempting is not None and plan.attempting.request_id in failed
    for rid in failed:
        assert_failed(engine, rid, Boom)
    assert untouched and not set(untouched) & set(failed)
    engine.check_invariants()                           # no half-grown table, no stray reference
    assert engine._pool.num_free >= free_before
    run_out(engine)
    for rid, p in zip(ids, PROMPTS):
        if rid in untouched:
            assert_exact(engine, rid, p)
    if engine._swap is not None:
        assert engine._swap.num_used == 0
    assert_clean_and_serving(engine)


def test_a_growth_that_fails_part_way_takes_no_block():
    from jupyter_pagedkv.core.block_pool import BlockPool
    from jupyter_pagedkv.core.block_table import BlockTable

    pool = BlockPool(8, 4)
    table = BlockTable(pool)
    table.grow(3, [])
    fail_on_call(pool, "allocate", lambda i, *a: i == 2, Boom("second block"))
    with pytest.raises(Boom):
        table.grow(13, [])                              # needs 3 more blocks; the second fails
    assert (len(table.blocks), table.num_slots, pool.num_free, pool.num_used) == (1, 3, 7, 1)
    pool.check_invariants(Counter(b.block_id for b in table.blocks))
