"""What a request must satisfy before it is queued: a prompt the model can read, a length the
model and the pool can hold, a beam width the vocabulary allows. Each failure is one ValueError
line that says what to change, raised before anything is queued.

The front is in two layers: the request's own fields (`SamplingParams.validate`, exact types and
bounds, see core/sampling_params.py) and here what needs the engine: its tokenizer, vocabulary,
context, pool, and `max_num_seqs`, the limit on `n` and `beam_width` (every sample and every beam
is a sequence that runs in the same steps as its siblings, so all of them must fit one step)."""
from __future__ import annotations

import dataclasses

from ..core.sampling_params import BeamSearchParams, SamplingParams, is_int, show
from ..decoding.beam_search import BeamSearch

Prompt = str | list[int]


def check_params(params: object) -> SamplingParams | BeamSearchParams:
    """SamplingParams (None: the defaults) or BeamSearchParams, each field valid (fields may have
    been changed since construction)."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, (SamplingParams, BeamSearchParams)):
        raise ValueError(f"params must be SamplingParams, BeamSearchParams or None, got {show(params)}")
    params.validate()
    return params


def check_parallel(params: SamplingParams | BeamSearchParams, max_num_seqs: int) -> None:
    """`n` samples or `beam_width` beams run together: at most `max_num_seqs` sequences."""
    name, width = (("beam_width", params.beam_width) if isinstance(params, BeamSearchParams)
                   else ("n", params.n))
    if width > max_num_seqs:
        raise ValueError(f"{name}={width} needs {width} sequences in one step but the engine runs at most "
                         f"max_num_seqs={max_num_seqs}: lower {name}, or load with a larger max_num_seqs")


def check_request_fields(request_id: object, priority: object) -> None:
    if request_id is not None and not (isinstance(request_id, str) and request_id):
        raise ValueError(f"request_id must be a non-empty string or None, got {show(request_id)}")
    if not is_int(priority):
        raise ValueError(f"priority must be an integer, got {show(priority)}")


def tokenize(tokenizer, prompt: Prompt, vocab_size: int) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt given as text or as token ids."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("empty prompt: give some text or token ids")
        if tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass token ids instead of text")
        return prompt, tokenizer(prompt).input_ids
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"a prompt is text or a list of token ids, got {show(prompt)}")
    ids = list(prompt)
    if not ids:
        raise ValueError("empty prompt: give some text or token ids")
    if not all(is_int(t) and 0 <= t < vocab_size for t in ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size}), got {show(ids)}")
    return None, ids


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Every token id a parameter names is one the model can produce (one row per parameter)."""
    for name, ids in (("stop_token_ids", params.stop_token_ids),
                      ("logit_bias", list(params.logit_bias or ())),
                      ("allowed_token_ids", list(params.allowed_token_ids or ())),
                      ("bad_words", [t for w in params.bad_words or () for t in w])):
        bad = sorted({t for t in ids if t >= vocab_size})
        if bad:
            raise ValueError(f"{name}: token ids {bad} are not in the vocabulary (ids 0 .. {vocab_size - 1})")


def check_logprobs(params: SamplingParams, vocab_size: int) -> None:
    """logprobs / prompt_logprobs ask for no more alternatives than the vocabulary has."""
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > vocab_size:
            raise ValueError(f"{name}={k} asks for more alternatives than the vocabulary's {vocab_size} "
                             f"tokens: use {name}={vocab_size} or less")


def resolve_bad_words(params: SamplingParams, tokenizer) -> SamplingParams:
    """`params` with each bad word given as text replaced by its token ids, with and without a
    leading space (as vLLM tokenises them: a word mid-sentence usually carries the space)."""
    if not params.bad_words or not any(isinstance(w, str) for w in params.bad_words):
        return params
    if tokenizer is None:
        raise ValueError("bad_words given as text need a tokenizer: pass token id lists instead")
    words: list[list[int]] = []
    for w in params.bad_words:
        variants = [list(w)] if not isinstance(w, str) else \
            [tokenizer(v, add_special_tokens=False).input_ids for v in (w.strip(), " " + w.strip())]
        words.extend(v for v in variants if v and v not in words)
    return dataclasses.replace(params, bad_words=words)


