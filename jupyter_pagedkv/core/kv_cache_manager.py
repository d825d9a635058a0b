"""KVCacheManager: the scheduler's one door to KV memory.

The scheduler decides *whose* tokens run; the manager decides *where* their KV lives and answers
whether it fits. It owns the BlockPool, every change to a sequence's BlockTable, the prefix cache
(lookup, the blocks this step's chunks will compute, the hit/miss accounting, publishing full
blocks) and the SwapSpace. Two classes implement the interface: `PagedKVCacheManager` (blocks on
demand, shared by prefix hits and forks) and `ContiguousKVCacheManager` (core/contiguous.py: one
run per request reserved at admission, the pre-paging baseline). The scheduler asks both the
same questions and never learns which one it has; fair share and quotas ask `num_held`,
`num_blocks` and `fits` instead of reading the pool.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from .block_pool import Block, BlockPool, NoFreeBlocksError
from .block_table import BlockTable
from .miss_report import MissReport, explain
from .sequence import SequenceStatus

if TYPE_CHECKING:
    from .sequence import Sequence
    from .swap_space import SwapSpace


@dataclass(frozen=True, slots=True)
class Admission:
    """What taking a waiting sequence in costs, as `computed_blocks` found it: the first position
    to compute (past its prefix-cache hits), the tokens to compute now, the blocks the pool must
    hand out (hits sitting in the free queue count: they stop being free) and the blocks its
    tenant would newly hold (what `max_blocks` checks). `hits` is opaque to the scheduler."""

    start: int
    num_tokens: int
    num_new_blocks: int
    num_tenant_blocks: int
    hits: tuple[Block, ...] = ()


class KVCacheManager(ABC):
    """The verbs and questions the scheduler has for memory; subclasses say how blocks are placed.

    `allocate_slots` and `admit` answer False ("no room", vLLM's None) and change nothing when
    the pool cannot give what they need; `free` returns every device block and host slot."""

    # False: admission holds a sequence's whole context, so growing never needs a block and
    # preempting could never make room (the contiguous baseline).
    preempts: ClassVar[bool] = True

    def __init__(self, pool: BlockPool, swap: SwapSpace | None = None) -> None:
        self.pool = pool
        self.swap = swap
        self.block_size = pool.block_size
        self.num_blocks = pool.num_blocks
        self.prefix_hits_by_tenant: dict[str | None, int] = {}   # prompt tokens found in the cache
        # Hashes a previous engine (another model or revision) had cached -> its identity (`why`).
        self.foreign: dict[int, str] = {}

    # -- questions (admission, fair share, quotas) -----------------------------------------------
    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def num_held(self, tenant: str | None) -> int:
        """Distinct blocks `tenant`'s sequences reference (O(1); a shared block counts for each)."""
        return self.pool.num_held(tenant)

    def fits(self, num_blocks: int, reserve: int = 0) -> bool:
        """Whether `num_blocks` new blocks can be had while `reserve` (the watermark) stay free."""
        return num_blocks <= self.pool.num_free - reserve

    def num_freeable(self, seqs: list[Sequence]) -> int:
        """Blocks that freeing all of `seqs` would make free: those no other sequence references
        (what a priority preemption can win; a block shared with someone else stays)."""
        refs: Counter[int] = Counter()
        blocks = {}
        for seq in seqs:
            for b in seq.block_table.blocks:
                refs[b.block_id] += 1
                blocks[b.block_id] = b
        return sum(1 for bid, n in refs.items() if blocks[bid].ref_count == n)

    def new_table(self) -> BlockTable:
        """An empty block table for a new sequence (its owner becomes the sequence's tenant)."""
        return BlockTable(self.pool)

    @abstractmethod
    def blocks_wanted(self, seq: Sequence) -> int:
        """Blocks admitting `seq` asks for, before any prefix hit (what a queue view shows)."""

    def free_runs(self) -> tuple[int, ...] | None:
        """Lengths of the runs of adjacent free blocks, when placement needs runs (else None)."""
        return None

    def refusals(self) -> tuple[int, int]:
        """(admissions refused for want of a placement, of them with enough blocks free in total):
        what external fragmentation costs. Only a manager that places runs can refuse that way."""
        return 0, 0

    # -- one step ---------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """A new schedule starts: forget what the last step's chunks offered (`offer`)."""

    def offer(self, seq: Sequence, start: int, num_tokens: int) -> None:
        """This step computes `seq`'s positions [start, start + num_tokens): the full blocks among
        them may serve admissions later in the same step."""

    @abstractmethod
    def computed_blocks(self, seq: Sequence, budget: int) -> Admission:
        """What admitting `seq` with at most `budget` tokens this step would take (a pure lookup:
        nothing is counted or taken)."""

    @abstractmethod
    def admit(self, seq: Sequence, admission: Admission, copies: list[tuple[int, int]],
              reserve: int = 0) -> bool:
        """Take `seq` in as `admission` says (hits adopted and counted, first chunk's slots held);
        False, nothing taken, when it does not fit while leaving `reserve` blocks free."""

    # -- why a prompt missed (core/miss_report.py) ---------------------------------------------
    def explain(self, seq: Sequence, num_hits: int) -> MissReport:
        """Why each prompt block of `seq`, admitted with `num_hits` hits, is or is not a hit."""
        return explain(self.pool, seq, num_hits, self.foreign)

    def cached_hashes(self) -> list[int]:
        """The hashes cached now (for the next engine's `remember_foreign`)."""
        return list(self.pool.cached)

    def remember_foreign(self, identity: str, hashes: list[int]) -> None:
        """Chains another model or revision cached (a previous engine): misses on them say so."""
        self.foreign.update(dict.fromkeys(hashes, identity))

    def blocks_needed(self, seq: Sequence, num_slots: int) -> int:
        """New blocks (copy-on-write included) that growing `seq` to `num_slots` slots takes."""
        return seq.block_table.blocks_needed(num_slots)

    def extend_in_place(self, seq: Sequence, num_slots: int) -> bool:
        """Give `seq` slots up to `num_slots` when that takes no new block (room left in its own
        last block, as most decode steps); False, nothing changed, when it does: then
        `blocks_needed` and `allocate_slots` decide, caps and preemption included."""
        return seq.block_table.extend_in_place(num_slots)

    def allocate_slots(self, seq: Sequence, num_slots: int, copies: list[tuple[int, int]]) -> bool:
        """Hold slots for `seq`'s positions up to `num_slots` (appending copy-on-write (src, dst)
        pairs to `copies`); False, nothing taken, when the pool has too few free blocks."""
        self.pool.claimant = seq.request_id   # whose allocation an eviction now serves
        try:
            seq.block_table.grow(num_slots, copies)
        except NoFreeBlocksError:
            return False
        return True

    def roll_back(self, seq: Sequence, num_slots: int) -> None:
        """Drop `seq`'s slots from `num_slots` on (rejected drafts); emptied blocks return now."""
        seq.block_table.rollback(num_slots)

    def publish(self, seq: Sequence) -> None:
        """Offer `seq`'s newly full, computed blocks to the prefix cache (paged only)."""

    def fork(self, seq: Sequence) -> BlockTable:
        """A table sharing every block of `seq`'s (ref counts +1); a write into a shared, partly
        filled block copies it first (copy-on-write, for n samples and beams)."""
        return seq.block_table.fork()

    def free(self, seq: Sequence) -> None:
        """Return everything `seq` holds: its device blocks, and its host slots if swapped."""
        if seq.swap_slots:
            self.swap.free(seq.swap_slots)
            seq.swap_slots = []
        self._release(seq.block_table)

    def _release(self, table: BlockTable) -> None:
        table.free()

    # -- swap -------------------------------------------------------------------------------------
    def swap_out(self, seq: Sequence) -> list[tuple[int, int]] | None:
        """Move `seq`'s blocks to host slots: the (device block, host slot) copies to make, its
        device blocks freed; None, nothing changed, when the swap space has too few slots."""
        if self.swap is None:
            return None
        table = seq.block_table
        slots = self.swap.allocate(len(table.blocks))
        if slots is None:
            return None
        copies = list(zip(table.block_ids, slots))
        seq.swap_slots, seq.swapped_num_slots = slots, table.num_slots
        self._release(table)
        return copies

    def blocks_to_swap_in(self, seq: Sequence, num_slots: int) -> int:
        """Device blocks bringing a swapped `seq` back and growing it to `num_slots` takes."""
        return max(len(seq.swap_slots), -(-num_slots // self.block_size))

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Fresh device blocks for a swapped `seq` (the caller asked `fits` first): the (host slot,
        device block) copies to make; its host slots are free again."""
        table = seq.block_table
        self.pool.claimant = seq.request_id
        table.blocks = self.pool.allocate_many(len(seq.swap_slots), table.owner)   # all or none
        table.num_slots = seq.swapped_num_slots
        copies = list(zip(seq.swap_slots, table.block_ids))
        self.swap.free(seq.swap_slots)
        seq.swap_slots = []
        return copies

    # -- invariants -------------------------------------------------------------------------------
    def check_invariants(self, live: list[Sequence]) -> None:
        """Invariants 1-3, 5-7 and 9 (docs/design.md) over the live sequences' memory."""
        bs = self.block_size
        expected: Counter[int] = Counter()
        owners: dict[object, Counter[int]] = {}
        for seq in live:
            table = seq.block_table
            assert table.owner == seq.tenant, f"{seq.request_id}: table owned by {table.owner!r}, not {seq.tenant!r}"
            expected.update(b.block_id for b in table.blocks)
            owners.setdefault(seq.tenant, Counter()).update(b.block_id for b in table.blocks)
            assert table.ids().tolist() == table.block_ids, (
                f"{seq.request_id}: its table's id array {table.ids().tolist()} is not its blocks "
                f"{table.block_ids} (invariant 5)")
            self._check_table(seq)
            slots = seq.swapped_num_slots if seq.status is SequenceStatus.SWAPPED else table.num_slots
            assert seq.num_computed_tokens <= slots, f"{seq.request_id}: computed tokens without slots"
            for i, block in enumerate(table.blocks):
                if block.block_hash is not None:
                    assert list(block.token_ids) == seq.token_ids[i * bs:(i + 1) * bs], (
                        f"{seq.request_id}: block {block.block_id} content differs from its hash "
                        f"(invariant 3)")
                    assert block.extra_key == seq.extra_key, (
                        f"{seq.request_id} (tenant {seq.tenant!r}) holds cached block {block.block_id} salted "
                        f"{block.extra_key!r}, not {seq.extra_key!r}: a prefix crossed tenants (invariant 7)")
        self.pool.check_invariants(expected, owners)  # invariants 1-3, the gauge and per-tenant counters
        swapped = [seq for seq in live if seq.status is SequenceStatus.SWAPPED]
        if self.swap is not None:
            self.swap.check_invariants([slot for seq in swapped for slot in seq.swap_slots])
        for seq in swapped:
            assert not seq.block_table.blocks and seq.swap_slots, (
                f"{seq.request_id}: swapped but holds device blocks or no host slots (invariant 6)")
        pool, by_tenant = self.pool, self.prefix_hits_by_tenant
        assert sum(by_tenant.values()) == pool.prefix_cache_hits <= pool.prefix_cache_queries, (
            f"prefix cache: {pool.prefix_cache_hits} hit tokens of {pool.prefix_cache_queries} looked up, "
            f"but the tenants' hits sum to {sum(by_tenant.values())} (invariant 9)")
        assert pool.prefix_cache_queries % bs == 0 and pool.prefix_cache_hits % bs == 0, (
            "prefix-cache counters must count whole blocks of tokens (invariant 9)")

    @abstractmethod
    def _check_table(self, seq: Sequence) -> None:
        """Invariant 5 for one live sequence: how its blocks must relate to its slots."""


class PagedKVCacheManager(KVCacheManager):
    """Blocks on demand: a sequence holds ceil(slots / block_size) blocks, shares cached prefixes
    and forks' blocks by reference, and may be preempted (swap or recompute) to make room."""

    def __init__(self, pool: BlockPool, swap: SwapSpace | None = None) -> None:
        super().__init__(pool, swap)
        # Full blocks this step's chunks will compute: hash -> (block, (parent hash, token ids,
        # extra key)), the same identity BlockPool.lookup checks; hits for later admissions.
        self._pending: dict[int, tuple[Block, tuple]] = {}

    def blocks_wanted(self, seq: Sequence) -> int:
        return -(-seq.num_tokens // self.block_size)

    def begin_step(self) -> None:
        self._pending.clear()

    def offer(self, seq: Sequence, start: int, num_tokens: int) -> None:
        if not self.pool.enable_prefix_caching:
            return
        bs = self.block_size
        first, end = start // bs, (start + num_tokens) // bs
        if end <= first:
            return
        hashes = seq.hashes_upto(end)
        for i in range(first, end):
            block = seq.block_table.blocks[i]
            if block.block_hash is None and hashes[i] not in self._pending:
                key = (hashes[i - 1] if i else None, tuple(seq.token_ids[i * bs:(i + 1) * bs]), seq.extra_key)
                self._pending[hashes[i]] = (block, key)

    def computed_blocks(self, seq: Sequence, budget: int) -> Admission:
        bs = self.block_size
        hits = self._cached_prefix(seq) if seq.num_computed_tokens == 0 else []
        start = len(hits) * bs if hits else seq.num_computed_tokens
        n = min(seq.num_tokens - start, budget)
        needed = -(-(start + n) // bs) - len(hits)
        return Admission(start, n, needed + sum(1 for b in hits if b.ref_count == 0),
                         needed + sum(1 for b in hits if seq.tenant not in b.owners), tuple(hits))

    def admit(self, seq: Sequence, admission: Admission, copies: list[tuple[int, int]],
              reserve: int = 0) -> bool:
        if not self.fits(admission.num_new_blocks, reserve):
            return False
        pool, bs, hits = self.pool, self.block_size, admission.hits
        if seq.miss is None:   # at its first admission, before its own allocations evict anything
            seq.miss = self.explain(seq, len(hits))
        pool.claimant = seq.request_id
        if pool.enable_prefix_caching and seq.num_computed_tokens == 0:
            # vLLM's prefix_cache_queries / _hits, in tokens; the last token is never looked up.
            pool.prefix_cache_queries += (seq.num_tokens - 1) // bs * bs
            pool.prefix_cache_hits += len(hits) * bs
            by_tenant = self.prefix_hits_by_tenant
            by_tenant[seq.tenant] = by_tenant.get(seq.tenant, 0) + len(hits) * bs
        if hits:
            seq.block_table.adopt(list(hits))
            seq.num_computed_tokens = admission.start
        seq.block_table.grow(admission.start + admission.num_tokens, copies)
        return True

    def _cached_prefix(self, seq: Sequence) -> list[Block]:
        """Cached blocks matching the sequence's leading full blocks, or blocks that this step
        computes for an earlier chunk; the last token is never a hit."""
        pool = self.pool
        if not pool.enable_prefix_caching:
            return []
        if getattr(seq.params, "prompt_logprobs", None) is not None and not seq.num_output_tokens:
            return []   # its prompt_logprobs need every prompt position's logits (as vLLM: recompute)
        bs = self.block_size
        hits = []
        parent = None
        for i, h in enumerate(seq.hashes_upto((seq.num_tokens - 1) // bs)):
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

    def publish(self, seq: Sequence) -> None:
        table = seq.block_table
        full = seq.num_computed_tokens // self.block_size
        if full <= table.num_published or not self.pool.enable_prefix_caching:
            return
        bs = self.block_size
        hashes = seq.hashes_upto(full)
        for i in range(table.num_published, full):
            # False when an equal block is already cached (computed twice concurrently): fine.
            self.pool.cache_block(table.blocks[i], hashes[i], hashes[i - 1] if i else None,
                                  seq.token_ids[i * bs:(i + 1) * bs], seq.extra_key)
        table.num_published = full

    def _check_table(self, seq: Sequence) -> None:
        table = seq.block_table
        assert len(table.blocks) == -(-table.num_slots // self.block_size), (
            f"{seq.request_id}: {len(table.blocks)} blocks for {table.num_slots} slots "
            f"(invariant 5: waste must stay under one block)")
