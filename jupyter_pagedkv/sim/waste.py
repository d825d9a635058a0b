"""WasteMeter: where a pool's token slots went during a real run, split four ways.

"Contiguous reservation wastes memory" is the thesis; this measures it on a running `Engine`, the
same way for both allocators, so the two can be set side by side. After every step each slot of
the pool is in exactly one of five places:

* **stored**: holds a token's K and V;
* **reservation waste**: held by a sequence, empty now, filled later by a token it has yet to
  generate (the contiguous baseline reserves `prompt + max_tokens` up front; paging holds at most
  the rest of the current block);
* **internal waste**: held by a sequence and never filled, because it stopped (EOS, a stop string)
  before its reservation or its last block was full;
* **external waste**: free, while the request at the head of the queue is refused although enough
  blocks are free in total: the free space is split into runs too short for it, so none of it is
  usable (the queue is first come, first served: nothing behind the head is admitted either);
* **free**: free, and no admission is refused for want of adjacent blocks.

Which empty slots are reservation and which internal is known only once a sequence finishes, so
the meter keeps per-step counts per sequence and splits them in `breakdown()`. Steps are weighted
equally (not by their duration), which makes the figures deterministic for a deterministic run:
a notebook can check them. Sequences must not share blocks (prefix caching off, n = 1): a shared
block belongs to no one sequence, so the split would count it twice. Paging has no external waste by construction (any free block serves any
block table), and the meter measures that rather than assuming it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..protocol import StepObserver

FINISHED_KEPT = 1000                # the finished requests an engine keeps (`request_rows`)

CATEGORIES = ("stored", "reservation", "internal", "external", "free")


@dataclass(frozen=True)
class WasteBreakdown:
    """Mean token slots per engine step in each category; they sum to `capacity`."""

    label: str
    capacity: int               # slots in the pool (blocks x block size)
    num_steps: int
    stored: float
    reservation: float
    internal: float
    external: float
    free: float
    external_steps: int         # steps after which the head of the queue was refused for want of a run

    def fraction(self, category: str) -> float:
        """Share of the pool's slots in `category`, averaged over the run's steps."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown category {category!r}: choose one of {', '.join(CATEGORIES)}")
        return getattr(self, category) / self.capacity if self.capacity else float("nan")

    @property
    def held(self) -> float:
        """Slots held by sequences: stored + reservation + internal."""
        return self.stored + self.reservation + self.internal

    @property
    def utilisation(self) -> float:
        """Tokens stored / slots held: what `RunSummary.kv_utilisation` reports (step-weighted here)."""
        return self.stored / self.held if self.held else float("nan")


def refused_by_layout(engine: Any) -> bool:
    """Is the request at the head of `engine`'s queue refused although enough blocks are free in
    total (external fragmentation, now)? Always False under paging: any free block serves any table."""
    head = engine.queue_head()
    return head is not None and head.refused_by_layout


def describe_refusal(engine: Any) -> str:
    """One line on what the head of a contiguous engine's queue waits for and how the free blocks
    lie ("" when nothing waits, or under paging): the caption a picture of external fragmentation needs."""
    head = engine.queue_head()
    if head is None or head.free_runs is None:
        return ""
    runs = sorted(head.free_runs, reverse=True)
    if not runs:
        return f"{head.request_id} waits for {head.blocks_needed} adjacent blocks; none is free"
    lie = f"in runs of {', '.join(map(str, runs))}" if len(runs) > 1 else "in one run"
    return (f"{head.request_id} waits for {head.blocks_needed} adjacent blocks (prompt + max_tokens); "
            f"{head.free_blocks} blocks are free, {lie}")


@dataclass
class _SeqSample:
    """One sequence after one step: slots held (whole blocks) and slots holding KV."""

    key: tuple[str, int]
    held: int
    stored: int


