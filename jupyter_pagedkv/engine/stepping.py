"""Stepping: one engine iteration (schedule, forward, verify drafts, sample, publish) and how a
request ends (finished, aborted, failed). A collaborator of `Engine`, which hands it its lock,
scheduler, runner, speculator, sampler, output processor, counters and request tables.

Failures end only the requests they touch: a forward that raises ends the step's requests (their
KV is incomplete) and re-raises; so does scheduling that fails part-way (an allocation: the plan's
swaps and copy-on-write copies never run), for what it had planned and the sequence it was
placing; a sampler, drafter, detokeniser or listener that raises ends the requests concerned
while the step goes on for the others; the background loop dying ends every
live request (nobody would step them). Each ends with finish reason "error" ("abort" for
Ctrl-C), the exception attached and logged once with its id, and returns every block.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..core.scheduler import SampledTokens, Scheduler, SchedulerOutput, StepRecord
from ..core.sequence import Sequence
from ..core.stats import EngineCounters
from ..decoding.speculative import Speculator
from ..worker.model_runner import ModelRunner
from ..worker.sampler import Sampler
from ..worker.step_timing import StepTiming
from .forks import advance_beams, fork_samples
from .logprobs import StepLogprobs, add_prompt_logprobs, mark_prompt_rows
from .output_processor import OutputProcessor
from .outputs import RequestOutput
from .request import Request

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Stepping:
    """Steps the engine's parts, given explicitly; the two tables are the engine's own objects
    (live requests by id, the last finished ones), shared, so both see one state under `_lock`."""

    _lock: threading.RLock
    scheduler: Scheduler
    runner: ModelRunner
    speculator: Speculator
    sampler: Sampler
    outputs: OutputProcessor
    counters: EngineCounters
    _requests: dict[str, Request]
    finished_requests: deque[Request]
    _step_listeners: list[Callable[[], None]]
    device: torch.device
    trace: list[StepRecord] | None = None            # [] records every step's schedule
    step_timings: list[StepTiming] | None = None     # [] times every step's phases
    recorder: Any = None     # a Recording (engine/recording.py): told of each arrival and end, nothing else

    def step(self, collect: bool = True) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and return outputs of requests that advanced
        (none unless `collect`: building one detokenises the request's whole output, which a caller
        waiting on handles and listeners never reads).

        A failure ends only the requests it touched (finish reason "error", or "abort" for Ctrl-C,
        the exception attached and logged once with the request id) and returns their blocks: a
        forward that raises (out of memory, Ctrl-C) ends the step's requests and re-raises; a
        sampler, drafter, detokeniser or listener that raises ends the requests concerned and the
        step goes on for the others."""
        with self._lock:
            t0 = time.perf_counter()
            self.scheduler.kv.pool.step = self.counters.num_steps   # what `why` stamps evictions with
            try:
                sched = self.scheduler.schedule()
            except BaseException as err:   # its swaps and copies will not run: what it planned ends
                self._fail(self._touched_by(self.scheduler.plan), err)
                raise
            if sched.is_empty:
                if self.scheduler.has_work():
                    raise RuntimeError("the scheduler could not run any request: the pool is too small")
                return []
            try:
                return self._step(sched, t0, collect)
            except BaseException as err:
                self._fail(self._touched_by(sched), err)
                raise

    def _step(self, sched: SchedulerOutput, t0: float, collect: bool = True) -> list[RequestOutput]:
        self.runner.clock.enabled = self.step_timings is not None
        drafts = self.speculator.propose(sched)
        record = None   # taken once the drafts widened their chunks, so a replay sees what ran
        if self.trace is not None:
            record = dataclasses.replace(sched.record(), drafts=tuple(
                (d.chunk.seq.request_id, d.chunk.seq.sample_index, len(d.proposal.tokens)) for d in drafts.values()))
        mark_prompt_rows(sched.chunks, self._requests)
        try:
            sampling, logits = self.runner.execute(sched.chunks, sched.copies, sched.swap_out, sched.swap_in)
        except BaseException:
            self.speculator.discard(drafts)
            raise
        t_launched = time.perf_counter()
        if self.step_timings is not None and self.runner.clock.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        now = time.perf_counter()
        self.speculator.observe(sched, drafts, self.runner.last_forward_s)
        verified = []
        if drafts:   # takes the drafts back out of token_ids before anything is hashed
            sampling, logits, verified = self.speculator.split(sampling, logits, drafts, self.sampler.generator,
                                                                self.sampler.process)
        touched = self._touched_requests(sched, t0)
        beam_rows: list[tuple[Sequence, int]] = []
        logprobs: dict[int, deque] = {}

        def sample() -> list[SampledTokens]:   # called once the step's KV is committed
            for seq, err in self.speculator.take_failures():      # their plain decode ran: KV is sound
                self._fail([self._requests.get(seq.request_id)], err)
            return self._sample(sampling, logits, verified, beam_rows, logprobs)

        num_tokens = self.scheduler.update_from_output(sched, sample, functools.partial(self._append_token, now, logprobs))
        if beam_rows:
            num_tokens += advance_beams(beam_rows, logits, self._requests, self.scheduler, now)
        outputs = []
        for req in touched.values():
            if req.request_id in self._requests:              # not failed or finished above
                if req.finished:
                    self._finish_request(req, now)
                else:
                    self._guard(req, self.outputs.publish, req)
            if collect:
                outputs.append(self._output_of(req))
        by_tenant: dict[str | None, int] = {}
        for req in touched.values():
            new = req.metrics.num_generated_tokens - req.tokens_counted
            if new:
                if req.metrics.first_token_step is None:
                    req.metrics.first_token_step = self.counters.num_steps
                by_tenant[req.tenant] = by_tenant.get(req.tenant, 0) + new
                req.tokens_counted = req.metrics.num_generated_tokens
        t1 = time.perf_counter()
        self.counters.record_step(now, num_tokens, t1 - t0, self.runner.last_forward_s, by_tenant)
        if record is not None:
            self.trace.append(dataclasses.replace(record, duration_s=t1 - t0))
        mask_s = self.sampler.grammar_mask.take_seconds()   # this step's grammar masks
        if self.step_timings is not None:
            self._time_step(sched, t0, t_launched, now, t1, mask_s)
        for listener in self._step_listeners:
            listener()
        return outputs

    def _touched_by(self, sched: SchedulerOutput) -> list[Request]:
        """The live requests a step touched: its chunks, sequences it swapped out or in (an
        interrupted copy leaves their KV incomplete), and the one it was scheduling if that failed."""
        seqs = [c.seq for c in sched.chunks] + list(sched.preempted) + list(sched.resumed)
        seqs += [sched.attempting] if sched.attempting is not None else []
        ids = dict.fromkeys(s.request_id for s in seqs)
        return [self._requests[rid] for rid in ids if rid in self._requests]

    def _output_of(self, req: Request) -> RequestOutput:
        """The request's output so far; if its text cannot be decoded, it fails (and says so)."""
        try:
            return self.outputs.output(req)
        except Exception as err:
            self._fail([req], err)
            return self.outputs.output(req)

    def _guard(self, req: Request, fn: Callable, *args) -> None:
        """Run one request's piece of the step; if it raises, that request alone fails."""
        try:
            fn(*args)
        except Exception as err:
            self._fail([req], err)

    def _touched_requests(self, sched: SchedulerOutput, t0: float) -> dict[str, Request]:
        """The step's requests (its chunks'), each stamped with when it was first scheduled."""
        touched: dict[str, Request] = {}
        for c in sched.chunks:
            req = self._requests[c.seq.request_id]
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time, req.metrics.first_scheduled_step = t0, self.counters.num_steps
            touched[req.request_id] = req
        return touched

    def _sample(self, sampling, logits: torch.Tensor, verified,
                beam_rows: list[tuple[Sequence, int]], logprobs: dict[int, deque]) -> list[SampledTokens]:
        """Pick the step's tokens: plain rows through the sampler (a request with n > 1 forks its
        samples at the first), then verified drafts (rejected slots rolled back first); beams'
        rows go to `beam_rows`, to select together once the others' tokens are in. The logprobs
        that rows ask for (generated, accepted drafts, prompt) come in one pass after the picks,
        from the raw logits (engine/logprobs.py), queued in `logprobs` by seq_id for `_append_token`."""
        rows, seqs = [], []
        for i, c in enumerate(sampling):
            req = self._requests.get(c.seq.request_id)
            if req is None:
                continue                                       # failed earlier in this step
            if req.beam is not None:
                beam_rows.append((c.seq, i))
                continue
            for seq in fork_samples(req, c.seq, self.scheduler):
                rows.append(i)
                seqs.append(seq)
        picked = logits[rows] if len(rows) != logits.shape[0] else logits
        try:
            tokens = self.sampler(picked, seqs) if seqs else []
        except Exception as err:                               # those rows' requests fail, no others
            self._fail(list({s.request_id: self._requests[s.request_id] for s in seqs}.values()), err)
            seqs, tokens = [], []
        for seq, found in self._logprobs(picked, seqs, tokens, verified).items():
            logprobs[seq] = deque(found)
        sampled = [SampledTokens(seq, [token]) for seq, token in zip(seqs, tokens)]
        for seq, accepted, _ in verified:
            if seq.request_id in self._requests:
                # The kept drafts' KV stays; rejected slots roll back, emptied blocks return at once.
                num_computed = seq.num_tokens + len(accepted) - 1
                self.speculator.roll_back(seq, num_computed)
                sampled.append(SampledTokens(seq, accepted, num_computed))
        return sampled

    def _append_token(self, now: float, logprobs: dict[int, deque], seq: Sequence, token: int) -> None:
        """Append one token, with its logprobs if the row asked (the output processor's stop rules
        may finish the sequence); if that raises, its request alone fails."""
        req = self._requests.get(seq.request_id)
        if req is not None:
            queued = logprobs.get(seq.seq_id)
            self._guard(req, self.outputs.append_token, req, seq, token, now, queued.popleft() if queued else None)

    def _logprobs(self, picked: torch.Tensor, seqs: list[Sequence], tokens: list[int], verified) -> dict:
        """One pass over the rows that ask; the prompt rows' answers go straight to their requests,
        the generated ones come back by seq_id (appended with their tokens). Nothing when nobody asks."""
        batch, groups = StepLogprobs(), []
        for j, (seq, token) in enumerate(zip(seqs, tokens)):
            if seq.params.logprobs is not None:
                groups.append((seq, batch.add(picked[j:j + 1], [token], seq.params.logprobs)))
        for seq, accepted, raw in verified:
            if getattr(seq.params, "logprobs", None) is not None:
                groups.append((seq, batch.add(raw, accepted, seq.params.logprobs)))
        prompt = []
        for c, rows in self.runner.last_prompt_logits:         # row at position p predicts token p + 1
            req, (first, count) = self._requests.get(c.seq.request_id), c.prompt_logits
            if req is not None:
                tokens = c.seq.token_ids[first + 1:first + 1 + count]
                prompt.append((c, req, batch.add(rows, tokens, req.params.prompt_logprobs)))
        if not groups and not prompt:
            return {}
        try:
            found = batch.compute()
        except Exception as err:                               # the asking requests fail, no others
            reqs = [self._requests.get(s.request_id) for s, _ in groups] + [r for _, r, _ in prompt]
            self._fail(list({r.request_id: r for r in reqs if r is not None}.values()), err)
            return {}
        for c, req, g in prompt:
            self._guard(req, add_prompt_logprobs, req, c, found[g], self.outputs.decode_token)
        return {seq.seq_id: found[g] for seq, g in groups}

    def _time_step(self, sched: SchedulerOutput, t0: float, launched: float, now: float, t1: float,
                   mask_s: float) -> None:
        r = self.runner
        started = launched - r.last_forward_s - r.last_prepare_s
        self.step_timings.append(StepTiming(
            len(sched.chunks), sched.num_tokens, sum(c.num_tokens == 1 for c in sched.chunks),
            started - t0, r.last_prepare_s, r.last_forward_s, r.clock.device_seconds(),
            now - launched, t1 - now, t1 - t0, r.last_h2d_copies, mask_s))

    # -- how requests end ---------------------------------------------------------------------------
    def arrived(self, req: Request) -> None:
        """A request was queued (under `_lock`): the one call a recording gets on arrival."""
        if self.recorder is not None:
            self.recorder.arrived(req)

    def _finish_request(self, req: Request, now: float) -> None:
        self._requests.pop(req.request_id, None)
        self.finished_requests.append(req)
        self.counters.record_finish(req.tenant)
        req.metrics.finish_step = self.counters.num_steps
        self.outputs.finish(req, now)
        if self.recorder is not None:
            self.recorder.finished(req)

    def abort(self, req: Request) -> None:
        """End a live request now (finish reason "abort") and return its blocks; under `_lock`."""
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        self._finish_request(req, time.perf_counter())

    def _fail(self, reqs: list[Request | None], err: BaseException) -> None:
        """End these requests because of `err`: finish reason "error" ("abort" for Ctrl-C), the
        exception attached, logged once with the request id; every block they held returns."""
        reason = "abort" if isinstance(err, KeyboardInterrupt) else "error"
        line = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        now = time.perf_counter()
        for req in reqs:
            if req is None or req.request_id not in self._requests:
                continue
            logger.error("request %s failed: %s", req.request_id, line)
            for seq in req.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, reason)
            req.error = err
            self._finish_request(req, now)
        try:
            err.reported_by_engine = True   # whoever catches it need not log it again
        except AttributeError:
            pass

    def loop_died(self, err: BaseException) -> None:
        """The background loop is gone: nobody steps the live requests, so they end now."""
        with self._lock:
            self._fail(list(self._requests.values()), err)
