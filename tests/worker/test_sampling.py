"""Sampling rules: seeds, top-k / top-p, stop strings and stop token ids."""
from __future__ import annotations

import torch

from conftest import tiny_model
from jupyter_pagedkv import SamplingParams
from jupyter_pagedkv.worker.sampler import Sampler

MODEL = tiny_model("llama", seed=1)
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [17]]


def test_seeded_request_is_reproducible_whatever_shares_its_batch(make_engine):
    engine = make_engine(MODEL)
    seeded = SamplingParams(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True)
    alone = engine.generate([PROMPTS[0]], seeded)[0].token_ids
    others = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, ignore_eos=True)
    crowd = engine.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [others, seeded, others])
    assert crowd[1].token_ids == alone
    assert engine.generate([PROMPTS[0]], seeded)[0].token_ids == alone


def test_different_seeds_give_different_samples(make_engine):
    engine = make_engine(MODEL)
    outs = engine.generate([PROMPTS[0]] * 2, [SamplingParams(max_tokens=24, temperature=1.0, seed=s,
                                                            ignore_eos=True) for s in (1, 2)])
    assert outs[0].token_ids != outs[1].token_ids


def test_top_k_one_is_greedy(make_engine):
    engine = make_engine(MODEL)
    greedy = engine.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    topk = engine.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=1.5, top_k=1,
                                                   ignore_eos=True))
    assert [o.token_ids for o in greedy] == [o.token_ids for o in topk]


def test_top_k_and_top_p_keep_exactly_the_intended_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    p = Sampler.probabilities(logits, [SamplingParams(temperature=1.0, top_k=2)])
    assert (p[0, 2:] == 0).all() and torch.isclose(p[0, :2].sum(), torch.tensor(1.0))
    probs = logits.softmax(-1)[0]             # 0.636, 0.234, 0.086, ...
    p = Sampler.probabilities(logits, [SamplingParams(temperature=1.0, top_p=0.8)])
    assert (p[0, :2] > 0).all() and (p[0, 2:] == 0).all()
    assert torch.allclose(p[0, :2], probs[:2] / probs[:2].sum())
    p = Sampler.probabilities(logits, [SamplingParams(temperature=1.0, top_p=0.5)])
    assert p[0, 0] == 1.0


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    sampler = Sampler(seed=0)

    class Seq:   # the sampler only reads .params and .generator
        params = SamplingParams(temperature=1.0)
        generator = None

    tokens = torch.tensor(sampler(logits, [Seq()] * 4000))
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(freq, logits[0].softmax(-1), atol=0.03)


def test_stop_token_ids_end_the_request(make_engine):
    engine = make_engine(MODEL)
    free = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    stop_at = free.token_ids[5]
    out = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                       stop_token_ids=[stop_at]))[0]
    first = free.token_ids.index(stop_at)
    assert out.token_ids == free.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_at


def test_max_tokens_is_a_length_finish(make_engine):
    engine = make_engine(MODEL)
    out = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
