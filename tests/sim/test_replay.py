"""Record a workload, replay it A/B (issue #36 items 1 and 2).

A trace replayed on the same engine and settings reproduces the original's admissions and greedy
outputs (and those match transformers); the simulator replays it step for step; a trace without
tokens rebuilds prompts that share exactly the recorded blocks; the replay table's figures for an
arm are those `bench tail` / `bench tenants` compute for the same workload; recording costs one
call per request event and nothing per token; bad input is one line.
"""
from __future__ import annotations

import json

import pytest
from IPython.core.error import UsageError

from conftest import assert_same_or_near_tie, tiny_model
from jupyter_pagedkv import EngineConfig, SamplingParams
from jupyter_pagedkv.engine import recording
from jupyter_pagedkv.engine.trace import read_trace
from jupyter_pagedkv.sim.replay import SimScale, replay, replay_in_sim
from jupyter_pagedkv.sim.replay_report import rows, text
from jupyter_pagedkv.sim.replay_run import replay_on_engine
from jupyter_pagedkv.sim.trace_replay import Arm, parse_vary, trace_of
from jupyter_pagedkv.sim.validate import compare_schedules
from jupyter_pagedkv.testing.models import hf_greedy, random_prompts

MODEL = tiny_model("llama", seed=8)
AS_RECORDED = Arm("as recorded", ())


def traffic(engine, path, keep_prompts: bool):
    """Chat-like and batch traffic under pressure: a shared system prompt, two tenants, a turn that
    repeats an earlier prompt and its reply, arrivals while the engine is busy; returns the trace."""
    system = random_prompts(1, 256, seed=5, lo=13, hi=14)[0]
    users = [system + p for p in random_prompts(7, 256, seed=3, lo=6, hi=30)]
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0)
    with engine.record(path, keep_prompts=keep_prompts):
        first = engine.generate(users[:3], greedy(14), tenant="chat")
        follow_up = users[0] + list(first[0].outputs[0].token_ids) + [7, 8, 9]
        for i, p in enumerate(users[3:]):
            engine.add_request(p, greedy(10 + 3 * i), f"batch-{i}", tenant="batch")
            engine.step()
        engine.add_request(follow_up, greedy(12), "follow-up", tenant="chat")
        while engine.has_unfinished_requests():
            engine.step()
    return read_trace(path)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    from jupyter_pagedkv import Engine

    engine = Engine(MODEL, None, block_size=4, num_blocks=20)
    trace = traffic(engine, tmp_path_factory.mktemp("t") / "kept.jsonl", keep_prompts=True)
    engine.check_invariants()
    return engine, trace


def test_same_engine_and_settings_reproduce_admissions_and_greedy_outputs(recorded):
    engine, trace = recorded
    assert engine.stats().num_preemptions > 0                      # the pool was under pressure
    arm = replay_on_engine(engine, trace, "as recorded", {})
    assert len(arm.admitted) == len(trace.finished) == 8
    for r in trace.finished:
        assert arm.admitted[r.request_id] == r.admitted_step, r.request_id
        assert arm.outputs[r.request_id] == r.output_token_ids, r.request_id
    # the outputs themselves are transformers' greedy ones (the oracle, not our earlier run)
    for r in trace.finished[:3]:
        ref = hf_greedy(MODEL, r.prompt_token_ids, r.max_tokens, stop_at_eos=True)
        assert_same_or_near_tie(MODEL, r.prompt_token_ids, arm.outputs[r.request_id], ref)


def test_the_simulator_replays_the_real_schedule_step_for_step(recorded):
    engine, trace = recorded
    for arm in parse_vary(["allocator=paged,contiguous"], engine.config):
        real = replay_on_engine(engine, trace, arm.label, arm.as_dict, keep_schedule=True)
        sim = replay_in_sim(trace, arm, SimScale(), engine)
        check = compare_schedules(real.schedule, sim.schedule)
        assert check.identical, f"{arm.label}: {check.line()}"
        assert real.admitted == sim.admitted
        # the same clock, so the same figures (KV utilisation is sampled differently: not compared)
        assert [(t.request_id, t.ttft, t.latency) for t in sorted(real.summary.requests, key=lambda t: t.request_id)] \
            == [(t.request_id, t.ttft, t.latency) for t in sorted(sim.summary.requests, key=lambda t: t.request_id)]


