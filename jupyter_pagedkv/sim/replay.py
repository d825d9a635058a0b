"""`%pagedkv replay NAME --vary ...`: one recorded trace under several configurations (arms), on
the real engine, in the simulator, or both; the figures of every arm come from the same code as
`bench tail` (RunSummary) and `bench tenants` (tenant_figures), so they can be compared with it.

The simulator either mirrors the live engine (its pool, its limits, one second per step: the
schedule of the real run, step for step) or runs a production preset (`model="Llama-3-70B",
gpus="2xH100"`: the capacity planner sizes the pool, datasheet numbers price each step in seconds,
and requests arrive at their recorded seconds, `repeat` copies of each).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from ..config import parse_size
from ..engine.trace import Trace
from .cost_model import CostModel
from .plan import GPUS, MODELS
from .replay_run import ArmResult, arm_config, replay_on_engine
from .simulator import Simulator
from .trace_replay import Arm, sim_requests, tenant_specs
from .validate import model_cost_of, sim_config_of

SCALES = ("engine", "sim", "both")
_SIM_KNOBS = ("allocator", "scheduling_policy", "preemption_mode", "enable_prefix_caching")


def find_model(name: str) -> str:
    """A simulator preset by name, case-insensitively ("llama-3-70b" -> "Llama-3-70B")."""
    found = {m.lower(): m for m in MODELS}.get(name.lower())
    if found is None:
        raise ValueError(f"--model {name!r}: the simulator knows {', '.join(MODELS)}")
    return found


def parse_gpus(text: str) -> tuple[int, str]:
    """"2xH100" -> (2, "H100-80GB"); a bare name is one GPU; a name prefix picks its first match."""
    m = re.fullmatch(r"(?:(\d+)\s*[xX]\s*)?(.+)", text.strip())
    count, name = int(m.group(1) or 1), m.group(2)
    found = [g for g in GPUS if g.lower() == name.lower()] or [g for g in GPUS if g.lower().startswith(name.lower())]
    if not found or count < 1:
        raise ValueError(f"--gpus {text!r}: write COUNTxGPU, e.g. 2xH100; GPUs: {', '.join(GPUS)}")
    return count, found[0]


@dataclass(frozen=True)
class SimScale:
    """Where the simulator runs: None model mirrors the live engine (step clock)."""

    model: str | None = None
    gpus: tuple[int, str] = (1, "H100-80GB")
    repeat: int = 1


def replay_in_sim(trace: Trace, arm: Arm, scale: SimScale, engine=None) -> ArmResult:
    """One arm in the simulator: mirroring `engine` on the step clock, or at a production preset."""
    opts = arm.as_dict
    bs = opts.get("block_size", trace.header.block_size if scale.model else engine.info().block_size)
    knobs = {k: v for k, v in trace.header.config.items() if k in _SIM_KNOBS}
    knobs.update({k: v for k, v in opts.items() if k in _SIM_KNOBS})
    tenants = tenant_specs(trace)
    if scale.model:
        kv = opts.get("kv_cache_dtype", trace.header.config.get("kv_cache_dtype", "auto"))   # as recorded
        sim = Simulator.for_gpu(scale.model, scale.gpus[1], scale.gpus[0], block_size=bs, kv_cache_dtype=kv,
                                tenants=tenants, **knobs)
        clock, vocab = "s", MODELS[scale.model].vocab_size
    else:
        info = engine.info()
        config = arm_config(engine.config, opts, info.num_blocks, info.block_size, info.bytes_per_block)
        per_block = info.bytes_per_block * bs // info.block_size
        swap = parse_size(config.swap_space) // per_block if config.preemption_mode == "swap" else 0
        cfg = dataclasses.replace(sim_config_of(engine), num_blocks=config.num_blocks, block_size=bs,
                                  swap_blocks=swap, tenants=tenants, **{k: getattr(config, k) for k in _SIM_KNOBS})
        sim, clock = Simulator(cfg, model_cost_of(engine), CostModel(1.0, 0.0, 0.0, 0.0)), "step"
        vocab = _text_vocab(engine)
    requests = sim_requests(trace, vocab, "steps" if clock == "step" else "s", scale.repeat)
    res = sim.run(requests, arm.label, record_trace=True)
    admitted: dict[str, int] = {}
    for i, step in enumerate(res.trace):
        for rid, *_ in step.chunks:
            admitted.setdefault(rid, i)
    return ArmResult(arm.label, "sim", clock, res.summary, sim.config.num_blocks, sim.config.block_size,
                     admitted, schedule=res.trace)


def _text_vocab(engine) -> int:
    config = engine.model.config
    return (config.get_text_config() if hasattr(config, "get_text_config") else config).vocab_size


def replay(trace: Trace, arms: list[Arm], where: str = "engine", engine=None, scale: SimScale = SimScale(),
           snapshot_step: int | None = None) -> list[ArmResult]:
    """Every arm on the real engine (`where` "engine"), in the simulator ("sim") or both, in order."""
    if where not in SCALES:
        raise ValueError(f"--scale {where!r}: choose {', '.join(SCALES)}")
    if not trace.finished:
        raise ValueError("the trace has no finished request to replay: record some traffic first")
    if engine is None and (where != "sim" or scale.model is None):
        raise ValueError("no engine to replay on: `%pagedkv load` first, or replay with --scale sim --model ...")
    if snapshot_step is None:
        snapshot_step = _busiest_step(trace)
    out = []
    for arm in arms:
        if where in ("engine", "both"):
            out.append(replay_on_engine(engine, trace, arm.label, arm.as_dict, snapshot_step))
        if where in ("sim", "both"):
            out.append(replay_in_sim(trace, arm, scale, engine))
    return out


def _busiest_step(trace: Trace) -> int:
    """The recorded step with the most requests live (arrived, unfinished): where block maps of
    the arms differ most. 0 for a trace without step stamps."""
    events = []
    for r in trace.finished:
        if r.finish_step is not None:
            events += [(r.arrival_step, 1), (r.finish_step + 1, -1)]
    best, live, at = 0, 0, 0
    for step, d in sorted(events):
        live += d
        if live > best:
            best, at = live, step
    return at
