"""The validation front, driven with arbitrary values: every input is either served (the request
completes, the invariants hold, no block leaks) or refused with one ValueError / UsageError line
and nothing queued. Never another exception type, never a failure mid-step.

One tiny engine (a random Llama with a byte-level tokenizer built in code) serves the module; it
is not started, so `generate` steps it in the test's thread and every example runs to its end.
"""
from __future__ import annotations

import math
import shlex

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError

from conftest import tiny_model
from jupyter_pagedkv import BeamSearchParams, Engine, SamplingParams, StructuredOutputsParams
from jupyter_pagedkv.testing.models import byte_tokenizer
from jupyter_pagedkv.config import EngineConfig, from_arguments
from jupyter_pagedkv.notebook.magics import PagedKVMagics
from jupyter_pagedkv.notebook.options import generate_params, parse_line

MAX_NUM_SEQS = 6
NUM_BLOCKS = 48
BLOCK_SIZE = 4
VOCAB = 256
PROPERTY = settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def engine():
    e = Engine(tiny_model("llama"), byte_tokenizer(), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
               max_num_seqs=MAX_NUM_SEQS)
    yield e
    e.stop()
    e.check_invariants()


class Opaque:
    """An object no rule knows, whose repr spans lines (errors must still be one line)."""

    def __repr__(self) -> str:
        return "Opaque(\n  1,\n  2)"


# Values of the wrong kind for any field: what a hurried caller or a notebook variable may hold.
junk = st.one_of(
    st.none(), st.booleans(), st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-10 ** 12, 10 ** 12), st.text(max_size=4), st.just(Opaque()),
    st.lists(st.integers(-3, 300), max_size=3), st.tuples(st.booleans()), st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
    st.just(b"ab"), st.just(2.5), st.just("2"), st.just(10 ** 7), st.just(2 ** 64),
)


