"""IncrementalText: a sequence's output text, grown by decoding only the tokens added since last time.

Why: every step, each touched request's output text is wanted (its `RequestOutput`, a stream's
delta, a stop-string check). Decoding the whole output each time costs ~0.3 us a token on the
embedded model's tokenizer, so a 2,048-token answer paid ~0.3 ms a step at its end (quadratic
over the answer) and a 64-request batch ~4 ms a step at 200 tokens each.

How: the text is kept in two parts. `settled` is the text of `ids[:read]`; the tokens after `read`
are decoded each call in a short window that starts at `prefix` (the last tokens settled that gave
text), so a decoder that treats the first token of what it decodes specially (SentencePiece strips
its leading space) sees the same context it would in the whole list. The window's text past the
context's is the new text. It settles (`prefix`, `read` move on) unless it may still change:
it ends in U+FFFD (a UTF-8 character whose bytes have not all arrived), or in a run of
SentencePiece byte-fallback tokens (`<0xNN>`), which decodes as one (one invalid byte anywhere in
the run turns every byte of it into U+FFFD, the valid ones too).

The result is `tokenizer.decode(ids)`'s wherever decoding is local in this sense (byte-level BPE at
character boundaries; SentencePiece with a token of context and whole byte runs); tests check both
kinds after every growth. Where the window's text does not extend its context's, it is not local,
and the whole list is decoded instead (then the window restarts from the first token). Tokenizers
whose decode cleans up spaces around punctuation (`decodes_locally`) always decode the whole list.
The engine decodes the whole list once more when a sequence finishes, so its final text is
`decode`'s in any case.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Callable

logger = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# What a decode that cleans up spaces around punctuation would change.
CLEAN_UP_PROBE = "a . b , c ! d ? e n't f 's"


def decodes_locally(tokenizer) -> bool:
    """Whether a window's text can stand for the whole list's: not where the decode cleans up spaces
    around punctuation, which joins text across tokens (" n't" -> "n't"). Asked of the decode itself,
    once: WordPiece's decoder cleans up whatever the flag says, and transformers ignores
    `clean_up_tokenization_spaces=True` for BPE tokenizers (Llama 3's config sets it)."""
    try:
        return tokenizer.decode(tokenizer.encode(CLEAN_UP_PROBE, add_special_tokens=False)) == CLEAN_UP_PROBE
    except Exception as err:     # a tokenizer that only decodes, say: trust its flag
        logger.debug("asking the tokenizer whether it cleans up spaces failed (%s): its flag decides", err)
        return not getattr(tokenizer, "clean_up_tokenization_spaces", False)


@dataclass(frozen=True)
class WindowDecoder:
    """One tokenizer's decode (special tokens skipped or kept), and what it needs to know of runs."""

    decode: Callable[[list[int]], str]
    byte_ids: frozenset[int] = frozenset()    # byte-fallback tokens: a run of them decodes as one
    skipped: frozenset[int] = frozenset()     # ids the decode drops: a run goes on across them

    @classmethod
    def of(cls, tokenizer, skip_special_tokens: bool) -> WindowDecoder:
        """For a transformers tokenizer, or any object with `decode(ids, skip_special_tokens=)`."""
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        bytes_ = frozenset(i for t, i in vocab.items() if BYTE_TOKEN.fullmatch(t))
        special = set(getattr(tokenizer, "all_special_ids", None) or ()) | {
            i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
        return cls(lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens), bytes_,
                   frozenset(special) if skip_special_tokens else frozenset())

    def in_byte_run(self, ids: list[int]) -> bool:
        """Whether the last token the decode keeps is a byte-fallback token (its run may go on)."""
        if not self.byte_ids:
            return False
        for token in reversed(ids):
            if token not in self.skipped:
                return token in self.byte_ids
        return False


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

    def extend(self, decoder: WindowDecoder, ids: list[int]) -> str:
        """The text of `ids`, decoding only the window after the tokens settled before."""
        seen = len(self.ids)
        if len(ids) < seen or ids[:seen] != self.ids:
            self.ids, self.settled, self.pending, self.prefix, self.read = [], "", "", 0, 0
        elif len(ids) == seen:
            return self.text
        decode = decoder.decode
        context = decode(ids[self.prefix:self.read])
        window = decode(ids[self.prefix:])
        self.ids = list(ids)
        if not window.startswith(context):       # not local here: decode it all, restart the window
            self.settled, self.pending, self.prefix, self.read = "", decode(ids), 0, 0
            return self.pending
        new = window[len(context):]
        if new.endswith(REPLACEMENT) or decoder.in_byte_run(ids):   # may still change: keep it open
            self.pending = new
        else:
            # The tokens just settled become the next context only if they gave text: a context of
            # skipped special tokens alone decodes to nothing, and the next word's leading space
            # would be stripped as the first of a decode ("the cat</s> sat" read "the catsat").
            self.settled, self.pending = self.settled + new, ""
            if new:
                self.prefix = self.read
            self.read = len(ids)
        return self.text
