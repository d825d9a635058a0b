"""frames: one instant of a paged (or contiguous) pool, read off a real engine between steps.

A `PagingFrame` holds every physical block's state and ref count and every live sequence's block
table (physical ids in logical order, slots filled): what a teaching figure draws, so figures can
never drift from what the allocator did. `capture` reads one now; `FrameAt` keeps one from inside
a run that something else drives.

`capture` takes the pool from `pool_snapshot()` and the block tables from `block_tables()`, two
`EngineClient` views each copied under the engine's lock. The two are checked against each other,
so a capture that raced a step is refused, not drawn.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..protocol import StepObserver


@dataclass(frozen=True)
class SeqTable:
    """One sequence's block table at one instant: physical block ids in logical order."""

    label: str                  # the request id, or "B #1" for sample 1 of an n > 1 request B
    request_id: str
    state: str                  # running, waiting, preempted (waiting to recompute), swapped
    block_ids: tuple[int, ...]
    num_tokens: int             # slots holding KV: token positions 0 .. num_tokens - 1

    def fill(self, i: int, block_size: int) -> int:
        """Tokens stored in logical block `i` (0 for a reserved block not reached yet)."""
        return max(0, min(block_size, self.num_tokens - i * block_size))


@dataclass(frozen=True)
class PagingFrame:
    """The pool and every live block table at one instant, with what the story calls it."""

    stage: str
    note: str
    step: int
    block_size: int
    states: tuple[str, ...]
    ref_counts: tuple[int, ...]
    tables: tuple[SeqTable, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.states)

    def block_fill(self) -> list[int]:
        """Tokens each physical block holds: the most any table stores in it (a shared block holds
        its tokens once); a cached block is full by construction, a free one holds nothing."""
        fill = [self.block_size if s == "cached" else 0 for s in self.states]
        for t in self.tables:
            for i, b in enumerate(t.block_ids):
                fill[b] = max(fill[b], t.fill(i, self.block_size))
        return fill


def capture(engine: Any, stage: str = "", note: str = "") -> PagingFrame:
    """Read one frame off `engine` (an `Engine`), between steps: call it from the cell that steps,
    not while a background loop runs, or the tables and the snapshot may describe two instants."""
    snap = engine.pool_snapshot()
    tables = [SeqTable(s.request_id if s.num_samples == 1 else f"{s.request_id} #{s.sample_index}",
                       s.request_id, s.state, s.block_ids, s.num_slots) for s in engine.block_tables()]
    refs = [0] * snap["num_blocks"]
    for t in tables:
        for b in t.block_ids:
            refs[b] += 1
            if t.request_id not in snap["owners"].get(b, ()):
                raise RuntimeError(f"block {b} of {t.label} is not in the snapshot's owners: capture "
                                   "between steps, with the background loop stopped")
    if refs != list(snap["ref_counts"]):
        raise RuntimeError("block tables and pool ref counts disagree: capture between steps")
    engine.check_invariants()           # a frame of a broken pool would teach the wrong thing
    return PagingFrame(stage, note, engine.stats().num_steps, snap["block_size"], tuple(snap["states"]),
                       tuple(snap["ref_counts"]), tuple(tables))


class FrameAt(StepObserver):
    """`with FrameAt(engine, step=k) as at: ...run...` keeps `at.frame`, the frame after step k (the
    engine's step count), or after the first step where `when(engine)` holds: a picture of one
    moment of a run that something else drives (`serve`, `generate`), taken between its steps.
    `note` may be a function of the engine, read at that moment (what the picture cannot show,
    such as what the head of the queue is waiting for)."""

    def __init__(self, engine: Any, step: int | None = None, when=None, stage: str = "", note="") -> None:
        if (step is None) == (when is None):
            raise ValueError("give FrameAt either step= (the engine's step count) or when= (a predicate)")
        self.engine, self.step, self.when, self.stage, self.note = engine, step, when, stage, note
        self.frame: PagingFrame | None = None

    def _on_step(self) -> None:
        if self.frame is not None:
            return
        hit = (self.engine.stats().num_steps == self.step) if self.when is None else self.when(self.engine)
        if hit:
            note = self.note(self.engine) if callable(self.note) else self.note
            self.frame = capture(self.engine, self.stage, note)