def either(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a plausible value (so requests do run), sometimes any junk."""
    return st.one_of(valid, valid, junk)


sampling_kwargs = st.fixed_dictionaries({}, optional={
    "max_tokens": either(st.integers(-1, 4)),
    "temperature": either(st.sampled_from([0.0, 0.0, 0.7, 1.0, 1e-9, 1e9])),
    "top_p": either(st.floats(0.0, 1.2)),
    "top_k": either(st.integers(-2, VOCAB + 5)),
    "seed": either(st.one_of(st.none(), st.integers(-2, 2 ** 64))),
    "stop": either(st.one_of(st.none(), st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2))),
    "stop_token_ids": either(st.lists(st.integers(-1, VOCAB + 1), max_size=2)),
    "n": either(st.integers(-1, MAX_NUM_SEQS + 2)),
    "ignore_eos": either(st.booleans()),
    # no arbitrary text here: a string names a draft model to load
    "speculative": st.sampled_from([None, False, "ngram", True, 0, 1.5, "", " "]),
})
beam_kwargs = st.fixed_dictionaries({}, optional={
    "beam_width": either(st.integers(-1, MAX_NUM_SEQS + 2)),
    "max_tokens": either(st.integers(-1, 4)),
    "length_penalty": either(st.floats(-2, 2)),
    "early_stopping": either(st.sampled_from([True, False, "never", 1, 0, "yes"])),
    "ignore_eos": either(st.booleans()),
    "speculative": st.sampled_from([None, False, True, "", 7]),
})
token_ids = st.lists(st.integers(-2, VOCAB + 2), max_size=8)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "bot", 3]),
                                 "content": either(st.text(max_size=8))})
prompts = st.one_of(st.text(max_size=12), token_ids, token_ids.map(tuple), st.lists(st.booleans(), max_size=3),
                    st.lists(st.one_of(st.integers(0, 9), st.floats(0, 9)), min_size=1, max_size=3), junk)


def assert_one_line(err: BaseException) -> None:
    text = str(err)
    assert text.strip() and "\n" not in text, f"not one line: {text!r}"


def assert_nothing_left(engine: Engine) -> None:
    assert not engine.has_unfinished_requests()
    engine.check_invariants()
    assert engine._pool.num_free == engine._pool.num_blocks, "a block leaked"


def assert_refused(engine: Engine, err: ValueError) -> None:
    """A refusal is a plain ValueError of one line, with nothing queued or held."""
    assert type(err) is ValueError, f"{type(err).__name__}: {err}"
    assert_one_line(err)
    assert_nothing_left(engine)


@pytest.mark.timeout(1200)   # 500 examples: ~5 min on a machine shared five ways
@PROPERTY
@given(prompt=st.one_of(prompts, st.lists(prompts, max_size=3)), kind=st.sampled_from([SamplingParams, BeamSearchParams]),
       sampling=sampling_kwargs, beam=beam_kwargs, tenant=st.one_of(st.none(), st.just("alice"), junk),
       call=st.sampled_from(["generate", "add_request", "beam_search"]),
       priority=st.one_of(st.just(0), junk), request_id=st.one_of(st.none(), junk))
def test_every_request_is_served_or_refused_in_one_line(engine, prompt, kind, sampling, beam, tenant, call,
                                                         priority, request_id):
    try:
        params = kind(**(sampling if kind is SamplingParams else beam))
        if call == "generate":
            outputs = engine.generate(prompt, params if kind is SamplingParams else None, tenant=tenant)
        elif call == "beam_search":
            outputs = engine.beam_search(prompt, params if kind is BeamSearchParams else None, tenant=tenant)
        else:
            rid = engine.add_request(prompt, params, request_id=request_id, priority=priority, tenant=tenant)
            outputs = engine._wait([rid])
    except ValueError as err:
        assert_refused(engine, err)
        return
    assert_nothing_left(engine)
    if kind is SamplingParams and call != "beam_search":
        for out in outputs:
            assert out.finished and len(out.outputs) == params.n
            for c in out.outputs:
                assert c.finish_reason in ("stop", "length")
                assert len(c.token_ids) <= params.max_tokens


# One field at a time, every other field valid, so a value that slips through reaches a step.
# The space is finite (each field x the values below) and smaller than max_examples: hypothesis
# tries every pair, so no hole depends on luck.
BAD_VALUES = [None, True, False, 0, -1, 2.5, float("nan"), float("inf"), "2", "", "abc", b"ab", 10 ** 7,
              2 ** 64, [True, 1], [1.0], (3,), {}, Opaque()]
GOOD_VALUES = {"max_tokens": [3], "temperature": [0.0, 0.8], "top_p": [0.5], "top_k": [3], "seed": [7],
               "stop": ["x", ["ab"]], "stop_token_ids": [[2]], "n": [3], "ignore_eos": [True],
               "speculative": ["ngram", " "], "prompt": ["hi", (5, 6)], "tenant": ["bob"], "priority": [1],
               "request_id": ["mine"],
               # the logits processors (worker/logits_processors.py) and min-p
               "min_p": [0.1], "repetition_penalty": [1.2], "presence_penalty": [0.5],
               "frequency_penalty": [-0.5], "min_tokens": [1], "logit_bias": [{5: 1.5}],
               "allowed_token_ids": [[5, 6, 7]], "bad_words": [["x"], [[5, 6]]],
               "include_stop_str_in_output": [True], "skip_special_tokens": [False],
               # structured outputs (decoding/grammar.py): letters the byte tokenizer has as tokens
               "structured_outputs": [StructuredOutputsParams(choice=["ab", "c"]),
                                      StructuredOutputsParams(regex="[a-c]{1,2}")]}
# (a speculative text other than 'ngram' names a draft model to load: not tried here)
FIELD_VALUES = [(name, v) for name in sorted(GOOD_VALUES) for v in BAD_VALUES + GOOD_VALUES[name]
                if not (name == "speculative" and isinstance(v, str) and v.strip() and v != "ngram")]


@settings(PROPERTY, max_examples=max(500, 2 * len(FIELD_VALUES)))
@given(pair=st.sampled_from(FIELD_VALUES))
def test_any_value_in_any_one_field_is_served_or_refused_in_one_line(engine, pair):
    name, value = pair
    base = {"max_tokens": 2, "temperature": 0.0}
    request = {"prompt": [5, 6, 7], "tenant": None, "priority": 0, "request_id": None}
    (request if name in request else base)[name] = value
    try:
        params = SamplingParams(**base)
        rid = engine.add_request(request["prompt"], params, request_id=request["request_id"],
                                 priority=request["priority"], tenant=request["tenant"])
        out = engine._wait([rid])[0]
    except ValueError as err:
        assert_refused(engine, err)
        return
    assert_nothing_left(engine)
    assert out.finished and len(out.outputs) == params.n
    assert all(len(c.token_ids) <= params.max_tokens for c in out.outputs)


@settings(PROPERTY, max_examples=100)
@given(conversation=st.one_of(st.lists(message, max_size=3), st.lists(st.lists(message, max_size=2), max_size=2),
                              junk),
       sampling=sampling_kwargs)
def test_every_chat_is_served_or_refused_in_one_line(engine, conversation, sampling):
    try:
        outputs = engine.chat(conversation, SamplingParams(**sampling))
    except ValueError as err:
        assert_refused(engine, err)
        return
    assert_nothing_left(engine)
    assert all(o.finished for o in outputs)


# -- the magic lines, parsed as %%generate and %pagedkv load parse them (no kernel needed) ------
number_word = st.one_of(st.integers(-3, MAX_NUM_SEQS + 3).map(str), st.floats(allow_nan=True).map(str),
                        st.sampled_from(["2.5", "abc", "", "1e3", "True", "-0", "10000000", "nan", "inf"]))
generate_options = st.lists(st.one_of(
    st.tuples(st.sampled_from(["--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--n",
                               "--beams"]), number_word),
    st.tuples(st.sampled_from(["--stop", "--tenant", "--out", "--format", "--system"]),
              st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=4)),
    st.tuples(st.sampled_from(["--no-stream", "--raw", "--bogus", "-h", "'"]), st.just(None)),
), max_size=4)


def line_of(options) -> str:
    words = []
    for flag, value in options:
        words.append(flag if flag != "'" else "'")
        if value is not None:
            words.append(shlex.quote(value))
    return " ".join(words)


@settings(PROPERTY, max_examples=200)
@given(options=generate_options, prompt=st.text(max_size=8))
def test_every_generate_line_is_served_or_refused_in_one_line(engine, options, prompt):
    try:
        # a short default first (the magic's own is 128 tokens); a drawn --max-tokens overrides it
        args = parse_line(PagedKVMagics.generate, "--max-tokens 3 " + line_of(options))
        params = generate_params(args)
    except UsageError as err:
        assert_one_line(err)
        assert_nothing_left(engine)
        return
    try:   # what the magic's _submit does with the engine's ValueError: one UsageError line
        rid = engine.add_request(prompt, params, tenant=args.tenant)
        engine._wait([rid])
    except ValueError as err:
        assert type(err) is ValueError, f"{type(err).__name__}: {err}"
        assert_one_line(err)
    assert_nothing_left(engine)


load_options = st.lists(st.tuples(
    st.sampled_from(["--block-size", "--num-blocks", "--max-num-seqs", "--max-num-batched-tokens",
                     "--kv-cache-memory", "--swap-space", "--seed", "--max-model-len", "--preemption",
                     "--num-speculative-tokens", "--dtype", "--allocator"]),
    number_word), max_size=3)


@settings(PROPERTY, max_examples=300)
@given(options=load_options)
def test_every_load_line_is_accepted_or_refused_in_one_line(options):
    """`%pagedkv load`'s options reach EngineConfig as the magic passes them."""
    try:
        args = parse_line(PagedKVMagics.pagedkv, "load " + line_of(options))
        EngineConfig(**from_arguments(args))
    except (UsageError, ValueError) as err:
        assert type(err) in (UsageError, ValueError), f"{type(err).__name__}: {err}"
        assert_one_line(err)


@settings(PROPERTY, max_examples=300)
@given(options=st.fixed_dictionaries({}, optional={
    name: junk for name in ("block_size", "num_blocks", "max_num_seqs", "kv_cache_memory", "swap_space",
                            "seed", "max_model_len", "preemption_mode", "enable_prefix_caching",
                            "num_speculative_tokens", "pack_weights", "device", "dtype", "step_loop")}))
def test_every_engine_option_value_is_accepted_or_refused_in_one_line(options):
    try:
        config = EngineConfig(**options)
    except ValueError as err:
        assert type(err) is ValueError, f"{type(err).__name__}: {err}"
        assert_one_line(err)
        return
    for name in ("block_size", "max_num_seqs", "num_speculative_tokens"):
        value = getattr(config, name)
        assert type(value) is int and value >= 1


# -- the holes of issue 35, one by one ----------------------------------------------------------
@pytest.mark.parametrize("make, field", [
    (lambda: SamplingParams(n=2.5), "n"),
    (lambda: SamplingParams(n="2"), "n"),
    (lambda: SamplingParams(seed="abc"), "seed"),
    (lambda: SamplingParams(seed=2 ** 64), "seed"),
    (lambda: SamplingParams(max_tokens=True), "max_tokens"),
    (lambda: SamplingParams(stop=5), "stop"),
    (lambda: SamplingParams(stop_token_ids=[True]), "stop_token_ids"),
    (lambda: SamplingParams(ignore_eos="no"), "ignore_eos"),
    (lambda: BeamSearchParams(beam_width=True), "beam_width"),
    (lambda: BeamSearchParams(early_stopping=1), "early_stopping"),
    (lambda: EngineConfig(block_size=True), "block_size"),
    (lambda: EngineConfig(kv_cache_memory=True), "kv_cache_memory"),
])
def test_wrong_types_are_refused_by_field_name(make, field):
    with pytest.raises(ValueError, match=f"^{field} must be ") as err:
        make()
    assert_one_line(err.value)


@pytest.mark.parametrize("prompt", [[True, 1], 3.5, None, [1.0, 2], {"role": "user"}])
def test_prompts_that_are_not_text_or_token_ids_are_refused(engine, prompt):
    with pytest.raises(ValueError, match="prompt") as err:
        engine.generate(prompt, SamplingParams(max_tokens=2))
    assert_one_line(err.value)
    assert_nothing_left(engine)


def test_n_and_beam_width_are_bounded_by_max_num_seqs(engine):
    for params in (SamplingParams(n=10 ** 7, max_tokens=2), BeamSearchParams(beam_width=MAX_NUM_SEQS + 1)):
        with pytest.raises(ValueError, match=f"at most max_num_seqs={MAX_NUM_SEQS}"):
            engine.add_request([5, 6], params)
        assert_nothing_left(engine)
    out = engine.generate([5, 6], SamplingParams(n=MAX_NUM_SEQS, max_tokens=2, seed=3))
    assert len(out[0].outputs) == MAX_NUM_SEQS
    assert_nothing_left(engine)


def test_a_params_changed_after_construction_is_checked_again(engine):
    params = SamplingParams(max_tokens=2)
    params.n = 2.5
    with pytest.raises(ValueError, match="^n must be"):
        engine.generate([5, 6], params)
    assert_nothing_left(engine)


def test_text_and_chat_prompts_run_on_the_byte_tokenizer(engine):
    out = engine.generate("hello", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    out = engine.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out[0].token_ids) == 2
    assert math.isfinite(out[0].metrics.latency)
    assert_nothing_left(engine)
