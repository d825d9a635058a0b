"""Logits processors: vLLM's per-request penalties, biases and masks, batched on the logits' device.

They change the raw logits of a step's sampling rows before anything picks a token (greedy
argmax, temperature and the cuts, speculative verification), in this order:

1. `logit_bias` is added (vLLM, and transformers' SequenceBias for single tokens, add it first).
2. `repetition_penalty` over every distinct token id of the prompt and the output (vLLM's set;
   transformers' RepetitionPenalty reads all of `input_ids`, which in `generate` is the same set):
   a positive logit is divided by it, a negative one multiplied.
3. `presence_penalty` / `frequency_penalty` over the output tokens only (the OpenAI/vLLM formula):
   logit -= frequency * count + presence * (count > 0).
4. Masks to -inf: tokens outside `allowed_token_ids`; the last token of each bad word whose
   other tokens end the context (transformers' NoBadWords; a one-token word always); EOS and
   `stop_token_ids` while fewer than `min_tokens` are generated (EOS not if `ignore_eos`).

A mask commutes with the rest (-inf stays -inf), so only 1 before 2 is a choice; both peers make
it. The counts are rebuilt each step from a row's token ids (prompt + output, plus the drafts a
verification position assumes accepted), so forks, preemption (recompute or swap) and prefix-cache
hits need nothing kept. Rows with no processor cost nothing, and a batch where no row has one
returns its logits untouched without any work.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..core.sampling_params import SamplingParams
from .upload import upload


class Context(Protocol):
    """What a processor reads of a row: its parameters and the tokens before the position."""
    params: SamplingParams
    token_ids: list[int]
    prompt_len: int


@dataclass(slots=True)
class DraftContext:
    """A verification position: the sequence's tokens plus the drafts assumed accepted before it."""
    params: SamplingParams
    token_ids: list[int]
    prompt_len: int
    grammar: object = None   # the position's grammar mask row (decoding/grammar.FixedMask), if any


def apply_processors(logits: torch.Tensor, rows: list[Context], eos_token_ids: set[int] | frozenset[int]
                     ) -> torch.Tensor:
    """`logits [rows, vocab]` with each row's processors applied (a new tensor when any applies)."""
    active = [i for i, r in enumerate(rows) if r.params.has_processors]
    if not active:
        return logits
    dev, vocab = logits.device, logits.shape[1]
    everyone = len(active) == len(rows)
    idx = None if everyone else upload(active, torch.long, dev)
    # (advanced indexing: index_select along rows measured ~30x slower on the CPU here)
    sub = logits.float().clone() if everyone else logits[idx].float()
    ctx = [rows[i] for i in active]
    _bias(sub, ctx)
    _repetition(sub, ctx)
    _presence_frequency(sub, ctx)
    _masks(sub, ctx, eos_token_ids, vocab)
    return sub if everyone else logits.float().index_copy(0, idx, sub)


def _pairs(rows: list[list[int]], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (row, token) index tensors of ragged per-row token lists, uploaded in one go."""
    r = [i for i, toks in enumerate(rows) for _ in toks]
    t = [tok for toks in rows for tok in toks]
    both = upload([r, t], torch.long, dev)
    return both[0], both[1]


def _bias(sub: torch.Tensor, ctx: list[Context]) -> None:
    if not any(c.params.logit_bias for c in ctx):
        return
    items = [list((c.params.logit_bias or {}).items()) for c in ctx]
    r, t = _pairs([[tok for tok, _ in row] for row in items], sub.device)
    values = upload([b for row in items for _, b in row], sub.dtype, sub.device)
    sub.index_put_((r, t), values, accumulate=True)


def _distinct(sub: torch.Tensor, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct (row, token) entries of ragged token lists as flat indices into `sub`, with
    their rows and how often each occurs: work in the number of tokens, not rows x vocab."""
    r, t = _pairs(rows, sub.device)
    flat, counts = torch.unique(r * sub.shape[1] + t, return_counts=True)
    return flat, torch.div(flat, sub.shape[1], rounding_mode="floor"), counts


def _repetition(sub: torch.Tensor, ctx: list[Context]) -> None:
    if all(c.params.repetition_penalty == 1.0 for c in ctx):
        return
    flat, row, _ = _distinct(sub, [c.token_ids if c.params.repetition_penalty != 1.0 else [] for c in ctx])
    penalty = upload([c.params.repetition_penalty for c in ctx], sub.dtype, sub.device)[row]
    seen = sub.view(-1).gather(0, flat)
    sub.view(-1).scatter_(0, flat, torch.where(seen > 0, seen / penalty, seen * penalty))


def _presence_frequency(sub: torch.Tensor, ctx: list[Context]) -> None:
    if all(c.params.presence_penalty == 0.0 and c.params.frequency_penalty == 0.0 for c in ctx):
        return
    flat, row, counts = _distinct(sub, [c.token_ids[c.prompt_len:] for c in ctx])
    knobs = upload([[c.params.frequency_penalty, c.params.presence_penalty] for c in ctx], sub.dtype,
                    sub.device)[row]
    sub.view(-1).scatter_add_(0, flat, -(knobs[:, 0] * counts.to(sub.dtype) + knobs[:, 1]))


def _masks(sub: torch.Tensor, ctx: list[Context], eos_token_ids, vocab: int) -> None:
    banned: list[list[int]] = []
    for c in ctx:
        p, row = c.params, []
        for word in p.bad_words or ():
            head = list(word[:-1])
            if not head or c.token_ids[len(c.token_ids) - len(head):] == head:
                row.append(word[-1])
        if len(c.token_ids) - c.prompt_len < p.min_tokens:
            row.extend(p.stop_token_ids)
            if not p.ignore_eos:
                row.extend(eos_token_ids)
        banned.append(row)
    if any(banned):
        r, t = _pairs(banned, sub.device)
        sub.index_put_((r, t), torch.tensor(float("-inf"), dtype=sub.dtype, device=sub.device))
    if any(c.params.allowed_token_ids is not None for c in ctx):
        allowed = [list(c.params.allowed_token_ids) if c.params.allowed_token_ids is not None
                   else range(vocab) for c in ctx]
        r, t = _pairs(allowed, sub.device)
        keep = torch.zeros_like(sub, dtype=torch.bool).index_put_((r, t), torch.ones_like(r, dtype=torch.bool))
        sub.masked_fill_(~keep, float("-inf"))
