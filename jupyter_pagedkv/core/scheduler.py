"""Scheduler: iteration-level (continuous) batching; memory only through a KVCacheManager.

Every step it first advances running sequences (decodes and unfinished prefill chunks, oldest
first), preempting the lowest-priority (then newest) running sequence when a block cannot be
had — by swap when a SwapSpace has room, else by recompute — then swaps sequences back in, and
only when none waits in swap admits waiting sequences in queue order while the token budget, the
sequence cap (n samples or beams count n) and free blocks (above a small watermark) allow. Which work
goes next, whom a dry pool preempts and what a tenant may hold are the Tenancy's decisions
(core/tenancy.py: "fcfs", the order above; "fair", weighted fair share of the pool; "priority", one
queue order for running and queued work, a candidate preempting lower-priority work to fit).

Prefix-cache hits are taken at admission, both from the cache and from full blocks that chunks
scheduled earlier in the same step will compute: requests that arrive together with a common
prefix (a chat template's system prompt) compute it once. That is sound because every layer writes
the whole step's K/V before it attends, so a block one chunk computes is in the cache for the next.

Where KV lives is the KVCacheManager's business (core/kv_cache_manager.py): the scheduler asks it for
computed blocks, slots ("no room": preempt or wait; most decode steps take none), to free, fork, swap and
publish, and never touches a pool or block table. `update_from_output` is the one post-forward step.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

from .kv_cache_manager import KVCacheManager
from .sequence import Sequence, SequenceStatus
from .tenancy import Tenancy, queue_order


class AtTenantCap(Exception):
    """Bringing this sequence in would take its tenant past max_blocks: it waits, others go on."""


@dataclass(slots=True)
class ScheduledChunk:
    """`num_tokens` tokens of `seq`, starting at position `start`, to compute this step."""

    seq: Sequence
    start: int
    num_tokens: int
    num_logits: int = 1   # logits rows wanted at the chunk's end (k + 1 when verifying k drafts)
    # (first position, count): rows whose logits a request's prompt_logprobs need, set by the
    # engine before the forward (engine/logprobs.py); the runner hands them back apart.
    prompt_logits: tuple[int, int] | None = None

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the known tokens, so it yields a new token."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One step's schedule: chunks as (request id, sample index, start, tokens, samples), preempted ids,
    blocks swapped out / in; `drafts` (request id, sample index, k): tokens counting k unverified drafts."""
    chunks: tuple[tuple[str, int, int, int, bool], ...]
    preempted: tuple[str, ...]
    num_swap_out: int = 0
    num_swap_in: int = 0
    duration_s: float = 0.0   # filled in by whoever ran the step (wall clock or cost model)
    drafts: tuple[tuple[str, int, int], ...] = ()


