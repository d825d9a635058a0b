"""Verification of draft tokens against the target model's logits (speculative decoding).

Greedy requests keep the longest prefix of drafts that equals the target's argmax, then add the
target's own argmax at the first mismatch (or after the last draft): exactly what plain greedy
decoding would have produced, just several tokens per forward pass.

Sampled requests use the standard rejection rule: draft d (drawn from the drafter's distribution
q) is kept with probability min(1, p(d) / q(d)); at the first rejection one token is drawn from
the residual max(p - q, 0) (renormalised), and if every draft survives a bonus token is drawn
from p at the next position. Each emitted token is then distributed exactly as p, the target's
distribution after temperature / top-k / top-p. A deterministic drafter (n-gram lookup) is the
case q = one-hot(d): keep d with probability p(d), else draw from p with d removed.
"""
from __future__ import annotations

import torch

from ..worker.sampler import Sampler, row_argmax
from ..core.sampling_params import SamplingParams


def verify_greedy(target_logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """`target_logits [len(drafts) + 1, vocab]` -> accepted drafts plus the target's next token."""
    best = row_argmax(target_logits).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == best[accepted]:
        accepted += 1
    return drafts[:accepted] + [best[accepted]]


def verify_sampled(target_logits: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                   params: SamplingParams, generator: torch.Generator) -> list[int]:
    """Rejection sampling: the returned tokens are distributed as the target's sampling distribution.

    `draft_probs [len(drafts), vocab]` is q for each draft, or None for a deterministic drafter.
    """
    p = Sampler.probabilities(target_logits.float(), [params] * target_logits.shape[0])
    out: list[int] = []
    for i, d in enumerate(drafts):
        q_d = float(draft_probs[i, d]) if draft_probs is not None else 1.0
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * q_d < float(p[i, d]):
            out.append(d)
            continue
        if draft_probs is not None:
            residual = (p[i] - draft_probs[i].to(p.device, p.dtype)).clamp_(min=0.0)
        else:
            residual = p[i].clone()
            residual[d] = 0.0
        if float(residual.sum()) <= 0.0:   # p == q up to rounding: p itself is the residual
            residual = p[i]
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[len(drafts)], 1, generator=generator)))
    return out
