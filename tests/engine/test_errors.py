"""Bad input gets one clear error; the engine stays usable and leaks no block."""
from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from jupyter_pagedkv import Engine, SamplingParams
from jupyter_pagedkv.worker.loader import ModelNotFoundError

MODEL = tiny_model("llama")


@pytest.fixture
def engine(make_engine):
    return make_engine(MODEL, block_size=4, num_blocks=32)


def still_works(engine):
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    engine.check_invariants()
    assert engine._pool.num_free == engine._pool.num_blocks


@pytest.mark.parametrize("bad, message", [
    (lambda e: e.generate([[]], SamplingParams()), "empty prompt"),
    (lambda e: e.generate(["   "], SamplingParams()), "empty prompt"),
    (lambda e: e.generate([[1] * 600], SamplingParams(max_tokens=1)), "context"),
    (lambda e: e.generate([[1, 2]], SamplingParams(max_tokens=200)), "blocks"),
    (lambda e: e.generate([[1, 2], [9999]], SamplingParams(max_tokens=2)), "token ids"),
    (lambda e: e.generate([[1, 2], [3]], [SamplingParams()]), "one per prompt"),
    (lambda e: e.generate([[1, -2]], SamplingParams()), "token ids"),
    (lambda e: e.beam_search([[1, 999]]), "token ids"),
    (lambda e: list(e.stream([3, 256])), "token ids"),
    (lambda e: e.generate([[1, 2]], SamplingParams(stop_token_ids=[256])), "not in the vocabulary"),
    (lambda e: e.chat([{"role": "user"}]), "no text content"),
    (lambda e: e.chat([{"role": "bot", "content": "hi"}]), "role 'bot'"),
    (lambda e: e.chat(["hello"]), "non-empty list"),
    (lambda e: e.chat([]), "non-empty list"),
])
def test_bad_request_is_a_clear_error_and_the_engine_survives(engine, bad, message):
    with pytest.raises(ValueError, match=message):
        bad(engine)
    still_works(engine)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "finite"),
    (dict(temperature=float("inf")), "finite"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(stop=["ok", ""]), "non-empty"),
    (dict(stop=""), "non-empty"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(top_k=1.5), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=float("nan")), "min_p"),
])
def test_bad_sampling_params_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_a_failed_batch_submission_leaves_nothing_queued(engine):
    with pytest.raises(ValueError):
        engine.generate([[1, 2, 3], [4, 5], []], SamplingParams(max_tokens=4))
    assert not engine.has_unfinished_requests()
    still_works(engine)


def test_unknown_model_is_one_line(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not in the local Hugging Face cache"):
        Engine.from_pretrained("no-such-org/no-such-model")      # tests run with HF_HUB_OFFLINE=1
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        Engine.from_pretrained(str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="no model folder"):
        Engine.from_pretrained(str(tmp_path / "missing" / "dir"))


@pytest.mark.parametrize("kwargs, message", [
    (dict(preemption_mode="lru"), "preemption_mode"),
    (dict(preemption_mode="swap", swap_space="1KiB"), "swap_space"),
    (dict(allocator="buddy"), "allocator"),
    (dict(attention_backend="cuda-magic"), "backend"),
])
def test_designed_options_not_built_yet_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Engine(MODEL, None, num_blocks=8, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(dtype="bfloat16"), r"^dtype='bfloat16', but the model passed in holds float32: load it with "
                             r"Engine.from_pretrained\(..., dtype='bfloat16'\) or convert it first$"),
    (dict(device="cuda:1"), r"^device='cuda:1', but the model passed in is on cpu"),
    (dict(weights="packed"), r"^weights='packed', but the model passed in holds dense weights"),
])
def test_load_options_that_contradict_a_model_passed_in_are_refused(kwargs, message):
    """An engine serves a model as it is: a config describing another engine is refused (one line)."""
    with pytest.raises(ValueError, match=message):
        Engine(MODEL, None, num_blocks=8, **kwargs)
    engine = Engine(MODEL, None, num_blocks=8, device="cpu", dtype="float32")    # agreeing: served
    assert (engine.device.type, engine.dtype, engine.config.dtype) == ("cpu", torch.float32, "float32")
    engine.shutdown()


def test_a_duplicate_live_request_id_is_refused_and_a_finished_one_may_be_reused(engine):
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request([5, 6], params, request_id="mine")
    with pytest.raises(ValueError, match="'mine' is already in use"):
        engine.add_request([7, 8], params, request_id="mine")
    while engine.has_unfinished_requests():
        engine.step()
    again = engine.add_request([7, 8], params, request_id="mine")     # finished ids are free again
    assert engine._handle(again).prompt_token_ids == [7, 8]
    while engine.has_unfinished_requests():
        engine.step()
    still_works(engine)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_blocks=0), "num_blocks must be a positive integer"),
    (dict(num_blocks=-4), "num_blocks must be a positive integer"),
    (dict(kv_cache_memory="4096GiB"), "does not fit: cpu has .* available"),
    (dict(num_blocks=10**12), "does not fit"),
    (dict(kv_cache_memory="lots"), "cannot read size"),
])
def test_impossible_cache_sizes_are_one_line_before_anything_is_allocated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Engine(MODEL, None, **kwargs)


def test_kv_memory_too_small_for_one_block_is_refused():
    with pytest.raises(ValueError, match="holds no block"):
        Engine(MODEL, None, kv_cache_memory="1KiB")


def test_a_request_that_needs_the_whole_pool_still_runs():
    from jupyter_pagedkv import Engine

    engine = Engine(MODEL, None, block_size=4, num_blocks=200, max_model_len=1000)   # watermark: 2 blocks
    out = engine.generate([[3 + i % 250 for i in range(199 * 4)]], SamplingParams(max_tokens=4, temperature=0.0,
                                                                          ignore_eos=True))
    assert len(out[0].token_ids) == 4
    engine.check_invariants()