@dataclass(slots=True)
class SampledTokens:
    """Tokens a step produced for one sequence. `num_computed`: for verified drafts, the positions
    whose KV stays (committed once the tokens are in; None for a plain sampled token)."""

    seq: Sequence
    token_ids: list[int]
    num_computed: int | None = None


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)   # copy-on-write (src, dst)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host slot, device block)
    preempted: list[Sequence] = field(default_factory=list)
    resumed: list[Sequence] = field(default_factory=list)          # swapped back in this step
    attempting: Sequence | None = None   # given slots last: what a failure part-way touched (`plan`)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def record(self) -> StepRecord:
        """What this step decided, in a form two runs (real engine, simulator) can compare;
        take it once drafts widened their chunks, before new tokens are appended (`samples`)."""
        return StepRecord(tuple((c.seq.request_id, c.seq.sample_index, c.start, c.num_tokens, c.samples)
                                for c in self.chunks),
                          tuple(s.request_id for s in self.preempted),
                          len(self.swap_out), len(self.swap_in))

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    """The queues (waiting, running, swapped) and each step's decisions; memory through `kv` only."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 watermark: float = 0.01, policy: str = "fcfs") -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_blocks = int(watermark * kv.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.tenancy = Tenancy(kv, policy)
        self.num_preemptions = 0
        self.num_swap_outs = 0
        # The step being planned (the last one once `schedule` returns): a failure part-way leaves
        # its swaps and copy-on-write copies undone, so whoever handles it ends what it names.
        self.plan = SchedulerOutput()

    # -- queue management ---------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._enqueue(self.waiting, seq)

    @staticmethod
    def _enqueue(queue: deque[Sequence], seq: Sequence) -> None:
        """Keep `queue` ordered by (priority, arrival): lower priority numbers go first, then FCFS."""
        key = queue_order(seq)
        i = len(queue)
        while i and queue_order(queue[i - 1]) > key:
            i -= 1
        queue.insert(i, seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (stop, length or abort) and return its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def add_running(self, seq: Sequence) -> None:
        """A sequence forked from a running one (n > 1 samples, a beam): it already holds its
        blocks (shared through `KVCacheManager.fork`), so it joins `running` directly."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def seats_taken(self) -> int:   # of max_num_seqs: n (beam_width) for a sequence not yet forked
        return sum(s.seats for s in self.running)

    @property
    def live(self) -> list[Sequence]:
        return [*self.running, *self.waiting, *self.swapped]

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.swapped)

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The next step's chunks, preemptions, swaps and copies (see the module docstring)."""
        out = self._schedule()
        out.attempting = None   # planned whole: nothing was left half-done
        return out

    def _schedule(self) -> SchedulerOutput:
        """One loop over running work (growing it) and candidates (bringing them in), in the order
        the Tenancy gives: "fcfs"/"fair" serve all running work first; "priority" interleaves by
        queue order, so a candidate runs before every lower-priority running sequence and may
        preempt them to fit (`_preempt_for`). Running work sits in `running` before index i."""
        out = self.plan = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.kv.begin_step()
        tenancy, by_priority = self.tenancy, self.tenancy.by_priority
        blocked = self._make_room(out) if tenancy.fair and self.waiting else set()
        rebalanced = len(out.preempted)
        if by_priority:
            self.running.sort(key=queue_order)   # victims are always the last: never a scheduled one
        i, admitting = 0, True
        while budget > 0:
            head = self.running[i] if i < len(self.running) else None
            cand = None
            if head is None and len(out.preempted) > rebalanced and not by_priority:
                admitting = False   # no swap-ins or admissions in a step that had to preempt to grow
            if admitting and (head is None or by_priority):
                cand = tenancy.next_candidate(self.swapped, self.waiting, blocked)
                if cand is not None and any(cand is s for s in out.preempted):
                    blocked.add(cand.tenant)   # not back in the step that preempted it; its tenant waits too
                    continue
            if head is not None and (cand is None or queue_order(head) < queue_order(cand)):
                out.attempting = head
                n = min(head.num_tokens - head.num_computed_tokens, budget)
                if n == 0:   # a beam holding its logits until its siblings have theirs
                    i += 1
                    continue
                before = len(out.preempted)
                if self._grow_or_preempt(head, head.num_computed_tokens + n, out):
                    self._append(out, ScheduledChunk(head, head.num_computed_tokens, n))
                    budget -= n
                    # A victim earlier in `running` shifts head down: find it again rather than skip one.
                    i = self.running.index(head) + 1 if len(out.preempted) > before else i + 1
                # else: head itself was preempted and removed from `running`; index i holds the next.
                continue
            if cand is None:
                break
            out.attempting = cand
            chunk = None
            if self.seats_taken() + cand.seats <= self.max_num_seqs:   # its n samples each take a seat
                try:
                    chunk = (self._swap_in(cand, budget, out) if cand.status is SequenceStatus.SWAPPED
                             else self._admit(cand, budget, out))
                except AtTenantCap:
                    blocked.add(cand.tenant)   # that tenant waits for its own blocks; others go on
                    continue
            if chunk is None:
                if not (by_priority and self._preempt_for(cand, budget, i, out)):
                    admitting = False   # the next in line does not fit: nothing behind it jumps the queue
                continue
            if cand.status is SequenceStatus.WAITING:
                self.waiting.remove(cand)
            else:
                self.swapped.remove(cand)
            cand.status = SequenceStatus.RUNNING
            self.running.insert(i, cand)
            i += 1
            if chunk.num_tokens:
                self._append(out, chunk)
            budget -= chunk.num_tokens
        # Chunks of sequences preempted after they were scheduled (fcfs/fair growth) must not run.
        if len(out.preempted) > rebalanced:
            gone = {s.seq_id for s in out.preempted}
            out.chunks = [c for c in out.chunks if c.seq.seq_id not in gone]
        return out

    def _preempt_for(self, cand: Sequence, budget: int, i: int, out: SchedulerOutput) -> bool:
        """Under "priority": preempt running sequences of lower priority than `cand` (those not yet
        served, `running[i:]`, lowest first) until `cand` fits, but only when preempting all of
        them would make it fit (blocks above the watermark and a sequence slot). Whether it did."""
        lower = self.tenancy.lower_priority(self.running[i:], cand)
        if not lower or not self.kv.preempts:
            return False
        if cand.status is SequenceStatus.SWAPPED:
            n = min(cand.num_tokens - cand.num_computed_tokens, budget)
            need = self.kv.blocks_to_swap_in(cand, cand.num_computed_tokens + n)
        else:
            need = self.kv.computed_blocks(cand, budget).num_new_blocks
        reserve = self.watermark_blocks if len(self.running) > len(lower) else 0
        if (self.seats_taken() - sum(s.seats for s in lower) + cand.seats > self.max_num_seqs
                or need > self.kv.num_free - reserve + self.kv.num_freeable(lower)):
            return False
        before = len(out.preempted)
        while lower and (not self.kv.fits(need, reserve) or self.seats_taken() + cand.seats > self.max_num_seqs):
            victim = lower.pop()
            self.preempt(victim, out)
            out.preempted.append(victim)
        return len(out.preempted) > before

    def _make_room(self, out: SchedulerOutput) -> set:
        """Under "fair": when the next tenant in line is under its share and its next request does
        not fit (blocks or sequence slots), preempt work of tenants over their share until it does.
        Returns the tenants whose work must not come back this step (they were just preempted)."""
        tenancy = self.tenancy
        active = {s.tenant for s in self.live}
        seq = tenancy.next_candidate(self.swapped, self.waiting, set())
        if seq is None or len(active) < 2 or not self.kv.preempts:   # preempting makes no room there
            return set()
        if seq.status is SequenceStatus.SWAPPED:
            need = len(seq.swap_slots) + 1
        else:
            need = self.kv.computed_blocks(seq, self.max_num_batched_tokens).num_new_blocks
        if tenancy.held(seq.tenant) + need > tenancy.share(seq.tenant, active) or tenancy.over_cap(seq.tenant, need):
            return set()   # it would be over its share (or cap): it waits its turn
        victims = set()
        while self.running:
            if self.kv.fits(need, self.watermark_blocks) and self.seats_taken() + seq.seats <= self.max_num_seqs:
                break
            victim = tenancy.over_share(self.running, active, seq.tenant)
            if victim is None:
                break
            self.preempt(victim, out)
            out.preempted.append(victim)
            victims.add(victim.tenant)
        return victims

    def _append(self, out: SchedulerOutput, chunk: ScheduledChunk) -> None:
        """Schedule `chunk` and offer the full blocks it completes to later admissions."""
        out.chunks.append(chunk)
        self.kv.offer(chunk.seq, chunk.start, chunk.num_tokens)

    def _grow_or_preempt(self, seq: Sequence, num_slots: int, out: SchedulerOutput) -> bool:
        """Give `seq` slots up to `num_slots`, preempting newer sequences (its tenant's own when
        it is at its cap; under "fair" the furthest-over tenant's); False if `seq` itself went."""
        while not self.kv.extend_in_place(seq, num_slots):   # most decode steps take no new block
            need = self.kv.blocks_needed(seq, num_slots)
            if self.tenancy.over_cap(seq.tenant, need):
                victim = self.tenancy.victim(self.running, tenant=seq.tenant)   # its own, nobody else's
            elif self.kv.allocate_slots(seq, num_slots, out.copies):
                return True
            else:
                victim = self.tenancy.victim(self.running)
            self.preempt(victim, out)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def set_tenant(self, name: str, weight: float = 1.0, max_blocks: int | None = None) -> None:
        """Register a tenant's weight and cap; a cap below what it holds now preempts its own
        newest sequences at once (by recompute: no step is running to copy KV out)."""
        self.tenancy.set(name, weight, max_blocks)
        while max_blocks is not None and self.kv.num_held(name) > max_blocks:
            victim = self.tenancy.victim(self.running, tenant=name)
            self.preempt(victim, SchedulerOutput(), swap=False)

    def preempt(self, seq: Sequence, out: SchedulerOutput, swap: bool = True) -> None:
        """Swap the sequence's blocks to host memory if the SwapSpace has room for all of them;
        otherwise recompute: free the blocks (cached ones may hit again), requeue at the front."""
        self.running.remove(seq)
        self.num_preemptions += 1
        seq.num_preemptions += 1
        # Swap-outs run before swap-ins (worker), so none may follow a swap-in in one step: it
        # could be given, and overwrite, a host slot the swap-in has yet to read.
        copies = self.kv.swap_out(seq) if swap and not out.swap_in else None
        if copies is not None:
            out.swap_out.extend(copies)
            seq.status = SequenceStatus.SWAPPED
            self._enqueue(self.swapped, seq)
            self.num_swap_outs += 1
            return
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self._enqueue(self.waiting, seq)   # ahead of everything newer of its priority

    def _swap_in(self, seq: Sequence, budget: int, out: SchedulerOutput) -> ScheduledChunk | None:
        """Bring a swapped sequence back into fresh blocks and schedule its next chunk, if it fits
        (AtTenantCap if its tenant could not hold them); the caller moves it to `running`."""
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        needed = self.kv.blocks_to_swap_in(seq, seq.num_computed_tokens + n)
        if self.tenancy.over_cap(seq.tenant, needed):
            raise AtTenantCap
        if not self.kv.fits(needed, self.watermark_blocks if self.running else 0):
            return None
        out.swap_in.extend(self.kv.swap_in(seq))
        out.resumed.append(seq)
        grown = self.kv.allocate_slots(seq, seq.num_computed_tokens + n, out.copies)
        assert grown, "fits() counted the blocks growing takes"
        return ScheduledChunk(seq, seq.num_computed_tokens, n)

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> ScheduledChunk | None:
        """Take `seq` in with its cached prefix and first chunk; None if memory cannot hold it
        now, AtTenantCap if its tenant could not."""
        admission = self.kv.computed_blocks(seq, budget)
        if self.tenancy.over_cap(seq.tenant, admission.num_tenant_blocks):
            raise AtTenantCap
        # The watermark keeps headroom for running sequences; with none running it protects nothing.
        if not self.kv.admit(seq, admission, out.copies, self.watermark_blocks if self.running else 0):
            return None
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = admission.start
        return ScheduledChunk(seq, admission.start, admission.num_tokens)

    # -- after the forward ------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sample: Callable[[], Iterable[SampledTokens]],
                           append: Callable[[Sequence, int], object]) -> int:
        """The one post-forward protocol (the engine's step and the simulator both call it).

        The step's chunks now have KV: each sequence advances and publishes its full blocks. Only then is
        `sample()` called (a sequence forked for n samples or beams shares committed KV); `append(seq,
        token)` adds each token it returns and finishes the sequence through `finish` when a stop rule
        says so, which frees its blocks; a finished sequence takes no more tokens. Verified drafts' KV
        is committed once their tokens are in. Returns how many tokens were handed to `append`."""
        kv = self.kv
        for c in out.chunks:
            seq = c.seq
            seq.num_computed_tokens = c.start + c.num_tokens
            kv.publish(seq)
        num_tokens = 0
        for sampled in sample():
            seq = sampled.seq
            for token in sampled.token_ids:
                if seq.is_finished:
                    break
                append(seq, token)
                num_tokens += 1
            if sampled.num_computed is not None and not seq.is_finished:
                seq.num_computed_tokens = sampled.num_computed
                kv.publish(seq)
        return num_tokens
