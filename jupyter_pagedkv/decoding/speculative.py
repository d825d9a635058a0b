"""Speculative decoding inside one engine step: draft, verify in the same forward, roll back.

For a decoding sequence with L tokens (the last one not yet computed) the Speculator appends k
draft tokens and widens its chunk to k + 1 query tokens, so the step's single forward writes
their KV into the sequence's own paged blocks and returns logits at all k + 1 positions. After
verification the drafts leave `token_ids`, the accepted ones come back as ordinary tokens, and
`KVCacheManager.roll_back` drops the rejected slots (blocks left empty go back to the pool at once).
Drafts exist only inside `Engine.step`, under the engine lock: no scheduler queue, preemption,
prefix-cache hash or snapshot ever sees an unverified token.

How many drafts a sequence gets is adaptive (`DraftLengthPolicy`): speculation backs off when
its drafts keep being rejected, and only when few tokens are batched, where a forward costs
about the same for 1 or k + 1 query tokens (CPU decode is bound by reading the weights).
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

import torch

from .drafters import Drafter, Proposal
from .grammar import FixedMask
from ..core.scheduler import ScheduledChunk, SchedulerOutput
from ..core.sequence import Sequence
from .verification import verify_greedy, verify_sampled
from ..worker.logits_processors import DraftContext

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DraftLengthPolicy:
    """Per-sequence draft length from a decayed estimate of the per-token acceptance rate p.

    Each verified draft is a Bernoulli trial up to and including the first rejection, so k
    drafts yield 1 + p + ... + p**k tokens per forward in expectation. `draft_len` picks the k
    that maximises the step's tokens per unit of forward time, using the measured cost of the
    extra query tokens (`cost(k)`: forward time with k more tokens / without). When no k pays,
    the sequence stops speculating for `backoff` steps and then probes with one draft; each
    probe doubles the wait (up to `max_backoff`), a kept draft resets it.
    """

    decay: float = 0.8
    accepted: float = 3.0     # optimistic prior: speculate at first, learn quickly
    rejected: float = 0.0
    cooldown: int = 0
    backoff: int = 4
    max_backoff: int = 64
    margin: float = 0.05      # demand a 5% gain before paying for drafts

    @property
    def acceptance(self) -> float:
        return (self.accepted + 1.0) / (self.accepted + self.rejected + 2.0)

    def best_len(self, k_max: int, batch_tokens: int, cost) -> int:
        """The k in 0..k_max with the most expected tokens per unit of forward time."""
        p, expected, term = self.acceptance, 1.0, 1.0
        best_k, best = 0, float(batch_tokens) * (1.0 + self.margin)
        for k in range(1, k_max + 1):
            term *= p
            expected += term
            rate = (batch_tokens - 1 + expected) / cost(k)
            if rate > best:
                best_k, best = k, rate
        return best_k

    def draft_len(self, k_max: int, batch_tokens: int = 1, cost=lambda k: 1.0) -> int:
        if k_max <= 0:
            return 0
        if self.cooldown > 0:
            self.cooldown -= 1
            return 0
        k = self.best_len(k_max, batch_tokens, cost)
        if k == 0:   # not worth it now: probe once, then wait longer
            self.cooldown = self.backoff
            self.backoff = min(2 * self.backoff, self.max_backoff)
            return 1
        return k

    def update(self, proposed: int, accepted: int) -> None:
        self.accepted = self.decay * self.accepted + accepted
        self.rejected = self.decay * self.rejected + (1 if accepted < proposed else 0)
        if accepted:   # a kept draft: look again next step
            self.backoff, self.cooldown = 4, 0


class StepCost:
    """Forward time by the number of query tokens in a step (decode-only steps), as moving averages.

    On a CPU one extra query token can double a batch-1 forward (matrix-vector becomes matrix-
    matrix); on a GPU it is nearly free. Speculation decides with what this engine measured.
    An unmeasured size is assumed cheap (10% per token), so it gets tried and then measured.
    """

    def __init__(self, alpha: float = 0.25) -> None:
        self.alpha = alpha
        self.seconds: dict[int, float] = {}

    def observe(self, num_tokens: int, seconds: float) -> None:
        old = self.seconds.get(num_tokens)
        self.seconds[num_tokens] = seconds if old is None else old + self.alpha * (seconds - old)

    def ratio(self, base: int, extra: int) -> float:
        t0, t1 = self.seconds.get(base), self.seconds.get(base + extra)
        if t0 is None or t1 is None or t0 <= 0:
            return 1.0 + 0.1 * extra
        return max(t1 / t0, 1.0)


@dataclass
class SpeculativeStats:
    """Counters since the engine started: drafts proposed, drafts kept, verification passes."""

    num_verifications: int = 0   # (sequence, step) pairs whose drafts were verified
    num_proposed: int = 0        # draft tokens verified
    num_accepted: int = 0        # draft tokens kept
    last_step_draft_slots: int = 0      # slots written for drafts in the most recent step
    last_step_rolled_back: int = 0      # of those, slots dropped by rollback (rejected drafts)
    last_step_freed_blocks: list[int] = field(default_factory=list)   # blocks emptied by rollback

    @property
    def acceptance_rate(self) -> float:
        """Kept drafts / proposed drafts."""
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Drafts kept per verification (the target's own token not counted)."""
        return self.num_accepted / self.num_verifications if self.num_verifications else 0.0


