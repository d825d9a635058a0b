"""Exactness against transformers where it is hardest to keep: several hundred positions, and the
paths that move or rewrite KV (swap preemption, beams under preemption, n-gram and draft-model
speculation), plus generation that really stops at EOS. Every reference is transformers' own
`generate`; none is an earlier run of the engine."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_same_or_near_tie, hf_greedy, tiny_model
from jupyter_pagedkv import BeamSearchParams, SamplingParams
from jupyter_pagedkv.testing.models import hf_beams, random_prompts

MODEL = tiny_model("llama", seed=21)
NEW = 64
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
# 4 prompts of 240-279 tokens: with 64 new tokens every sequence passes 300 positions.
PROMPTS = random_prompts(4, 256, seed=41, lo=240, hi=280)
REFS = [hf_greedy(MODEL, p, NEW, stop_at_eos=False) for p in PROMPTS]


def check(model, prompts, refs, outputs) -> None:
    assert all(len(p) + len(o.token_ids) >= 300 for p, o in zip(prompts, outputs))
    identical = [assert_same_or_near_tie(model, p, o.token_ids, r) for p, o, r in zip(prompts, outputs, refs)]
    assert sum(identical) >= len(identical) - 1


def test_swap_preemption_at_300_positions_is_exact(make_engine):
    # 4 sequences of ~320 tokens need ~320 blocks of 4; 200 force swaps.
    engine = make_engine(MODEL, block_size=4, num_blocks=200, preemption_mode="swap", swap_space="64MiB")
    outs = engine.generate(PROMPTS, GREEDY)
    check(MODEL, PROMPTS, REFS, outs)
    assert engine._scheduler.num_swap_outs > 0 and engine._swap.num_used == 0


def test_recompute_preemption_at_300_positions_is_exact(make_engine):
    engine = make_engine(MODEL, block_size=4, num_blocks=200)
    outs = engine.generate(PROMPTS, GREEDY)
    check(MODEL, PROMPTS, REFS, outs)
    assert engine.stats().num_preemptions > 0


@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_speculation_at_300_positions_is_exact(make_engine, draft):
    drafter = "ngram" if draft == "ngram" else tiny_model("llama", seed=22)
    # Prompts that repeat themselves, so the n-gram drafter finds continuations to propose.
    prompts = [p[:150] + p[:150] for p in PROMPTS[:3]]
    refs = [hf_greedy(MODEL, p, NEW, stop_at_eos=False) for p in prompts]
    engine = make_engine(MODEL, block_size=4, speculative=drafter, num_speculative_tokens=4)
    outs = engine.generate(prompts, GREEDY)
    check(MODEL, prompts, refs, outs)
    assert engine.stats().spec_proposed_tokens > 0


def test_beam_search_under_preemption_at_300_positions_matches_transformers(make_engine):
    params = BeamSearchParams(beam_width=3, max_tokens=200, ignore_eos=True)
    prompts = random_prompts(6, 256, seed=45, lo=100, hi=110)
    # Each request's beams hold ~80 blocks of 4 (they share their prompt and most of their past);
    # six of them in 236 blocks (one request may need 233 in the worst case) preempt beams, which
    # come back by recompute.
    engine = make_engine(MODEL, block_size=4, num_blocks=236)
    outputs = engine.beam_search(prompts, params)
    assert engine.stats().num_preemptions > 0
    for prompt, out in zip(prompts, outputs):
        assert len(prompt) + len(out.sequences[0].token_ids) >= 300
        ref = hf_beams(MODEL, prompt, params.beam_width, params.max_tokens, ignore_eos=True)
        assert [s.token_ids for s in out.sequences] == [tokens for tokens, _ in ref]


def test_generation_stops_at_a_real_eos_like_transformers(make_engine):
    model = tiny_model("llama", seed=3)
    with torch.no_grad():              # EOS (id 2) likely enough that most answers end on it
        model.lm_head.weight[2] += 2.5 * model.lm_head.weight.abs().mean()
    prompts = random_prompts(6, 256, seed=11, lo=100, hi=200)
    refs = [hf_greedy(model, p, 128, stop_at_eos=True) for p in prompts]
    assert any(r and r[-1] == 2 and len(r) < 128 for r in refs), "the reference must reach EOS"
    engine = make_engine(model, block_size=4)
    outs = engine.generate(prompts, SamplingParams(max_tokens=128, temperature=0.0))
    assert [o.token_ids for o in outs] == refs
    for o in outs:
        assert o.finish_reason == ("stop" if o.token_ids[-1] == 2 else "length")
    assert sum(o.finish_reason == "stop" for o in outs) >= 2
