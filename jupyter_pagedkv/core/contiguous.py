"""ContiguousArena: the pre-paging baseline — one contiguous reservation per request, first fit.

Each admitted request reserves room for `prompt_len + max_tokens` tokens as one run of adjacent
blocks of the same BlockPool, so the model, the attention path and the scheduler stay exactly the
ones paging uses; only memory management differs. All three kinds of fragmentation happen for
real: *reservation* (slots held for tokens not generated yet), *internal* (slots never filled
because the request stopped before `max_tokens`) and *external* (free blocks split into gaps too
short for the next reservation, so it waits although enough blocks are free in total).

The arena is granular to whole blocks so the KV layout stays block-addressed; the rounding adds
less than one block per request, which is negligible next to the reservation itself.
`ContiguousKVCacheManager` puts the arena behind the scheduler's door (core/kv_cache_manager.py),
so the scheduler runs the baseline without knowing it is one.

Free space is kept as a sorted list of extents `(start, length)`; first fit scans it in order and
a release merges with both neighbours, so both are O(number of extents), which stays small (at
most one more than the number of live reservations).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from typing import TYPE_CHECKING

from .block_pool import BlockPool
from .block_table import BlockTable
from .kv_cache_manager import Admission, KVCacheManager

if TYPE_CHECKING:
    from .sequence import Sequence
    from .swap_space import SwapSpace


@dataclass(frozen=True, slots=True)
class Fragmentation:
    """How the arena's free space lies: `largest_extent` < a request's need while `num_free` is
    not means external fragmentation is what refuses it."""

    num_free: int
    largest_extent: int
    num_extents: int


class ContiguousArena:
    """First-fit allocator of runs of adjacent blocks over a BlockPool (no sharing, no caching)."""

    def __init__(self, pool: BlockPool) -> None:
        if pool.enable_prefix_caching:
            raise ValueError("the contiguous baseline cannot share blocks: build its BlockPool "
                             "with enable_prefix_caching=False")
        self.pool = pool
        self._starts: list[int] = [0]
        self._lengths: list[int] = [pool.num_blocks]
        self.num_refused = 0            # reservations that found no run long enough
        self.num_refused_external = 0   # ... although enough blocks were free in total

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.pool.block_size)

    def find(self, num_blocks: int) -> int | None:
        """Start of the first free run of at least `num_blocks` blocks, or None."""
        for start, length in zip(self._starts, self._lengths):
            if length >= num_blocks:
                return start
        return None

    def reserve(self, table: BlockTable, num_tokens: int) -> bool:
        """Give an empty table a contiguous run for `num_tokens` tokens; False (nothing taken) if
        no free run is long enough."""
        assert not table.blocks, "reserve() needs an empty table"
        need = self.blocks_for(num_tokens)
        start = self.find(need)
        if start is None:
            self.num_refused += 1
            if need <= self.pool.num_free:
                self.num_refused_external += 1
            return False
        i = bisect.bisect_left(self._starts, start)
        if self._lengths[i] == need:
            del self._starts[i], self._lengths[i]
        else:
            self._starts[i] += need
            self._lengths[i] -= need
        table.blocks = [self.pool.take(b, table.owner) for b in range(start, start + need)]
        return True

    def release(self, table: BlockTable) -> None:
        """Return a table's run to the arena (then free it in the pool), merging neighbour gaps."""
        if table.blocks:
            start, length = table.blocks[0].block_id, len(table.blocks)
            assert table.blocks[-1].block_id == start + length - 1, "a contiguous table is not contiguous"
            i = bisect.bisect_left(self._starts, start)
            if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start:
                i -= 1
                self._lengths[i] += length
            else:
                self._starts.insert(i, start)
                self._lengths.insert(i, length)
            if i + 1 < len(self._starts) and self._starts[i] + self._lengths[i] == self._starts[i + 1]:
                self._lengths[i] += self._lengths[i + 1]
                del self._starts[i + 1], self._lengths[i + 1]
        table.free()

    def free_runs(self) -> list[int]:
        """Lengths of the free runs, in block order."""
        return list(self._lengths)

    def fragmentation(self) -> Fragmentation:
        return Fragmentation(sum(self._lengths), max(self._lengths, default=0), len(self._lengths))

    def check_invariants(self) -> None:
        """Extents are sorted, disjoint, non-adjacent and cover exactly the pool's free blocks."""
        free = set()
        end = -1
        for start, length in zip(self._starts, self._lengths):
            assert length > 0 and start > end, "arena extents overlap, touch or are empty"
            end = start + length
            free.update(range(start, end))
        pool_free = {b.block_id for b in self.pool.blocks if b.ref_count == 0}
        assert free == pool_free, (f"arena thinks {len(free)} blocks are free, the pool has "
                                   f"{len(pool_free)}")


