"""Reading what a server sends as a careful parser: nothing it sends can make the kernel hang,
build something huge, or fail with anything but one `RemoteError` line.

Every limit is explicit: a JSON response of at most `MAX_BODY` bytes, a server-sent-event line of
at most `MAX_LINE`, a whole stream of at most `MAX_STREAM`; a line, once begun, must end within
the client's timeout (a server dripping bytes cannot hold a cell forever); a choice's `index`
must lie within the `n` asked for; every field has the JSON type the OpenAI protocol gives it."""
from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from ..engine.outputs import PositionLogprobs
from .logprob_fields import parse_choice_logprobs, parse_prompt_logprobs
from .errors import RemoteError

MAX_BODY = 4 << 20        # /v1/models, /version, an error body
MAX_LINE = 1 << 20        # one `data: {...}` line of a stream
MAX_STREAM = 64 << 20     # everything one request streams
MAX_QUIET_LINES = 10_000  # lines in a row without an event (comments, blanks)
MAX_CHOICES = 256         # the most choices (n) the client asks for, so indices stay small
_READ = 64 << 10


def read_body(resp: http.client.HTTPResponse, url: str) -> bytes:
    """A response body of at most MAX_BODY bytes."""
    body = resp.read(MAX_BODY + 1)
    if len(body) > MAX_BODY:
        raise RemoteError(f"{url} sent a response over {MAX_BODY >> 20} MiB: is this a vLLM server?")
    return body


class EventStream:
    """The `data:` payloads of a server-sent-event stream, read within the limits above.
    `done` tells whether the stream ended with `[DONE]`."""

    def __init__(self, resp: http.client.HTTPResponse, url: str, timeout: float) -> None:
        self.resp, self.url, self.timeout = resp, url, timeout
        self.done = False
        self._total = 0

    def events(self) -> Iterator[str]:
        quiet = 0
        for line in self._lines():
            if not line.startswith("data:"):
                quiet += 1
                if quiet > MAX_QUIET_LINES:
                    raise RemoteError(f"{self.url} sent {MAX_QUIET_LINES} lines without an event: "
                                      f"is this a vLLM server?")
                continue
            quiet = 0
            data = line[5:].strip()
            if data == "[DONE]":
                self.done = True
                return
            yield data

    def _lines(self) -> Iterator[str]:
        buf = bytearray()
        started: float | None = None    # when the line now in `buf` began
        while True:
            cut = buf.find(b"\n")
            if cut >= 0:
                yield self._decode(bytes(buf[:cut]))
                del buf[:cut + 1]
                started = time.monotonic() if buf else None
                continue
            if len(buf) > MAX_LINE:
                raise RemoteError(f"{self.url} sent a stream line over {MAX_LINE >> 20} MiB: the output so "
                                  f"far is kept")
            if started is not None and time.monotonic() - started > self.timeout:
                raise RemoteError(f"{self.url} sent one stream line for over {self.timeout:g} s (a slow "
                                  f"drip): raise --timeout if the server is just slow")
            piece = self.resp.read1(_READ)
            if not piece:
                if buf.strip():
                    raise RemoteError(f"{self.url} closed the stream in the middle of a line: the output "
                                      f"so far is kept, run the cell again for the rest")
                return
            self._total += len(piece)
            if self._total > MAX_STREAM:
                raise RemoteError(f"{self.url} streamed over {MAX_STREAM >> 20} MiB for one request: "
                                  f"stopped reading; the output so far is kept")
            if started is None:
                started = time.monotonic()
            buf += piece

    def _decode(self, raw: bytes) -> str:
        try:
            return raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise RemoteError(f"{self.url} sent a stream line that is not UTF-8: the output so far is "
                              f"kept") from None


@dataclass
class Choice:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[PositionLogprobs] = field(default_factory=list)   # per token of this chunk, when asked


@dataclass
class Chunk:
    """One event, checked: its choices, the prompt's ids, usage counts, or a server error."""

    choices: list[Choice] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None   # vLLM's, when asked


def _bad(url: str, what: str) -> RemoteError:
    return RemoteError(f"{url} sent {what}: not an OpenAI-compatible stream; the output so far is kept")


def _ids(value: Any, url: str, name: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(type(t) is int and t >= 0 for t in value):
        raise _bad(url, f"{name} that are not a list of token ids")
    return value


def _count(value: Any, url: str, name: str) -> int | None:
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise _bad(url, f"a {name} that is not a count")
    return value


def parse_chunk(data: str, n: int, chat: bool, url: str) -> Chunk:
    """One `data:` payload of a completion (or chat) stream asked for `n` choices."""
    try:
        obj = json.loads(data)
    except ValueError:
        raise _bad(url, "an event that is not JSON") from None
    if not isinstance(obj, dict):
        raise _bad(url, f"an event that is a JSON {type(obj).__name__}, not an object")
    if "error" in obj and "choices" not in obj:
        err = obj["error"]
        message = err.get("message", err) if isinstance(err, dict) else err
        return Chunk(error=" ".join(str(message).split())[:300])
    chunk = Chunk(prompt_token_ids=_ids(obj.get("prompt_token_ids"), url, "prompt_token_ids"))
    choices = obj.get("choices") or []
    if not isinstance(choices, list):
        raise _bad(url, "choices that are not a list")
    for c in choices:
        if not isinstance(c, dict):
            raise _bad(url, "a choice that is not an object")
        index = c.get("index", 0)
        if type(index) is not int or not 0 <= index < n:
            raise _bad(url, f"choice index {str(index)[:20]} (asked for {n} choice{'s' if n != 1 else ''})")
        if chat:
            delta = c.get("delta") or {}
            if not isinstance(delta, dict):
                raise _bad(url, "a delta that is not an object")
            text = delta.get("content")
        else:
            text = c.get("text")
        if text is not None and not isinstance(text, str):
            raise _bad(url, "text that is not a string")
        finish = c.get("finish_reason")
        if finish is not None and not isinstance(finish, str):
            raise _bad(url, "a finish_reason that is not a string")
        bad = lambda what: _bad(url, what)   # noqa: E731
        chunk.choices.append(Choice(index, text or "", _ids(c.get("token_ids"), url, "token_ids") or [],
                                    finish[:40] if finish else None,
                                    parse_choice_logprobs(c.get("logprobs"), chat, bad)))
        chunk.prompt_logprobs = chunk.prompt_logprobs or parse_prompt_logprobs(c.get("prompt_logprobs"), bad)
        chunk.prompt_token_ids = chunk.prompt_token_ids or _ids(c.get("prompt_token_ids"), url, "prompt_token_ids")
    usage = obj.get("usage")
    if usage is not None:
        if not isinstance(usage, dict):
            raise _bad(url, "usage that is not an object")
        chunk.completion_tokens = _count(usage.get("completion_tokens"), url, "completion_tokens")
        details = usage.get("prompt_tokens_details") or {}
        if not isinstance(details, dict):
            raise _bad(url, "prompt_tokens_details that are not an object")
        chunk.cached_tokens = _count(details.get("cached_tokens"), url, "cached_tokens")
    return chunk