@dataclass
class WasteMeter(StepObserver):
    """`with WasteMeter(engine) as meter: ...run...` then `meter.breakdown()`.

    Reads the engine's block tables (`block_tables()`, one copy under its lock) between steps
    through its step-listener hook (the one `PoolRecorder` uses), and each sequence's final length
    from the engine's finished requests (`request_rows`) once the run is over."""

    engine: Any
    label: str = ""
    _samples: list[list[_SeqSample]] = field(default_factory=list)
    _free: list[tuple[int, bool]] = field(default_factory=list)     # (free slots, head refused by layout)
    _seen: dict[tuple[str, int], None] = field(default_factory=dict)    # every sequence, in order
    _final: dict[str, int] | None = None                              # its tokens once finished
    _block_size: int = field(init=False)
    _num_blocks: int = field(init=False)
    admitted_at: dict[tuple[str, int], int] = field(default_factory=dict)
    """Per sequence, the first recorded step (1-based, of this recording) after which it held blocks:
    waiting time counted in engine steps, which a deterministic run repeats exactly."""

    def __post_init__(self) -> None:
        self.label = self.label or getattr(getattr(self.engine, "config", None), "allocator", "paged")
        info = self.engine.info()               # the pool's geometry is fixed: read it once
        self._block_size, self._num_blocks = info.block_size, info.num_blocks

    def _on_step(self) -> None:
        bs = self._block_size
        step: list[_SeqSample] = []
        held: list[int] = []
        for seq in self.engine.block_tables():
            key = (seq.request_id, seq.sample_index)
            self._seen[key] = None
            if seq.block_ids:
                self.admitted_at.setdefault(key, len(self._samples) + 1)
            step.append(_SeqSample(key, len(seq.block_ids) * bs, seq.num_slots))
            held.extend(seq.block_ids)
        if len(held) != len(set(held)):           # a block in two tables: shared
            raise RuntimeError("WasteMeter splits slots per sequence, so it needs an unshared pool: build "
                               "the engine with enable_prefix_caching=False and run n=1 requests")
        self._samples.append(step)
        # Ref-0 blocks (free or cached) are free here: the allocator may hand any of them out.
        free_blocks = self._num_blocks - len(held)
        self._free.append((free_blocks * bs, refused_by_layout(self.engine)))

    def final_kv_tokens(self, key: tuple[str, int]) -> int:
        """Slots a sequence fills over its whole life: every token but the last one sampled (its
        K and V would only be written by the step after, which never comes)."""
        return self._final_lengths()[key[0]] - 1

    def _final_lengths(self) -> dict[str, int]:
        """Prompt plus generated tokens of every request seen, read once after the run (n = 1, so
        a request is its one sequence)."""
        if self._final is None:
            seen = {rid for rid, _ in self._seen}
            rows = [r for r in self.engine.request_rows(finished=FINISHED_KEPT) if r.request_id in seen]
            unfinished = [r.request_id for r in rows if not r.finished]
            if unfinished:
                raise RuntimeError(f"{len(unfinished)} sequences are still running ({unfinished[0]}, ...): "
                                   "call breakdown() after the run, when every final length is known")
            final = {r.request_id: r.prompt_tokens + r.output_tokens for r in rows}
            if seen - final.keys():
                raise RuntimeError(f"the engine keeps its last {FINISHED_KEPT} finished requests and this run "
                                   f"had {len(seen)}: record a shorter run")
            self._final = final
        return self._final

    def breakdown(self) -> WasteBreakdown:
        """Split every recorded step's slots four ways (plus free); call after the run ends."""
        if not self._samples:
            raise RuntimeError("nothing recorded: run requests inside `with WasteMeter(engine):`")
        self._final = None                  # a breakdown reads the final lengths afresh
        capacity = self._num_blocks * self._block_size
        totals = dict.fromkeys(CATEGORIES, 0)
        for step, (free, refused) in zip(self._samples, self._free):
            for s in step:
                final = self.final_kv_tokens(s.key)
                totals["stored"] += s.stored
                totals["reservation"] += max(0, min(s.held, final) - s.stored)
                totals["internal"] += s.held - max(s.stored, min(s.held, final))
            totals["external" if refused else "free"] += free
        n = len(self._samples)
        b = WasteBreakdown(self.label, capacity, n, *(totals[c] / n for c in CATEGORIES),
                           external_steps=sum(r for _, r in self._free))
        held = sum(s.held for step in self._samples for s in step) / n
        assert abs(b.stored + b.reservation + b.internal - held) < 1e-6, "categories do not cover the held slots"
        assert abs(sum(getattr(b, c) for c in CATEGORIES) - capacity) < 1e-6 * max(1, capacity), (
            "held + free slots do not add up to the pool: a block is counted twice or not at all")
        return b
