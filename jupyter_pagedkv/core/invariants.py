"""The engine's invariants (docs/design.md, "Invariants"), checked over the scheduler's sequences
and the memory their KV-cache manager owns (pool, block tables, swap space, prefix-cache counts).
`Engine.check_invariants()` calls this under the engine's lock; tests call it after every engine
they touch."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .scheduler import Scheduler
    from .swap_space import SwapSpace


def check_invariants(scheduler: Scheduler, swap: SwapSpace | None = None) -> None:
    """Assert invariants 1-10; an AssertionError names the sequence or block that breaks one.
    `swap`, when given, must be the swap space the scheduler's manager owns."""
    kv = scheduler.kv
    assert swap is None or swap is kv.swap, "the engine's swap space is not its KV-cache manager's"
    live = scheduler.live
    kv.check_invariants(live)   # invariants 1-3, 5-7, 9 (and 10 for the contiguous baseline)
    for name, spec in scheduler.tenancy.specs.items():
        if spec.max_blocks is not None:
            assert kv.num_held(name) <= spec.max_blocks, (
                f"tenant {name!r} holds {kv.num_held(name)} blocks, over its max_blocks "
                f"{spec.max_blocks} (invariant 8)")
    if not live:
        assert kv.pool.num_used == 0, "blocks referenced with no request (invariant 4)"
