"""Recording: `with engine.record("chat.jsonl"):` captures every request the engine serves.

Cheap by construction: the engine calls `arrived` once when a request is queued and `finished`
once when it ends (both under its lock); nothing runs per token or per step. `arrived` hashes the
prompt's full blocks once (or copies its ids when prompts are kept); `finished` reads the step
indices the engine already stamps on the request's metrics. The trace is written when the
recording stops (engine/trace.py has the format).
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from ..core.sampling_params import SamplingParams
from .request import Request
from .trace import BlockHasher, Trace, TraceHeader, TraceRequest

_DEFAULTS = SamplingParams()
# Fields a trace does not carry: not JSON (a grammar spec), or engine-local (a draft model).
_NOT_RECORDED = {"structured_outputs", "speculative"}


def sampling_fields(params: SamplingParams) -> dict[str, Any]:
    """The request's SamplingParams fields (vLLM's names) that differ from the defaults."""
    out = {}
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if f.name in _NOT_RECORDED or value == getattr(_DEFAULTS, f.name):
            continue
        if f.name == "logit_bias":
            value = {str(k): v for k, v in value.items()}
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


class Recording:
    """A recording in progress on one engine; a context manager (`Engine.record`).

    `path` is where `stop()` writes the trace (None: kept in memory only, `.trace`); `keep_prompts`
    writes prompt and output token ids too (default: lengths and keyed block hashes only)."""

    def __init__(self, engine, path: str | Path | None = None, keep_prompts: bool = False) -> None:
        self.engine, self.path, self.keep_prompts = engine, Path(path) if path else None, keep_prompts
        self.hasher = BlockHasher(engine.block_size)
        self.requests: dict[str, TraceRequest] = {}
        self._prompts: dict[str, list[int]] = {}     # live requests' prompt ids (the engine's own lists)
        self.skipped = 0
        self.trace: Trace | None = None
        self._t0 = time.perf_counter()
        self._step0 = engine.num_steps

    # -- the engine's two calls (under its lock) ---------------------------------------------------
    def arrived(self, req: Request) -> None:
        if req.beam is not None:            # a beam search's sequences come and go: not replayable
            self.skipped += 1
            return
        self._prompts[req.request_id] = req.prompt_token_ids      # hashed once, when it ends (or at stop)
        self.requests[req.request_id] = TraceRequest(
            req.request_id, round(req.metrics.arrival_time - self._t0, 6), self.engine.num_steps - self._step0,
            len(req.prompt_token_ids), [], "", sampling_fields(req.params), req.params.max_tokens, req.tenant,
            req.seqs[0].priority)

    def finished(self, req: Request) -> None:
        rec = self.requests.get(req.request_id)
        if rec is None:
            return
        seq, m = req.seqs[0], req.metrics
        rec.output_len, rec.finish_reason = seq.num_output_tokens, seq.finish_reason
        shift = lambda step: None if step is None else step - self._step0
        rec.admitted_step, rec.first_token_step = shift(m.first_scheduled_step), shift(m.first_token_step)
        rec.finish_step = shift(m.finish_step)
        self._seal(rec, seq.output_token_ids)

    def _seal(self, rec: TraceRequest, output: list[int]) -> None:
        """Hash the full blocks of prompt + output (a later turn that repeats this reply shares
        them), and keep the ids if asked."""
        prompt = self._prompts.pop(rec.request_id)
        rec.block_hashes = self.hasher.block_hashes(list(prompt) + list(output))
        rec.prompt_hash = self.hasher.prompt_hash(prompt, rec.block_hashes[:len(prompt) // self.hasher.block_size])
        if self.keep_prompts:
            rec.prompt_token_ids, rec.output_token_ids = list(prompt), list(output)

    # -- start and stop --------------------------------------------------------------------------------
    def stop(self) -> Trace:
        """Stop recording and write the trace (if a path was given); returns it."""
        with self.engine._lock:
            if self.engine._stepping.recorder is self:
                self.engine._stepping.recorder = None
            for rid in list(self._prompts):           # still live: its prompt only
                self._seal(self.requests[rid], [])
        config = {k: v for k, v in dataclasses.asdict(self.engine.config).items()
                  if isinstance(v, (int, float, str, bool, type(None)))}
        tenancy = self.engine._scheduler.tenancy
        tenants = {name: {"weight": s.weight, "max_blocks": s.max_blocks}
                   for name, s in tenancy.specs.items() if name is not None}
        header = TraceHeader(self.engine.name, self.engine.config.revision, self.engine.block_size,
                             self.engine._vocab_size, self.keep_prompts, config, tenants, self.skipped)
        self.trace = Trace(header, list(self.requests.values()))
        if self.path is not None:
            self.trace.write(self.path)
        return self.trace

    def __enter__(self) -> Recording:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start(engine, path: str | Path | None = None, keep_prompts: bool = False) -> Recording:
    """Begin recording `engine` (one recording at a time)."""
    with engine._lock:
        if engine._stepping.recorder is not None:
            raise ValueError("this engine is already recording: stop that recording first")
        rec = Recording(engine, path, keep_prompts)
        engine._stepping.recorder = rec
    return rec
