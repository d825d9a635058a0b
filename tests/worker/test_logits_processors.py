"""Logits processors (vLLM's penalties, logit_bias, bad words, allowed ids, min_tokens): exact
against transformers' own processors in greedy `generate`, also under preemption (recompute and
swap), a prefix-cache hit and n-gram speculation; presence/frequency against the OpenAI/vLLM
formula; bad input refused in one line with nothing queued."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_model
from jupyter_pagedkv import SamplingParams
from jupyter_pagedkv.testing.models import attention, random_prompts
from jupyter_pagedkv.worker.logits_processors import apply_processors

MODEL = tiny_model("llama", seed=3)
EOS = 2
NEW = 16
PROMPTS = random_prompts(4, 256, seed=11)
# Prompts that repeat themselves: the answers repeat too (repetition penalty binds) and n-gram
# lookup finds drafts.
LOOPING = [p[:5] * 3 for p in PROMPTS]


@torch.inference_mode()
def hf_generate(prompt: list[int], stop_at_eos: bool = False, **processors) -> list[int]:
    """Transformers' greedy `generate` with its own logits processors: the oracle."""
    with attention(MODEL, "sdpa"):
        ids = torch.tensor([prompt])
        out = MODEL.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=EOS if stop_at_eos else [], pad_token_id=0,
                             temperature=None, top_p=None, top_k=None, **processors)
    return out[0, len(prompt):].tolist()


def plain(prompt: list[int]) -> list[int]:
    return hf_generate(prompt)


def ours(engine, prompts, **params) -> list[list[int]]:
    params.setdefault("ignore_eos", True)
    outs = engine.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0.0, **params))
    return [o.outputs[0].token_ids for o in outs]


def cases(prompt: list[int]) -> dict[str, tuple[dict, dict]]:
    """(our parameters, transformers' generate kwargs) per processor, built so that each binds:
    the bad words are a token and a pair the unconstrained answer produces."""
    base = plain(prompt)
    return {
        "repetition_penalty": (dict(repetition_penalty=4.0), dict(repetition_penalty=4.0)),
        "logit_bias": (dict(logit_bias={base[3]: -4.0, 17: 3.0}),
                       dict(sequence_bias={(base[3],): -4.0, (17,): 3.0})),
        "bad_words": (dict(bad_words=[[base[2]], [base[5], base[6]]]),
                      dict(bad_words_ids=[[base[2]], [base[5], base[6]]])),
        # EOS made likely by a bias, held back for 9 tokens: the answer then ends at EOS
        "min_tokens": (dict(min_tokens=9, logit_bias={EOS: 6.0}, ignore_eos=False),
                       dict(min_new_tokens=9, sequence_bias={(EOS,): 6.0}, stop_at_eos=True)),
        "all": (dict(repetition_penalty=1.3, logit_bias={base[3]: -4.0}, bad_words=[[base[5], base[6]]],
                     min_tokens=4, ignore_eos=False),
                dict(repetition_penalty=1.3, sequence_bias={(base[3],): -4.0}, bad_words_ids=[[base[5], base[6]]],
                     min_new_tokens=4, stop_at_eos=True)),
        # no repetition penalty, and a bad pair late in the answer: the answer keeps looping,
        # so n-gram lookup has drafts to verify
        "looping": (dict(logit_bias={base[3]: -4.0}, bad_words=[[base[12], base[13]]], min_tokens=4,
                         ignore_eos=False),
                    dict(sequence_bias={(base[3],): -4.0}, bad_words_ids=[[base[12], base[13]]],
                         min_new_tokens=4, stop_at_eos=True)),
    }


@pytest.mark.parametrize("name", ["repetition_penalty", "logit_bias", "bad_words", "min_tokens", "all"])
def test_greedy_processors_are_token_identical_to_transformers(make_engine, name):
    engine = make_engine(MODEL, block_size=4)
    got, want = [], []
    for prompt in [PROMPTS[0], LOOPING[2]]:
        mine, theirs = cases(prompt)[name]
        got += ours(engine, [prompt], **mine)
        want.append(hf_generate(prompt, **theirs))
        assert want[-1] != plain(prompt), f"{name} does not bind on this prompt: the test would prove nothing"
    assert got == want
    if name == "min_tokens":
        assert all(9 <= len(t) < NEW and t[-1] == EOS for t in got)


