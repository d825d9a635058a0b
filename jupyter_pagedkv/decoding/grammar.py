"""Structured outputs through xgrammar: each distinct spec compiled once per engine, one matcher per
sequence.

A `GrammarState` wraps one xgrammar matcher that has accepted exactly a sequence's output tokens.
Before each sampling step it fills that sequence's row of the token bitmask (`worker/grammar_mask.py`
applies the rows on the logits' device); after it, `OutputProcessor.append_token` makes it accept
the token, and a matcher that accepted a stop token has terminated: the sequence ends with "stop".
An n > 1 request forks the state with its samples (a deep copy of the parse state); speculative
verification walks the drafts through the matcher to fill one row per draft position, then rolls
them back, and the kept tokens are accepted like any other. Preemption keeps the Sequence and so
its matcher (recompute recomputes KV, not tokens; swap moves KV only): nothing is replayed.
"""
from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict

import torch

from ..core.structured_outputs import StructuredOutputsParams
from .schema_keywords import check_schema_keywords

logger = logging.getLogger(__name__)

# "[07:06:23] /project/cpp/regex_converter.cc:94: " and "Check failed: (...) is false: " in front
# of xgrammar's messages: where in its C++ it failed, which a user cannot act on.
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: .*? is false:\s*)?")


def xgrammar():
    """The xgrammar module, or a one-line error that says how to get it."""
    try:
        import xgrammar as xgr
    except ImportError as err:
        raise ValueError("structured outputs need xgrammar: pip install 'xgrammar>=0.2.9'") from err
    return xgr


def one_line(err: BaseException) -> str:
    """xgrammar's message without its C++ location, first line only."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return _CPP_PREFIX.sub("", text)


def choice_grammar(choice: list[str] | tuple[str, ...]) -> str:
    """An EBNF grammar whose strings are exactly the choices (JSON string escapes are EBNF's)."""
    import json
    return "root ::= " + " | ".join(json.dumps(c) for c in choice)


class GrammarState:
    """One sequence's matcher: fills its bitmask row, accepts its tokens, forks, rolls back."""

    __slots__ = ("matcher",)

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask`: the tokens the grammar allows next."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        """A stop token was accepted where the grammar may end: the output is complete."""
        return self.matcher.is_terminated()

    def fork(self) -> GrammarState:
        return GrammarState(self.matcher.fork())

    def fill_drafts(self, drafts: list[int], vocab_size: int) -> torch.Tensor:
        """Bitmask rows for the len(drafts) + 1 verification positions: row j as if drafts[:j] were
        accepted. The matcher walks the drafts and rolls back to where it was. A draft it refuses
        is masked in its own row, so verification rejects it and later rows go unread (left open)."""
        xgr = xgrammar()
        bitmask = xgr.allocate_token_bitmask(len(drafts) + 1, vocab_size)   # host: the matcher fills it there
        walked = 0
        self.fill(bitmask, 0)
        for j, token in enumerate(drafts):
            if not self.matcher.accept_token(token):
                break
            walked += 1
            if self.matcher.is_terminated():
                break
            self.fill(bitmask, j + 1)
        if walked:
            self.matcher.rollback(walked)
        return bitmask


class FixedMask:
    """A bitmask row computed ahead (a draft position): fills it into the step's bitmask."""

    __slots__ = ("row",)

    def __init__(self, row: torch.Tensor) -> None:
        self.row = row

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].copy_(self.row)


class Grammars:
    """The engine's grammar compiler: each distinct spec (`StructuredOutputsParams.key`) compiles
    once with the model's tokenizer, then every request with it starts a matcher from the cached
    result. Least recently used specs are dropped beyond `capacity`. xgrammar is imported, and the
    tokenizer read, at the first spec: an engine that never sees one pays nothing."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int] | frozenset[int],
                 capacity: int = 128) -> None:
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, stop_token_ids
        self._compiler = None
        self.capacity = capacity
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()   # requests are added from any thread, outside the engine's lock

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar of `spec`; one ValueError line if xgrammar refuses it, or if a JSON
        schema has a keyword the output would not obey (`schema_keywords.py`)."""
        with self._lock:
            return self._compile(spec)

    @property
    def compiler(self):
        if self._compiler is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs need the model's tokenizer: build the engine with one")
            xgr = xgrammar()
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=sorted(self.stop_token_ids) or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        return self._compiler

    def _compile(self, spec: StructuredOutputsParams):
        key = spec.key()
        compiled = self._compiled.get(key)
        if compiled is not None:
            self._compiled.move_to_end(key)
            return compiled
        kind = spec.kind
        if kind == "json":
            try:
                check_schema_keywords(spec.schema())
            except ValueError as err:
                raise ValueError(f"structured_outputs.json: {err}") from None
        try:
            if kind == "json":
                # One line, ", " and ": " between items (json.dumps' style): free whitespace lets a
                # small model loop on spaces and newlines forever.
                compiled = self.compiler.compile_json_schema(spec.schema(), any_whitespace=False)
            elif kind == "regex":
                compiled = self.compiler.compile_regex(spec.regex)
            elif kind == "grammar":
                compiled = self.compiler.compile_grammar(spec.grammar)
            else:
                compiled = self.compiler.compile_grammar(choice_grammar(spec.choice))
        except Exception as err:   # xgrammar raises RuntimeError (and others) for what it refuses
            raise ValueError(f"structured_outputs.{kind} was refused by xgrammar: {one_line(err)}") from err
        self._compiled[key] = compiled
        if len(self._compiled) > self.capacity:
            self._compiled.popitem(last=False)
        return compiled

    def start(self, spec: StructuredOutputsParams) -> GrammarState:
        """A fresh matcher for a new sequence of a request with `spec`."""
        return GrammarState(xgrammar().GrammarMatcher(self.compile(spec)))
