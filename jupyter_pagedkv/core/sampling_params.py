"""What a caller asks of one request: how to pick tokens and when to stop (vLLM's names)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request sampling and stopping rules; `temperature=0` means greedy."""

    # None: as many as the model's context allows (the request ends with finish reason "length"
    # there); a number that would run past the context is refused up front instead.
    max_tokens: int | None = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability; 0: off
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    ignore_eos: bool = False
    # Speculative decoding for this request: None = the engine's default, False = off,
    # "ngram" or a draft model id/path = that drafter.
    speculative: str | bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Reject nonsense early, with a message that says what to pass instead."""
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens <= 0):
            raise ValueError(f"max_tokens must be a positive integer (or None: up to the model's context), "
                             f"got {self.max_tokens!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty text, got {self.stop!r}: drop the empty one")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids (integers >= 0), got {self.stop_token_ids!r}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not (self.speculative is None or isinstance(self.speculative, (bool, str))) or \
                self.speculative == "":
            raise ValueError(f"speculative must be None, False, 'ngram' or a draft model id/path, "
                             f"got {self.speculative!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class BeamSearchParams:
    """Beam search as in transformers: length-penalised scores, optional early stopping."""

    beam_width: int = 4
    max_tokens: int = 32
    length_penalty: float = 1.0
    early_stopping: bool | str = False   # True, False or "never", as transformers reads them
    ignore_eos: bool = False
    # Speculative decoding for this request: None = the engine's default, False = off,
    # "ngram" or a draft model id/path = that drafter.
    speculative: str | bool | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be a positive integer, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if not _finite(self.length_penalty):
            raise ValueError(f"length_penalty must be a number, got {self.length_penalty!r}")


def _finite(x) -> bool:
    """A real number that is neither nan nor infinite (bools are not numbers here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
