"""Beam search equals transformers' `generate(num_beams=B)`: same hypotheses, same scores, and the
beams share their blocks (fork on selection, free on pruning)."""
from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from jupyter_pagedkv import BeamSearchParams
from jupyter_pagedkv.testing import models

MAX_NEW = 12


def hf_beams(model, prompt: list[int], params: BeamSearchParams) -> list[tuple[list[int], float]]:
    """transformers' beam search on one unpadded prompt: (generated tokens, score), best first."""
    return models.hf_beams(model, prompt, params.beam_width, params.max_tokens, params.length_penalty,
                           params.early_stopping)


def assert_same_beams(model, prompts, outputs, params) -> None:
    for prompt, out in zip(prompts, outputs):
        ref = hf_beams(model, prompt, params)
        assert [s.token_ids for s in out.sequences] == [r[0] for r in ref]
        for s, (_, score) in zip(out.sequences, ref):
            assert abs(s.score - score) < 1e-4, (s.score, score)


def eos_prone(arch: str):
    """A tiny model where EOS is likely, so hypotheses finish at different lengths."""
    model = tiny_model(arch, seed=3)
    with torch.no_grad():
        model.lm_head.weight[2] += 4.0 * model.lm_head.weight.abs().mean()
    return model


MODELS = {arch: eos_prone(arch) for arch in ("llama", "qwen3")}
PROMPTS = [torch.randint(3, 256, (k,), generator=torch.Generator().manual_seed(k)).tolist()
           for k in (5, 17, 33)]


@pytest.mark.parametrize("beam_width", [2, 4])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_batch_of_3_matches_hf_beam_search(arch, beam_width, make_engine):
    model = MODELS[arch]
    params = BeamSearchParams(beam_width=beam_width, max_tokens=MAX_NEW)
    engine = make_engine(model, block_size=4)
    outputs = engine.beam_search(PROMPTS, params)
    assert [len(o.sequences) for o in outputs] == [beam_width] * 3
    # The EOS-prone model makes some hypotheses end early: the finished-hypothesis rules are used.
    assert any(len(s.token_ids) < MAX_NEW for o in outputs for s in o.sequences)
    assert_same_beams(model, PROMPTS, outputs, params)


@pytest.mark.parametrize("early_stopping,length_penalty", [(True, 2.0), ("never", 0.5), (False, -1.0)])
def test_early_stopping_and_length_penalty_match_hf(early_stopping, length_penalty, make_engine):
    model = MODELS["llama"]
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_NEW, early_stopping=early_stopping,
                              length_penalty=length_penalty)
    prompts = PROMPTS[:2]
    assert_same_beams(model, prompts, make_engine(model, block_size=4).beam_search(prompts, params), params)


def test_beams_share_blocks_and_pruned_beams_free_theirs(make_engine):
    model = tiny_model("llama", seed=4)            # EOS unlikely: all beams live to the end
    engine = make_engine(model, block_size=4, enable_prefix_caching=False)
    prompt = list(range(3, 30))                    # 27 tokens: 6 full blocks + a partial one
    rid = engine.add_request(prompt, BeamSearchParams(beam_width=4, max_tokens=10))
    engine.step()                                  # prefill; the first selection forks 4 beams
    beams = engine._requests[rid].seqs
    assert len(beams) == 4
    assert engine.stats().num_shared == 7          # every prompt block is held by all 4 tables
    engine.check_invariants()
    saw_pruning = False
    while engine.has_unfinished_requests():
        live = {id(s) for s in engine._requests[rid].seqs}
        engine.step()
        engine.check_invariants()
        if rid in engine._requests:
            now = engine._requests[rid].seqs
            saw_pruning |= any(id(s) not in live for s in now)   # a fork replaced a pruned beam
            stats = engine.stats()
            # Without sharing the 4 beams would hold 4 private copies of every block.
            assert stats.num_used < sum(len(s.block_table.blocks) for s in now)
            assert stats.num_block_refs == sum(len(s.block_table.blocks) for s in now)
    assert saw_pruning
    assert engine.stats().num_used == 0


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_under_preemption_the_beams_are_transformers_beams(preemption_mode, make_engine):
    model = tiny_model("llama", seed=4)            # EOS unlikely: 12 beams grow to full length
    prompts = [p[:n] for p, n in zip(PROMPTS, (5, 6, 7))]
    params = BeamSearchParams(beam_width=4, max_tokens=20)
    swap = dict(swap_space="1MiB") if preemption_mode == "swap" else {}
    # 28 blocks of 4 hold one request's 4 beams even unshared, but not three requests' beams.
    engine = make_engine(model, block_size=4, num_blocks=28, preemption_mode=preemption_mode, **swap)
    tight = engine.beam_search(prompts, params)
    assert engine.stats().num_preemptions > 0
    if preemption_mode == "swap":
        assert engine._scheduler.num_swap_outs > 0          # KV went to host memory and came back
    assert_same_beams(model, prompts, tight, params)