def within_context(ids: list[int], params: SamplingParams | BeamSearchParams,
                   max_model_len: int) -> SamplingParams | BeamSearchParams:
    """The prompt and its new tokens fit the model's context: `params` with `max_tokens=None`
    resolved to what the context leaves (the request then ends with "length" at the limit); a
    prompt, or a prompt + max_tokens, longer than the context is refused here, up front."""
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens but the model's context is "
                         f"{max_model_len}: shorten the prompt")
    room = max_model_len - len(ids)
    if params.max_tokens is None:
        return dataclasses.replace(params, max_tokens=room)
    if params.max_tokens > room:
        raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                         f"model's context of {max_model_len}: lower max_tokens to {room} or less, or "
                         f"pass max_tokens=None to stop at the context")
    return params


def check_fits(ids: list[int], params: SamplingParams, max_model_len: int, block_size: int,
               num_blocks: int) -> None:
    """The prompt fits the model's context (within_context first) and one request fits the pool."""
    need_tokens = min(len(ids) + params.max_tokens, max_model_len)
    need_blocks = -(-need_tokens // block_size)
    if need_blocks > num_blocks:
        raise ValueError(
            f"one request needs {need_blocks} blocks ({len(ids)} prompt + {params.max_tokens} "
            f"new tokens) but the pool has {num_blocks}: lower max_tokens or load "
            f"with more num_blocks / kv_cache_memory")


def beam_state(ids: list[int], params: BeamSearchParams, eos_token_ids: set[int], max_model_len: int,
               vocab_size: int, block_size: int, num_blocks: int) -> BeamSearch:
    """The selection state of a beam request, once its length, width and worst-case blocks fit."""
    within_context(ids, params, max_model_len)
    beam = BeamSearch(params, len(ids), eos_token_ids, max_model_len)
    if beam.num_candidates > vocab_size:
        raise ValueError(f"beam_width {params.beam_width} keeps {beam.num_candidates} candidates per "
                         f"step but the vocabulary has {vocab_size}: use a smaller beam_width")
    need = beam.blocks_needed(len(ids), block_size)
    if need > num_blocks:
        raise ValueError(f"beam search with {params.beam_width} beams may need {need} blocks "
                         f"({len(ids)} prompt + {beam.max_new_tokens} new tokens per beam) but the "
                         f"pool has {num_blocks}: lower beam_width or max_tokens, or load "
                         f"with more num_blocks / kv_cache_memory")
    return beam


def check_tenant(tenant: object) -> str | None:
    """A tenant is None (nobody named) or a non-empty name; anything else is one clear line."""
    if tenant is None:
        return None
    if not isinstance(tenant, str) or not tenant.strip():
        raise ValueError(f"tenant must be a non-empty string such as 'alice' (or None), got {show(tenant)}")
    return tenant


def check_cap(tenant: str | None, max_blocks: int | None, ids: list[int], params: SamplingParams,
              beam: BeamSearch | None, max_model_len: int, block_size: int,
              request_id: str | None = None) -> None:
    """One request fits its tenant's max_blocks: one sequence's whole context (all beams' worst
    case for a beam search, whose beams advance together and so must fit together)."""
    if max_blocks is None:
        return
    if beam is not None:
        need = beam.blocks_needed(len(ids), block_size)
        what = f"its beams, {len(ids)} prompt + {beam.max_new_tokens} new tokens each"
    else:
        need = -(-min(len(ids) + params.max_tokens, max_model_len) // block_size)
        what = f"{len(ids)} prompt + {params.max_tokens} new tokens"
    if need > max_blocks:
        which = f"its live request {request_id}" if request_id else "this request"
        raise ValueError(f"tenant {tenant!r} may hold at most {max_blocks} blocks (max_blocks) but {which} "
                         f"needs {need} ({what}): lower max_tokens, or raise the cap with "
                         f"engine.set_tenant({tenant!r}, max_blocks={need})")


def check_live_caps(name: str, max_blocks: int | None, requests, max_model_len: int, block_size: int) -> None:
    """A new cap for tenant `name` must still hold each of its live requests whole (else it could
    never finish): one line naming the first that would not fit."""
    if max_blocks is None:
        return
    for req in requests:
        if req.tenant == name and not req.finished:
            check_cap(name, max_blocks, req.prompt_token_ids, req.params, req.beam, max_model_len,
                      block_size, req.request_id)
