"""BlockPool: the fixed set of physical KV blocks, their ref counts and the prefix cache.

Free blocks wait in a doubly linked queue threaded through the blocks themselves. Allocation
takes from the head; a block freed without a hash goes to the head (nothing worth keeping), a
block freed with a hash goes to the tail, so the least recently used cached prefix is evicted
first. A prefix-cache hit on a free block unlinks it from the middle of the queue in O(1). The pool
also keeps its block gauges (used, shared, cached, references) as counters updated on every
transition, so reading them is O(1) however large the pool is. Every reference is taken for an
owner (a tenant), and the pool counts the distinct blocks each owner holds (`num_held`): a block
two tenants reference counts for both, since either alone would need it. Fair share and quotas
read that count every step, so it is kept as a counter too. For "why did this prompt miss?"
(core/miss_report.py) the pool also keeps, at O(1) per transition, a bounded log of evicted
hashes (when, for whom), its cached hashes by parent (the chains a prompt can be compared with)
and how many cached blocks each salt holds.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import numpy as np


# Evicted hashes remembered for `why` (a few times any pool we run; the oldest are forgotten).
EVICTION_LOG_SIZE = 1 << 14


@dataclass(frozen=True, slots=True)
class Eviction:
    """A cached block's content was dropped: at which engine step, for whose allocation (a
    request id; "reset_prefix_cache()" when the cache was reset)."""

    step: int
    by: str | None
    block_id: int


class NoFreeBlocksError(RuntimeError):
    """The pool has no free block left; the scheduler answers this by preempting."""


def hash_block(parent_hash: int | None, token_ids: Sequence[int], extra_key: object = None) -> int:
    """Chain the parent's hash with this block's tokens, so equal hashes mean equal prefixes."""
    return hash((parent_hash, tuple(token_ids), extra_key))


@dataclass(slots=True, eq=False)
class Block:
    """One physical block of `block_size` KV slots."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    # What the hash covers, kept to verify hits (a hash collision must never serve wrong KV).
    parent_hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    extra_key: object = None
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)
    in_free_queue: bool = False
    # References per owner (a tenant's name, None for requests that name nobody): who holds it.
    owners: dict = field(default_factory=dict, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) push at either end, pop at the head, unlink anywhere."""

    def __init__(self) -> None:
        self._head = Block(-1)
        self._tail = Block(-2)
        self._head.next, self._tail.prev = self._tail, self._head
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Block]:
        node = self._head.next
        while node is not self._tail:
            yield node
            node = node.next

    def _link(self, block: Block, before: Block) -> None:
        assert not block.in_free_queue, f"block {block.block_id} is already free"
        prev = before.prev
        prev.next, block.prev, block.next, before.prev = block, prev, before, block
        block.in_free_queue = True
        self._len += 1

    def append(self, block: Block) -> None:
        self._link(block, self._tail)

    def appendleft(self, block: Block) -> None:
        self._link(block, self._head.next)

    def remove(self, block: Block) -> None:
        assert block.in_free_queue, f"block {block.block_id} is not free"
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        block.in_free_queue = False
        self._len -= 1

    def popleft(self) -> Block:
        if self._len == 0:
            raise NoFreeBlocksError("no free KV blocks")
        block = self._head.next
        self.remove(block)
        return block


class BlockPool:
    """Owns every physical block: allocation, ref counting, prefix-cache lookup and eviction."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue()
        for block in self.blocks:
            self.free_queue.append(block)
        self.cached: dict[int, Block] = {}
        # Counters in tokens, as vLLM's prefix_cache_queries / prefix_cache_hits.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_evictions = 0
        # Ids of blocks whose ref count or cached content changed since a monitor last drained
        # them (`drain_touched`), so a monitor's diff costs O(changes), not O(num_blocks).
        self.touched: set[int] = set()
        self.num_used = 0        # blocks with ref >= 1
        self.num_shared = 0      # blocks with ref >= 2
        self.num_refs = 0        # sum of ref counts: blocks the live tables would hold unshared
        self.num_cached = 0      # ref 0 but holding a reusable prefix
        self.held: Counter = Counter()          # owner -> distinct blocks it references
        self.held_shared: Counter = Counter()   # owner -> of those, blocks with ref >= 2
        # For `why` (core/miss_report.py): the manager says which step and request allocate.
        self.step = 0
        self.claimant: str | None = None
        self.evictions: OrderedDict[int, Eviction] = OrderedDict()
        self.children: dict[int | None, set[int]] = {}   # parent hash -> cached hashes under it
        self.salts: Counter = Counter()                  # extra key -> cached blocks salted with it

    # -- allocation -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (never filled, evicted, or cached with ref 0)."""
        return len(self.free_queue)

    def allocate(self, owner: object = None) -> Block:
        """Take the head of the free queue, evicting its cached prefix if it holds one."""
        return self._claim(self.free_queue.popleft(), owner)

    def allocate_many(self, n: int, owner: object = None) -> list[Block]:
        """`n` blocks, all or none: if an allocation fails part-way (a bug, Ctrl-C), the blocks
        taken so far go back before the error propagates, so no caller holds half a growth."""
        taken: list[Block] = []
        try:
            for _ in range(n):
                taken.append(self.allocate(owner))
        except BaseException:
            self.free_all(reversed(taken), owner)
            raise
        return taken

    def take(self, block_id: int, owner: object = None) -> Block:
        """Allocate one particular free block (the contiguous baseline places runs itself)."""
        block = self.blocks[block_id]
        self.free_queue.remove(block)
        return self._claim(block, owner)

    def num_held(self, owner: object) -> int:
        """Distinct blocks `owner` references (O(1))."""
        return self.held.get(owner, 0)

    def _own(self, block: Block, owner: object) -> None:
        n = block.owners.get(owner, 0)
        block.owners[owner] = n + 1
        if n == 0:
            self.held[owner] += 1

    def _disown(self, block: Block, owner: object) -> None:
        n = block.owners.get(owner, 0)
        assert n > 0, f"block {block.block_id} freed for {owner!r}, which holds no reference to it"
        if n == 1:
            del block.owners[owner]
            self.held[owner] -= 1
            if not self.held[owner]:
                del self.held[owner]
        else:
            block.owners[owner] = n - 1

    def _unshare(self, owner: object) -> None:
        self.held_shared[owner] -= 1
        if not self.held_shared[owner]:
            del self.held_shared[owner]

    def _claim(self, block: Block, owner: object) -> Block:
        """A block just out of the free queue gets its first reference (and loses its prefix)."""
        if block.block_hash is not None:
            self.num_cached -= 1
            self._evict(block)
        block.ref_count = 1
        self.num_used += 1
        self.num_refs += 1
        self._own(block, owner)
        self.touched.add(block.block_id)
        return block

    def incref(self, block: Block, owner: object = None) -> None:
        """Share a block (fork or prefix hit); a cached free block leaves the free queue."""
        before, joins = block.ref_count, owner not in block.owners
        if block.ref_count == 0:
            self.free_queue.remove(block)
            self.num_used += 1
            if block.block_hash is not None:
                self.num_cached -= 1
        elif block.ref_count == 1:
            self.num_shared += 1
        block.ref_count += 1
        self.num_refs += 1
        self._own(block, owner)
        if before == 1:            # now shared: by every owner it has
            for o in block.owners:
                self.held_shared[o] += 1
        elif before >= 2 and joins:
            self.held_shared[owner] += 1
        self.touched.add(block.block_id)

    def free(self, block: Block, owner: object = None) -> None:
        """Drop one reference; at zero the block becomes free but keeps its cached content."""
        assert block.ref_count > 0, f"double free of block {block.block_id}"
        if block.ref_count == 2:   # about to be unshared: for every owner it has
            for o in block.owners:
                self._unshare(o)
        elif block.ref_count > 2 and block.owners.get(owner) == 1:
            self._unshare(owner)
        self._disown(block, owner)
        block.ref_count -= 1
        self.num_refs -= 1
        self.touched.add(block.block_id)
        if block.ref_count == 1:
            self.num_shared -= 1
        elif block.ref_count == 0:
            self.num_used -= 1
            if block.block_hash is not None:
                self.num_cached += 1
                self.free_queue.append(block)
            else:
                self.free_queue.appendleft(block)

    def free_all(self, blocks: Iterable[Block], owner: object = None) -> None:
        """Free a sequence's blocks tail first, so its prefix is the last part to be evicted."""
        for block in reversed(list(blocks)):
            self.free(block, owner)

    # -- prefix cache -----------------------------------------------------------------------
    def lookup(self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int],
               extra_key: object = None) -> Block | None:
        """The cached block holding exactly this prefix block, or None."""
        block = self.cached.get(block_hash)
        if block is None or block.parent_hash != parent_hash or block.extra_key != extra_key:
            return None
        if block.token_ids != tuple(token_ids):
            return None
        return block

    def cache_block(self, block: Block, block_hash: int, parent_hash: int | None,
                    token_ids: Sequence[int], extra_key: object = None) -> bool:
        """Publish a full, computed block under its hash; False if an equal block already is."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False
        block.block_hash, block.parent_hash = block_hash, parent_hash
        block.token_ids, block.extra_key = tuple(token_ids), extra_key
        self.cached[block_hash] = block
        self.children.setdefault(parent_hash, set()).add(block_hash)
        self.salts[extra_key] += 1
        if block.ref_count == 0:
            self.num_cached += 1
        self.touched.add(block.block_id)
        return True

    def _evict(self, block: Block) -> None:
        self._log_eviction(block, self.claimant)
        self._uncache(block)
        self.num_evictions += 1

    def _uncache(self, block: Block) -> None:
        del self.cached[block.block_hash]
        siblings = self.children[block.parent_hash]
        siblings.discard(block.block_hash)
        if not siblings:
            del self.children[block.parent_hash]
        self.salts[block.extra_key] -= 1
        if not self.salts[block.extra_key]:
            del self.salts[block.extra_key]
        block.block_hash = block.parent_hash = block.token_ids = block.extra_key = None

    def _log_eviction(self, block: Block, by: str | None) -> None:
        log = self.evictions
        log[block.block_hash] = Eviction(self.step, by, block.block_id)
        log.move_to_end(block.block_hash)
        if len(log) > EVICTION_LOG_SIZE:
            log.popitem(last=False)

    def reset_cache(self) -> int:
        """Forget every cached prefix (blocks in use keep their KV); returns how many were dropped."""
        dropped = 0
        for block in list(self.cached.values()):
            self._log_eviction(block, "reset_prefix_cache()")
            self._uncache(block)
            self.touched.add(block.block_id)
            if block.ref_count == 0:
                # An unhashed free block belongs at the head of the queue.
                self.num_cached -= 1
                self.free_queue.remove(block)
                self.free_queue.appendleft(block)
            dropped += 1
        return dropped

    # -- views --------------------------------------------------------------------------------
    def drain_touched(self) -> set[int]:
        """The ids touched since the last drain (and forget them): what a monitor must re-read."""
        touched, self.touched = self.touched, set()
        return touched

    def ref_counts(self) -> np.ndarray:
        return np.fromiter((b.ref_count for b in self.blocks), dtype=np.int32, count=self.num_blocks)

    def hashed(self) -> np.ndarray:
        return np.fromiter((b.block_hash is not None for b in self.blocks), dtype=bool,
                           count=self.num_blocks)

    def check_invariants(self, expected_refs: Counter[int],
                         expected_owners: dict[object, Counter[int]] | None = None) -> None:
        """Invariants 1-3 (docs/design.md) and the gauge counters; `expected_refs` counts the
        block tables pointing at each block, `expected_owners` the same per owner."""
        free_ids = set()
        for block in self.free_queue:
            assert block.block_id not in free_ids, f"block {block.block_id} twice in the free queue"
            free_ids.add(block.block_id)
        assert len(free_ids) == len(self.free_queue), "free queue length is off"
        for block in self.blocks:
            want = expected_refs.get(block.block_id, 0)
            assert block.ref_count == want, (
                f"block {block.block_id}: ref_count {block.ref_count} but {want} tables point at it")
            assert (block.ref_count == 0) == (block.block_id in free_ids) == block.in_free_queue, (
                f"block {block.block_id}: ref_count {block.ref_count} but free-queue membership "
                f"{block.block_id in free_ids}")
        in_use = sum(1 for b in self.blocks if b.ref_count > 0)
        assert len(free_ids) + in_use == self.num_blocks, "free + in-use != num_blocks"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"block {block.block_id} cached under a stale hash"
            assert block.token_ids is not None and len(block.token_ids) == self.block_size, (
                f"block {block.block_id} is hashed but not full")
            assert hash_block(block.parent_hash, block.token_ids, block.extra_key) == block_hash, (
                f"block {block.block_id}: content does not match its hash")
        hashed = sum(1 for b in self.blocks if b.block_hash is not None)
        assert hashed == len(self.cached), "a block carries a hash that the cache does not index"
        by_parent: dict[int | None, set[int]] = {}
        for block_hash, block in self.cached.items():
            by_parent.setdefault(block.parent_hash, set()).add(block_hash)
        assert by_parent == self.children, "the cached hashes by parent disagree with the cache"
        assert Counter(b.extra_key for b in self.cached.values()) == self.salts, (
            f"cached blocks per salt {dict(self.salts)} disagree with the cache")
        refs = [b.ref_count for b in self.blocks]
        counted = (sum(r > 0 for r in refs), sum(r > 1 for r in refs), sum(refs),
                   sum(1 for b in self.blocks if b.ref_count == 0 and b.block_hash is not None))
        assert (self.num_used, self.num_shared, self.num_refs, self.num_cached) == counted, (
            f"gauge counters (used, shared, refs, cached) {(self.num_used, self.num_shared, self.num_refs, self.num_cached)} "
            f"but the blocks say {counted}")
        if expected_owners is not None:
            for block in self.blocks:
                want = {o: c[block.block_id] for o, c in expected_owners.items() if c[block.block_id]}
                assert block.owners == want, (
                    f"block {block.block_id}: references by owner {block.owners} but the tables say {want}")
            held = {o: len(c) for o, c in expected_owners.items() if c}
            assert dict(self.held) == held, f"blocks held per owner {dict(self.held)} but the tables say {held}"
            shared = {o: n for o, c in expected_owners.items()
                      if (n := sum(1 for b in c if self.blocks[b].ref_count > 1))}
            assert dict(self.held_shared) == shared, (
                f"shared blocks per owner {dict(self.held_shared)} but the tables say {shared}")
