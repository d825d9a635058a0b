"""The public Engine API: streaming, background stepping, abort, stats and snapshots."""
from __future__ import annotations

import threading

import pytest

from conftest import tiny_model
from jupyter_pagedkv import SamplingParams

MODEL = tiny_model("llama", seed=2)
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]


def test_stream_yields_every_token_once_and_then_finishes(make_engine):
    engine = make_engine(MODEL)
    expected = engine.generate([PROMPTS[0]], GREEDY)[0].token_ids
    deltas = list(engine.stream(PROMPTS[0], GREEDY))
    assert [t for d in deltas for t in d.token_ids] == expected
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert all(not d.finished for d in deltas[:-1])


def test_closing_a_stream_early_aborts_the_request_and_frees_its_blocks(make_engine):
    engine = make_engine(MODEL)
    stream = engine.stream(PROMPTS[2], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    next(stream)
    next(stream)
    assert engine.stats().num_used > 0
    stream.close()
    assert not engine.has_unfinished_requests()
    assert engine.stats().num_used == 0


def test_background_thread_serves_concurrent_callers(make_engine):
    engine = make_engine(MODEL)
    expected = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    engine.start()
    results: dict[int, list[int]] = {}

    def call(i):
        results[i] = engine.generate([PROMPTS[i]], GREEDY)[0].token_ids

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()        # bounded by pytest-timeout, not by a guess at how slow the machine is
    streamed = [t for d in engine.stream(PROMPTS[1], GREEDY) for t in d.token_ids]
    engine.stop()
    assert [results[i] for i in range(3)] == expected
    assert streamed == expected[1]


def test_requests_added_under_admission_are_all_in_the_loops_next_step(make_engine):
    """`with engine.admission():` the background loop takes no step, so all three prompts are
    queued before its next one and its first step holds them all (they fit one step's budget), as
    a cell's prompts and a `generate` list are. Between two adds the test gives the loop half a
    second to step: it cannot (without the hold it would, and its first step would hold one
    prompt). The engine's lock is not held meanwhile: another thread reads its stats."""
    engine = make_engine(MODEL)
    engine.trace = []
    stepped = threading.Event()
    engine.add_step_listener(stepped.set)
    engine.start()
    try:
        with engine.admission():
            ids = []
            for p in PROMPTS:
                ids.append(engine.add_request(p, GREEDY))
                assert not stepped.wait(0.5)
            reader = threading.Thread(target=engine.stats)
            reader.start()
            reader.join()               # would never return were the lock held here
            with pytest.raises(RuntimeError, match=r"^cannot wait for requests inside `with engine.admission\(\):`"):
                engine.generate([PROMPTS[0]], GREEDY)
            with pytest.raises(RuntimeError, match="wait after the block"):
                next(engine.stream(PROMPTS[0], GREEDY))
        assert all(engine._handle(rid).done.wait(600) for rid in ids)
    finally:
        engine.stop()
    assert {chunk[0] for chunk in engine.trace[0].chunks} == set(ids)
    assert engine.generate([PROMPTS[0]], GREEDY)[0].token_ids      # after the block: served


def test_abort_frees_blocks_at_once_and_reports_abort(make_engine):
    engine = make_engine(MODEL)
    rid = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.stats().num_used > 0
    assert engine.abort(rid)
    engine.check_invariants()
    assert engine.stats().num_used == 0
    assert engine._finished[-1].seqs[0].finish_reason == "abort"
    assert not engine.abort(rid)


def test_outputs_carry_metrics_and_cached_tokens(make_engine):
    engine = make_engine(MODEL, block_size=4)
    prompt = list(range(3, 40))
    first = engine.generate([prompt], GREEDY)[0]
    second = engine.generate([prompt + [50]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == len(prompt) // 4 * 4
    m = second.metrics
    assert 0 < m.ttft <= m.latency and m.tpot > 0


def test_paged_waste_is_under_one_block_per_live_sequence(make_engine):
    engine = make_engine(MODEL, block_size=8)
    ids = [engine.add_request(p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
           for p in PROMPTS * 3]
    for _ in range(7):
        engine.step()
        s = engine.stats()
        live = s.num_running + s.num_waiting
        assert s.internal_waste < engine.block_size * max(live, 1)
        assert s.slots_allocated - s.tokens_stored == s.internal_waste
    for rid in ids:
        engine.abort(rid)


def test_pool_snapshot_names_states_and_owners(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=16)
    engine.generate([list(range(3, 20))], GREEDY)      # leaves cached blocks behind
    rid = engine.add_request(list(range(30, 41)), GREEDY)
    engine.step()
    snap = engine.pool_snapshot()
    assert set(snap["states"]) <= {"free", "cached", "used", "shared"}
    assert "cached" in snap["states"] and "used" in snap["states"]
    used = [i for i, s in enumerate(snap["states"]) if s == "used"]
    assert all(snap["owners"][i] == [rid] for i in used)
    engine.abort(rid)


@pytest.mark.parametrize("use_tqdm", [False, True])
def test_generate_returns_outputs_in_prompt_order(make_engine, use_tqdm):
    engine = make_engine(MODEL)
    outs = engine.generate(PROMPTS, GREEDY, use_tqdm=use_tqdm)
    assert [o.prompt_token_ids for o in outs] == PROMPTS


def test_lower_priority_numbers_are_admitted_first(make_engine):
    engine = make_engine(MODEL, max_num_seqs=1)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    late = [engine.add_request(p, params, priority=1) for p in PROMPTS[:2]]
    urgent = engine.add_request(PROMPTS[2], params, priority=0)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == [urgent, *late]


def test_preemption_takes_the_lowest_priority_first(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=12)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    background = engine.add_request(list(range(3, 15)), params, priority=5)   # older, less urgent
    engine.step()
    urgent = engine.add_request(list(range(20, 32)), params, priority=0)
    while engine.has_unfinished_requests():
        engine.step()
    seqs = {r.request_id: r.seqs[0] for r in engine._finished}
    assert seqs[background].num_preemptions > 0 and seqs[urgent].num_preemptions == 0


def test_request_rows_keep_as_many_finished_rows_as_asked(make_engine):
    engine = make_engine(MODEL, block_size=4)
    engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=2, temperature=0.0))
    assert engine.request_rows(finished=0) == []          # not "all of them" ([-0:] is the whole list)
    assert [r.state for r in engine.request_rows(finished=1)] == ["done"]
    assert len(engine.request_rows()) == 2


def test_from_pretrained_keeps_the_config_device_and_dtype_unless_told(monkeypatch):
    """`device` and `dtype` given to from_pretrained override the config's; not given, the config's
    stand (they were once reset to "auto" by the arguments' defaults)."""
    import torch

    from jupyter_pagedkv import Engine, EngineConfig
    from jupyter_pagedkv.worker import loader

    asked = []

    def load_model(model, dtype, device, **kwargs):
        asked.append((dtype, torch.device(device).type))
        raise RuntimeError("stop here")

    monkeypatch.setattr(loader, "load_model", load_model)
    for kwargs in ({"config": EngineConfig(device="cpu", dtype="bfloat16")},
                   {"config": EngineConfig(device="cpu", dtype="bfloat16"), "dtype": "float32"}):
        with pytest.raises(RuntimeError, match="stop here"):
            Engine.from_pretrained("some/model", **kwargs)
    assert asked == [(torch.bfloat16, "cpu"), (torch.float32, "cpu")]
