"""SamplingParams(logprobs=k, prompt_logprobs=k): the raw model distribution's log-probabilities,
exact against log_softmax of transformers' own logits (fp32, SDPA) at the same positions."""
from __future__ import annotations

import pytest
import torch

from conftest import attention, tiny_model
from jupyter_pagedkv import SamplingParams
from jupyter_pagedkv.core.sampling_params import MAX_LOGPROBS
from jupyter_pagedkv.engine import logprobs as engine_logprobs

MODEL = tiny_model("llama", seed=11)
PROMPT = list(range(5, 32))          # 27 tokens
TOL = 1e-4


@torch.inference_mode()
def reference(ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits over the whole sequence: row p predicts token p + 1."""
    with attention(MODEL, "sdpa"):
        return MODEL(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)


def assert_position(entry: dict, token: int, ref_row: torch.Tensor, k: int) -> None:
    """The chosen token's logprob and rank, and the top-k alternatives: ordered, complete, exact."""
    chosen = entry[token]
    assert abs(chosen.logprob - ref_row[token].item()) < TOL
    assert chosen.rank == int((ref_row > ref_row[token]).sum()) + 1
    alternatives = sorted((lp.rank, tok, lp.logprob) for tok, lp in entry.items() if lp.rank <= k)
    assert [r for r, _, _ in alternatives] == list(range(1, k + 1))          # ranks 1..k, none missing
    values = [v for _, _, v in alternatives]
    assert values == sorted(values, reverse=True)                            # best first
    top = ref_row.topk(k + 1)
    assert [t for _, t, _ in alternatives] == top.indices[:k].tolist()      # the model's own top k
    assert all(abs(v - r) < TOL for v, r in zip(values, top.values[:k].tolist()))
    assert len(entry) == k + (chosen.rank > k)                               # chosen first, added if outside


def assert_generated(out, k: int) -> None:
    for sample in out.outputs:
        ref = reference(PROMPT + sample.token_ids)
        assert len(sample.logprobs) == len(sample.token_ids)
        for i, (token, entry) in enumerate(zip(sample.token_ids, sample.logprobs)):
            assert next(iter(entry)) == token                                # the chosen token first
            assert_position(entry, token, ref[len(PROMPT) + i - 1], k)
        total = sum(ref[len(PROMPT) + i - 1, t].item() for i, t in enumerate(sample.token_ids))
        assert abs(sample.cumulative_logprob - total) < 1e-3


def assert_prompt(out, k: int) -> None:
    ref = reference(PROMPT)
    assert len(out.prompt_logprobs) == len(PROMPT) and out.prompt_logprobs[0] is None
    for p in range(1, len(PROMPT)):
        assert_position(out.prompt_logprobs[p], PROMPT[p], ref[p - 1], k)


def test_greedy_logprobs_equal_transformers_log_softmax(make_engine):
    engine = make_engine(MODEL, block_size=4)
    out = engine.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                   logprobs=5))[0]
    assert_generated(out, 5)
    assert all(o.logprobs[i][t].rank == 1 for o in out.outputs for i, t in enumerate(o.token_ids))
    assert out.prompt_logprobs is None


def test_logprobs_are_the_raw_distribution_not_the_processed_one(make_engine):
    """Temperature, top-k and a repetition penalty change the pick, never the numbers reported."""
    engine = make_engine(MODEL)
    out = engine.generate([PROMPT], SamplingParams(max_tokens=8, temperature=1.7, top_k=20, seed=3,
                                                   repetition_penalty=1.5, ignore_eos=True, logprobs=3))[0]
    assert_generated(out, 3)


@pytest.mark.parametrize("attention_backend", ["torch", "triton"])   # triton: its staged logits_to_keep
def test_prompt_logprobs_over_chunked_prefill_equal_transformers(make_engine, attention_backend):
    engine = make_engine(MODEL, block_size=4, max_num_batched_tokens=8,     # the prompt in 4 chunks
                         attention_backend=attention_backend)
    out = engine.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                                   prompt_logprobs=4, logprobs=0))[0]
    assert_prompt(out, 4)
    assert_generated(out, 0)


def test_prompt_logprobs_recompute_a_cached_prefix(make_engine):
    """A prefix-cache hit has no logits: the request that asks for prompt_logprobs recomputes it (as
    vLLM does), while a request that does not ask still takes the hit."""
    engine = make_engine(MODEL, block_size=4)
    plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.generate([PROMPT], plain)
    assert engine.generate([PROMPT], plain)[0].num_cached_tokens == 24
    out = engine.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))[0]
    assert out.num_cached_tokens == 0
    assert_prompt(out, 2)


def test_n_samples_each_get_their_own_logprobs(make_engine):
    engine = make_engine(MODEL, block_size=4)
    out = engine.generate([PROMPT], SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=7,
                                                   ignore_eos=True, logprobs=2, prompt_logprobs=1))[0]
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    assert_generated(out, 2)
    assert_prompt(out, 1)


def test_logprobs_under_preemption_count_each_prompt_position_once(make_engine):
    # 16 blocks of 4 slots cannot hold 4 sequences of ~47 tokens: recompute preemption
    engine = make_engine(MODEL, block_size=4, num_blocks=16, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    outs = engine.generate([PROMPT] * 4, params)
    assert engine.stats().num_preemptions > 0
    for out in outs:
        assert_prompt(out, 3)
        assert_generated(out, 3)


def test_speculative_accepted_tokens_carry_the_verify_pass_logprobs(make_engine):
    engine = make_engine(MODEL, block_size=4)
    loop = [7, 8, 9, 10] * 6                       # repetitive: the n-gram drafter proposes
    out = engine.generate([loop], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                 speculative="ngram", logprobs=2))[0]
    assert engine._speculator.stats.num_accepted > 0
    ref = reference(loop + out.token_ids)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.outputs[0].logprobs)):
        assert_position(entry, token, ref[len(loop) + i - 1], 2)


def test_a_step_where_nobody_asks_computes_nothing(make_engine, monkeypatch):
    def refuse(*args):
        raise AssertionError("logprobs computed for a request that did not ask")
    monkeypatch.setattr(engine_logprobs, "token_logprobs", refuse)
    engine = make_engine(MODEL, block_size=4)
    out = engine.generate([PROMPT], SamplingParams(n=2, max_tokens=4, temperature=0.8, seed=1))[0]
    assert all(o.logprobs is None and o.cumulative_logprob is None for o in out.outputs)
    assert engine._runner.last_prompt_logits == []


@pytest.mark.parametrize("field,value,says", [
    ("logprobs", MAX_LOGPROBS + 1, f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}]"),
    ("logprobs", -1, "logprobs must be"),
    ("logprobs", True, "logprobs must be"),
    ("prompt_logprobs", "3", "prompt_logprobs must be"),
])
def test_bad_logprobs_are_refused_in_one_line(field, value, says):
    with pytest.raises(ValueError, match=r"^" + says.replace("[", r"\[").replace("]", r"\]")) as err:
        SamplingParams(**{field: value})
    assert "\n" not in str(err.value)


def test_more_alternatives_than_the_vocabulary_are_refused_before_queueing(make_engine):
    engine = make_engine(tiny_model("llama", vocab=16, seed=1))
    with pytest.raises(ValueError, match=r"^prompt_logprobs=20 asks for more alternatives than the "
                                         r"vocabulary's 16 tokens: use prompt_logprobs=16 or less$"):
        engine.add_request([3, 4, 5], SamplingParams(prompt_logprobs=20))
    assert not engine.has_unfinished_requests() and not engine.live_requests()