def combined(prompt, how: str = "") -> tuple[dict, dict]:
    return cases(prompt)["looping" if how == "speculative" else "all"]


@pytest.mark.parametrize("how", ["recompute", "swap", "speculative", "prefix-hit"])
def test_processors_stay_exact_under_preemption_prefix_hits_and_speculation(make_engine, how):
    kwargs = {"recompute": dict(num_blocks=20), "swap": dict(num_blocks=20, preemption_mode="swap",
                                                             swap_space="4MiB"),
              "speculative": dict(num_blocks=256, speculative="ngram"), "prefix-hit": dict(num_blocks=256)}[how]
    engine = make_engine(MODEL, block_size=4, **kwargs)   # speculation unmeasured (conftest)
    prompts = {"speculative": [PROMPTS[0][:6] * 4, LOOPING[2]], "prefix-hit": [PROMPTS[0][:12] + p for p in PROMPTS[1:3]]}.get(how, PROMPTS)
    if how == "prefix-hit":
        ours(engine, [prompts[0]])   # caches the shared 12-token prefix (3 blocks)
    outs = engine.generate(prompts, [SamplingParams(max_tokens=NEW, temperature=0.0, **combined(p, how)[0])
                                     for p in prompts])
    assert [o.outputs[0].token_ids for o in outs] == [hf_generate(p, **combined(p, how)[1]) for p in prompts]
    if how in ("recompute", "swap"):
        assert engine._scheduler.num_preemptions > 0
    if how == "swap":
        assert engine._scheduler.num_swap_outs > 0
    if how == "speculative":
        assert engine._speculator.stats.num_accepted > 0
    if how == "prefix-hit":
        assert all(o.num_cached_tokens >= 12 for o in outs)


def test_speculation_with_processors_sees_the_drafts_before_each_position(make_engine):
    """A draft that is only banned because of the draft before it (a bad pair) must be rejected."""
    engine = make_engine(MODEL, block_size=4, num_blocks=256, speculative="ngram")
    prompt = PROMPTS[0][:6] * 4
    base = plain(prompt)   # loops with period 4 from token 4 on: n-gram drafts are mostly right
    pair = [base[9], base[10]]
    got = ours(engine, [prompt], bad_words=[pair])
    assert got == [hf_generate(prompt, bad_words_ids=[pair])] and got != [base]
    assert engine._speculator.stats.num_accepted > 0


@torch.inference_mode()
def penalised_reference(prompt: list[int], presence: float, frequency: float) -> list[int]:
    """Greedy decoding written from the OpenAI/vLLM definition, one full forward per token:
    logit[t] -= frequency * count(t in output) + presence * (t in output)."""
    ids, out = list(prompt), []
    with attention(MODEL, "sdpa"):
        for _ in range(NEW):
            logits = MODEL(torch.tensor([ids])).logits[0, -1].double()
            for t in set(out):
                logits[t] -= frequency * out.count(t) + presence
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out


@pytest.mark.parametrize("presence,frequency", [(1.5, 0.0), (0.0, 0.9), (0.4, 0.7), (-1.0, 0.0)])
def test_presence_and_frequency_penalties_follow_the_openai_formula(make_engine, presence, frequency):
    engine = make_engine(MODEL, block_size=4)
    prompt = PROMPTS[2]
    want = penalised_reference(prompt, presence, frequency)
    assert want != plain(prompt) or presence < 0
    assert ours(engine, [prompt], presence_penalty=presence, frequency_penalty=frequency) == [want]


def test_penalties_count_output_tokens_not_the_prompt():
    logits = torch.zeros(2, 8)
    rows = [SimpleNamespace(params=SamplingParams(presence_penalty=1.0, frequency_penalty=0.5),
                            token_ids=[3, 3, 4, 5, 5, 5], prompt_len=2),
            SimpleNamespace(params=SamplingParams(repetition_penalty=2.0), token_ids=[3, 6], prompt_len=1)]
    logits[1] = torch.tensor([1.0, -1.0, 1.0, 4.0, 1.0, 1.0, -2.0, 1.0])
    out = apply_processors(logits, rows, {EOS})
    assert out[0].tolist() == [0, 0, 0, 0, -1.5, -2.5, 0, 0]
    # repetition over prompt and output: 3 (prompt, positive: halved) and 6 (output, negative: doubled)
    assert out[1].tolist() == [1.0, -1.0, 1.0, 2.0, 1.0, 1.0, -4.0, 1.0]


