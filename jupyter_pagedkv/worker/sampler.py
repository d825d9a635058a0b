"""Sampler: the logits of a step's sampling rows -> their next tokens, on the logits' device.

Greedy rows take the argmax of the logits (as before). Random rows go through temperature, then
top-k, then top-p, then min-p (transformers' order; vLLM applies min-p before top-k/top-p, which
differs only when top-p and min-p are both set), batched over the whole `[rows, vocab]` with the
per-row knobs as one tensor on the logits' device. The draw is the exponential race: token =
argmax(p / E) with E ~ Exp(1) per vocabulary entry, which picks token i with probability p_i,
for every row in one argmax. Only the final `.tolist()` waits for the device: one sync a step.

Seeded rows stay reproducible whatever shares their batch because each draws its E row from its
own generator (on the logits' device; one `vocab`-sized draw a step, so its stream never depends
on the batch), while unseeded rows take theirs from the engine's generator in one call. This was
chosen over a generator per row for everything (one kernel per unseeded row) and over hashing
(seed, step) into noise (more code for the same result). On the CPU, `torch.multinomial(p, 1)` is
this same race over the same `vocab` draws, so a seeded row's tokens are those of the earlier
per-row multinomial sampler (checked on torch 2.13); unseeded rows now share one draw, so their
(unreproducible anyway) tokens differ. On CUDA, seeded tokens are the race's on that device.

Before any of this, the requests' logits processors (penalties, logit_bias, bad words,
allowed_token_ids, min_tokens: `logits_processors.py`) change the rows that have any, greedy rows
included; a batch in which no row has one skips them at the cost of one Python check per row.
Before those, the structured outputs' grammar mask (`grammar_mask.py`) sets what a row's grammar
forbids to -inf.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..core.sequence import Sequence
from .grammar_mask import GrammarMask
from .logits_processors import apply_processors
from .upload import upload


class Sampler:
    def __init__(self, seed: int | None = None, device: torch.device | str = "cpu",
                 eos_token_ids: set[int] | frozenset[int] = frozenset()) -> None:
        self.device = torch.device(device)
        self.eos_token_ids = eos_token_ids   # what min_tokens masks besides stop_token_ids
        self.generator = torch.Generator(device=self.device)
        self.grammar_mask = GrammarMask()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        logits = self.process(logits.float(), seqs)
        random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        everyone = len(random_rows) == len(seqs)
        tokens = None if everyone else row_argmax(logits)
        if random_rows:
            rows = None if everyone else upload(random_rows, torch.long, logits.device)
            picked = logits if everyone else logits[rows]
            probs = self.probabilities(picked, [seqs[i].params for i in random_rows])
            drawn = race(probs, self._noise(probs, [seqs[i].generator for i in random_rows]))
            tokens = drawn if everyone else tokens.index_copy(0, rows, drawn)
        return tokens.tolist()

    def process(self, logits: torch.Tensor, rows: list) -> torch.Tensor:
        """The rows' grammar masks, then their logits processors, applied (the same tensor when no
        row has any)."""
        return apply_processors(self.grammar_mask(logits, rows), rows, self.eos_token_ids)

    def _noise(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """E ~ Exp(1) per entry: all rows from the engine's generator in one call, then each
        seeded row redrawn from its own generator."""
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, gen in enumerate(generators):
            if gen is not None:
                noise[row].exponential_(generator=gen)
        return noise

    @staticmethod
    def probabilities(logits: torch.Tensor, params: list) -> torch.Tensor:
        """Temperature, then top-k, then top-p (nucleus), then min-p on `[rows, vocab]`; returns
        probabilities. Each cut is skipped (no sort) when no row asks for it."""
        rows, vocab = logits.shape
        knobs = upload([[p.temperature, p.top_k if p.top_k > 0 else vocab, p.top_p,
                         math.log(p.min_p) if p.min_p > 0 else -math.inf] for p in params],
                       logits.dtype, logits.device)
        temps, top_ks, top_ps, log_min_ps = knobs.unbind(dim=1)
        logits = logits / temps.unsqueeze(1)
        cut_k = any(0 < p.top_k < vocab for p in params)
        cut_p = any(p.top_p < 1.0 for p in params)
        cut_min = any(p.min_p > 0.0 for p in params)
        if cut_k or cut_p or cut_min:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            if cut_k:
                ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
                sorted_logits = sorted_logits.masked_fill(ranks >= top_ks.unsqueeze(1), float("-inf"))
            if cut_p:
                # Keep the smallest prefix whose mass reaches top_p (always at least one token).
                sorted_probs = sorted_logits.softmax(dim=-1)
                mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
                cut = (mass_before >= top_ps.unsqueeze(1)) & (top_ps < 1.0).unsqueeze(1)
                sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
            if cut_min:
                # p_i < min_p * p_max, read as a logit gap: renormalising after the cuts above
                # changes no ratio, and the most likely token (column 0) always stays.
                gap = sorted_logits - sorted_logits[:, :1]
                sorted_logits = sorted_logits.masked_fill(gap < log_min_ps.unsqueeze(1), float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        return logits.softmax(dim=-1)


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(p / E) per row: token i wins with probability p_i when E is i.i.d. Exp(1).

    E is floored at the smallest normal float so that an exact 0 from the generator cannot make
    0 / 0 = nan for a token cut to probability 0."""
    return row_argmax(probs / noise.clamp_min(torch.finfo(noise.dtype).tiny))


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)`, the same indices (the first of equal maxima; a NaN counts as the
    largest). On the CPU, numpy's argmax over float32 rows is SIMD where ATen's walks the row with
    its index: 6 against 57 us for one row of 49,152 logits, 0.8 against 2.9 ms for 64 rows
    (2-core EPYC, torch 2.13), which was most of a greedy token's sampling time."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or x.requires_grad or x.is_neg():
        return x.argmax(dim=-1)
    found = np.asarray(x.numpy().argmax(axis=-1)).astype(np.int64, copy=False)   # ATen's dtype on every platform
    return torch.from_numpy(found)   # host: a CPU tensor's own indices
