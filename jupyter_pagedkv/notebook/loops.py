"""Spotting an answer that loops, and checking it against transformers before blaming the model.

Greedy decoding of a small model often falls into a cycle ("a cat sleeps, a cat sleeps, ...").
To a reader of a KV-cache engine that looks like a corrupted block table, so the demo says which
it is: it finds the loop in the tokens (a span repeated back to back) and reruns the prompt through
transformers' own `generate`; identical tokens mean the loop is the model's, not the cache's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True, slots=True)
class Loop:
    """`period` tokens repeated back to back `repeats` times, starting at token `start`."""
    start: int
    period: int
    repeats: int

    @property
    def length(self) -> int:
        return self.period * self.repeats


def find_loop(tokens: Sequence[int], min_repeats: int = 3, min_tokens: int = 16,
              max_period: int = 32) -> Loop | None:
    """The longest run of one span repeated back to back (at least `min_repeats` times and
    `min_tokens` tokens in all), or None. O(len x max_period): compares each token with the one
    `period` earlier and measures runs of agreement, so no n-gram table is built."""
    best: Loop | None = None
    n = len(tokens)
    for period in range(1, min(max_period, n // min_repeats) + 1):
        run = 0                       # tokens so far equal to the one `period` earlier
        for i in range(period, n + 1):
            if i < n and tokens[i] == tokens[i - period]:
                run += 1
                continue
            repeats = (run + period) // period
            if repeats >= min_repeats and repeats * period >= min_tokens:
                loop = Loop(i - run - period, period, repeats)
                if best is None or loop.length > best.length:
                    best = loop
            run = 0
    return best


@dataclass(frozen=True, slots=True)
class OracleCheck:
    """Our tokens against transformers' greedy `generate` on the same prompt."""
    identical: bool
    first_difference: int | None = None

    def line(self, loop: Loop) -> str:
        where = f"a {loop.period}-token span repeated {loop.repeats} times from token {loop.start}"
        if self.identical:
            return (f"   [loops: {where}. Greedy decoding of a small model loops; these tokens are "
                    f"identical to transformers' generate on the same prompt: the model, not the cache]")
        return (f"   [loops: {where}; transformers' generate on the same prompt differs from token "
                f"{self.first_difference} (this machine's dtype or kernels: see docs/demo.md)]")


def check_against_transformers(model, prompt: list[int], ours: list[int], max_tokens: int) -> OracleCheck:
    """Rerun `prompt` through transformers' greedy `generate` (one unpadded prompt, stopping at
    the model's EOS as the engine does) and compare token by token."""
    import torch

    device = next(model.parameters()).device
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False, eos_token_id=model.config.eos_token_id, pad_token_id=0,
                             temperature=None, top_p=None, top_k=None)
    ref = out[0, len(prompt):].tolist()
    if ref == list(ours):
        return OracleCheck(True)
    return OracleCheck(False, next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b),
                                   min(len(ours), len(ref))))