def test_result_is_the_same_when_the_budget_schedules_only_some_beams(make_engine):
    model = MODELS["llama"]
    params = BeamSearchParams(beam_width=4, max_tokens=8)
    roomy = make_engine(model, block_size=4).beam_search(PROMPTS[:2], params)
    # A 5-token budget runs some beams per step; the others wait with their logits for a later one.
    engine = make_engine(model, block_size=4, max_num_batched_tokens=5)
    ids = [engine.add_request(p, params) for p in PROMPTS[:2]]
    waited = False
    while engine.has_unfinished_requests():
        engine.step()
        waited |= any(r.beam.pending for r in engine.live_requests())
    assert waited
    done = {r.request_id: r for r in engine._finished}
    assert [[s.token_ids for s in done[rid].beam.sequences] for rid in ids] == \
        [[s.token_ids for s in o.sequences] for o in roomy]


def test_abort_mid_search_frees_every_block(make_engine):
    engine = make_engine(MODELS["llama"], block_size=4)
    rid = engine.add_request(PROMPTS[2], BeamSearchParams(beam_width=4, max_tokens=MAX_NEW))
    for _ in range(3):
        engine.step()
    assert engine.stats().num_used > 0
    assert engine.abort(rid)
    assert engine.stats().num_used == 0


def test_bad_beam_requests_are_refused_with_a_clear_message(make_engine):
    engine = make_engine(MODELS["llama"], block_size=4, num_blocks=20, max_num_seqs=256)
    with pytest.raises(ValueError, match="beam_width must be a positive integer"):
        BeamSearchParams(beam_width=0)
    with pytest.raises(ValueError, match="early_stopping must be"):
        BeamSearchParams(early_stopping="sometimes")
    with pytest.raises(ValueError, match="may need 48 blocks .* lower beam_width or max_tokens"):
        engine.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=4, max_tokens=40))
    with pytest.raises(ValueError, match="candidates per step but the vocabulary has 256"):
        engine.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=200, max_tokens=1))
    with pytest.raises(ValueError, match="beam_width=300 needs 300 sequences .* max_num_seqs=256"):
        engine.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=300, max_tokens=1))
    with pytest.raises(ValueError, match="BeamSearchParams"):
        engine.beam_search([PROMPTS[0]], object())


@pytest.mark.slow
@pytest.mark.parametrize("beam_width", [2, 4])
def test_embedded_model_matches_hf_beam_search(beam_width, embedded, make_engine):
    from test_embedded import chat_prompts

    model, tokenizer = embedded
    prompts = chat_prompts(tokenizer, 3)
    params = BeamSearchParams(beam_width=beam_width, max_tokens=4)
    outputs = make_engine(model, tokenizer).beam_search(prompts, params)
    assert_same_beams(model, prompts, outputs, params)
    assert outputs[0].best.text == tokenizer.decode(outputs[0].best.token_ids, skip_special_tokens=True)
