"""BlockTable: one sequence's logical-to-physical block map, with fork, copy-on-write and rollback."""
from __future__ import annotations

import numpy as np

from .block_pool import Block, BlockPool, NoFreeBlocksError


class BlockTable:
    """Maps token position p to slot `blocks[p // block_size].block_id * block_size + p % block_size`.

    `num_slots` counts the positions that own a slot; only the last block may be partly filled,
    so a sequence wastes fewer than `block_size` slots.

    The block ids are also kept as an int32 array (`ids`), updated as the table grows, so a step
    stages each sequence's row with one copy instead of walking its blocks: at 32k tokens in
    blocks of 16 that walk is 2,048 Python steps per sequence per step.
    """

    __slots__ = ("pool", "_blocks", "_ids", "num_slots", "num_published", "owner")

    def __init__(self, pool: BlockPool, owner: object = None) -> None:
        self.pool = pool
        self.owner = owner   # the tenant every reference of this table is taken for
        self._blocks: list[Block] = []
        self._ids: np.ndarray | None = None   # [:len(blocks)] mirrors the ids; None: rebuild when read
        self.num_slots = 0
        self.num_published = 0   # leading blocks already offered to the prefix cache

    @property
    def blocks(self) -> list[Block]:
        return self._blocks

    @blocks.setter
    def blocks(self, blocks: list[Block]) -> None:
        self._blocks, self._ids = blocks, None

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self._blocks]

    def ids(self) -> np.ndarray:
        """The block ids as an int32 array view, valid until the table next changes (copy it to
        keep it)."""
        n = len(self._blocks)
        if self._ids is None or len(self._ids) < n:
            ids = np.empty(max(16, 2 * n), dtype=np.int32)
            ids[:n] = [b.block_id for b in self._blocks]
            self._ids = ids
        return self._ids[:n]

    def blocks_needed(self, num_slots: int) -> int:
        """New blocks (copy-on-write included) that growing to `num_slots` would take."""
        bs = self.pool.block_size
        extra = max(0, -(-num_slots // bs) - len(self._blocks))
        if num_slots > self.num_slots and self._last_block_is_shared():
            extra += 1
        return extra

    def _last_block_is_shared(self) -> bool:
        return bool(self._blocks) and self.num_slots % self.pool.block_size != 0 \
            and self._blocks[-1].ref_count > 1

    def extend_in_place(self, num_slots: int) -> bool:
        """Own slots up to `num_slots` if the blocks held already have room for them and the last
        is not shared (the common decode step: nothing allocated, nothing copied); False, nothing
        changed, when growing takes a new block or a copy (`grow`)."""
        if num_slots <= self.num_slots:
            return True
        if num_slots > len(self._blocks) * self.pool.block_size or self._last_block_is_shared():
            return False
        self.num_slots = num_slots
        return True

    def grow(self, num_slots: int, copies: list[tuple[int, int]]) -> None:
        """Own slots up to `num_slots`; a shared, partly filled last block is copied first.

        Appends (src, dst) block copies the KV cache must perform before the next write.
        Raises NoFreeBlocksError without changing anything if the pool runs dry, and changes
        nothing either when an allocation fails part-way (BlockPool.allocate_many).
        """
        if self.extend_in_place(num_slots):
            return
        if self.blocks_needed(num_slots) > self.pool.num_free:
            raise NoFreeBlocksError("no free KV blocks")
        fresh = self.pool.allocate_many(self.blocks_needed(num_slots), self.owner)
        if self._last_block_is_shared():
            old, self._blocks[-1] = self._blocks[-1], fresh.pop(0)
            copies.append((old.block_id, self._blocks[-1].block_id))
            self.pool.free(old, self.owner)
            if self._ids is not None:
                self._ids[len(self._blocks) - 1] = self._blocks[-1].block_id
        start = len(self._blocks)
        self._blocks.extend(fresh)
        if self._ids is not None:
            if len(self._ids) < len(self._blocks):
                self._ids = None             # rebuilt, twice as wide, when next read
            else:
                self._ids[start:len(self._blocks)] = [b.block_id for b in fresh]
        self.num_slots = num_slots

    def adopt(self, cached: list[Block]) -> None:
        """Start an empty table from prefix-cache hits (each gets one more reference)."""
        assert not self._blocks, "adopt() needs an empty table"
        for block in cached:
            self.pool.incref(block, self.owner)
        self.blocks = list(cached)
        self.num_slots = len(cached) * self.pool.block_size
        self.num_published = len(cached)

    def slot(self, position: int) -> int:
        bs = self.pool.block_size
        return self._blocks[position // bs].block_id * bs + position % bs

    def fork(self) -> BlockTable:
        """A child that shares every block (ref count +1); writes later copy on demand."""
        child = BlockTable(self.pool, self.owner)
        for block in self._blocks:
            self.pool.incref(block, self.owner)
        child.blocks = list(self._blocks)
        child.num_slots = self.num_slots
        child.num_published = self.num_published
        return child

    def rollback(self, num_slots: int) -> None:
        """Drop slots from `num_slots` on (rejected draft tokens); emptied blocks return at once."""
        assert num_slots <= self.num_slots, "rollback cannot grow a table"
        keep = -(-num_slots // self.pool.block_size)
        self.pool.free_all(self._blocks[keep:], self.owner)
        del self._blocks[keep:]
        self.num_slots = num_slots
        self.num_published = min(self.num_published, num_slots // self.pool.block_size)

    def free(self) -> None:
        """Return every block to the pool (cached content survives until reused)."""
        self.pool.free_all(self._blocks, self.owner)
        self.blocks = []
        self.num_slots = 0
        self.num_published = 0