class ContiguousKVCacheManager(KVCacheManager):
    """The baseline behind the manager's interface: admission reserves `prompt_len + max_tokens`
    tokens (capped at `max_model_len`) as one run, growth stays inside it, nothing is shared or
    cached, and nothing is ever preempted to make room (the run already holds every slot)."""

    preempts = False

    def __init__(self, pool: BlockPool, max_model_len: int | None = None,
                 swap: SwapSpace | None = None) -> None:
        super().__init__(pool, swap)
        self.arena = ContiguousArena(pool)
        self.max_model_len = max_model_len

    def reservation(self, seq: Sequence) -> int:
        """Tokens reserved: the whole prompt plus every token it may generate."""
        want = seq.prompt_len + seq.params.max_tokens
        return min(want, self.max_model_len) if self.max_model_len else want

    def blocks_wanted(self, seq: Sequence) -> int:
        return self.arena.blocks_for(self.reservation(seq))

    def free_runs(self) -> tuple[int, ...]:
        return tuple(self.arena.free_runs())

    def refusals(self) -> tuple[int, int]:
        return self.arena.num_refused, self.arena.num_refused_external

    def computed_blocks(self, seq: Sequence, budget: int) -> Admission:
        start = seq.num_computed_tokens
        need = self.blocks_wanted(seq)
        return Admission(start, min(seq.num_tokens - start, budget), need, need)

    def admit(self, seq: Sequence, admission: Admission, copies: list[tuple[int, int]],
              reserve: int = 0) -> bool:
        """A run either exists or not: the watermark (`reserve`) protects no growth here."""
        if not self.arena.reserve(seq.block_table, self.reservation(seq)):
            return False
        seq.block_table.grow(admission.start + admission.num_tokens, copies)   # inside the run
        if seq.miss is None:
            seq.miss = self.explain(seq, 0)   # every block: caching off (the baseline shares nothing)
        return True

    def roll_back(self, seq: Sequence, num_slots: int) -> None:
        """Rejected drafts give their slots back to the run, never blocks to the pool."""
        table = seq.block_table
        assert num_slots <= table.num_slots, "rollback cannot grow a table"
        table.num_slots = num_slots

    def _release(self, table: BlockTable) -> None:
        self.arena.release(table)

    def swap_out(self, seq: Sequence) -> None:
        """Never: the baseline preempts only by recompute (and only when a cap is lowered)."""
        return None

    def check_invariants(self, live: list[Sequence]) -> None:
        """The common invariants, then the arena's own: its extents are the pool's free blocks."""
        super().check_invariants(live)
        self.arena.check_invariants()

    def _check_table(self, seq: Sequence) -> None:
        ids = seq.block_table.block_ids
        if ids:   # the baseline holds its whole reservation, in one run
            want = self.blocks_wanted(seq)
            assert ids == list(range(ids[0], ids[0] + want)), (
                f"{seq.request_id}: contiguous reservation {ids[0]}.. is not {want} adjacent blocks")
