"""The simulator runs the engine's own scheduler: it must reproduce a real run step for step."""
from __future__ import annotations

import math

import pytest

from conftest import tiny_model
from jupyter_pagedkv import SamplingParams
from jupyter_pagedkv.sim import CostModel, ModelCost, SimConfig, Simulator, StepWork, synthetic
from jupyter_pagedkv.sim.serve import TimedPrompt, serve
from jupyter_pagedkv.sim.validate import offline_check, sim_config_of
from jupyter_pagedkv.testing.models import random_prompts

MODEL = tiny_model("llama", seed=8)


def timed(n: int = 8, seed: int = 21, max_tokens: int = 32, rate: float = 0.0) -> list[TimedPrompt]:
    prompts = random_prompts(n, 256, seed=seed)
    return [TimedPrompt(f"r{i}", i / rate if rate else 0.0, p,
                        SamplingParams(max_tokens=max_tokens - max_tokens // 4 * (i % 4), temperature=0.0))
            for i, p in enumerate(prompts)]


@pytest.mark.parametrize("kwargs", [
    dict(num_blocks=24),                                               # heavy recompute preemption
    dict(num_blocks=24, preemption_mode="swap", swap_space="4MiB"),   # heavy swapping
    dict(num_blocks=48, allocator="contiguous"),                       # the baseline's queueing
    dict(num_blocks=256, max_num_batched_tokens=16),                   # chunked prefill
], ids=["recompute", "swap", "contiguous", "chunked"])
def test_offline_schedule_is_reproduced_step_for_step(make_engine, kwargs):
    engine = make_engine(MODEL, block_size=4, **kwargs)
    check, trace = offline_check(engine, timed())
    assert check.identical, check.line()
    assert check.real_steps == len(trace) > 8
    if kwargs.get("num_blocks") == 24:
        assert check.real_preemptions > 0                              # the pressure was real


def test_the_simulator_mirrors_the_engine_configuration(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=40, max_num_seqs=3, preemption_mode="swap",
                         swap_space="1MiB")
    cfg = sim_config_of(engine)
    assert (cfg.num_blocks, cfg.block_size, cfg.max_num_seqs, cfg.preemption_mode) == (40, 4, 3, "swap")
    assert cfg.swap_blocks == engine._swap.num_slots > 0


def test_serve_measures_latency_from_the_intended_arrival(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=128)
    summary, outputs = serve(engine, timed(4, rate=20.0, max_tokens=8), "real")
    assert len(summary.requests) == 4 and set(outputs) == {"r0", "r1", "r2", "r3"}
    for r in summary.requests:
        assert r.arrival_s <= r.first_token_s <= r.finish_s
    assert 0 < summary.kv_utilisation <= 1 and summary.max_concurrent >= 1


def test_cost_model_fit_recovers_known_coefficients():
    truth = CostModel(0.01, 2e-11, 3e-12, 0)
    works = [StepWork(1e9 + 1e8 * i, 1e9 * (i % 5 + 1) ** 2, 0) for i in range(20)]
    fitted = CostModel.fit(works, [truth.step_time(w) for w in works])
    for name in ("overhead_s", "s_per_byte", "s_per_flop"):
        assert math.isclose(getattr(fitted, name), getattr(truth, name), rel_tol=1e-6), name


def test_cost_model_fit_never_returns_a_negative_coefficient():
    works = [StepWork(1e9, 1e9 * i, 0) for i in range(1, 6)]
    fitted = CostModel.fit(works, [0.5 - 0.01 * i for i in range(1, 6)])   # time falls with work
    assert min(fitted.overhead_s, fitted.s_per_byte, fitted.s_per_flop) >= 0


def test_cost_model_prices_grouped_query_attention_and_tensor_parallelism():
    m = ModelCost.of("Llama-3-70B")
    assert m.kv_bytes_per_token == 327_680
    one = CostModel.for_gpu("H100-80GB", 1).step_time(m.work([(1000, 1, True)] * 64))
    four = CostModel.for_gpu("H100-80GB", 4).step_time(m.work([(1000, 1, True)] * 64))
    assert one / 4 < four < one                                   # split 4 ways, plus all-reduces


def small_sim(allocator: str, **kw) -> Simulator:
    kw.setdefault("num_blocks", 400)
    return Simulator(SimConfig(block_size=16, max_num_seqs=64, allocator=allocator, **kw),
                     ModelCost.of("Llama-3-8B"), CostModel.for_gpu("A100-80GB"))


def test_paging_keeps_kv_utilisation_high_and_the_baseline_does_not():
    """ShareGPT-long sequences: paging wastes under one block of ~30; the baseline reserves 1,024."""
    reqs = synthetic(150, "sharegpt", rate=100.0, seed=1, vocab=128256, max_context=2048)
    cfg = dict(num_blocks=1200, max_model_len=2048)
    paged = small_sim("paged", **cfg).run(reqs, "paged").summary
    contiguous = small_sim("contiguous", **cfg).run(reqs, "contiguous").summary
    assert paged.kv_utilisation >= 0.96 > 0.5 > contiguous.kv_utilisation
    assert paged.max_concurrent > 2 * contiguous.max_concurrent
    assert len(paged.requests) == len(contiguous.requests) == 150


def test_simulated_swap_preemption_returns_every_block_and_slot():
    reqs = synthetic(120, "sharegpt", rate=100.0, seed=2, vocab=128256, max_context=2048)
    res = small_sim("paged", preemption_mode="swap", swap_blocks=200, max_model_len=2048).run(reqs)
    assert res.summary.num_preemptions > 0 and len(res.summary.requests) == 120


def test_shared_system_prompts_are_prefix_cache_hits_in_the_simulator():
    reqs = synthetic(60, "alpaca", rate=50.0, seed=3, vocab=128256, system_prompt_len=512, num_tenants=2)
    res = small_sim("paged").run(reqs)
    assert res.summary.kv_utilisation > 0.9 and len(res.summary.requests) == 60


def test_a_request_larger_than_the_pool_is_one_clear_error():
    reqs = synthetic(1, "sharegpt", seed=4, vocab=1000)
    sim = Simulator(SimConfig(num_blocks=2, block_size=16), ModelCost.of("Llama-3-8B"), CostModel(0, 0, 0, 0))
    with pytest.raises(ValueError, match="lower its max_tokens or give more blocks"):
        sim.run(reqs)


def test_small_runs_report_max_not_p99():
    """A P99 over 12 samples is the maximum in disguise: the summary names it "max" and returns the
    maximum; from 20 samples on it is the interpolated 99th percentile."""
    from jupyter_pagedkv.sim.summary import RequestTiming, RunSummary, tail, tail_name

    small = [float(v) for v in range(1, 13)]
    assert tail_name(len(small)) == "max" and tail(small) == 12.0
    big = [float(v) for v in range(1, 101)]
    assert tail_name(len(big)) == "P99" and tail(big) == pytest.approx(99.01)
    run = RunSummary("r", [RequestTiming(str(i), 0.0, 0.1 * i, float(i), 4) for i in range(1, 6)], 5.0, 0.5, 5)
    assert run.tail_name == "max" and run.latency_tail() == 5.0 and " max " in run.line() and "p99" not in run.line()


def test_status_lines_name_a_small_tail_max():
    """`%pagedkv status` (EngineStats.summary) and the server client's line: over 5 requests the
    nearest-rank p99 is the maximum, and is named so; over 25 it is a p99."""
    from types import SimpleNamespace

    from jupyter_pagedkv.core.stats import latency_line, latency_percentiles

    few = latency_percentiles(SimpleNamespace(ttft=0.1 * i, tpot=0.01, latency=float(i)) for i in range(1, 6))
    assert few["latency"]["count"] == 5 and few["latency"]["p99"] == 5.0
    assert latency_line(few) == "TTFT p50 300 ms / max 500 ms, end-to-end p50 3.00 s / max 5.00 s"
    many = latency_percentiles(SimpleNamespace(ttft=0.1, tpot=0.01, latency=float(i)) for i in range(1, 26))
    assert " / p99 " in latency_line(many) and "max" not in latency_line(many)
    assert latency_line({}) is None
