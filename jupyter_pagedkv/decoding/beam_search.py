"""Beam search over the paged cache: beams fork their parent's block table, pruned beams free at once.

`BeamSearch` holds one request's beam state and makes transformers' selection decisions (5.x
`_beam_search`): each step keeps the top `max(2, 1 + #eos) * B` continuations of all live beams by
summed log-probability; a continuation ending in EOS (or at the length limit) becomes a finished
hypothesis only if it ranks in the top B of those, scored `sum_logprob / generated_len **
length_penalty`; the best B unfinished continuations become the next beams. The engine turns the
decisions into block-table operations: a parent chosen k times is forked k - 1 times (ref counts,
copy-on-write of the shared partial block on the next write), a parent chosen 0 times is freed.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from ..core.sampling_params import BeamSearchParams, SamplingParams
from ..core.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from ..core.scheduler import Scheduler

# transformers' mask value: a candidate carrying it can never outrank a real one.
_MASK = -1.0e9


@dataclass
class BeamSequence:
    """One returned hypothesis: generated tokens (EOS included), text and length-penalised score."""

    token_ids: list[int]
    text: str
    score: float
    finish_reason: str = "length"


@dataclass
class BeamSearchOutput:
    """The result of one prompt's beam search; `sequences` are sorted best first."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSequence]

    @property
    def best(self) -> BeamSequence:
        return self.sequences[0]


