"""Log-probabilities of chosen tokens and their top alternatives, on the logits' device.

One pass over the rows that ask (generated tokens, accepted drafts and prompt positions of a
step, concatenated by the engine): `log_softmax` in fp32, the chosen token's value and rank, and
one `topk` at the largest k asked; everything comes back to the host in one copy. The logits are
the model's raw ones (before temperature, the cuts and the logits processors), so the numbers
are those of the model's own distribution, as vLLM reports by default.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .upload import upload


@dataclass(slots=True, frozen=True)
class TokenLogprobs:
    """One position: the chosen token's (logprob, rank) and the top-k as (token, logprob), best first."""

    token: int
    logprob: float
    rank: int                               # 1 + how many tokens are strictly more likely
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """`logits [rows, vocab]` (raw), the token chosen at each row and each row's k."""
    assert logits.shape[0] == len(tokens) == len(ks), (logits.shape, len(tokens), len(ks))
    if not tokens:
        return []
    lp = logits.float().log_softmax(dim=-1)
    chosen = lp.gather(1, upload(tokens, torch.long, lp.device).unsqueeze(1))       # [rows, 1]
    rank = (lp > chosen).sum(dim=1, keepdim=True) + 1
    k = max(ks)
    parts = [chosen.double(), rank.double()]
    if k:
        top_v, top_i = lp.topk(k, dim=-1)       # sorted, most likely first
        parts += [top_v.double(), top_i.double()]   # ids < 2**53: exact in float64
    host = torch.cat(parts, dim=1).tolist()       # the one copy back
    out = []
    for row, token, kr in zip(host, tokens, ks):
        values, ids = row[2:2 + k], row[2 + k:]
        out.append(TokenLogprobs(token, row[0], int(row[1]),
                                 tuple((int(ids[j]), values[j]) for j in range(kr))))
    return out
