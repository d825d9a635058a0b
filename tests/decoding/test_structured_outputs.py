"""Structured outputs (xgrammar): every output of a JSON schema, a regex, a choice and an EBNF grammar
is valid, 200 seeded sampled outputs per kind, also with n = 4 forks, n-gram speculation and
preemption (recompute and swap); greedy output equals transformers' `generate` masked by its own
xgrammar logits processor; bad specs are one line, nothing queued.

A tiny random llama over a real byte-level BPE trained here in code (`trained_tokenizer`, ~1,000
tokens: JSON needs multi-character tokens that cross its structure, such as '{"' and '", "'; a
vocabulary 48 times smaller than the embedded model's keeps 800 sampled requests to seconds). The
oracles are independent of the engine and of xgrammar's matcher: `jsonschema`, pydantic, `re`, and
a recursive-descent parser of the EBNF grammar written here. All 800 requests of a run go in at
once and decode batched (`max_num_seqs` 256), each kind with `max_tokens` above its longest valid
output in characters (every token has one at least), so "length" means a bug, never bad luck.
"""
from __future__ import annotations

import json
import re
import time
from typing import Literal

import pytest
import torch

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
from pydantic import BaseModel, Field  # noqa: E402

from conftest import tiny_model  # noqa: E402
from jupyter_pagedkv import SamplingParams, StructuredOutputsParams  # noqa: E402
from jupyter_pagedkv.decoding.drafters import Proposal  # noqa: E402



def trained_tokenizer(vocab: int = 1024):
    """A byte-level BPE (GPT-2's pre-tokenizer, every byte a token) trained on text shaped like the
    four kinds' outputs, so its merges cross their structure ('{"', '": "', '"}]', '+(' ...).
    Ids 0-2 are pad, BOS and EOS, as in `tiny_model`. Deterministic: the corpus is seeded."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = ["Ann", "Bob", "Cleo", "Dan", "Eve", "red", "green", "blue", "cat", "dog", "fish", "admin", "user",
             "name", "pets", "kind", "age", "role", "Answer", "in", "JSON", "like", "the", "a", "and", "of"]
    corpus = []
    for _ in range(600):
        pets = [{"kind": rng.choice(["cat", "dog", "fish"]), "age": rng.randrange(31)} for _ in range(rng.randrange(3))]
        corpus.append(json.dumps({"name": rng.choice(words), "pets": pets, "role": rng.choice(["admin", "user"])}))
        corpus.append(f"{''.join(rng.choices('abcdefghijklmnopqrstuvwxyz', k=rng.randrange(2, 7)))}-{rng.randrange(999)}")
        corpus.append("+".join(rng.choice([str(rng.randrange(99)), f"({rng.randrange(99)}*{rng.randrange(99)})"])
                               for _ in range(rng.randrange(1, 4))))
        corpus.append(" ".join(rng.choices(words, k=8)))
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


TOKENIZER = trained_tokenizer()
VOCAB = len(TOKENIZER)
MODEL = tiny_model("llama", vocab=VOCAB, seed=3)
# 33 tokens: two full blocks of 16 and one token. After the first prefill, a request with it hits the
# prefix cache for 32 and computes one token in the batched decode path, not a prompt of its own.
PROMPT = 'Answer in JSON like {"name": "Ann", "pets": [{"kind": "cat", "age": 3}], "role": "user"}: Answer:'


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
# One to three terms summed, a term a number or a parenthesised product of one or two numbers
# (bounded: a random model must end, and within MAX_TOKENS).
GRAMMAR = """root ::= term ("+" term){0,2}
term ::= num | "(" num ("*" num)? ")"
num ::= [0-9] | [1-9] [0-9]"""

SPECS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICE),
    "grammar": StructuredOutputsParams(grammar=GRAMMAR),
}
PER_KIND = 200    # sampled outputs per kind, all kinds batched in one engine run
# Above each kind's longest valid output in characters: the JSON's is 105 ('{"name": "' + 8 letters +
# two pets of '{"kind": "fish", "age": 30}' + ', "role": "admin"}'), the regex's 10, "green", and
# the grammar's 23 ("(99*99)+(99*99)+(99*99)"): plus the stop token.
MAX_TOKENS = {"json": 110, "regex": 12, "choice": 8, "grammar": 26}
ENGINE = dict(max_num_seqs=256)
# Of 4 tokens: the shared prompt's 8, then each running answer's own (a JSON answer ~11, up to 28):
# the 256 running answers outgrow it.
POOL_BLOCKS = 320


@pytest.fixture(scope="module")
def tokenizer():
    assert TOKENIZER.convert_tokens_to_ids(["<pad>", "<s>", "</s>"]) == [0, 1, 2]
    assert any(t.startswith('{"') for t in TOKENIZER.get_vocab()), "no merge crosses the JSON's structure"
    return TOKENIZER


@pytest.fixture(scope="module")
def embedded_pair():
    """The embedded model's real tokenizer (49,152 tokens, no weights) and a tiny random llama of its
    vocabulary: the greedy checks also run at a real vocabulary's size and merges."""
    from transformers import AutoTokenizer

    from jupyter_pagedkv.worker.loader import embedded_model_dir
    try:
        tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    except Exception as err:   # the embedded model's package is missing
        pytest.skip(f"the embedded model's tokenizer is not available: {err}")
    return tiny_model("llama", vocab=49152, seed=3), tokenizer


