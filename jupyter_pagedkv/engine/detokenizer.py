"""IncrementalText: a sequence's output text, grown by decoding only the tokens added since last time.

Why: every step, each touched request's output text is wanted (its `RequestOutput`, a stream's
delta, a stop-string check). Decoding the whole output each time costs ~0.3 us a token on the
embedded model's tokenizer, so a 2,048-token answer paid ~0.6 ms a step at its end (quadratic
over the answer) and a 64-request batch ~4 ms a step at 200 tokens each.

How: the text is kept in two parts. `settled` is the text of `ids[:read]`; the tokens after `read`
are decoded each call in a short window that starts at `prefix` (the tokens settled last time), so
a decoder that treats the first token of what it decodes specially (SentencePiece strips its
leading space) sees the same context it would in the whole list. The window's text past the
context's is the new text; it settles (`prefix`, `read` move on) once it no longer ends in U+FFFD,
the replacement character of a UTF-8 character whose bytes have not all arrived.

The result is `tokenizer.decode(ids)`'s wherever decoding is local (byte-level BPE at character
boundaries; SentencePiece with a token of context). Where the window's text does not extend its
context's text, it is not, and the whole list is decoded instead (then the window restarts from the
first token). Tokenizers that clean up spaces around punctuation across tokens
(`clean_up_tokenization_spaces`) always decode the whole list. The engine decodes the whole list
once more when a sequence finishes, so its final text is `decode`'s in any case.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

Decode = Callable[[list[int]], str]

REPLACEMENT = "\ufffd"


def decodes_locally(tokenizer) -> bool:
    """Whether a window's text can stand for the whole list's (see the module docstring)."""
    return not getattr(tokenizer, "clean_up_tokenization_spaces", False)


@dataclass(slots=True)
class IncrementalText:
    """The text of one growing token list; `extend` with the whole list each time (it may only grow:
    a list that no longer starts with the tokens seen starts over)."""

    ids: list[int] = field(default_factory=list)    # the tokens seen (a copy, to notice a rewrite)
    settled: str = ""                                # the text of ids[:read]
    pending: str = ""                                # the text of ids[read:], as far as decoded
    prefix: int = 0                                  # the window's first token (context only)
    read: int = 0                                    # the first token whose text is not settled

    @property
    def text(self) -> str:
        return self.settled + self.pending

    def extend(self, decode: Decode, ids: list[int]) -> str:
        """The text of `ids`, decoding only the window after the tokens settled before."""
        seen = len(self.ids)
        if len(ids) < seen or ids[:seen] != self.ids:
            self.ids, self.settled, self.pending, self.prefix, self.read = [], "", "", 0, 0
        elif len(ids) == seen:
            return self.text
        self.ids = list(ids)
        context = decode(ids[self.prefix:self.read])
        window = decode(ids[self.prefix:])
        if not window.startswith(context):       # not local here: decode it all, restart the window
            self.settled, self.pending, self.prefix, self.read = "", decode(ids), 0, 0
            return self.pending
        new = window[len(context):]
        if new.endswith(REPLACEMENT):            # a character still incomplete: keep the window open
            self.pending = new
        else:
            self.settled, self.pending = self.settled + new, ""
            self.prefix, self.read = self.read, len(ids)
        return self.text
