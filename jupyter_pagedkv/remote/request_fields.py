"""A request's SamplingParams as an OpenAI-compatible server reads them: OpenAI's own fields, and
vLLM's extensions under vLLM's own names, each sent only when it differs from the default (a
server other than vLLM refuses fields it does not know)."""
from __future__ import annotations

from typing import Any

from ..core.sampling_params import SamplingParams
from ..core.structured_outputs import StructuredOutputsParams


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
