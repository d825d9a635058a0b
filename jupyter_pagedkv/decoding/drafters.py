"""Drafters: cheap guesses of a sequence's next tokens, for the target model to verify in one pass.

`NgramDrafter` (prompt lookup) needs no model: it finds the most recent earlier occurrence of the
sequence's last n tokens and proposes what followed it, which pays off when the output copies the
prompt (summaries, edits, code changes). `DraftModelDrafter` runs a small model with the same
vocabulary; its KV lives in its own cache tensors but is addressed through the *target's* block
tables (same block ids, same slots), so rollback, copy-on-write and freeing need no second
allocator. The draft KV only has to be good, not exact: a stale slot lowers acceptance, never
changes the output, because every token is verified by the target.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Protocol

import torch

from ..worker.kv_cache import KVCache, KVSpec
from ..worker.model_runner import ModelRunner, RunnerConfig, prepare_model
from ..worker.plan import PlanOptions, plan_execution
from ..worker.sampler import Sampler, row_argmax
from ..core.scheduler import ScheduledChunk
from ..core.sequence import Sequence


@dataclass(slots=True)
class Proposal:
    """Draft tokens for one sequence; `probs [len(tokens), vocab]` is the distribution each was
    drawn from (None: chosen deterministically, as the n-gram lookup and greedy drafting do)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


class Drafter(Protocol):
    name: str
    # True when propose() writes KV at the draft positions, so their slots must exist beforehand.
    needs_slots: bool

    def propose(self, seqs: list[Sequence], ks: list[int], copies: list[tuple[int, int]]) -> list[Proposal]:
        """Up to `ks[i]` draft tokens for each sequence (whose token_ids it leaves unchanged)."""

    def rolled_back(self, seq: Sequence, num_computed: int) -> None:
        """The target kept KV for `num_computed` positions of `seq`; later draft KV is void."""


class NgramDrafter:
    """Prompt lookup: match the last `max_n` .. `min_n` tokens against everything before them.

    One backward scan per sequence, most recent occurrence first (recent context predicts best);
    it stops at the first occurrence matching the full `max_n` tokens. O(sequence length) integer
    comparisons, no tensors.
    """

    needs_slots = False

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n for n-gram lookup, got {min_n}, {max_n}")
        self.name = "ngram"
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], ks: list[int], copies=()) -> list[Proposal]:
        return [Proposal(self.lookup(s.token_ids, k)) for s, k in zip(seqs, ks)]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """The `k` tokens that followed the longest, most recent earlier match of the suffix."""
        n_tokens = len(tokens)
        if n_tokens < self.min_n + 1 or k <= 0:
            return []
        last = tokens[-1]
        best_end, best_len = -1, 0
        for end in range(n_tokens - 2, self.min_n - 2, -1):
            if tokens[end] != last:
                continue
            m = 1
            while m < self.max_n and end - m >= 0 and tokens[end - m] == tokens[n_tokens - 1 - m]:
                m += 1
            if m > best_len:
                best_end, best_len = end, m
                if m == self.max_n:
                    break
        if best_len < self.min_n:
            return []
        return tokens[best_end + 1:best_end + 1 + k]

    def rolled_back(self, seq: Sequence, num_computed: int) -> None:
        pass