def test_privacy_default_stores_no_tokens_yet_rebuilds_the_same_sharing(recorded, tmp_path):
    from jupyter_pagedkv import Engine

    engine, kept = recorded
    fresh = Engine(MODEL, None, block_size=4, num_blocks=20)
    private = traffic(fresh, tmp_path / "private.jsonl", keep_prompts=False)
    lines = [json.loads(ln) for ln in (tmp_path / "private.jsonl").read_text().splitlines()]
    assert lines[0]["keeps_prompts"] is False and len(lines) == 9
    for line in lines[1:]:
        assert "prompt_token_ids" not in line and "output_token_ids" not in line
        assert line["block_hashes"] and all(len(h) == 16 for h in line["block_hashes"])
    # The keyed hashes differ between recordings, yet say the same thing: which blocks are shared.
    assert private.requests[0].block_hashes[0] != kept.requests[0].block_hashes[0]
    shared = lambda t: [sum(h in {x for o in t.requests if o is not r for x in o.block_hashes} for h in r.block_hashes)
                        for r in t.requests]
    assert shared(private) == shared(kept) and sum(shared(kept)) > 0
    # Prompts rebuilt from the hashes hit the prefix cache exactly where the real ones did.
    with_tokens = replay_in_sim(kept, AS_RECORDED, SimScale(), engine)
    without = replay_in_sim(private, AS_RECORDED, SimScale(), engine)
    assert compare_schedules(with_tokens.schedule, without.schedule).identical
    real = replay_on_engine(engine, private, "hashes only", {})     # lengths forced, outputs the model's
    assert {rid: len(t) for rid, t in real.outputs.items()} == {r.request_id: r.output_len for r in kept.finished}


def test_recording_is_one_call_per_request_event_and_nothing_per_token(monkeypatch, tmp_path):
    from jupyter_pagedkv import Engine

    calls = {"arrived": 0, "finished": 0, "hashed": 0}
    for name in ("arrived", "finished"):
        original = getattr(recording.Recording, name)
        monkeypatch.setattr(recording.Recording, name,
                            lambda self, req, _o=original, _n=name: (calls.__setitem__(_n, calls[_n] + 1), _o(self, req))[1])
    original_hash = recording.BlockHasher.block_hashes
    monkeypatch.setattr(recording.BlockHasher, "block_hashes",
                        lambda self, ids: (calls.__setitem__("hashed", calls["hashed"] + 1), original_hash(self, ids))[1])
    engine = Engine(MODEL, None, block_size=4, num_blocks=256)
    prompts = random_prompts(6, 256, seed=11)
    with engine.record(tmp_path / "t.jsonl"):
        outs = engine.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 240 and engine.num_steps >= 40
    assert calls == {"arrived": 6, "finished": 6, "hashed": 6}
    assert engine._stepping.recorder is None                         # stopped: the engine pays nothing


def test_replay_table_equals_bench_tail_figures():
    from jupyter_pagedkv.sim import Simulator, synthetic

    reqs = synthetic(30, "alpaca", rate=6.0, seed=2, vocab=128256, max_context=8192)
    preset = dict(model="Llama-3-70B", gpu="H100-80GB", num_gpus=2, max_num_seqs=256, enable_prefix_caching=False)
    trace = trace_of(reqs, 16, config={"enable_prefix_caching": False})
    arms = parse_vary(["allocator=paged,contiguous"], EngineConfig())
    table = rows(replay(trace, arms, "sim", None, SimScale("Llama-3-70B", (2, "H100-80GB"))))
    for row, alloc in zip(table, ("paged", "contiguous")):
        bench = Simulator.for_gpu(allocator=alloc, **preset).run(reqs).summary     # what `bench tail` prints
        t = bench.tail_name
        assert (row[f"TTFT p50 (s)"], row[f"TTFT {t} (s)"], row[f"e2e p50 (s)"], row[f"e2e {t} (s)"]) == \
            (bench.ttft(50), bench.ttft_tail(), bench.latency(50), bench.latency_tail())
        assert (row["tokens/s"], row["KV util"], row["max concurrent"], row["preemptions"]) == \
            (bench.throughput, bench.kv_utilisation, bench.max_concurrent, bench.num_preemptions)


def test_a_trace_of_a_quantized_cache_replays_at_scale_with_that_cache():
    """The trace's recorded kv_cache_dtype sizes the simulated pool (about twice the blocks)."""
    from jupyter_pagedkv.sim import Simulator, synthetic

    preset = dict(model="Llama-3-70B", gpu="H100-80GB", num_gpus=2, enable_prefix_caching=False)
    plain, fp8 = Simulator.for_gpu(**preset), Simulator.for_gpu(kv_cache_dtype="fp8_e4m3", **preset)
    assert fp8.config.num_blocks >= 1.9 * plain.config.num_blocks
    assert fp8.model.kv_bytes_per_token < 0.6 * plain.model.kv_bytes_per_token
    reqs = synthetic(30, "alpaca", rate=6.0, seed=2, vocab=128256, max_context=8192)
    trace = trace_of(reqs, 16, config={"enable_prefix_caching": False, "kv_cache_dtype": "fp8_e4m3"})
    arms = parse_vary(["allocator=contiguous"], EngineConfig())
    row, = rows(replay(trace, arms, "sim", None, SimScale("Llama-3-70B", (2, "H100-80GB"))))
    bench = Simulator.for_gpu(allocator="contiguous", kv_cache_dtype="fp8_e4m3", **preset).run(reqs).summary
    assert (row["max concurrent"], row["preemptions"], row["KV util"]) == \
        (bench.max_concurrent, bench.num_preemptions, bench.kv_utilisation)


