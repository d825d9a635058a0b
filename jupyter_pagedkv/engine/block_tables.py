"""SeqBlocks: one live sequence's block table as a front end may see it, copied under the engine's
lock so a figure or a meter never reads a `Sequence` that the stepping thread is changing."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from .request import Request


@dataclass(frozen=True, slots=True)
class SeqBlocks:
    """Physical block ids in logical order, and how many of their slots hold KV, at one instant."""

    request_id: str
    sample_index: int             # which of the request's samples (0 for n=1)
    num_samples: int              # the request's sequences, finished ones too (n, or the beam width)
    state: str                    # running, waiting, preempted (waiting to recompute) or swapped
    block_ids: tuple[int, ...]
    num_slots: int                # slots holding KV: token positions 0 .. num_slots - 1
    num_tokens: int               # the sequence's tokens, prompt and generated
    tenant: str | None = None


def block_tables(requests: Iterable[Request]) -> list[SeqBlocks]:
    """Every unfinished sequence of `requests`, in their order; the caller holds the engine's lock."""
    rows = []
    for req in requests:
        for seq in req.seqs:
            if seq.is_finished:
                continue
            state = seq.status.value
            if state == "waiting" and seq.num_preemptions:
                state = "preempted"
            table = seq.block_table
            rows.append(SeqBlocks(req.request_id, seq.sample_index, len(req.seqs), state, tuple(table.block_ids),
                                  table.num_slots, seq.num_tokens, req.tenant))
    return rows
