"""Structured outputs (xgrammar): every output of a JSON schema, a regex, a choice and an EBNF grammar
is valid, with n > 1 forks, n-gram speculation and preemption; greedy output equals transformers'
`generate` masked by its own xgrammar logits processor; bad specs are one line, nothing queued.

A tiny random llama with the embedded model's vocabulary (49,152) and its real tokenizer (loaded
from the converted embedded model's folder, no weights): JSON needs a real byte-level BPE. The
oracles are independent of the engine and of xgrammar's matcher: `jsonschema`, pydantic, `re`.
"""
from __future__ import annotations

import json
import re
from typing import Literal

import pytest
import torch

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
from pydantic import BaseModel, Field  # noqa: E402

from conftest import tiny_model  # noqa: E402
from jupyter_pagedkv import SamplingParams, StructuredOutputsParams  # noqa: E402

VOCAB = 49152
MODEL = tiny_model("llama", vocab=VOCAB, seed=3)
PROMPT = 'Answer in JSON like {"name": "Ann", "pets": [{"kind": "cat", "age": 3}], "role": "user"}:'


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)


class Person(BaseModel):
    # A pattern, not max_length: xgrammar 0.2.9 lets a raw control character (seen: U+000C) into a
    # string bounded by maxLength, which strict JSON parsers refuse.
    name: str = Field(pattern=r"^[A-Za-z ]{1,8}$")
    pets: list[Pet] = Field(max_length=2)
    role: Literal["admin", "user"]


SCHEMA = Person.model_json_schema()
REGEX = r"[a-z]{2,6}-[0-9]{1,3}"
CHOICE = ["red", "green", "blue"]
# Sums of one to four small numbers in parentheses (repetition bounded: a random model must end).
GRAMMAR = 'root ::= "(" num ("+" num){0,3} ")"\nnum ::= [0-9] | [1-9] [0-9]'
GRAMMAR_ORACLE = re.compile(r"\((?:[0-9]|[1-9][0-9])(?:\+(?:[0-9]|[1-9][0-9])){0,3}\)")

SPECS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICE),
    "grammar": StructuredOutputsParams(grammar=GRAMMAR),
}
PER_KIND = 8      # sampled requests per kind, all kinds batched in one engine run (~10-20 s on 2 cores)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from jupyter_pagedkv.worker.loader import embedded_model_dir
    try:
        return AutoTokenizer.from_pretrained(embedded_model_dir())
    except Exception as err:   # the embedded model's package is missing
        pytest.skip(f"the embedded model's tokenizer is not available: {err}")


def valid(kind: str, text: str) -> bool:
    """The independent oracle of each kind."""
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
            Person.model_validate_json(text)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICE
    return GRAMMAR_ORACLE.fullmatch(text) is not None


def run_all_kinds(engine, per_kind: int = PER_KIND, distinct: bool = False, **params) -> dict[str, list]:
    """`per_kind` sampled requests of every kind in one batch; returns the completions by kind.
    `distinct` numbers the prompts, so that they share no prefix-cached block."""
    kinds = [k for k in SPECS for _ in range(per_kind)]
    prompts = [f"{i}. {PROMPT}" if distinct else PROMPT for i in range(len(kinds))]
    outs = engine.generate(prompts, [
        SamplingParams(max_tokens=80, temperature=1.0, structured_outputs=SPECS[k], **params) for k in kinds])
    by_kind: dict[str, list] = {k: [] for k in SPECS}
    for kind, out in zip(kinds, outs):
        by_kind[kind].extend(out.outputs)
    return by_kind


def assert_all_valid(by_kind: dict[str, list]) -> None:
    for kind, completions in by_kind.items():
        bad = [(c.finish_reason, c.text) for c in completions if c.finish_reason != "stop" or not valid(kind, c.text)]
        assert not bad, f"{kind}: {len(bad)} of {len(completions)} invalid, e.g. {bad[:2]}"


def test_every_sampled_output_of_each_kind_is_valid(make_engine, tokenizer):
    engine = make_engine(MODEL, tokenizer, seed=0)
    by_kind = run_all_kinds(engine)
    assert_all_valid(by_kind)
    assert len({c.text for c in by_kind["json"]}) > 1, "sampling drew one output only: the test shows nothing"


def test_n_samples_fork_the_grammar_state_and_all_are_valid(make_engine, tokenizer):
    engine = make_engine(MODEL, tokenizer, seed=1)
    outs = engine.generate([PROMPT] * 4, [SamplingParams(max_tokens=80, temperature=1.0, n=4,
                                                         structured_outputs=SPECS[k]) for k in SPECS])
    by_kind = {k: o.outputs for k, o in zip(SPECS, outs)}
    assert all(len(c) == 4 for c in by_kind.values())
    assert_all_valid(by_kind)
    assert len({c.text for c in by_kind["json"]}) > 1


def test_speculation_rolls_the_grammar_back_and_greedy_output_is_unchanged(make_engine, tokenizer):
    params = [SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=s) for s in SPECS.values()]
    plain = make_engine(MODEL, tokenizer).generate([PROMPT] * 4, params)
    engine = make_engine(MODEL, tokenizer, speculative="ngram")
    spec = engine.generate([PROMPT] * 4, params)
    stats = engine._speculator.stats
    assert stats.num_proposed > stats.num_accepted > 0, "no draft was both kept and rejected: nothing tested"
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert_all_valid({k: o.outputs for k, o in zip(SPECS, spec)})


