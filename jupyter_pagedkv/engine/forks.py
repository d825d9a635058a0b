"""Where one sequence becomes several: the n samples of a request fork at their first token,
and beams fork (or are pruned) at every selection. Forks share their parent's blocks (ref counts
+1); the first write into a shared, partly filled block copies it."""
from __future__ import annotations

import torch

from ..core.scheduler import Scheduler
from ..core.sequence import Sequence
from ..decoding.beam_search import advance
from .request import Request


def fork_samples(req: Request, seq: Sequence, scheduler: Scheduler) -> list[Sequence]:
    """`[seq]`, or for the first sample of an n > 1 request, seq plus n - 1 forks of it: the n
    samples share the prompt's blocks and draw from the same logits row."""
    n = seq.params.n
    if n == 1 or len(req.seqs) > 1 or seq.num_output_tokens:
        return [seq]
    for i in range(1, n):
        child = Sequence(seq.request_id, list(seq.token_ids), seq.prompt_len, seq.params,
                         scheduler.kv.fork(seq), seq.arrival_time, seq.priority,
                         num_computed_tokens=seq.num_computed_tokens,
                         num_cached_tokens=seq.num_cached_tokens, miss=seq.miss,
                         block_hashes=list(seq.block_hashes), extra_key=seq.extra_key, tenant=seq.tenant)
        child.sample_index = i
        if seq.grammar is not None:   # the samples part here: each gets its own parse state
            child.grammar = seq.grammar.fork()
        if seq.params.seed is not None:
            # Sample i of seed s is reproducible on its own, whatever else runs.
            child.generator = torch.Generator(device=seq.generator.device).manual_seed(
                hash((seq.params.seed, i)) & (2**63 - 1))
        scheduler.add_running(child)
        req.seqs.append(child)
    return list(req.seqs)


def advance_beams(rows: list[tuple[Sequence, int]], logits: torch.Tensor, requests: dict[str, Request],
                  scheduler: Scheduler, now: float) -> int:
    """Hand each beam request its beams' logits; a request selects once all its beams have them.
    Returns the tokens appended (one per live beam of each request that selected)."""
    reqs: dict[str, Request] = {}
    for seq, row in rows:
        req = requests[seq.request_id]
        req.beam.pending[seq.seq_id] = logits[row].clone()
        reqs[req.request_id] = req
    num_tokens = 0
    for req in reqs.values():
        before = req.beam.num_generated
        req.seqs = advance(req.beam, req.seqs, scheduler)
        if req.beam.num_generated > before:
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.num_generated_tokens += 1
            num_tokens += len(req.seqs)
    return num_tokens