class BeamSearch:
    """Selection state of one beam request: live beams' running scores and the B best finished."""

    def __init__(self, params: BeamSearchParams, prompt_len: int, eos_token_ids: set[int],
                 max_model_len: int) -> None:
        self.params = params
        self.width = params.beam_width
        self.eos = set() if params.ignore_eos else set(eos_token_ids)
        self.num_candidates = max(2, 1 + len(self.eos)) * self.width
        self.max_new_tokens = min(params.max_tokens, max_model_len - prompt_len)
        self.num_generated = 0
        # Selection state is small and read by the host every step: it lives there, and only the
        # top candidates of the device's logits come over (see select).
        self.running_scores = torch.zeros(1)  # host: of the live beams, best first
        self.finished_scores = torch.full((self.width,), _MASK)  # host: selection state
        self.finished_flags = torch.zeros(self.width, dtype=torch.bool)  # host: selection state
        self.finished_tokens: list[list[int] | None] = [None] * self.width
        self.improvable = True     # transformers' "early stop heuristic unsatisfied", sticky False
        self.done = False
        self.pending: dict[int, torch.Tensor] = {}               # seq_id -> logits row
        self.sequences: list[BeamSequence] = []

    @property
    def sampling_params(self) -> SamplingParams:
        """What the scheduler and the views see; tokens are chosen here, never by the sampler."""
        return SamplingParams(max_tokens=self.params.max_tokens, temperature=0.0,
                              ignore_eos=self.params.ignore_eos)

    def blocks_needed(self, prompt_len: int, block_size: int) -> int:
        """Worst case with no sharing at all: every beam private at full length."""
        return self.width * -(-(prompt_len + self.max_new_tokens) // block_size)

    @torch.no_grad()
    def select(self, logits: torch.Tensor, beam_tokens: list[list[int]]) -> list[tuple[int, int]]:
        """One step from the live beams' logits `[num_beams, vocab]` (best beam first).

        Records newly finished hypotheses and returns the next beams as (parent index, token),
        best first; empty once the search is done."""
        width, vocab = self.width, logits.shape[-1]
        running = self.running_scores.to(logits.device)[:, None]
        log_probs = torch.log_softmax(logits.float(), dim=-1) + running
        top_scores, top_index = torch.topk(log_probs.reshape(-1), self.num_candidates)
        top_scores, top_index = top_scores.cpu(), top_index.cpu()
        parents = (top_index // vocab).tolist()
        tokens = (top_index % vocab).tolist()
        gen = self.num_generated + 1
        at_limit = gen >= self.max_new_tokens
        hits = torch.tensor([at_limit or t in self.eos for t in tokens])  # host: selection state

        # Next live beams: the best B continuations that did not just finish.
        masked = top_scores + hits.to(torch.float32) * _MASK
        keep = torch.topk(masked, width).indices
        self.running_scores = masked[keep]

        # Finished hypotheses: only candidates in the top B may enter, and not once the set is
        # closed (early_stopping=True and full) or no running beam can improve on it any more.
        penalised = top_scores / (gen ** self.params.length_penalty)
        closed = bool(self.finished_flags.all()) and self.params.early_stopping is True
        penalised += float(closed) * _MASK
        penalised += float(not self.improvable) * _MASK
        just = hits & (torch.arange(self.num_candidates) < width)  # host: selection state
        penalised += (~just) * _MASK
        merged = torch.cat((self.finished_scores, penalised))
        best = torch.topk(merged, width).indices.tolist()
        flags = torch.cat((self.finished_flags, just))
        self.finished_tokens = [self.finished_tokens[i] if i < width else
                                (beam_tokens[parents[i - width]] + [tokens[i - width]]
                                 if just[i - width] else None) for i in best]
        self.finished_scores = merged[best]
        self.finished_flags = flags[best]
        self.num_generated = gen

        # transformers' stopping heuristic: can the best live beam still beat the worst finished?
        lp = self.params.length_penalty
        hypothetical = self.max_new_tokens if self.params.early_stopping == "never" and lp > 0 else gen
        best_running = self.running_scores[:1] / (hypothetical ** lp)
        worst = torch.where(self.finished_flags, self.finished_scores.min(), _MASK)
        self.improvable = self.improvable and bool((best_running > worst).any())
        self.done = (not self.improvable or bool(hits.all())
                     or (self.params.early_stopping is True and bool(self.finished_flags.all())))
        if self.done:
            return []
        return [(parents[i], tokens[i]) for i in keep.tolist()]

    def finalize(self, decode: Callable[[list[int]], str], live: list[Sequence]) -> None:
        """Fix the returned hypotheses; an aborted search returns its live beams instead."""
        if self.done:
            assert bool(self.finished_flags.all()), "a finished beam search returns B hypotheses"
            picked = zip(self.finished_tokens, self.finished_scores.tolist())
        else:
            gen = max(self.num_generated, 1) ** self.params.length_penalty
            picked = ((s.output_token_ids, score / gen)
                      for s, score in zip(live, self.running_scores.tolist()))
        self.sequences = [BeamSequence(list(ids), decode(ids), score,
                                       "stop" if ids and ids[-1] in self.eos else
                                       ("length" if self.done else "abort"))
                          for ids, score in picked]


def advance(beam: BeamSearch, live: list[Sequence], scheduler: Scheduler) -> list[Sequence]:
    """Run one selection once every live beam has its logits; returns the new live beams.

    Pruned beams free their blocks before survivors are forked, so a parent whose siblings all
    died writes its partial block in place instead of copying it."""
    if any(s.seq_id not in beam.pending for s in live):
        return live   # a sibling was not scheduled this step (budget, preemption): wait for it
    logits = torch.stack([beam.pending.pop(s.seq_id) for s in live])
    choices = beam.select(logits, [s.output_token_ids for s in live])
    if beam.done:
        for s in live:
            scheduler.finish(s, "stop")
        return live
    uses = Counter(parent for parent, _ in choices)
    for i, s in enumerate(live):
        if not uses[i]:
            scheduler.finish(s, "pruned")
    taken: set[int] = set()
    beams = []
    for parent, _ in choices:
        beams.append(live[parent] if parent not in taken else spawn(live[parent], scheduler))
        taken.add(parent)
    for seq, (_, token) in zip(beams, choices):
        seq.token_ids.append(token)
    return beams


def spawn(parent: Sequence, scheduler: Scheduler) -> Sequence:
    """A sibling of `parent` with the same tokens: a running parent's table is forked (blocks
    shared, ref counts +1); a waiting or swapped parent holds no device blocks, so the child
    starts empty and is recomputed (its prefix usually hits the cache)."""
    running = parent.status is SequenceStatus.RUNNING
    table = scheduler.kv.fork(parent) if running else scheduler.kv.new_table()
    child = Sequence(parent.request_id, list(parent.token_ids), parent.prompt_len, parent.params,
                     table, parent.arrival_time, parent.priority,
                     num_computed_tokens=parent.num_computed_tokens if running else 0,
                     num_cached_tokens=parent.num_cached_tokens, miss=parent.miss,
                     block_hashes=list(parent.block_hashes), extra_key=parent.extra_key,
                     tenant=parent.tenant)
    if running:
        scheduler.add_running(child)
    else:
        scheduler.add(child)
    return child
