"""Sequence: the tokens of one generation stream, how many have KV, and where that KV lives."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .block_pool import hash_block
from .block_table import BlockTable

if TYPE_CHECKING:
    import torch

    from .miss_report import MissReport
    from .sampling_params import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # not admitted yet, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"      # preempted by swap: its KV waits in host memory
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One stream of tokens; `token_ids[:num_computed_tokens]` have their KV in the cache."""

    request_id: str
    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    block_table: BlockTable
    arrival_time: float
    priority: int = 0
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int | None = None   # prefix hit at first admission
    miss: MissReport | None = None         # why each prompt block hit or not, at first admission
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    # Structured outputs: the grammar matcher of this stream (decoding/grammar.GrammarState), which
    # has accepted exactly its output tokens; it forks with n and stays through preemption.
    grammar: object = None
    # Chained hashes of the full blocks of token_ids, extended lazily; valid across preemption.
    block_hashes: list[int] = field(default_factory=list)
    text: str = ""
    extra_key: object = None   # salts the block hash chain: ("tenant", name) under prefix_cache_scope="tenant"
    tenant: str | None = None  # who the request belongs to (None: nobody named)
    sample_index: int = 0   # which of a request's n samples this is
    width: int = 1          # sequences it becomes at its first token: n samples, or beam_width beams
    swap_slots: list[int] = field(default_factory=list)   # host slots, in block-table order
    swapped_num_slots: int = 0                           # table.num_slots when swapped out

    def __post_init__(self) -> None:
        table = self.block_table
        if table.owner != self.tenant:   # a fresh table: its references are taken for our tenant
            assert not table.blocks, f"{self.request_id}: a table of tenant {table.owner!r} given to {self.tenant!r}"
            table.owner = self.tenant

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def seats(self) -> int:
        """Running slots (of `max_num_seqs`) this sequence takes once it runs: an n-sample or beam
        request that has not forked yet will be n (beam_width) sequences at its first token, and
        vLLM counts each of them, so admission reserves them all."""
        if self.num_output_tokens or self.sample_index:
            return 1
        return self.width

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def hashes_upto(self, num_blocks: int) -> list[int]:
        """Hashes of the first `num_blocks` full blocks (computed once, then reused)."""
        bs = self.block_table.pool.block_size
        hashes = self.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, self.token_ids[i * bs:(i + 1) * bs], self.extra_key))
        return hashes[:num_blocks]
