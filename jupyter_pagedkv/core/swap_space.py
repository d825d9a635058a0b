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

    def check_invariants(self, held: list[int]) -> None:
        """Invariant 6: `held` (every slot swapped sequences hold) and the free list are each
        without repeats, and together they are every slot exactly once."""
        free, taken = set(self._free), set(held)
        assert len(free) == len(self._free), "swap space: a slot is on the free list twice (invariant 6)"
        assert len(taken) == len(held), "swap space: two swapped sequences hold one slot (invariant 6)"
        assert not free & taken and free | taken == set(range(self.num_slots)), (
                f"swap space: slots {sorted(free & taken)[:5]} both free and held, or "
                f"{self.num_slots - len(free | taken)} neither (invariant 6)")