class DraftModelDrafter:
    """A small causal LM with the target's vocabulary drafts k tokens autoregressively.

    Per sequence it remembers how many leading positions hold its own KV; each proposal first
    catches up (the prompt on first use, the target's accepted tokens afterwards) in the same
    forward that yields the first draft, then decodes one token per forward, batched over
    sequences. A preemption (recompute or swap) invalidates that memory, since the blocks change.
    """

    needs_slots = True

    @classmethod
    def load(cls, source, dtype: torch.dtype, device: torch.device, hold_weights: bool = False,
             **options) -> DraftModelDrafter:
        """From a draft model id/path (loaded now, in the target's dtype; owned, so held packed and
        released with the drafter) or a loaded model (its owner keeps it); `options` as __init__'s."""
        if isinstance(source, str):
            from ..worker.loader import load_model
            return cls(load_model(source, dtype, device).model, source, device=device, owns_model=True,
                       hold_weights=True, **options)
        if isinstance(source, torch.nn.Module):
            name = getattr(source.config, "_name_or_path", None) or f"draft-{id(source):x}"
            return cls(source, name, device=device, hold_weights=hold_weights, **options)
        raise ValueError(f"speculative must be 'ngram', a draft model id/path or a model, got {source!r}")

    def __init__(self, model, name: str, num_blocks: int, block_size: int, device: torch.device,
                 backend: str, target_vocab_size: int, seed: int | None = None,
                 pack_weights: bool = False, owns_model: bool = False, hold_weights: bool = False) -> None:
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if config.vocab_size != target_vocab_size:
            raise ValueError(f"draft model {name!r} has a vocabulary of {config.vocab_size} but the "
                             f"target's is {target_vocab_size}: use a draft with the same tokenizer")
        self.name = name
        self.model = model
        dtype = next(model.parameters()).dtype
        self.kv_cache = KVCache(KVSpec.from_config(model.config, dtype), num_blocks, block_size, device)
        self.owns_model = owns_model
        # Its own plan, as an engine's (the same defaults), but never graphs: drafts are not padded.
        packed = prepare_model(model, device, pack_weights, pack_weights and hold_weights)
        plan, kernels = plan_execution(PlanOptions(attention_backend=backend, cuda_graphs=False), model, device,
                                       dtype, self.kv_cache.spec.head_dim, packed)
        self.runner = ModelRunner(model, self.kv_cache, RunnerConfig(device, plan, kernels, packed))
        self.generator = torch.Generator(device=device)
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()
        # seq -> (positions with draft KV, the seq's preemption count when that was true)
        self._computed: weakref.WeakKeyDictionary[Sequence, tuple[int, int]] = weakref.WeakKeyDictionary()

    def propose(self, seqs: list[Sequence], ks: list[int], copies: list[tuple[int, int]]) -> list[Proposal]:
        self.kv_cache.copy_blocks(list(copies))   # copy-on-write blocks carry their draft KV too
        base = [s.num_tokens for s in seqs]
        chunks = []
        for seq in seqs:
            known, preemptions = self._computed.get(seq, (0, -1))
            start = min(known, seq.num_tokens - 1) if preemptions == seq.num_preemptions else 0
            chunks.append(ScheduledChunk(seq, start, seq.num_tokens - start))
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        try:
            for j in range(max(ks, default=0)):
                live = [i for i, k in enumerate(ks) if k > j]
                step = [chunks[i] if j == 0 else ScheduledChunk(seqs[i], seqs[i].num_tokens - 1, 1)
                        for i in live]
                index = {id(c): i for c, i in zip(step, live)}
                sampling, logits = self.runner.execute(step, [])
                for row, c in enumerate(sampling):
                    i = index[id(c)]
                    token, q = self._draw(logits[row], seqs[i])
                    tokens[i].append(token)
                    if q is not None:
                        probs[i].append(q)
                    seqs[i].token_ids.append(token)
        finally:
            for seq, n in zip(seqs, base):
                del seq.token_ids[n:]
        for seq, n, k in zip(seqs, base, ks):
            if k > 0:
                # KV was written for positions up to n + k - 2: the last draft was never fed back.
                self._computed[seq] = (n + k - 1, seq.num_preemptions)
        return [Proposal(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def _draw(self, logits: torch.Tensor, seq: Sequence) -> tuple[int, torch.Tensor | None]:
        if seq.params.greedy:
            return int(row_argmax(logits)), None
        q = Sampler.probabilities(logits.float().unsqueeze(0), [seq.params])[0]
        return int(torch.multinomial(q, 1, generator=seq.generator or self.generator)), q

    def rolled_back(self, seq: Sequence, num_computed: int) -> None:
        known = self._computed.get(seq)
        if known is not None and known[0] > num_computed:
            self._computed[seq] = (num_computed, known[1])

    def release(self) -> None:
        self.kv_cache.release()
        self.runner.packed.release(restore=not self.owns_model)
        self.runner.model = None
        self.model = None
