"""Greedy output of the engine equals transformers' `generate`, under every scheduling regime."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_same_or_near_tie, hf_greedy, tiny_model
from jupyter_pagedkv import SamplingParams
from jupyter_pagedkv.testing.models import random_prompts

ARCHS = ["llama", "qwen3", "mistral", "phi3"]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
# Where a GPU exists the engine runs there too, on both attention backends (`make gpu-check`).
BACKENDS = [("cpu", "torch")] + ([("cuda", "triton"), ("cuda", "torch")] if torch.cuda.is_available() else [])


@pytest.fixture(params=BACKENDS, ids=lambda b: f"{b[0]}-{b[1]}")
def backend(request):
    return request.param


def engine_on(make_engine, model, backend, **kwargs):
    """An engine over `model` moved to the backend's device (the CPU copy stays the oracle)."""
    import copy

    device, attention = backend
    if device != "cpu":
        model = copy.deepcopy(model).to(device)
    return make_engine(model, attention_backend=attention, **kwargs)


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request):
    model = tiny_model(request.param)
    prompts = random_prompts(8, 256, seed=7)
    refs = [hf_greedy(model, p, 32, stop_at_eos=False) for p in prompts]
    return request.param, model, prompts, refs


def check(model, prompts, refs, outputs):
    identical = [assert_same_or_near_tie(model, p, o.token_ids, r) for p, o, r in zip(prompts, outputs, refs)]
    # Near-ties may excuse a rare flip, never most of the batch.
    assert sum(identical) >= len(identical) - 1


def test_batch_of_8_is_token_identical_to_hf_generate(arch_case, make_engine, backend):
    _, model, prompts, refs = arch_case
    engine = engine_on(make_engine, model, backend, block_size=16)
    check(model, prompts, refs, engine.generate(prompts, GREEDY))


def test_identical_under_preemption(arch_case, make_engine, backend):
    _, model, prompts, refs = arch_case
    # 24 blocks of 4 slots cannot hold 8 sequences of up to ~90 tokens: recompute preemption.
    engine = engine_on(make_engine, model, backend, block_size=4, num_blocks=24)
    check(model, prompts, refs, engine.generate(prompts, GREEDY))
    assert engine.stats().num_preemptions > 0


def test_identical_with_chunked_prefill(arch_case, make_engine, backend):
    _, model, prompts, refs = arch_case
    engine = engine_on(make_engine, model, backend, block_size=8, max_num_batched_tokens=13)
    assert max(len(p) for p in prompts) > 13
    check(model, prompts, refs, engine.generate(prompts, GREEDY))


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_identical_with_prefix_caching_on_and_off(prefix_caching, make_engine):
    model = tiny_model("llama")
    shared = random_prompts(1, 256, seed=3, lo=40, hi=41)[0]
    prompts = [shared + tail for tail in random_prompts(6, 256, seed=4, lo=1, hi=20)]
    refs = [hf_greedy(model, p, 32, stop_at_eos=False) for p in prompts]
    engine = make_engine(model, block_size=8, enable_prefix_caching=prefix_caching)
    first = engine.generate(prompts[:1], GREEDY)           # warms the cache with the shared prefix
    rest = engine.generate(prompts[1:], GREEDY)
    check(model, prompts, refs, first + rest)
    hits = engine.stats().prefix_cache_hits
    assert (hits >= 5 * 40 // 8 * 8) if prefix_caching else hits == 0


@pytest.mark.parametrize("budget", [2048, 24])
def test_requests_arriving_together_compute_a_shared_prefix_once(budget, make_engine):
    """The shared prefix's full blocks are computed by the first request's chunk; the others
    adopt them in the same step (every layer writes the step's K/V before it attends) and still
    generate exactly what transformers generates. With a budget smaller than the prompt, only the
    blocks the leading chunk completes are shared."""
    model = tiny_model("llama")
    shared = random_prompts(1, 256, seed=3, lo=40, hi=41)[0]
    prompts = [shared + tail for tail in random_prompts(6, 256, seed=4, lo=1, hi=20)]
    refs = [hf_greedy(model, p, 32, stop_at_eos=False) for p in prompts]
    engine = make_engine(model, block_size=8, max_num_batched_tokens=budget)
    engine.trace = []
    outs = engine.generate(prompts, GREEDY)
    check(model, prompts, refs, outs)
    cached = [o.num_cached_tokens for o in outs]
    first_step = engine.trace[0]
    if budget >= sum(map(len, prompts)):
        # All six prefill in step one; five of them skip the prefix's five full blocks.
        assert cached == [0] + [40] * 5
        assert sum(n for _, _, _, n, _ in first_step.chunks) == sum(map(len, prompts)) - 5 * 40
    else:
        # Step one holds 24 tokens of the first prompt: three full blocks the next ones can adopt.
        assert first_step.chunks[0][2:4] == (0, 24)
        assert cached[0] == 0 and all(c >= 24 for c in cached[1:])
    assert engine.stats().prefix_cache_hits == sum(cached)


def test_stop_at_eos_like_hf(make_engine):
    model = tiny_model("llama", seed=3)
    prompts = random_prompts(6, 256, seed=11)
    # Make EOS likely so that some sequences stop early.
    with torch.no_grad():
        model.lm_head.weight[2] += 0.6 * model.lm_head.weight.abs().mean()
    refs = [hf_greedy(model, p, 32, stop_at_eos=True) for p in prompts]
    engine = make_engine(model)
    outs = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0))
    check(model, prompts, refs, outs)
    for o in outs:
        assert o.finish_reason == ("stop" if o.token_ids[-1] == 2 else "length")