@pytest.fixture(params=["trained", "embedded"])
def pair(request, tokenizer):
    return (MODEL, tokenizer) if request.param == "trained" else request.getfixturevalue("embedded_pair")


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
    return parses_as_grammar(text)


def parses_as_grammar(text: str) -> bool:
    """GRAMMAR's recursive-descent parser: root ::= term ("+" term){0,2}, term ::= num | "(" num
    ("*" num)? ")", num ::= [0-9] | [1-9] [0-9]."""
    pos = 0

    def eat(char: str) -> bool:
        nonlocal pos
        if text[pos:pos + 1] == char:
            pos += 1
            return True
        return False

    def num() -> bool:
        nonlocal pos
        if not text[pos:pos + 1].isdigit():
            return False
        pos += 1
        if text[pos - 1] != "0" and text[pos:pos + 1].isdigit():
            pos += 1
        return True

    def term() -> bool:
        if eat("("):
            return num() and (not eat("*") or num()) and eat(")")
        return num()

    if not term():
        return False
    for _ in range(2):
        if not eat("+"):
            break
        if not term():
            return False
    return pos == len(text)


def run_all_kinds(engine, per_kind: int = PER_KIND, n: int = 1) -> dict[str, list]:
    """`per_kind` sampled outputs of every kind (per_kind / n requests of n samples each), all in one
    batch; returns the completions by kind. Prints the run's time (`-s` shows it)."""
    kinds = [k for k in SPECS for _ in range(per_kind // n)]
    prompts = [PROMPT] * len(kinds)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, [SamplingParams(max_tokens=MAX_TOKENS[k], temperature=1.0, n=n,
                                                    structured_outputs=SPECS[k]) for k in kinds])
    print(f"{len(kinds)} requests, n={n}: {time.perf_counter() - t0:.1f} s")
    by_kind: dict[str, list] = {k: [] for k in SPECS}
    for kind, out in zip(kinds, outs):
        by_kind[kind].extend(out.outputs)
    assert all(len(c) == per_kind for c in by_kind.values())
    return by_kind


def test_the_prompt_is_two_blocks_and_one_token(tokenizer):
    assert len(tokenizer(PROMPT).input_ids) == 33


def assert_all_valid(by_kind: dict[str, list]) -> None:
    for kind, completions in by_kind.items():
        bad = [(c.finish_reason, c.text) for c in completions if c.finish_reason != "stop" or not valid(kind, c.text)]
        assert not bad, f"{kind}: {len(bad)} of {len(completions)} invalid, e.g. {bad[:2]}"


def test_parses_as_grammar_is_the_grammar():
    """The EBNF oracle itself: what it accepts and refuses (it must not accept everything)."""
    for text in ["0", "7", "42", "(3)", "(3*45)", "1+(2*3)+40", "(10*0)+(1)"]:
        assert parses_as_grammar(text), text
    for text in ["", "05", "123", "(3", "3)", "(1*2*3)", "1+2+3+4", "1+", "(1+2)", "((1))", "1 + 2", "1*2"]:
        assert not parses_as_grammar(text), text


def distinct_outputs(by_kind: dict[str, list]) -> None:
    """Sampling drew many outputs, not one: otherwise the test shows little."""
    assert len({c.text for c in by_kind["json"]}) > PER_KIND // 2
    assert len({c.text for c in by_kind["regex"]}) > PER_KIND // 2
    assert {c.text for c in by_kind["choice"]} == set(CHOICE)


def test_every_sampled_output_of_each_kind_is_valid(make_engine, tokenizer):
    engine = make_engine(MODEL, tokenizer, seed=0, **ENGINE)
    by_kind = run_all_kinds(engine)
    assert_all_valid(by_kind)
    distinct_outputs(by_kind)


def test_n_samples_fork_the_grammar_state_and_all_are_valid(make_engine, tokenizer):
    engine = make_engine(MODEL, tokenizer, seed=1, **ENGINE)
    by_kind = run_all_kinds(engine, n=4)
    assert_all_valid(by_kind)
    distinct_outputs(by_kind)


class ScriptedDrafter:
    """Drafts each request's own greedy answer, taken from the run without speculation, with the
    last token of every other proposal changed: drafts are kept and rejected by construction on
    any CPU, where a random model's n-gram repeats (what the n-gram drafter needs) are not."""

    name = "scripted"
    needs_slots = False

    def __init__(self, answers: list[list[int]], vocab_size: int) -> None:
        self.answers, self.vocab_size, self.calls = answers, vocab_size, 0

    def propose(self, seqs, ks, copies=()):
        proposals = []
        for seq, k in zip(seqs, ks):
            done = seq.output_token_ids
            answer = next((a for a in self.answers if a[:len(done)] == done), [])
            draft = list(answer[len(done):len(done) + k])
            self.calls += 1
            if draft and self.calls % 2 == 0:
                draft[-1] = (draft[-1] + 1) % self.vocab_size
            proposals.append(Proposal(draft))
        return proposals

    def rolled_back(self, seq, num_computed):
        pass


@pytest.mark.parametrize("drafter", ["scripted", "ngram"])
def test_speculation_rolls_the_grammar_back_and_greedy_output_is_unchanged(make_engine, embedded_pair, drafter):
    # The real tokenizer and vocabulary. The scripted drafter makes sure drafts are both kept and
    # rejected (so the grammar is rolled back); the n-gram one proposes what this model happens to
    # repeat, which depends on the CPU's rounding, so only the outputs are checked for it.
    model, tokenizer = embedded_pair
    params = [SamplingParams(max_tokens=MAX_TOKENS[k], temperature=0.0, structured_outputs=s) for k, s in SPECS.items()]
    plain = make_engine(model, tokenizer).generate([PROMPT] * 4, params)
    answers = [o.outputs[0].token_ids for o in plain]
    speculative = ScriptedDrafter(answers, model.config.vocab_size) if drafter == "scripted" else "ngram"
    engine = make_engine(model, tokenizer, speculative=speculative)
    spec = engine.generate([PROMPT] * 4, params)
    stats = engine._speculator.stats
    if drafter == "scripted":
        assert stats.num_proposed > stats.num_accepted > 0, "no draft was both kept and rejected: nothing tested"
    assert [o.outputs[0].token_ids for o in spec] == answers
    assert_all_valid({k: o.outputs for k, o in zip(SPECS, spec)})


def test_sampled_outputs_stay_valid_under_speculation(make_engine, tokenizer):
    engine = make_engine(MODEL, tokenizer, seed=2, speculative="ngram", **ENGINE)
    by_kind = run_all_kinds(engine)
    assert_all_valid(by_kind)
    distinct_outputs(by_kind)
    stats = engine._speculator.stats
    assert stats.num_proposed > stats.num_accepted > 0, "no draft was both kept and rejected: nothing tested"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_grammar_state_survives_preemption(make_engine, tokenizer, mode):
    # One shared prompt (a preempted answer's recompute hits its cached blocks, as in a real pool);
    # the answers' own blocks outgrow the pool.
    engine = make_engine(MODEL, tokenizer, seed=4, block_size=4, num_blocks=POOL_BLOCKS, preemption_mode=mode,
                         swap_space="8MiB", **ENGINE)
    by_kind = run_all_kinds(engine)
    assert_all_valid(by_kind)
    distinct_outputs(by_kind)
    print(f"preemptions {engine._scheduler.num_preemptions}, swap-outs {engine._scheduler.num_swap_outs}")
    assert engine._scheduler.num_preemptions > 0
    if mode == "swap":
        assert engine._scheduler.num_swap_outs > 0


class XgrammarProcessor:
    """transformers' side: a logits processor on its own xgrammar matcher (the independent path)."""

    def __init__(self, compiled, vocab: int) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.prompt_len: int | None = None
        self.bitmask = xgr.allocate_token_bitmask(1, vocab)

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
def test_greedy_output_equals_transformers_generate_masked_by_xgrammar(make_engine, pair, kind):
    from transformers import LogitsProcessorList

    model, tokenizer = pair
    vocab = model.config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[tokenizer.eos_token_id])
    compiler = xgr.GrammarCompiler(info)
    compiled = (compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False) if kind == "json"
                else compiler.compile_regex(REGEX))
    ids = tokenizer(PROMPT).input_ids
    with torch.inference_mode():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS[kind], do_sample=False,
                             logits_processor=LogitsProcessorList([XgrammarProcessor(compiled, vocab)]),
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    expected = ref[0, len(ids):].tolist()
    out = make_engine(model, tokenizer).generate([ids], SamplingParams(max_tokens=MAX_TOKENS[kind], temperature=0.0,
                                                                        structured_outputs=SPECS[kind]))[0]
    assert out.outputs[0].token_ids == expected
    assert out.outputs[0].finish_reason == "stop" and valid(kind, out.outputs[0].text)


def test_plain_rows_beside_structured_ones_are_untouched(make_engine, tokenizer):
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = make_engine(MODEL, tokenizer).generate([PROMPT], plain)[0]
    mixed = make_engine(MODEL, tokenizer).generate([PROMPT] * 3, [
        SamplingParams(max_tokens=MAX_TOKENS["json"], temperature=0.0, structured_outputs=SPECS["json"]), plain,
        SamplingParams(max_tokens=MAX_TOKENS["regex"], temperature=0.0, structured_outputs=SPECS["regex"])])
    assert mixed[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert valid("json", mixed[0].outputs[0].text) and valid("regex", mixed[2].outputs[0].text)


def test_a_pydantic_class_is_a_schema(make_engine, tokenizer):
    out = make_engine(MODEL, tokenizer, seed=5).generate([PROMPT], SamplingParams(
        max_tokens=MAX_TOKENS["json"], temperature=1.0, structured_outputs=StructuredOutputsParams(json=Person)))[0]
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
