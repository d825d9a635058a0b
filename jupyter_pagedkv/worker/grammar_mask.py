"""Structured outputs' token mask: the rows whose sequence follows a grammar get their bitmask
filled on the host (one `[rows, vocab / 32]` int32 tensor a step, xgrammar's layout), copied to the
logits' device and applied there in one batched call (xgrammar's CPU kernel or its Triton one on
CUDA): a disallowed token's logit becomes -inf.

It runs first in the sampler, before the logits processors: a mask commutes with them (-inf stays
-inf under a bias, a penalty or another mask), so the order changes nothing but the work. A row
knows its mask through `row.grammar` (anything with `fill(bitmask, row)`): a sequence's matcher,
or a draft position's row computed ahead (`decoding/grammar.FixedMask`). A batch with no such
row returns its logits untouched after one Python check per row.
"""
from __future__ import annotations

import time

import torch


class GrammarMask:
    """Applies the rows' grammar masks; `seconds` adds up the time spent (the step breakdown)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self, logits: torch.Tensor, rows: list) -> torch.Tensor:
        """`logits [rows, vocab]` with each grammar row masked (a new tensor when any is)."""
        active = [i for i, r in enumerate(rows) if getattr(r, "grammar", None) is not None]
        if not active:
            return logits
        t0 = time.perf_counter()
        import xgrammar as xgr   # present: the engine compiled these rows' grammars with it

        bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])   # host: the matchers fill it there
        for i in active:
            rows[i].grammar.fill(bitmask, i)
        if logits.device.type == "cuda":
            bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
        out = logits.float().clone()
        xgr.apply_token_bitmask_inplace(out, bitmask, indices=None if len(active) == len(rows) else active)
        self.seconds += time.perf_counter() - t0
        return out

    def take_seconds(self) -> float:
        """The time spent since the last call (the engine reads it once a step)."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds
