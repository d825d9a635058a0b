"""Log-probabilities over a server: the request's fields in OpenAI's and vLLM's names, and the
streamed answer's logprobs read back into the local engine's shape (token id -> Logprob).

Asked: `/v1/completions` takes `logprobs: k`; `/v1/chat/completions` takes `logprobs: true` and
`top_logprobs: k`; `prompt_logprobs: k` is vLLM's extension; `return_tokens_as_token_ids` (vLLM)
makes every token arrive as "token_id:N", so entries are keyed by id as locally. The server then
sends no token text, so `decoded_token` is None; ranks are the order of the alternatives sent (the
chosen token's rank is None when it is not among them). Each value is checked as wire.py checks
the rest: anything malformed is one RemoteError line.
"""
from __future__ import annotations

from typing import Any, Callable

from ..core.sampling_params import SamplingParams
from ..engine.outputs import Logprob, PositionLogprobs

_ID = "token_id:"


def logprob_fields(params: SamplingParams, chat: bool) -> dict[str, Any]:
    """The body's logprob fields (none when nothing is asked)."""
    body: dict[str, Any] = {}
    if params.logprobs is not None:
        body.update({"logprobs": True, "top_logprobs": params.logprobs} if chat else {"logprobs": params.logprobs})
    if params.prompt_logprobs is not None:
        body["prompt_logprobs"] = params.prompt_logprobs
    if body:
        body["return_tokens_as_token_ids"] = True
    return body


def _token_id(token: Any, bad: Callable[[str], Exception]) -> int:
    if isinstance(token, str) and token.startswith(_ID) and token[len(_ID):].isdigit():
        return int(token[len(_ID):])
    raise bad(f"a logprob token {str(token)[:30]!r} that is not 'token_id:N'")


def _value(v: Any, bad: Callable[[str], Exception]) -> float:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0:
        return float(v)
    raise bad(f"a logprob {str(v)[:30]} that is not a number <= 0")


def _position(chosen: int, value: Any, top: list[tuple[int, Any]], bad) -> PositionLogprobs:
    ranked = sorted(((t, _value(v, bad)) for t, v in top), key=lambda tv: -tv[1])
    ranks = {t: r for r, (t, _) in enumerate(ranked, start=1)}
    entry = {chosen: Logprob(_value(value, bad), ranks.get(chosen))}
    entry.update((t, Logprob(v, ranks[t])) for t, v in ranked if t != chosen)
    return entry


def parse_choice_logprobs(obj: Any, chat: bool, bad: Callable[[str], Exception]) -> list[PositionLogprobs]:
    """A choice's `logprobs` object (completions: parallel lists; chat: `content` entries)."""
    if obj is None:
        return []
    if not isinstance(obj, dict):
        raise bad("logprobs that are not an object")
    out = []
    if chat:
        for e in obj.get("content") or []:
            if not isinstance(e, dict) or not isinstance(e.get("top_logprobs") or [], list):
                raise bad("a logprobs content entry that is not an object")
            top = [(_token_id(a.get("token"), bad), a.get("logprob")) for a in e.get("top_logprobs") or []
                   if isinstance(a, dict)]
            out.append(_position(_token_id(e.get("token"), bad), e.get("logprob"), top, bad))
        return out
    tokens, values, tops = obj.get("tokens") or [], obj.get("token_logprobs") or [], obj.get("top_logprobs")
    tops = tops if tops is not None else [None] * len(tokens)
    if not (isinstance(tokens, list) and isinstance(values, list) and isinstance(tops, list)
            and len(tokens) == len(values) == len(tops)):
        raise bad("logprobs whose tokens, token_logprobs and top_logprobs differ in length")
    for token, value, top in zip(tokens, values, tops):
        if top is not None and not isinstance(top, dict):
            raise bad("top_logprobs that are not objects")
        pairs = [(_token_id(t, bad), v) for t, v in (top or {}).items()]
        out.append(_position(_token_id(token, bad), value, pairs, bad))
    return out


def parse_prompt_logprobs(obj: Any, bad: Callable[[str], Exception]) -> list[PositionLogprobs | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token None or {"id": {logprob, rank, decoded_token}}."""
    if obj is None:
        return None
    if not isinstance(obj, list):
        raise bad("prompt_logprobs that are not a list")
    out: list[PositionLogprobs | None] = []
    for pos in obj:
        if pos is None:
            out.append(None)
            continue
        if not isinstance(pos, dict) or not all(isinstance(k, str) and k.isdigit() and isinstance(v, dict)
                                                for k, v in pos.items()):
            raise bad("a prompt_logprobs entry that is not {token id: {logprob, rank, decoded_token}}")
        out.append({int(k): Logprob(_value(v.get("logprob"), bad), v.get("rank") if type(v.get("rank")) is int else None,
                                    v.get("decoded_token") if isinstance(v.get("decoded_token"), str) else None)
                    for k, v in pos.items()})
    return out
