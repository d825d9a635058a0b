"""One arm of a replay: the trace served by a real engine on the step clock, or by the simulator.

Both count time the same way, so their figures sit side by side: a request arrives at its
recorded step; each step advances the clock by one (the simulator: a cost model of exactly one
second per step, unless a GPU preset prices steps in seconds); an idle engine jumps to the next
arrival. A request's TTFT is the clock after the step that gave its first token, less its arrival;
its end-to-end time, the clock after its last. So the same trace gives the same numbers on any
machine, and a notebook can check them.

Outputs: with prompts kept and the same model, requests run exactly as recorded (greedy outputs
match, stop rules and EOS included). Otherwise every request generates exactly its recorded
length: EOS and stop rules are off and the driver ends it (abort) after the step that gave its
last token, which frees its blocks at the same step boundary a natural finish would.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..config import EngineConfig
from ..core.sampling_params import SamplingParams
from ..core.scheduler import StepRecord
from ..engine.trace import Trace
from .summary import RequestTiming, RunSummary, UtilisationMeter
from .tenant_workload import TenantFigures, tenant_figures
from .trace_replay import rebuilt_tokens, tenant_specs
from .waste import WasteBreakdown, WasteMeter


@dataclass
class ArmResult:
    """What one arm did. `admitted`: request -> index of the engine step that first scheduled it
    (idle time not counted: the index a recording stores)."""

    label: str
    where: str                      # "engine" or "sim"
    clock: str                      # "step" or "s": the unit of every time in `summary`
    summary: RunSummary
    num_blocks: int
    block_size: int
    admitted: dict[str, int] = field(default_factory=dict)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    waste: WasteBreakdown | None = None
    snapshot: dict | None = None    # the pool after step `snapshot_step`
    snapshot_step: int | None = None
    schedule: list[StepRecord] | None = None

    def tenants(self) -> dict[str, TenantFigures]:
        """Per tenant (requests that named none as "default"), once any request names one."""
        names = {t.tenant for t in self.summary.requests}
        if names <= {None}:
            return {}
        return {n or "default": tenant_figures(self.summary.requests, n) for n in sorted(names, key=str)}

    def jain(self) -> float:
        """Jain's fairness index over the tenants' output tokens per unit of time, each over its
        own span: (sum x)^2 / (n sum x^2), 1 when all are equal, 1/n when one takes everything;
        nan with fewer than two tenants."""
        xs = [f.tokens_per_s for f in self.tenants().values() if not math.isnan(f.tokens_per_s)]
        return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if len(xs) > 1 and any(xs) else math.nan


def arm_config(base: EngineConfig, options: dict, num_blocks: int, block_size: int,
               bytes_per_block: int | None = None) -> EngineConfig:
    """`base` with the arm's options; a new block size keeps the pool's token capacity; swap
    preemption without a given swap space gets as much host memory as the pool's."""
    bs = options.get("block_size", block_size)
    config = base.replace(**options, num_blocks=max(1, num_blocks * block_size // bs))
    if config.preemption_mode == "swap" and config.swap_space is None and bytes_per_block:
        config = config.replace(swap_space=num_blocks * bytes_per_block)    # host slots for the whole pool
    return config


def replay_on_engine(engine, trace: Trace, label: str, options: dict, snapshot_step: int | None = None,
                     keep_schedule: bool = False) -> ArmResult:
    """Serve `trace` on a new engine over `engine`'s model and tokenizer, with its options and the
    arm's (`options`: EngineConfig fields), on the step clock."""
    from ..engine.engine import Engine

    info = engine.info()
    config = arm_config(engine.config, options, info.num_blocks, info.block_size, info.bytes_per_block)
    eng = Engine(engine.model, engine.tokenizer, config, name=engine.name)
    for spec in tenant_specs(trace):
        eng.set_tenant(spec.name, spec.weight, spec.max_blocks)
    vocab = _vocab(engine)
    exact = trace.header.keeps_prompts and trace.header.model == engine.name
    reqs = sorted(trace.finished, key=lambda r: r.arrival_step)
    want = {r.request_id: r.output_len for r in reqs}
    unshared = config.allocator == "contiguous" or not config.enable_prefix_caching
    meter = WasteMeter(eng, label) if unshared and all(r.sampling.get("n", 1) == 1 for r in reqs) else None
    if keep_schedule:
        eng.trace = []
    util, arrived, first, done, outputs, clock_at = UtilisationMeter(), {}, {}, {}, {}, []
    clock, i, max_conc, snapshot = 0, 0, 0, None
    if meter is not None:
        meter.__enter__()
    try:
        while i < len(reqs) or eng.has_unfinished_requests():
            while i < len(reqs) and reqs[i].arrival_step <= clock:
                r = reqs[i]
                prompt, _ = rebuilt_tokens(r, trace.header.block_size, vocab)
                eng.add_request(prompt, _params(r, exact), r.request_id, r.priority, tenant=r.tenant)
                arrived[r.request_id] = clock
                i += 1
            if not eng.has_unfinished_requests():
                clock = reqs[i].arrival_step
                continue
            clock_at.append(clock)
            outs = eng.step()
            clock += 1
            s = eng.stats()
            util.add(s.tokens_stored, s.slots_allocated, 1.0)
            max_conc = max(max_conc, s.num_running + sum(1 for o in outs if o.finished))
            for o in outs:
                tokens = o.outputs[0].token_ids
                if tokens and o.request_id not in first:
                    first[o.request_id] = clock
                if not o.finished and not exact and len(tokens) >= want[o.request_id]:
                    eng.abort(o.request_id)               # its recorded length: it ends here
                if o.finished or (not exact and len(tokens) >= want[o.request_id]):
                    done[o.request_id] = (clock, o.metrics.first_scheduled_step, list(tokens))
            if snapshot_step is not None and len(clock_at) == snapshot_step + 1:
                snapshot = eng.pool_snapshot()
    finally:
        if meter is not None:
            meter.__exit__(None, None, None)
        for rid in arrived:
            eng.abort(rid)
    eng.check_invariants()
    tenant = {r.request_id: r.tenant for r in reqs}
    timings = [RequestTiming(rid, float(arrived[rid]), float(first[rid]), float(end), len(toks), tenant[rid])
               for rid, (end, _, toks) in done.items()]
    start = min(arrived.values(), default=0)
    end = max((t.finish_s for t in timings), default=start)
    summary = RunSummary(label, timings, end - start, util.value, max_conc, eng.stats().num_preemptions)
    return ArmResult(label, "engine", "step", summary, config.num_blocks, config.block_size,
                     {rid: adm for rid, (_, adm, _) in done.items()}, {rid: toks for rid, (_, _, toks) in done.items()},
                     meter.breakdown() if meter is not None else None, snapshot, snapshot_step,
                     eng.trace if keep_schedule else None)


def _vocab(engine) -> int:
    config = engine.model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return text.vocab_size


def _params(r, exact: bool) -> SamplingParams:
    fields = {k: v for k, v in r.sampling.items() if k in SamplingParams.__dataclass_fields__}
    if "logit_bias" in fields:
        fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
    params = SamplingParams(**fields)
    params.max_tokens = r.max_tokens
    if not exact:     # the recorded length, whatever these tokens are: nothing may end it sooner
        params = dataclasses.replace(params, ignore_eos=True, stop=[], stop_token_ids=[], min_tokens=0)
    return params