def test_sampled_outputs_stay_valid_under_speculation(make_engine, tokenizer):
    engine = make_engine(MODEL, tokenizer, seed=2, speculative="ngram")
    assert_all_valid(run_all_kinds(engine, per_kind=4))
    assert engine._speculator.stats.num_proposed > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_grammar_state_survives_preemption(make_engine, tokenizer, mode):
    # Distinct prompts of ~9 blocks each: three fit the pool, and they outgrow it as they generate.
    engine = make_engine(MODEL, tokenizer, seed=4, block_size=4, num_blocks=32, preemption_mode=mode,
                         swap_space="8MiB")
    assert_all_valid(run_all_kinds(engine, per_kind=3, distinct=True))
    assert engine._scheduler.num_preemptions > 0
    if mode == "swap":
        assert engine._scheduler.num_swap_outs > 0


class XgrammarProcessor:
    """transformers' side: a logits processor on its own xgrammar matcher (the independent path)."""

    def __init__(self, compiled) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.prompt_len: int | None = None
        self.bitmask = xgr.allocate_token_bitmask(1, VOCAB)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.prompt_len is None:
            self.prompt_len = input_ids.shape[1]
        else:
            assert self.matcher.accept_token(int(input_ids[0, -1]))
        self.matcher.fill_next_token_bitmask(self.bitmask)
        scores = scores.clone()
        xgr.apply_token_bitmask_inplace(scores, self.bitmask)
        return scores


@pytest.mark.parametrize("kind", ["json", "regex"])
def test_greedy_output_equals_transformers_generate_masked_by_xgrammar(make_engine, tokenizer, kind):
    from transformers import LogitsProcessorList

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB, stop_token_ids=[tokenizer.eos_token_id])
    compiler = xgr.GrammarCompiler(info)
    compiled = (compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False) if kind == "json"
                else compiler.compile_regex(REGEX))
    ids = tokenizer(PROMPT).input_ids
    with torch.inference_mode():
        ref = MODEL.generate(torch.tensor([ids]), max_new_tokens=80, do_sample=False,
                             logits_processor=LogitsProcessorList([XgrammarProcessor(compiled)]),
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    expected = ref[0, len(ids):].tolist()
    out = make_engine(MODEL, tokenizer).generate([ids], SamplingParams(max_tokens=80, temperature=0.0,
                                                                        structured_outputs=SPECS[kind]))[0]
    assert out.outputs[0].token_ids == expected
    assert out.outputs[0].finish_reason == "stop" and valid(kind, out.outputs[0].text)


def test_plain_rows_beside_structured_ones_are_untouched(make_engine, tokenizer):
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = make_engine(MODEL, tokenizer).generate([PROMPT], plain)[0]
    mixed = make_engine(MODEL, tokenizer).generate([PROMPT] * 3, [
        SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=SPECS["json"]), plain,
        SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=SPECS["regex"])])
    assert mixed[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert valid("json", mixed[0].outputs[0].text) and valid("regex", mixed[2].outputs[0].text)


def test_a_pydantic_class_is_a_schema(make_engine, tokenizer):
    out = make_engine(MODEL, tokenizer, seed=5).generate([PROMPT], SamplingParams(
        max_tokens=80, temperature=1.0, structured_outputs=StructuredOutputsParams(json=Person)))[0]
    assert isinstance(Person.model_validate_json(out.outputs[0].text), Person)


def test_a_finished_grammar_stops_even_with_ignore_eos(make_engine, tokenizer):
    out = make_engine(MODEL, tokenizer).generate([PROMPT], SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True, structured_outputs=SPECS["choice"]))[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in CHOICE


@pytest.mark.parametrize("spec, says", [
    (dict(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "Unsupported type"),
    (dict(json="{not json"), "structured_outputs.json was refused"),
    (dict(regex="a(b"), "parenthesis is not closed"),
    (dict(grammar='root ::= missing'), "not defined"),
])
def test_a_spec_xgrammar_refuses_is_one_line_and_nothing_is_queued(make_engine, tokenizer, spec, says):
    engine = make_engine(MODEL, tokenizer)
    with pytest.raises(ValueError) as err:
        engine.add_request(PROMPT, SamplingParams(structured_outputs=StructuredOutputsParams(**spec)))
    message = str(err.value)
    assert says in message and "\n" not in message and ".cc:" not in message
    assert not engine._scheduler.has_work()


@pytest.mark.parametrize("spec, says", [
    (dict(), "exactly one of"),
    (dict(regex="a", choice=["a"]), "got regex, choice"),
    (dict(choice=[]), "non-empty list"),
    (dict(choice=["a", ""]), "non-empty list"),
    (dict(json=42), "JSON-schema dict"),
    (dict(regex=""), "non-empty string"),
])
def test_a_malformed_spec_is_one_line(spec, says):
    with pytest.raises(ValueError, match=says) as err:
        StructuredOutputsParams(**spec)
    assert "\n" not in str(err.value)


def test_structured_outputs_need_a_tokenizer(make_engine):
    engine = make_engine(MODEL)
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request([1, 2, 3], SamplingParams(structured_outputs=SPECS["choice"]))
    assert not engine._scheduler.has_work()


def test_equal_specs_compile_once(make_engine, tokenizer):
    engine = make_engine(MODEL, tokenizer)
    for _ in range(3):
        engine.add_request(PROMPT, SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
            json=json.loads(json.dumps(SCHEMA)))))
    assert len(engine._grammars._compiled) == 1
    while engine._scheduler.has_work():
        engine.step()
