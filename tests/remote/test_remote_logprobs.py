"""Log-probabilities over a server: asked in OpenAI's and vLLM's field names, read back from vLLM's
answer into the local engine's shape (token id -> Logprob), anything malformed one line."""
from __future__ import annotations

import pytest

from jupyter_pagedkv import Engine
from jupyter_pagedkv.core.sampling_params import SamplingParams
from jupyter_pagedkv.engine.outputs import Logprob
from jupyter_pagedkv.remote.client import RemoteError
from jupyter_pagedkv.remote.logprob_fields import logprob_fields, parse_choice_logprobs

from fake_vllm import fake  # noqa: F401  (a fixture)


def bad(what: str) -> RemoteError:
    return RemoteError(f"server sent {what}")


def test_fields_in_vllms_names_for_completions_and_chat():
    params = SamplingParams(logprobs=3, prompt_logprobs=2)
    assert logprob_fields(params, chat=False) == {"logprobs": 3, "prompt_logprobs": 2,
                                                  "return_tokens_as_token_ids": True}
    assert logprob_fields(params, chat=True) == {"logprobs": True, "top_logprobs": 3, "prompt_logprobs": 2,
                                                 "return_tokens_as_token_ids": True}
    assert logprob_fields(SamplingParams(), chat=False) == {}


def test_chat_logprobs_parse_into_token_id_entries_with_ranks():
    content = {"content": [{"token": "token_id:5", "logprob": -0.1,
                            "top_logprobs": [{"token": "token_id:8", "logprob": -3.0},
                                             {"token": "token_id:5", "logprob": -0.1}]}]}
    [entry] = parse_choice_logprobs(content, chat=True, bad=bad)
    assert list(entry) == [5, 8]                                  # the chosen token first
    assert entry[5] == Logprob(-0.1, 1) and entry[8] == Logprob(-3.0, 2)


@pytest.mark.parametrize("obj,says", [
    ({"tokens": ["token_id:1"], "token_logprobs": [], "top_logprobs": []}, "differ in length"),
    ({"tokens": ["hello"], "token_logprobs": [-1.0], "top_logprobs": [None]}, "not 'token_id:N'"),
    ({"tokens": ["token_id:1"], "token_logprobs": [0.5], "top_logprobs": [None]}, "not a number <= 0"),
])
def test_malformed_logprobs_are_one_line(obj, says):
    with pytest.raises(RemoteError, match=says) as err:
        parse_choice_logprobs(obj, chat=False, bad=bad)
    assert "\n" not in str(err.value)


def test_a_streamed_answer_keeps_its_logprobs_and_prompt_logprobs(fake):
    handler, url = fake
    client = Engine.connect(url + "/v1")
    out = client.generate("ok", SamplingParams(max_tokens=2, logprobs=2, prompt_logprobs=1))[0]
    body = handler.bodies[-1]
    assert (body["logprobs"], body["prompt_logprobs"], body["return_tokens_as_token_ids"]) == (2, 1, True)
    sample = out.outputs[0]
    assert [list(p) for p in sample.logprobs] == [[1, 9], [2, 9]]
    assert sample.logprobs[0][1] == Logprob(-1.0, 2) and sample.logprobs[0][9] == Logprob(-0.5, 1)
    assert sample.cumulative_logprob == -2.0
    assert out.prompt_logprobs == [None, {6: Logprob(-2.0, 4, " b")}, {7: Logprob(-0.25, 1, " c")}]
    plain = client.generate("ok", SamplingParams(max_tokens=2))[0]
    assert plain.outputs[0].logprobs is None and plain.prompt_logprobs is None
    assert "logprobs" not in handler.bodies[-1]
    client.check_invariants()
