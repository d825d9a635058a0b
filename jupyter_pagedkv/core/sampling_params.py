"""What a caller asks of one request: how to pick tokens and when to stop (vLLM's names)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request sampling and stopping rules; `temperature=0` means greedy."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
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
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Reject nonsense early, with a message that says what to pass instead."""
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k}")
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
        if not isinstance(self.length_penalty, (int, float)) or self.length_penalty != self.length_penalty:
            raise ValueError(f"length_penalty must be a number, got {self.length_penalty!r}")
