"""A request as an OpenAI-compatible server reads it: the prompt (text, token ids or a ChatPrompt
the server templates), and the SamplingParams as OpenAI's own fields and vLLM's extensions under
vLLM's own names, each sent only when it differs from the default (a server other than vLLM
refuses fields it does not know)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.sampling_params import SamplingParams
from ..core.structured_outputs import StructuredOutputsParams
from .logprob_fields import logprob_fields


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation for the server to template (its own chat template, not a local tokenizer)."""

    messages: tuple[dict, ...]


def request_body(prompt, params: SamplingParams, model: str, vllm: bool) -> dict[str, Any]:
    """The JSON body of a streamed completion (a text or token-id prompt) or chat completion (a
    ChatPrompt) for `model`; vLLM's extensions only to a vLLM server (`vllm`), else refused."""
    body: dict[str, Any] = {"model": model, "max_tokens": params.max_tokens,
                            "temperature": params.temperature, "top_p": params.top_p,
                            "n": params.n, "stream": True,
                            "stream_options": {"include_usage": True}}
    if params.max_tokens is None:
        del body["max_tokens"]      # the server's default: up to the model's context
    if isinstance(prompt, ChatPrompt):
        body["messages"] = list(prompt.messages)
    elif isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("empty prompt: give some text or token ids")
        body["prompt"] = prompt
    else:
        ids = list(prompt)
        if not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ValueError("prompt token ids must be a non-empty list of non-negative integers")
        body["prompt"] = ids
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    body.update(openai_fields(params))
    extensions = vllm_fields(params) | logprob_fields(params, isinstance(prompt, ChatPrompt))
    if vllm:
        body["return_token_ids"] = True
        body.update(extensions)
    elif extensions:
        raise ValueError(f"{', '.join(extensions)} need a vLLM server")
    return body


def openai_fields(params: SamplingParams) -> dict[str, Any]:
    """Penalties and logit_bias (its keys are token ids written as text)."""
    body: dict[str, Any] = {name: value for name, value in (("presence_penalty", params.presence_penalty),
                                                            ("frequency_penalty", params.frequency_penalty))
                            if value != 0.0}
    if params.logit_bias:
        body["logit_bias"] = {str(t): b for t, b in params.logit_bias.items()}
    return body


def vllm_fields(params: SamplingParams) -> dict[str, Any]:
    """vLLM's extensions of the request (field name -> value), those not at vLLM's default."""
    if any(isinstance(w, (list, tuple)) for w in params.bad_words or ()):
        raise ValueError("a server takes bad_words as text only: pass words, not token id lists")
    fields = (("top_k", max(params.top_k, 0), 0), ("min_p", params.min_p, 0.0),
              ("ignore_eos", params.ignore_eos, False), ("stop_token_ids", list(params.stop_token_ids), []),
              ("repetition_penalty", params.repetition_penalty, 1.0), ("min_tokens", params.min_tokens, 0),
              ("allowed_token_ids", params.allowed_token_ids, None), ("bad_words", params.bad_words, None),
              ("include_stop_str_in_output", params.include_stop_str_in_output, False),
              ("skip_special_tokens", params.skip_special_tokens, True))
    body = {name: list(value) if isinstance(value, (list, tuple)) else value
            for name, value, default in fields if value != default}
    if params.structured_outputs is not None:
        body["structured_outputs"] = structured_outputs_field(params.structured_outputs)
    return body


def structured_outputs_field(spec: StructuredOutputsParams) -> dict[str, Any]:
    """vLLM's `structured_outputs` object (its server's name since `guided_*` were removed): the
    one kind given, a pydantic class sent as its JSON schema."""
    kind = spec.kind
    value = spec.schema() if kind == "json" else getattr(spec, kind)
    return {kind: list(value) if kind == "choice" else value}