def test_a_batch_without_processors_is_returned_untouched():
    logits = torch.randn(3, 8)
    rows = [SimpleNamespace(params=SamplingParams(temperature=t), token_ids=[1, 2], prompt_len=1)
            for t in (0.0, 0.5, 1.0)]
    assert apply_processors(logits, rows, {EOS}) is logits


def test_sampled_forks_respect_allowed_ids_and_bad_words(make_engine):
    engine = make_engine(MODEL, block_size=4)
    allowed = [5, 9, 11, 40, 41, 42]
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=1.5, seed=4, n=3,
                                                       allowed_token_ids=allowed, bad_words=[[9], [40, 41]],
                                                       ignore_eos=True))[0]
    seqs = [c.token_ids for c in out.outputs]
    assert len(seqs) == 3 and len({tuple(s) for s in seqs}) > 1
    for s in seqs:
        assert set(s) <= set(allowed) - {9}
        assert all((a, b) != (40, 41) for a, b in zip(s, s[1:]))


class WordTokenizer:
    """Token i is the word 'w<i>'; EOS (2) is the special token '</s>'."""
    eos_token_id = EOS
    all_special_ids = [EOS]

    def decode(self, ids, skip_special_tokens=True, **kwargs):
        return " ".join("</s>" if i == EOS else f"w{i}" for i in ids if not (skip_special_tokens and i == EOS))

    def __call__(self, text, add_special_tokens=True):
        return SimpleNamespace(input_ids=[int(w[1:]) for w in text.split()])


def test_bad_words_as_text_stop_strings_kept_and_special_tokens_shown(make_engine):
    engine = make_engine(MODEL, WordTokenizer(), block_size=4)
    prompt = PROMPTS[1]
    base = plain(prompt)
    word = f"w{base[1]}"
    banned = ours(engine, [prompt], bad_words=[word])[0]
    assert banned == hf_generate(prompt, bad_words_ids=[[base[1]]])
    stop = f"w{base[4]}"
    cut, kept = (engine.generate([prompt], SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True,
                                                          stop=[stop], include_stop_str_in_output=k))[0]
                 .outputs[0].text for k in (False, True))
    assert kept == cut + stop and kept.endswith(stop)
    shown = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, min_tokens=0,
                                                     logit_bias={EOS: 50.0}, skip_special_tokens=False))
    hidden = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, logit_bias={EOS: 50.0}))
    assert shown[0].outputs[0].text == "</s>" and hidden[0].outputs[0].text == ""


@pytest.mark.parametrize("params,message", [
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
    (dict(repetition_penalty=-1.2), "repetition_penalty must be a finite number > 0"),
    (dict(presence_penalty=-2.5), "presence_penalty must be in [-2, 2]"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
    (dict(frequency_penalty=-3), "frequency_penalty must be in [-2, 2]"),
    (dict(min_tokens=-1), "min_tokens must be an integer >= 0"),
    (dict(min_tokens=10, max_tokens=5), "min_tokens (10) must not exceed max_tokens (5)"),
    (dict(logit_bias={5: float("inf")}), "logit_bias must be None or a dict"),
    (dict(logit_bias={-1: 1.0}), "logit_bias must be None or a dict"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must be None or a non-empty list"),
    (dict(bad_words=[""]), "bad_words must be None or a list"),
    (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output must be True or False"),
])
def test_bad_processor_parameters_are_one_line(params, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**params)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("params,message", [
    (dict(logit_bias={300: 1.0}), "logit_bias: token ids [300] are not in the vocabulary"),
    (dict(allowed_token_ids=[1, 256]), "allowed_token_ids: token ids [256] are not in the vocabulary"),
    (dict(bad_words=[[3, 999]]), "bad_words: token ids [999] are not in the vocabulary"),
    (dict(bad_words=["w3"]), "bad_words given as text need a tokenizer"),
])
def test_unknown_token_ids_are_refused_before_anything_is_queued(make_engine, params, message):
    engine = make_engine(MODEL, block_size=4)
    with pytest.raises(ValueError) as err:
        engine.add_request(PROMPTS[0], SamplingParams(**params))
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not engine._scheduler.has_work()
