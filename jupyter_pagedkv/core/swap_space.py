"""SwapSpace: slots of host memory, one KV block each, for swap preemption."""
from __future__ import annotations


class SwapSpace:
    """A free list of host block slots; a swapped-out sequence holds one slot per block it had."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """`n` slots, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, slots: list[int]) -> None:
        self._free.extend(reversed(slots))
