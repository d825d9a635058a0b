"""Check the simulator against the real engine: the same schedule step for step, and — with a
cost model fitted to measured steps — the same total time and median latency within 20%."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .plan import ModelShape
from ..core.scheduler import StepRecord
from .cost_model import CostModel, ModelCost
from .serve import TimedPrompt
from .simulator import SimConfig, Simulator
from .summary import RunSummary
from .workload import SimRequest


def sim_config_of(engine) -> SimConfig:
    """The simulator configuration that mirrors a live engine."""
    info, config = engine.info(), engine.config
    return SimConfig(num_blocks=info.num_blocks, block_size=info.block_size,
                     max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                     allocator=config.allocator, preemption_mode=config.preemption_mode,
                     swap_blocks=info.swap_blocks, enable_prefix_caching=info.prefix_caching,
                     max_model_len=info.max_model_len, scheduling_policy=config.scheduling_policy)


def model_cost_of(engine) -> ModelCost:
    """Per-token bytes and FLOPs of the engine's own model at its own precision (packed GGUF
    weights: their logical parameters for the FLOPs, their blocks' bytes for the reads)."""
    info = engine.info()
    shape = ModelShape.from_config(engine.model.config, engine.name, float(info.num_parameters))
    return ModelCost(shape, info.weight_bytes, info.bytes_per_block // info.block_size)


def replay_requests(prompts: list[TimedPrompt], outputs: dict) -> list[SimRequest]:
    """The requests of a finished real run, with the tokens each one actually generated."""
    return [SimRequest(p.request_id, p.arrival_s, list(p.prompt_ids), list(outputs[p.request_id].token_ids),
                       p.params.max_tokens, p.priority) for p in prompts]


def completion_order(trace: list[StepRecord]) -> list[str]:
    """Requests ordered by the step that finished them (the last step that scheduled them)."""
    last: dict[str, int] = {}
    for i, step in enumerate(trace):
        for rid, *_ in step.chunks:
            last[rid] = i
    return sorted(last, key=lambda rid: (last[rid], rid))


@dataclass
class ScheduleCheck:
    real_steps: int
    sim_steps: int
    first_difference: int | None     # index of the first step whose schedule differs
    real_preemptions: int
    sim_preemptions: int
    same_completion_order: bool

    @property
    def identical(self) -> bool:
        return self.first_difference is None and self.same_completion_order

    def line(self) -> str:
        verdict = "identical" if self.identical else f"DIFFERS at step {self.first_difference}"
        return (f"schedule: {verdict} ({self.real_steps} real steps, {self.sim_steps} simulated; "
                f"preemptions {self.real_preemptions} real, {self.sim_preemptions} simulated; "
                f"completion order {'same' if self.same_completion_order else 'different'})")


def compare_schedules(real: list[StepRecord], sim: list[StepRecord]) -> ScheduleCheck:
    key = lambda r: (r.chunks, r.preempted, r.num_swap_out, r.num_swap_in)   # not the durations
    diff = next((i for i, (a, b) in enumerate(zip(real, sim)) if key(a) != key(b)), None)
    if diff is None and len(real) != len(sim):
        diff = min(len(real), len(sim))
    return ScheduleCheck(len(real), len(sim), diff, sum(len(r.preempted) for r in real),
                         sum(len(r.preempted) for r in sim), completion_order(real) == completion_order(sim))


def offline_check(engine, prompts: list[TimedPrompt]) -> tuple[ScheduleCheck, list[StepRecord]]:
    """Run every prompt at once on the engine (recording its schedule), replay the same requests
    in the simulator and compare the two schedules step by step. Returns the real trace too
    (its step times calibrate the cost model)."""
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine is busy: run the check on an idle engine")
    engine.reset_prefix_cache()
    engine.trace = []
    try:
        outs = engine.generate([p.prompt_ids for p in prompts], [p.params for p in prompts],
                               priority=[p.priority for p in prompts])
        trace = engine.trace
    finally:
        engine.trace = None
    # generate() names requests itself; map them back to ours, in submission order.
    by_id = {p.request_id: o for p, o in zip(prompts, outs)}
    renamed = {o.request_id: p.request_id for p, o in zip(prompts, outs)}
    trace = [dataclasses.replace(r, chunks=tuple((renamed[c[0]], *c[1:]) for c in r.chunks),
                                 preempted=tuple(renamed[x] for x in r.preempted),
                                 drafts=tuple((renamed[d[0]], *d[1:]) for d in r.drafts)) for r in trace]
    engine.reset_prefix_cache()
    sim = Simulator(sim_config_of(engine), model_cost_of(engine), CostModel(0, 0, 0, 0))
    result = sim.run(replay_requests([TimedPrompt(p.request_id, 0.0, p.prompt_ids, p.params, p.priority)
                                      for p in prompts], by_id), record_trace=True)
    return compare_schedules(trace, result.trace), trace


def calibrate(engine, trace: list[StepRecord]) -> CostModel:
    """Fit the cost model to the measured step times of a real trace."""
    model = model_cost_of(engine)
    works = [model.work(((start, n, samples) for _, _, start, n, samples in r.chunks),
                        r.num_swap_out + r.num_swap_in, engine.block_size) for r in trace]
    return CostModel.fit(works, [r.duration_s for r in trace])


def timing_check(engine, prompts: list[TimedPrompt], cost: CostModel) -> tuple[RunSummary, RunSummary]:
    """Serve timed prompts for real, then simulate the same stream with `cost`."""
    from .serve import serve

    engine.reset_prefix_cache()
    real, outputs = serve(engine, prompts, "real engine")
    engine.reset_prefix_cache()
    sim = Simulator(sim_config_of(engine), model_cost_of(engine), cost)
    simulated = sim.run(replay_requests(prompts, outputs), "simulator").summary
    return real, simulated