def test_replay_table_equals_bench_tenants_figures():
    from jupyter_pagedkv.sim.tenant_comparison import compare, sim_runs
    from jupyter_pagedkv.sim.tenant_workload import TenantMix, noisy_neighbour

    mix = TenantMix(quiet_requests=24, quiet_rate=2.0, noisy_at=2.0)      # 16 long generations overfill the pool
    weights = {"quiet": 1.0, "noisy": 1.0}
    preset = dict(model="Llama-3-70B", gpu="H100-80GB", num_gpus=2)
    bench = compare(sim_runs(mix, 0, weights, **preset), weights)                   # what `bench tenants` prints
    trace = trace_of(noisy_neighbour(mix, 0), 16, tenants={t: {"weight": w} for t, w in weights.items()})
    arms = parse_vary(["scheduling=fcfs,fair"], EngineConfig())
    table = rows(replay(trace, arms, "sim", None, SimScale("Llama-3-70B", (2, "H100-80GB"))))
    assert bench["fcfs"]["preemptions"] + bench["fair"]["preemptions"] > 0           # the tenants competed
    for row, policy in zip(table, ("fcfs", "fair")):
        for tenant in ("quiet", "noisy"):
            b = bench[policy][tenant]
            assert row[f"{tenant} TTFT {b['tail']} (s)"] == b["ttft_tail_s"]
            assert row[f"{tenant} tokens/s"] == b["tokens_per_s"]
        assert row["preemptions"] == bench[policy]["preemptions"]
    assert 0.5 <= table[0]["Jain"] <= 1.0


@pytest.mark.parametrize("vary, message", [
    (["colour=red"], "unknown key 'colour'; choose from allocator, scheduling"),
    (["allocator=paged,blocky"], "allocator must be 'paged' or 'contiguous', got 'blocky'"),
    (["scheduling=lottery"], "scheduling_policy must be"),
    (["block_size=8,x"], "block_size='x': give positive integers"),
    (["prefix_caching=maybe"], "give on or off"),
    (["allocator"], "write KEY=V1,V2"),
    (["allocator=paged", "allocator=contiguous"], "allocator is given twice"),
])
def test_bad_vary_is_one_line(vary, message):
    with pytest.raises(ValueError) as err:
        parse_vary(vary, EngineConfig())
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_replay_lines_are_one_usage_error(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from jupyter_pagedkv.notebook import lab

    monkeypatch.chdir(tmp_path)
    session = SimpleNamespace(engine=None)
    for line, message in [("nothere", "no trace at 'nothere.jsonl': record one"),
                          ("", "the following arguments are required: name"),
                          ("t --scale moon", "invalid choice: 'moon'"),
                          ("t --model gpt-9 --scale sim", "--model 'gpt-9': the simulator knows")]:
        if line.startswith("t "):
            (tmp_path / "t.jsonl").write_text('{"format": "jupyter-pagedkv-trace", "version": 1, "model": "m", '
                                              '"revision": null, "block_size": 16, "vocab_size": 9, '
                                              '"keeps_prompts": false}\n')
        with pytest.raises(UsageError) as err:
            lab.replay(session, None, line)
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    (tmp_path / "old.jsonl").write_text('{"format": "jupyter-pagedkv-trace", "version": 99}\n')
    with pytest.raises(UsageError, match="version 99; this jupyter-pagedkv reads version 1"):
        lab.replay(session, None, "old")
    with pytest.raises(UsageError, match="nothing is being recorded"):
        lab.record(session, "stop")
    with pytest.raises(UsageError, match="write `%pagedkv record start"):
        lab.record(session, "pause")


def test_the_table_prints_every_arm(recorded):
    engine, trace = recorded
    results = replay(trace, parse_vary(["allocator=paged,contiguous"], engine.config), "both", engine)
    out = text(results)
    assert out.count("allocator=paged") == 2 and out.count("allocator=contiguous") == 2
    contiguous = next(r for r in results if r.label == "allocator=contiguous" and r.where == "engine")
    assert contiguous.waste is not None and contiguous.waste.reservation > 0     # it reserves max_tokens
    assert all(r.snapshot is not None for r in results if r.where == "engine")
