"""Scheduler: iteration-level (continuous) batching over the BlockPool.

Every step it first advances running sequences (decodes and unfinished prefill chunks, oldest
first), preempting the lowest-priority (then newest) running sequence when a block cannot be
had — by swap when a SwapSpace has room, else by recompute — then swaps sequences back in, and
only when none waits in swap admits waiting sequences in arrival order while the token budget,
the sequence cap and free blocks (above a small watermark) allow. Which tenant's work goes next,
whom a dry pool preempts and what a tenant may hold at most are the Tenancy's decisions
(core/tenancy.py: "fcfs", the order above, or "fair", weighted fair share of the pool). Prefix-cache hits are taken at
admission, both from the cache and from full blocks that chunks scheduled earlier in the same
step will compute: requests that arrive together with a common prefix (a chat template's system
prompt) compute it once. That is sound because every layer writes the whole step's K/V before it
attends, so a block computed by one chunk is in the cache when another chunk of the step reads it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_pool import Block, BlockPool, NoFreeBlocksError
from .contiguous import ContiguousArena
from .sequence import Sequence, SequenceStatus
from .swap_space import SwapSpace
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
    """One step's schedule: chunks as (request id, sample index, start, tokens, samples),
    preempted ids, and how many blocks were swapped out / in."""

    chunks: tuple[tuple[str, int, int, int, bool], ...]
    preempted: tuple[str, ...]
    num_swap_out: int = 0
    num_swap_in: int = 0
    duration_s: float = 0.0   # filled in by whoever ran the step (wall clock or cost model)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)   # copy-on-write (src, dst)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host slot, device block)
    preempted: list[Sequence] = field(default_factory=list)
    resumed: list[Sequence] = field(default_factory=list)          # swapped back in this step
    # The sequence being given slots last: if scheduling fails part-way (Scheduler.plan), it and
    # the plan so far are what the failure touched.
    attempting: Sequence | None = None

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def record(self) -> StepRecord:
        """What this step decided, in a form two runs (real engine, simulator) can compare;
        take it before the step's new tokens are appended (`samples` depends on that)."""
        return StepRecord(tuple((c.seq.request_id, c.seq.sample_index, c.start, c.num_tokens, c.samples)
                                for c in self.chunks),
                          tuple(s.request_id for s in self.preempted),
                          len(self.swap_out), len(self.swap_in))

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 watermark: float = 0.01, swap: SwapSpace | None = None,
                 arena: ContiguousArena | None = None, max_model_len: int | None = None,
                 policy: str = "fcfs") -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_blocks = int(watermark * pool.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.swap = swap
        # The contiguous baseline: admission reserves a whole run up front instead of growing.
        self.arena = arena
        self.max_model_len = max_model_len
        self.tenancy = Tenancy(pool, policy)
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.prefix_hits_by_tenant: dict[str | None, int] = {}   # prompt tokens found in the cache
        # Full blocks this step's chunks will compute: hash -> (block, (parent hash, token ids,
        # extra key)), the same identity BlockPool.lookup checks; hits for later admissions.
        self._pending: dict[int, tuple[Block, tuple]] = {}
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
            self.swap.free(seq.swap_slots)
            seq.swap_slots = []
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def add_running(self, seq: Sequence) -> None:
        """A sequence forked from a running one (n > 1 samples, a beam): it already holds its
        blocks (shared through `BlockTable.fork`), so it joins `running` directly."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    @property
    def num_running(self) -> int:
        return len(self.running)

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
        out = self.plan = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self._pending.clear()
        blocked = self._make_room(out) if self.tenancy.fair and self.waiting else set()
        rebalanced = len(out.preempted)

        i = 0
        while i < len(self.running) and budget > 0:
            seq = out.attempting = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n == 0:   # a beam holding its logits until its siblings have theirs
                i += 1
                continue
            before = len(out.preempted)
            if self._grow_or_preempt(seq, seq.num_computed_tokens + n, out):
                self._append(out, ScheduledChunk(seq, seq.num_computed_tokens, n))
                budget -= n
                # A victim earlier in `running` shifts seq down: find it again rather than skip one.
                i = self.running.index(seq) + 1 if len(out.preempted) > before else i + 1
            # else: seq itself was preempted and removed from `running`; index i now holds the next.
        # Chunks of sequences preempted later in this loop must not run.
        if len(out.preempted) > rebalanced:
            gone = {s.seq_id for s in out.preempted}
            out.chunks = [c for c in out.chunks if c.seq.seq_id not in gone]
            return out   # no swap-ins or admissions in a step that had to preempt to grow

        # Swapped sequences come back before anything new is admitted (under "fair": the tenant
        # with the least usage goes first, its swapped work before its waiting work).
        while budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.tenancy.next_candidate(self.swapped, self.waiting, blocked)
            if seq is None:
                break
            out.attempting = seq
            try:
                if seq.status is SequenceStatus.SWAPPED:
                    if out.swap_out:
                        break   # a host slot freed by a swap-in could be overwritten by this step's swap-out
                    chunk = self._swap_in(seq, budget, out)
                else:
                    chunk = self._admit(seq, budget, out)
            except AtTenantCap:
                blocked.add(seq.tenant)   # that tenant waits for its own blocks; others go on
                continue
            if chunk is None:
                break   # the next in line does not fit, so nothing behind it jumps the queue
            if chunk.seq.status is SequenceStatus.WAITING:
                self.waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
            if chunk.num_tokens:
                self._append(out, chunk)
            budget -= chunk.num_tokens
        return out

    def _make_room(self, out: SchedulerOutput) -> set:
        """Under "fair": when the next tenant in line is under its share and its next request does
        not fit (blocks or sequence slots), preempt work of tenants over their share until it does.
        Returns the tenants whose work must not come back this step (they were just preempted)."""
        tenancy, pool = self.tenancy, self.pool
        active = {s.tenant for s in self.live}
        seq = tenancy.next_candidate(self.swapped, self.waiting, set())
        if seq is None or len(active) < 2 or self.arena is not None:   # the baseline never preempts
            return set()
        if seq.status is SequenceStatus.SWAPPED:
            need = len(seq.swap_slots) + 1
        else:
            hits, _, _, need = self._admission(seq, self.max_num_batched_tokens)
            need += sum(1 for b in hits if b.ref_count == 0)
        if tenancy.held(seq.tenant) + need > tenancy.share(seq.tenant, active) or tenancy.over_cap(seq.tenant, need):
            return set()   # it would be over its share (or cap): it waits its turn
        victims = set()
        while self.running:
            if need <= pool.num_free - self.watermark_blocks and len(self.running) < self.max_num_seqs:
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
        if not self.pool.enable_prefix_caching or self.arena is not None:
            return
        seq, bs = chunk.seq, self.pool.block_size
        first, end = chunk.start // bs, (chunk.start + chunk.num_tokens) // bs
        if end <= first:
            return
        hashes = seq.hashes_upto(end)
        for i in range(first, end):
            block = seq.block_table.blocks[i]
            if block.block_hash is None and hashes[i] not in self._pending:
                key = (hashes[i - 1] if i else None, tuple(seq.token_ids[i * bs:(i + 1) * bs]), seq.extra_key)
                self._pending[hashes[i]] = (block, key)

    def _grow_or_preempt(self, seq: Sequence, num_slots: int, out: SchedulerOutput) -> bool:
        """Give `seq` slots up to `num_slots`, preempting newer sequences (its tenant's own when
        it is at its cap; under "fair" the furthest-over tenant's); False if `seq` itself went."""
        while True:
            need = seq.block_table.blocks_needed(num_slots)
            if self.tenancy.over_cap(seq.tenant, need):
                victim = self.tenancy.victim(self.running, tenant=seq.tenant)   # its own, nobody else's
            else:
                try:
                    seq.block_table.grow(num_slots, out.copies)
                    return True
                except NoFreeBlocksError:
                    victim = self.tenancy.victim(self.running)
            self.preempt(victim, out)
            out.preempted.append(victim)
            if victim is seq:
                return False

    def set_tenant(self, name: str, weight: float = 1.0, max_blocks: int | None = None) -> None:
        """Register a tenant's weight and cap; a cap below what it holds now preempts its own
        newest sequences at once (by recompute: no step is running to copy KV out)."""
        self.tenancy.set(name, weight, max_blocks)
        while max_blocks is not None and self.pool.num_held(name) > max_blocks:
            victim = self.tenancy.victim(self.running, tenant=name)
            self.preempt(victim, SchedulerOutput(), swap=False)

    def preempt(self, seq: Sequence, out: SchedulerOutput, swap: bool = True) -> None:
        """Swap the sequence's blocks to host memory if the SwapSpace has room for all of them;
        otherwise recompute: free the blocks (cached ones may hit again), requeue at the front."""
        self.running.remove(seq)
        self.num_preemptions += 1
        seq.num_preemptions += 1
        table = seq.block_table
        slots = self.swap.allocate(len(table.blocks)) if self.swap is not None and swap else None
        if slots is not None:
            out.swap_out.extend(zip(table.block_ids, slots))
            seq.swap_slots, seq.swapped_num_slots = slots, table.num_slots
            self._release(seq)
            seq.status = SequenceStatus.SWAPPED
            self._enqueue(self.swapped, seq)
            self.num_swap_outs += 1
            return
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self._enqueue(self.waiting, seq)   # ahead of everything newer of its priority

    def _swap_in(self, seq: Sequence, budget: int, out: SchedulerOutput) -> ScheduledChunk | None:
        """Bring a swapped sequence back into fresh blocks and schedule its next chunk, if it fits
        (AtTenantCap if its tenant could not hold them)."""
        assert not out.swap_out, "a host slot freed here could be overwritten by a swap-out"
        assert self.arena is None, "the contiguous baseline never preempts, so never swaps in"
        pool, bs = self.pool, self.pool.block_size
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        needed = max(len(seq.swap_slots), -(-(seq.num_computed_tokens + n) // bs))
        if self.tenancy.over_cap(seq.tenant, needed):
            raise AtTenantCap
        watermark = self.watermark_blocks if self.running else 0
        if needed > pool.num_free - watermark:
            return None
        table = seq.block_table
        table.blocks = pool.allocate_many(len(seq.swap_slots), table.owner)
        table.num_slots = seq.swapped_num_slots
        out.swap_in.extend(zip(seq.swap_slots, table.block_ids))
        out.resumed.append(seq)
        self.swap.free(seq.swap_slots)
        seq.swap_slots = []
        self.swapped.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        table.grow(seq.num_computed_tokens + n, out.copies)
        return ScheduledChunk(seq, seq.num_computed_tokens, n)

    def _release(self, seq: Sequence) -> None:
        if self.arena is not None:
            self.arena.release(seq.block_table)
        else:
            seq.block_table.free()

    def reservation(self, seq: Sequence) -> int:
        """Tokens the contiguous baseline reserves: the whole prompt plus every token it may generate."""
        want = seq.prompt_len + seq.params.max_tokens
        return min(want, self.max_model_len) if self.max_model_len else want

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> ScheduledChunk | None:
        """Take `seq` in with its cached prefix and first chunk; None if the pool cannot hold it
        now, AtTenantCap if its tenant could not."""
        pool, bs = self.pool, self.pool.block_size
        if self.arena is not None:
            start = seq.num_computed_tokens
            n = min(seq.num_tokens - start, budget)
            if self.tenancy.over_cap(seq.tenant, -(-self.reservation(seq) // bs)):
                raise AtTenantCap
            if not self.arena.reserve(seq.block_table, self.reservation(seq)):
                return None
            seq.block_table.grow(start + n, out.copies)   # inside the run: takes no block
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = 0
            return ScheduledChunk(seq, start, n)
        hits, start, n, needed = self._admission(seq, budget)
        # The watermark keeps headroom for running sequences; with none running it protects nothing.
        watermark = self.watermark_blocks if self.running else 0
        if self.tenancy.over_cap(seq.tenant, needed + sum(1 for b in hits if seq.tenant not in b.owners)):
            raise AtTenantCap
        # Hit blocks that sit in the free queue stop being free once we take them.
        if needed + sum(1 for b in hits if b.ref_count == 0) > pool.num_free - watermark:
            return None
        if pool.enable_prefix_caching and seq.num_computed_tokens == 0:
            pool.prefix_cache_queries += (seq.num_tokens - 1) // bs * bs
            pool.prefix_cache_hits += len(hits) * bs
            by_tenant = self.prefix_hits_by_tenant
            by_tenant[seq.tenant] = by_tenant.get(seq.tenant, 0) + len(hits) * bs
        if hits:
            seq.block_table.adopt(hits)
            seq.num_computed_tokens = start
        seq.block_table.grow(start + n, out.copies)
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = start
        return ScheduledChunk(seq, start, n)

    def _admission(self, seq: Sequence, budget: int) -> tuple[list, int, int, int]:
        """What admitting `seq` with `budget` tokens takes: (prefix-cache hits, first position to
        compute, tokens to compute, new blocks to allocate)."""
        bs = self.pool.block_size
        hits = self._cached_prefix(seq) if seq.num_computed_tokens == 0 else []
        start = len(hits) * bs if hits else seq.num_computed_tokens
        n = min(seq.num_tokens - start, budget)
        return hits, start, n, -(-(start + n) // bs) - len(hits)

    def _cached_prefix(self, seq: Sequence) -> list:
        """Cached blocks matching the sequence's leading full blocks, or blocks that this step
        computes for an earlier chunk; the last token is never a hit."""
        pool = self.pool
        if not pool.enable_prefix_caching:
            return []
        if getattr(seq.params, "prompt_logprobs", None) is not None and not seq.num_output_tokens:
            return []   # its prompt_logprobs need every prompt position's logits (as vLLM: recompute)
        bs = pool.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        hits = []
        parent = None
        for i, h in enumerate(seq.hashes_upto(max_blocks)):
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            block = pool.lookup(h, parent, tokens, seq.extra_key)
            if block is None and h in self._pending:
                pending, key = self._pending[h]
                if key == (parent, tuple(tokens), seq.extra_key):
                    block = pending   # an earlier chunk of this very step computes it
            if block is None:
                break
            hits.append(block)
            parent = h
        return hits

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Publish the sequence's newly full, computed blocks in the prefix cache."""
        pool = self.pool
        if not pool.enable_prefix_caching:
            return
        bs = pool.block_size
        table = seq.block_table
        full = seq.num_computed_tokens // bs
        if full <= table.num_published:
            return
        hashes = seq.hashes_upto(full)
        for i in range(table.num_published, full):
            # False when an equal block is already cached (computed twice concurrently): fine.
            pool.cache_block(table.blocks[i], hashes[i], hashes[i - 1] if i else None,
                             seq.token_ids[i * bs:(i + 1) * bs], seq.extra_key)
        table.num_published = full
