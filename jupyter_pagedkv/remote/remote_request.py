"""RemoteRequest: one server request's state as its server-sent events arrive.

The client's reading thread folds each checked chunk (wire.py) into the request (`fold_chunk`),
which tells its listeners what is new; `request_output` gives what it holds as a RequestOutput,
the same record a local engine's request gives.
"""
from __future__ import annotations

import http.client
import queue
import socket
import threading
import time
from dataclasses import dataclass, field

from ..core.sampling_params import SamplingParams
from ..engine.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput, StreamDelta
from . import wire


@dataclass(eq=False)
class RemoteRequest:
    """A request streamed from the server: its prompt, what each sample has produced, how it ended,
    and the connection its thread reads (kept so that `abort` can shut it)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    listeners: list[queue.SimpleQueue] = field(default_factory=list)
    num_output_tokens: int = 0           # of the first sample, as streamed
    num_cached_tokens: int | None = None  # prompt tokens the server found cached (from `usage`)
    texts: dict[int, str] = field(default_factory=dict)
    tokens: dict[int, list[int]] = field(default_factory=dict)
    finish: dict[int, str] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    aborted: bool = False
    conn: http.client.HTTPConnection | None = None
    sock: socket.socket | None = None    # kept: http.client drops conn.sock once a response owns it
    thread: threading.Thread | None = None
    tenant: str | None = None            # sent as the body's cache_salt
    logprobs: dict[int, list[PositionLogprobs]] = field(default_factory=dict)   # by choice index
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return self.done.is_set()


def fold_chunk(req: RemoteRequest, chunk: wire.Chunk) -> None:
    """One checked chunk of the stream into the request; sample 0's new text and tokens go to its
    listeners as a StreamDelta."""
    now = time.perf_counter()
    if chunk.prompt_token_ids and not req.prompt_token_ids:
        req.prompt_token_ids = list(chunk.prompt_token_ids)
    new_text, new_tokens = "", []
    for c in chunk.choices:
        req.texts[c.index] = req.texts.get(c.index, "") + c.text
        req.tokens.setdefault(c.index, []).extend(c.token_ids)
        req.logprobs.setdefault(c.index, []).extend(c.logprobs)
        if c.finish_reason:
            req.finish[c.index] = c.finish_reason
        if c.index == 0:
            new_text += c.text
            new_tokens += c.token_ids
    if chunk.completion_tokens is not None:
        req.metrics.num_generated_tokens = chunk.completion_tokens
    if chunk.cached_tokens is not None:
        req.num_cached_tokens = chunk.cached_tokens
    req.prompt_logprobs = chunk.prompt_logprobs or req.prompt_logprobs
    if (new_text or new_tokens) and req.metrics.first_token_time is None:
        req.metrics.first_token_time = now
    req.num_output_tokens = len(req.tokens.get(0, [])) or req.num_output_tokens
    if new_text or new_tokens:
        delta = StreamDelta(req.request_id, new_text, new_tokens, False)
        for q in req.listeners:
            q.put(delta)


def request_output(req: RemoteRequest) -> RequestOutput:
    """What the request holds so far, as the local engine reports a request (samples by index)."""
    n = max([req.params.n] + [i + 1 for i in req.texts])
    wants = req.params.logprobs is not None
    outs = [CompletionOutput(i, req.texts.get(i, ""), req.tokens.get(i, []), req.finish.get(i),
                             logprobs=req.logprobs.get(i, []) if wants else None,
                             cumulative_logprob=sum(p[t].logprob for p, t in zip(
                                 req.logprobs.get(i, []), req.tokens.get(i, [])) if t in p) if wants else None)
            for i in range(n)]
    return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.finished,
                         req.num_cached_tokens or 0, req.metrics, req.tenant, req.prompt_logprobs)
