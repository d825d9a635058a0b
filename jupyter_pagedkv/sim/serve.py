"""Serve a timed request stream through a real Engine, measured the way the simulator measures.

Single-threaded on purpose: requests due by now are added between steps (a request arriving
mid-step joins at the next step boundary, as in the simulator), and latencies count from the
*intended* arrival time, so time a request spends waiting for the current step is not hidden.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..engine.outputs import RequestOutput
from ..core.sampling_params import SamplingParams
from .summary import RequestTiming, RunSummary, UtilisationMeter


@dataclass(frozen=True)
class TimedPrompt:
    request_id: str
    arrival_s: float
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0


def serve(engine, prompts: list[TimedPrompt], label: str = "") -> tuple[RunSummary, dict[str, RequestOutput]]:
    """Run `prompts` at their arrival times (seconds from now); returns the summary and outputs."""
    if engine.is_running:
        raise RuntimeError("serve() steps the engine itself: stop its background thread first")
    pending = sorted(prompts, key=lambda p: p.arrival_s)
    intended = {p.request_id: p.arrival_s for p in prompts}
    outputs: dict[str, RequestOutput] = {}
    timings: list[RequestTiming] = []
    meter = UtilisationMeter()
    max_conc = 0
    preempt0 = engine.stats().num_preemptions
    t0 = time.perf_counter()
    try:
        while pending or engine.has_unfinished_requests():
            now = time.perf_counter() - t0
            while pending and pending[0].arrival_s <= now:
                p = pending.pop(0)
                engine.add_request(p.prompt_ids, p.params, p.request_id, p.priority)
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, pending[0].arrival_s - now))
                continue
            s0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - s0
            s = engine.stats()
            max_conc = max(max_conc, s.num_running + sum(1 for o in outs if o.finished))
            meter.add(s.tokens_stored, s.slots_allocated, dt)
            for o in outs:
                if o.finished:
                    outputs[o.request_id] = o
                    m = o.metrics
                    timings.append(RequestTiming(o.request_id, intended[o.request_id],
                                                 m.first_token_time - t0, m.finish_time - t0,
                                                 len(o.token_ids)))
    except BaseException:
        for p in prompts:
            engine.abort(p.request_id)
        raise
    start = min((p.arrival_s for p in prompts), default=0.0)
    end = max((t.finish_s for t in timings), default=start)
    summary = RunSummary(label, timings, end - start, meter.value, max_conc,
                         engine.stats().num_preemptions - preempt0)
    return summary, outputs