@dataclass(slots=True)
class Draft:
    """The drafts of one sequence in the current step."""

    chunk: ScheduledChunk
    base_len: int            # the sequence's length without drafts
    drafter: Drafter
    proposal: Proposal


class Speculator:
    """Chooses which sequences speculate, adds their drafts to the step, verifies, keeps stats."""

    def __init__(self, scheduler, drafters: dict[str, Drafter], default: str | None,
                 num_speculative_tokens: int, max_model_len: int, generator: torch.Generator,
                 max_step_tokens: int = 64) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.drafters = drafters
        self.default = default
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.generator = generator
        # Beyond this many tokens in a step the forward is no longer ~free per extra token.
        self.max_step_tokens = max_step_tokens
        self.stats = SpeculativeStats()
        self.cost = StepCost()
        self._policy: weakref.WeakKeyDictionary[Sequence, DraftLengthPolicy] = weakref.WeakKeyDictionary()
        self._failures: list[tuple[Sequence, Exception]] = []

    def drafter_for(self, seq: Sequence) -> Drafter | None:
        choice = seq.params.speculative
        if choice is False:
            return None
        name = self.default if choice is None or choice is True else choice
        return self.drafters.get(name) if name is not None else None

    def policy(self, seq: Sequence) -> DraftLengthPolicy:
        policy = self._policy.get(seq)
        if policy is None:
            policy = self._policy[seq] = DraftLengthPolicy()
        return policy

    # -- before the forward ---------------------------------------------------------------------
    def propose(self, sched: SchedulerOutput) -> dict[int, Draft]:
        """Add drafts to the decode chunks of speculating sequences; returns them by seq_id."""
        budget = min(self.scheduler.max_num_batched_tokens, self.max_step_tokens) - sched.num_tokens
        self.stats.last_step_draft_slots = self.stats.last_step_rolled_back = 0
        self.stats.last_step_freed_blocks = []
        groups: dict[str, list[tuple[ScheduledChunk, int]]] = {}
        granted = 0
        for c in sched.chunks:
            seq = c.seq
            if budget <= 0:
                break
            if c.num_tokens != 1 or not c.samples or seq.num_output_tokens == 0:
                continue
            drafter = self.drafter_for(seq)
            if drafter is None:
                continue
            k_max = min(self.k, budget, seq.params.max_tokens - seq.num_output_tokens - 1,
                        self.max_model_len - seq.num_tokens - 1)
            base = sched.num_tokens + granted
            k = self.policy(seq).draft_len(k_max, base, lambda extra: self.cost.ratio(base, extra))
            if drafter.needs_slots:
                k = self._reserve(seq, k, sched)
            if k <= 0:
                continue
            groups.setdefault(drafter.name, []).append((c, k))
            budget -= k
            granted += k
        drafts: dict[int, Draft] = {}
        for name, items in groups.items():
            drafter = self.drafters[name]
            seqs = [c.seq for c, _ in items]
            try:
                proposals = drafter.propose(seqs, [k for _, k in items], sched.copies)
            except Exception as err:
                # Their plain decode chunks still run (other chunks may adopt blocks they complete);
                # the engine ends these requests after the forward (`take_failures`).
                logger.warning("drafter %r failed for %d sequence(s): %s", name, len(seqs), err)
                for seq in seqs:
                    if drafter.needs_slots:
                        self.kv.roll_back(seq, seq.num_tokens)      # the slots reserved for drafts
                    self._failures.append((seq, err))
                continue
            for (c, k), prop in zip(items, proposals):
                seq, base = c.seq, c.seq.num_tokens
                n = min(len(prop.tokens), k)
                if drafter.needs_slots:
                    self.kv.roll_back(seq, base + n)   # slots reserved for drafts not proposed
                else:
                    n = self._reserve(seq, n, sched)
                if n <= 0:
                    continue
                prop.tokens = prop.tokens[:n]
                if prop.probs is not None:
                    prop.probs = prop.probs[:n]
                seq.token_ids.extend(prop.tokens)
                c.num_tokens += n
                c.num_logits = n + 1
                drafts[seq.seq_id] = Draft(c, base, drafter, prop)
                self.stats.last_step_draft_slots += n
        return drafts

    def _reserve(self, seq: Sequence, k: int, sched: SchedulerOutput) -> int:
        """Grow the table by up to `k` draft slots from blocks free beyond the watermark and within
        the tenant's max_blocks (drafts are optional: they never take a tenant past its cap)."""
        kv, base, tenancy = self.kv, seq.num_tokens, self.scheduler.tenancy
        while k > 0 and (not kv.fits(needed := kv.blocks_needed(seq, base + k), self.scheduler.watermark_blocks)
                         or tenancy.over_cap(seq.tenant, needed)):
            k -= 1
        if k > 0:
            grown = kv.allocate_slots(seq, base + k, sched.copies)
            assert grown, "fits() counted the blocks growing takes"
        return k

    # -- after the forward ----------------------------------------------------------------------
    def observe(self, sched: SchedulerOutput, drafts: dict[int, Draft], seconds: float) -> None:
        """Record the forward time of a decode-only step (drafts included) for the cost model."""
        num_tokens = 0
        for c in sched.chunks:
            if c.num_tokens > 1 and c.seq.seq_id not in drafts:
                return   # a prefill chunk: its cost says nothing about decoding
            num_tokens += c.num_tokens
        if num_tokens <= self.max_step_tokens:
            self.cost.observe(num_tokens, seconds)

    def split(self, sampling: list[ScheduledChunk], logits: torch.Tensor, drafts: dict[int, Draft],
              default_generator: torch.Generator, process=None
              ) -> tuple[list[ScheduledChunk], torch.Tensor, list[tuple[Sequence, list[int], torch.Tensor]]]:
        """Verify every draft; returns the plain sampling chunks with their logits rows, and for each
        speculating sequence the tokens to append (kept drafts plus the target's own token) with
        the verify pass's raw logits rows they were picked at (what their logprobs read).

        `process(logits, contexts)` applies the request's logits processors: the target's row at
        draft position j sees the context as if drafts 0 .. j-1 had been accepted, so the tokens
        kept are those the processors would have let plain decoding pick. A grammar's mask at
        position j is likewise its matcher's after drafts 0 .. j-1 (`GrammarState.fill_drafts`)."""
        plain, plain_rows, verified = [], [], []
        row = 0
        for c in sampling:
            draft = drafts.get(c.seq.seq_id)
            if draft is None or draft.chunk is not c:
                plain.append(c)
                plain_rows.append(row)
                row += c.num_logits
                continue
            rows = raw = logits[row:row + c.num_logits]
            row += c.num_logits
            seq, tokens = c.seq, draft.proposal.tokens
            del seq.token_ids[draft.base_len:]
            c.num_tokens, c.num_logits = 1, 1
            masks = seq.grammar.fill_drafts(tokens, rows.shape[1]) if seq.grammar is not None else None
            if process is not None and (seq.params.has_processors or masks is not None):
                rows = process(rows.float(), [DraftContext(seq.params, seq.token_ids + tokens[:j], seq.prompt_len,
                                                           FixedMask(masks[j]) if masks is not None else None)
                                              for j in range(len(tokens) + 1)])
            if seq.params.greedy:
                out = verify_greedy(rows, tokens)
            else:
                out = verify_sampled(rows, tokens, draft.proposal.probs, seq.params,
                                     seq.generator or default_generator)
            kept = len(out) - 1
            self.policy(seq).update(len(tokens), kept)
            self.stats.num_verifications += 1
            self.stats.num_proposed += len(tokens)
            self.stats.num_accepted += kept
            verified.append((seq, out, raw[:len(out)]))
        plain_logits = logits if len(plain_rows) == row else logits[plain_rows]
        return plain, plain_logits, verified

    def take_failures(self) -> list[tuple[Sequence, Exception]]:
        """The sequences whose drafter raised this step, and why (handed over once)."""
        failures, self._failures = self._failures, []
        return failures

    def roll_back(self, seq: Sequence, num_computed: int) -> None:
        """Keep KV slots for `num_computed` positions only; emptied blocks return to the pool now."""
        table = seq.block_table
        dropped = table.num_slots - num_computed
        before = set(table.block_ids)
        self.kv.roll_back(seq, num_computed)
        self.stats.last_step_rolled_back += max(dropped, 0)
        self.stats.last_step_freed_blocks.extend(sorted(before - set(table.block_ids)))
        for drafter in self.drafters.values():
            drafter.rolled_back(seq, num_computed)

    def discard(self, drafts: dict[int, Draft]) -> None:
        """A failed forward: take the drafts back out so the sequences are as scheduled."""
        for draft in drafts.values():
            seq = draft.chunk.seq
            del seq.token_ids[draft.base_len:]
            draft.chunk.num_tokens, draft.chunk.num_logits = 1, 1
