"""Log-probabilities in the step: which rows ask, one pass over them, and where each answer goes.

Before the forward, `mark_prompt_rows` names on each chunk the positions whose logits a request's
`prompt_logprobs` still needs; positions already collected are never asked for again, so the
recompute after a preemption adds nothing twice (and such a request takes no prefix-cache hit
until its prompt is computed: core/scheduler.py). After the forward and the verification of
drafts, `StepLogprobs` gathers the rows that ask: each sampled token's row (each fork its own),
the verify pass's rows of accepted draft tokens, and the prompt rows; `compute` runs them through
one pass on the logits' device (worker/logprobs.py). A step where nobody asks costs one check
per chunk and per row. The logits are the raw ones, so the numbers are the model's own
distribution (before temperature, the cuts and the logits processors), as vLLM's default.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..core.scheduler import ScheduledChunk
from ..worker.logprobs import TokenLogprobs, token_logprobs
from .outputs import Logprob, PositionLogprobs
from .request import Request


def prompt_span(req: Request | None, chunk: ScheduledChunk) -> tuple[int, int] | None:
    """(first position, count) of the chunk's rows whose logits the request's prompt_logprobs still
    needs: the row at position p predicts prompt token p + 1, and tokens already collected are skipped."""
    if req is None or req.prompt_logprobs is None:
        return None
    first = max(chunk.start, len(req.prompt_logprobs) - 1)
    end = min(chunk.start + chunk.num_tokens, len(req.prompt_token_ids) - 1)
    return (first, end - first) if end > first else None


def mark_prompt_rows(chunks: list[ScheduledChunk], requests: dict[str, Request]) -> None:
    """Set each chunk's `prompt_logits` (None where its request asks nothing of it)."""
    for c in chunks:
        c.prompt_logits = prompt_span(requests.get(c.seq.request_id), c)


class StepLogprobs:
    """The step's rows that ask for logprobs, in the order they were added, for one pass."""

    def __init__(self) -> None:
        self._rows: list[torch.Tensor] = []
        self._tokens: list[int] = []
        self._ks: list[int] = []
        self._counts: list[int] = []

    def add(self, rows: torch.Tensor, tokens: list[int], k: int) -> int:
        """Rows `[len(tokens), vocab]` and the token chosen at each; returns the group's index."""
        assert rows.shape[0] == len(tokens), (rows.shape, len(tokens))
        self._rows.append(rows)
        self._tokens.extend(tokens)
        self._ks.extend([k] * len(tokens))
        self._counts.append(len(tokens))
        return len(self._counts) - 1

    def compute(self) -> list[list[TokenLogprobs]]:
        """Per group added, its positions' logprobs (one pass over all rows)."""
        if not self._tokens:
            return [[] for _ in self._counts]
        flat = token_logprobs(torch.cat(self._rows) if len(self._rows) > 1 else self._rows[0],
                              self._tokens, self._ks)
        out, at = [], 0
        for n in self._counts:
            out.append(flat[at:at + n])
            at += n
        return out


def as_position(t: TokenLogprobs, decode: Callable[[int], str | None]) -> PositionLogprobs:
    """vLLM's shape of one position: the chosen token first, then the alternatives by rank."""
    out = {t.token: Logprob(t.logprob, t.rank, decode(t.token))}
    for rank, (token, value) in enumerate(t.top, start=1):
        if token not in out:
            out[token] = Logprob(value, rank, decode(token))
    return out


def add_prompt_logprobs(req: Request, chunk: ScheduledChunk, entries: list[TokenLogprobs],
                        decode: Callable[[int], str | None]) -> None:
    """Extend the request's prompt_logprobs with the chunk's positions (asked in order, once)."""
    first, count = chunk.prompt_logits
    assert req.prompt_logprobs is not None and first == len(req.prompt_logprobs) - 1 and count == len(entries)
    req.prompt_logprobs.extend(as_position(t, decode) for t in entries)
