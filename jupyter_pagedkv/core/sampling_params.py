"""What a caller asks of one request: how to pick tokens and when to stop (vLLM's names).

Every field is checked against one rule in a table (`SAMPLING_RULES`, `BEAM_RULES`): exact types
(a bool is not an int, "2" is not a number), then bounds; a failure is one ValueError line that
names the field and says what to pass. A new field adds one row. Limits that depend on an engine
(its vocabulary, context, pool and `max_num_seqs`) are checked when a request is added
(`engine/intake.py`)."""
from __future__ import annotations

import logging
import math
import reprlib
from dataclasses import dataclass, field
from typing import Any, Callable

from .structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

# A field's rule: (does the value pass, what to pass instead).
Rule = tuple[Callable[[Any], bool], str]
_SEED_LIMIT = 2 ** 63   # torch.Generator.manual_seed takes less than 2**64; forks hash into 2**63
MAX_LOGPROBS = 20       # most alternatives per token (vLLM's default max_logprobs)


def is_int(x: Any) -> bool:
    """A Python int that is not a bool (True is not a count)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    """A finite real number: int or float, neither bool, nan nor infinite."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _token_id(x: Any) -> bool:
    return is_int(x) and x >= 0


def _bad_word(w: Any) -> bool:
    return (isinstance(w, str) and w.strip() != "") or \
        (isinstance(w, (list, tuple)) and len(w) > 0 and all(_token_id(t) for t in w))


def _speculative(v: Any) -> bool:
    return v is None or v is False or (isinstance(v, str) and bool(v.strip()))


SPECULATIVE = (_speculative, "None (the engine's default), False (off), 'ngram' or a draft model id/path")

SAMPLING_RULES: dict[str, Rule] = {
    "max_tokens": (lambda v: v is None or (is_int(v) and v > 0),
                   "a positive integer (or None: up to the model's context)"),
    "temperature": (lambda v: is_number(v) and v >= 0, "a finite number >= 0 (0 = greedy)"),
    "top_p": (lambda v: is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: is_int(v) and v >= -1, "-1, 0 (off) or a positive integer"),
    "min_p": (lambda v: is_number(v) and 0 <= v <= 1, "a number in [0, 1] (0 = off)"),
    "seed": (lambda v: v is None or (is_int(v) and 0 <= v < _SEED_LIMIT), "an integer in [0, 2**63) or None"),
    "stop": (lambda v: isinstance(v, list) and all(isinstance(s, str) and s for s in v),
             "non-empty text or a list of non-empty texts (drop an empty one)"),
    "stop_token_ids": (lambda v: isinstance(v, list) and all(is_int(t) and t >= 0 for t in v),
                       "a list of token ids (integers >= 0)"),
    "n": (lambda v: is_int(v) and v >= 1, "a positive integer (samples per prompt, at most the engine's "
                                          "max_num_seqs)"),
    "ignore_eos": (lambda v: isinstance(v, bool), "True or False"),
    "speculative": SPECULATIVE,
    # The logits processors (worker/logits_processors.py). Token ids are checked against the
    # vocabulary at intake (engine/intake.py: check_token_ids).
    "repetition_penalty": (lambda v: is_number(v) and v > 0, "a finite number > 0 (1 = off)"),
    "presence_penalty": (lambda v: is_number(v) and -2 <= v <= 2, "in [-2, 2] (0 = off)"),
    "frequency_penalty": (lambda v: is_number(v) and -2 <= v <= 2, "in [-2, 2] (0 = off)"),
    "min_tokens": (lambda v: is_int(v) and v >= 0, "an integer >= 0 (0 = off)"),
    "logit_bias": (lambda v: v is None or (isinstance(v, dict) and all(
        _token_id(t) and is_number(b) for t, b in v.items())),
        "None or a dict of token id (integer >= 0) -> finite bias"),
    "allowed_token_ids": (lambda v: v is None or (isinstance(v, (list, tuple)) and len(v) > 0 and all(
        _token_id(t) for t in v)), "None or a non-empty list of token ids (integers >= 0)"),
    "bad_words": (lambda v: v is None or (isinstance(v, (list, tuple)) and all(_bad_word(w) for w in v)),
                  "None or a list of non-empty strings or non-empty token id lists"),
    "include_stop_str_in_output": (lambda v: isinstance(v, bool), "True or False"),
    "skip_special_tokens": (lambda v: isinstance(v, bool), "True or False"),
    # Log-probabilities (engine/logprobs.py): top alternatives per token, from the raw model
    # distribution. The vocabulary bound is checked at intake.
    "logprobs": (lambda v: v is None or (is_int(v) and 0 <= v <= MAX_LOGPROBS),
                 f"None or an integer in [0, {MAX_LOGPROBS}] (alternatives per generated token)"),
    "prompt_logprobs": (lambda v: v is None or (is_int(v) and 0 <= v <= MAX_LOGPROBS),
                        f"None or an integer in [0, {MAX_LOGPROBS}] (alternatives per prompt token)"),
    # Compiled with the engine's tokenizer at intake (decoding/grammar.py).
    "structured_outputs": (lambda v: v is None or isinstance(v, StructuredOutputsParams),
                           "None or StructuredOutputsParams(json=..., regex=..., grammar=... or choice=...)"),
}

BEAM_RULES: dict[str, Rule] = {
    "beam_width": (lambda v: is_int(v) and v >= 1, "a positive integer (at most the engine's max_num_seqs)"),
    "max_tokens": (lambda v: is_int(v) and v > 0, "a positive integer"),
    "length_penalty": (is_number, "a finite number"),
    "early_stopping": (lambda v: v is True or v is False or v == "never", "True, False or 'never'"),
    "ignore_eos": (lambda v: isinstance(v, bool), "True or False"),
    "speculative": SPECULATIVE,
}

_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = 40
_SHOW.maxlist = _SHOW.maxtuple = 6


def show(value: Any) -> str:
    """A value as an error message quotes it: short and on one line, whatever it is."""
    try:
        text = _SHOW.repr(value)
    except Exception:   # a repr that raises still gets a one-line error
        logger.debug("repr of a %s raised", type(value).__name__, exc_info=True)
        text = f"<{type(value).__name__}>"
    return " ".join(text.split())


def check_fields(obj: Any, rules: dict[str, Rule]) -> None:
    """The first field that breaks its rule, as one ValueError line."""
    for name, (ok, what) in rules.items():
        value = getattr(obj, name)
        if not ok(value):
            raise ValueError(f"{name} must be {what}, got {show(value)}")


def _as_list(value: Any) -> Any:
    """None -> [], a tuple -> a list; anything else as it is (its rule then refuses it)."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else value


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
    # Log-probabilities from the raw model distribution (before temperature, the cuts and the
    # logits processors, as vLLM's default): per generated token the chosen token's and the top
    # `logprobs` alternatives'; per prompt token from the second on, the same with `prompt_logprobs`
    # (a request asking for them skips prefix-cache hits until its prompt is computed). None: off.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # The output matches a JSON schema, regex, grammar or choice (a mask before the processors).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.stop = [self.stop] if isinstance(self.stop, str) else _as_list(self.stop)
        self.stop_token_ids = _as_list(self.stop_token_ids)
        self.validate()

    def validate(self) -> None:
        """Reject nonsense early, with a message that says what to pass instead."""
        check_fields(self, SAMPLING_RULES)
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
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
        check_fields(self, BEAM_RULES)
