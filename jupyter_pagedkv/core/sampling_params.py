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
    # Logits processors (vLLM's names and semantics; worker/logits_processors.py applies them).
    repetition_penalty: float = 1.0    # > 0; over prompt + output tokens; 1: off
    presence_penalty: float = 0.0      # [-2, 2]; over output tokens; 0: off
    frequency_penalty: float = 0.0     # [-2, 2]; over output tokens; 0: off
    min_tokens: int = 0                # EOS and stop_token_ids masked until this many are generated
    logit_bias: dict[int, float] | None = None       # token id -> added to its logit
    allowed_token_ids: list[int] | None = None       # only these may be generated
    # Text (tokenised at intake, with and without a leading space, as vLLM does) or token id lists
    # (transformers' bad_words_ids): the last token is masked when the others end the context.
    bad_words: list[str | list[int]] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

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
        for name, ok, what in _PROCESSOR_CHECKS:
            value = getattr(self, name)
            if not ok(value):
                raise ValueError(f"{name} must be {what}, got {value!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")

    @property
    def has_processors(self) -> bool:
        """Whether any logits processor is on (the sampler skips all their work otherwise)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or self.min_tokens > 0 or bool(self.logit_bias)
                or self.allowed_token_ids is not None or bool(self.bad_words))

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


def _token_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _bad_word(w) -> bool:
    return (isinstance(w, str) and w.strip() != "") or \
        (isinstance(w, (list, tuple)) and len(w) > 0 and all(_token_id(t) for t in w))


# The logits processors' checks, one row per field: (field, accepts, what to pass instead).
# Token ids are checked against the vocabulary at intake (engine/intake.py: check_token_ids).
_PROCESSOR_CHECKS = [
    ("repetition_penalty", lambda v: _finite(v) and v > 0, "a finite number > 0 (1 = off)"),
    ("presence_penalty", lambda v: _finite(v) and -2.0 <= v <= 2.0, "in [-2, 2] (0 = off)"),
    ("frequency_penalty", lambda v: _finite(v) and -2.0 <= v <= 2.0, "in [-2, 2] (0 = off)"),
    ("min_tokens", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
     "an integer >= 0 (0 = off)"),
    ("logit_bias", lambda v: v is None or (isinstance(v, dict) and all(
        _token_id(t) and _finite(b) for t, b in v.items())),
     "None or a dict of token id (integer >= 0) -> finite bias"),
    ("allowed_token_ids", lambda v: v is None or (isinstance(v, (list, tuple)) and len(v) > 0 and all(
        _token_id(t) for t in v)), "None or a non-empty list of token ids (integers >= 0)"),
    ("bad_words", lambda v: v is None or (isinstance(v, (list, tuple)) and all(_bad_word(w) for w in v)),
     "None or a list of non-empty strings or non-empty token id lists"),
    ("include_stop_str_in_output", lambda v: isinstance(v, bool), "True or False"),
    ("skip_special_tokens", lambda v: isinstance(v, bool), "True or False"),
]
