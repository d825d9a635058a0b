"""The engine's invariants (docs/design.md, "Invariants"), checked over the pool, the scheduler's
sequences and the swap space. `Engine.check_invariants()` calls this under the engine's lock;
tests call it after every engine they touch."""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from .sequence import SequenceStatus

if TYPE_CHECKING:
    from .scheduler import Scheduler
    from .swap_space import SwapSpace


def check_invariants(scheduler: Scheduler, swap: SwapSpace | None = None) -> None:
    """Assert invariants 1-8; an AssertionError names the sequence or block that breaks one."""
    pool, arena = scheduler.pool, scheduler.arena
    bs = pool.block_size
    expected: Counter[int] = Counter()
    owners: dict[object, Counter[int]] = {}
    live = scheduler.live
    for seq in live:
        table = seq.block_table
        assert table.owner == seq.tenant, f"{seq.request_id}: table owned by {table.owner!r}, not {seq.tenant!r}"
        expected.update(b.block_id for b in table.blocks)
        owners.setdefault(seq.tenant, Counter()).update(b.block_id for b in table.blocks)
        if arena is None:
            assert len(table.blocks) == -(-table.num_slots // bs), (
                f"{seq.request_id}: {len(table.blocks)} blocks for {table.num_slots} slots "
                f"(invariant 5: waste must stay under one block)")
        elif table.blocks:   # the baseline holds its whole reservation, in one run
            want = -(-scheduler.reservation(seq) // bs)
            ids = [b.block_id for b in table.blocks]
            assert ids == list(range(ids[0], ids[0] + want)), (
                f"{seq.request_id}: contiguous reservation {ids[0]}.. is not {want} adjacent blocks")
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
    pool.check_invariants(expected, owners)  # invariants 1-3, the gauge and per-tenant counters
    for name, spec in scheduler.tenancy.specs.items():
        if spec.max_blocks is not None:
            assert pool.num_held(name) <= spec.max_blocks, (
                f"tenant {name!r} holds {pool.num_held(name)} blocks, over its max_blocks "
                f"{spec.max_blocks} (invariant 8)")
    if arena is not None:
        arena.check_invariants()
    if swap is not None:
        held = [slot for seq in scheduler.swapped for slot in seq.swap_slots]
        assert len(held) == len(set(held)) == swap.num_used, (
            f"swap space: {swap.num_used} slots in use but swapped sequences hold {len(held)} "
            f"(invariant 6)")
    for seq in scheduler.swapped:
        assert not seq.block_table.blocks and seq.swap_slots, (
            f"{seq.request_id}: swapped but holds device blocks or no host slots (invariant 6)")
    if not live:
        assert pool.num_used == 0, "blocks referenced with no request (invariant 4)"
