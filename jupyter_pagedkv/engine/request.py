"""Request: the engine-side state of one request (its sequences, metrics, listeners, error)."""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

from ..core.sampling_params import SamplingParams
from ..core.sequence import Sequence
from ..decoding.beam_search import BeamSearch
from .outputs import PositionLogprobs, RequestMetrics


@dataclass(eq=False)
class Request:
    """One request: `seqs` holds its sample (n > 1: its samples; beam search: its live beams)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    done: threading.Event = field(default_factory=threading.Event)
    listeners: list[queue.SimpleQueue] = field(default_factory=list)
    sent_text: list[str] = field(default_factory=list)
    sent_tokens: list[int] = field(default_factory=list)
    error: BaseException | None = None
    beam: BeamSearch | None = None      # set for beam search requests
    tenant: str | None = None           # who sent it: prefix isolation and per-tenant figures
    tokens_counted: int = 0             # generated tokens already in the tenant's throughput
    # params.logprobs: per sample index, one entry per generated token (engine/logprobs.py)
    logprobs: dict[int, list[PositionLogprobs]] = field(default_factory=dict)
    # params.prompt_logprobs: one entry per prompt token computed so far ([None] before any)
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    def __post_init__(self) -> None:
        if getattr(self.params, "prompt_logprobs", None) is not None:
            self.prompt_logprobs = [None]

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
