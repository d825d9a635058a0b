"""Sampler: logits of each sampling sequence -> its next token.

Greedy rows take the argmax. Random rows apply temperature, top-k and top-p, then draw from
the sequence's own torch.Generator when it has a seed, so a seeded request draws the same
tokens whatever else shares its batch.
"""
from __future__ import annotations

import torch

from ..core.sequence import Sequence


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        logits = logits.float()
        tokens = logits.argmax(dim=-1).tolist()
        random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if not random_rows:
            return tokens
        rows = torch.tensor(random_rows)
        probs = self.probabilities(logits[rows], [seqs[i].params for i in random_rows])
        for j, i in enumerate(random_rows):
            gen = seqs[i].generator or self.generator
            tokens[i] = int(torch.multinomial(probs[j], 1, generator=gen))
        return tokens

    @staticmethod
    def probabilities(logits: torch.Tensor, params: list) -> torch.Tensor:
        """Temperature, then top-k, then top-p (nucleus) on `[rows, vocab]`; returns probabilities."""
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
        logits = logits / temps
        top_ks = [p.top_k if p.top_k > 0 else logits.shape[1] for p in params]
        top_ps = [p.top_p for p in params]
        if any(k < logits.shape[1] for k in top_ks) or any(p < 1.0 for p in top_ps):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(logits.shape[1]).unsqueeze(0)
            sorted_logits = sorted_logits.masked_fill(ranks >= torch.tensor(top_ks).unsqueeze(1),
                                                      float("-inf"))
            sorted_probs = sorted_logits.softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            cut = mass_before >= torch.tensor(top_ps, dtype=logits.dtype).unsqueeze(1)
            sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        return logits.softmax(dim=-1)
