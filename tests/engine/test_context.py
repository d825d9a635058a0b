"""The model's context as users meet it: `max_model_len` from the config (overridable), a prompt or
prompt + max_tokens beyond it refused up front, `max_tokens=None` stopping at the context, and an
~7,000-token prompt on the embedded model token-identical to transformers."""
from __future__ import annotations

import pytest

from conftest import assert_same_or_near_tie, hf_greedy, tiny_model
from jupyter_pagedkv import BeamSearchParams, SamplingParams
from jupyter_pagedkv.testing.models import random_prompts

MODEL = tiny_model("llama", seed=31)          # max_position_embeddings=512


def test_the_context_comes_from_the_config_and_can_be_lowered(make_engine):
    assert make_engine(MODEL, block_size=4).max_model_len == 512
    assert make_engine(MODEL, block_size=4, max_model_len=100).max_model_len == 100


@pytest.mark.parametrize("prompt_len, params, message", [
    (100, SamplingParams(max_tokens=1), "prompt has 100 tokens but the model's context is 100"),
    (90, SamplingParams(max_tokens=11), "prompt (90 tokens) + max_tokens (11) exceeds the model's context "
                                        "of 100: lower max_tokens to 10 or less, or pass max_tokens=None"),
    (90, BeamSearchParams(beam_width=2, max_tokens=20), "exceeds the model's context of 100"),
])
def test_requests_past_the_context_are_refused_up_front(make_engine, prompt_len, params, message):
    engine = make_engine(MODEL, block_size=4, max_model_len=100)
    with pytest.raises(ValueError) as err:
        engine.add_request(list(range(3, 3 + prompt_len)), params)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not engine.has_unfinished_requests() and engine.stats().num_used == 0


def test_max_tokens_none_runs_to_the_context_and_stops_there_exactly(make_engine):
    engine = make_engine(MODEL, block_size=4, max_model_len=100)
    prompt = list(range(3, 83))
    out = engine.generate([prompt], SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.outputs[0].token_ids) == 20
    assert_same_or_near_tie(MODEL, prompt, out.outputs[0].token_ids, hf_greedy(MODEL, prompt, 20, stop_at_eos=False))


@pytest.mark.slow
def test_a_7000_token_prompt_on_the_embedded_model_is_exact(embedded, make_engine):
    """Chunked prefill over ~7,000 positions (4 chunks of 2,048, each attending to everything
    before it), then decoding: the same tokens as transformers' `generate` on the whole prompt."""
    model, tokenizer = embedded
    assert model.config.max_position_embeddings >= 8192
    prompt = random_prompts(1, model.config.vocab_size, seed=5, lo=7000, hi=7001)[0]
    engine = make_engine(model, tokenizer, kv_cache_memory="384MiB", max_num_batched_tokens=2048)
    out = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert out.num_cached_tokens == 0 and len(out.prompt_token_ids) == 7000
    assert_same_or_near_tie(model, prompt, out.outputs[0].token_ids, hf_greedy(model, prompt, 8, stop_at_eos=False))
    assert engine.stats().num_used == 0
