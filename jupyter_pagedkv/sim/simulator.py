"""Simulator: the engine's own Scheduler and BlockPool on a virtual clock, priced by a CostModel.

Nothing is re-implemented: each step calls `Scheduler.schedule()` exactly as `Engine.step()`
does, advances the clock by the cost model's step time instead of running a model, then hands
`Scheduler.update_from_output` (the engine's own post-forward protocol: computed tokens, full
blocks published, tokens appended, finished sequences freed) each sampling sequence's next token
from the request's predetermined output. With the real run's
prompts and outputs it therefore reproduces the real schedule step for step; with synthetic
requests it replays a production-scale day on a laptop (a 70B model, thousands of requests).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from dataclasses import dataclass, field

from ..core.block_pool import BlockPool
from ..core.contiguous import ContiguousKVCacheManager
from ..core.kv_cache_manager import PagedKVCacheManager
from .plan import plan as capacity_plan
from ..core.sampling_params import SamplingParams
from ..core.scheduler import SampledTokens, Scheduler, SchedulerOutput, StepRecord
from ..core.sequence import Sequence
from ..core.swap_space import SwapSpace
from ..core.tenancy import TenantSpec
from .cost_model import CostModel, ModelCost
from ..core.stats import occupancy
from .summary import RequestTiming, RunSummary, UtilisationMeter
from .workload import SimRequest


@dataclass
class SimConfig:
    """The serving configuration being simulated (the same knobs `Engine` takes)."""

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    allocator: str = "paged"
    preemption_mode: str = "recompute"
    swap_blocks: int = 0
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    scheduling_policy: str = "fcfs"
    tenants: tuple[TenantSpec, ...] = ()     # weights and caps; unnamed tenants get weight 1

    def __post_init__(self) -> None:
        if self.allocator not in ("paged", "contiguous"):
            raise ValueError(f"allocator must be 'paged' or 'contiguous', got {self.allocator!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")


@dataclass
class SimResult:
    summary: RunSummary
    trace: list[StepRecord] = field(default_factory=list)
    completion_order: list[str] = field(default_factory=list)
    num_steps: int = 0
    # Blocks each tenant held, summed over steps: its share of the pool over the run.
    block_steps: Counter = field(default_factory=Counter)


class Simulator:
    def __init__(self, config: SimConfig, model: ModelCost, cost: CostModel) -> None:
        self.config, self.model, self.cost = config, model, cost

    @classmethod
    def for_gpu(cls, model: str = "Llama-3-70B", gpu: str = "H100-80GB", num_gpus: int = 4,
                block_size: int = 16, kv_cache_dtype: str = "auto", **config) -> Simulator:
        """A preset: the capacity planner sizes the KV pool (`kv_cache_dtype` as the engine's
        option: a quantized cache holds ~twice the blocks), datasheet numbers price the steps."""
        p = capacity_plan(model, gpu, num_gpus, block_size=block_size, kv_cache_dtype=kv_cache_dtype)
        if not p.fits:
            raise ValueError(p.summary())
        shape = p.model
        config.setdefault("max_model_len", shape.max_context)
        if config.get("preemption_mode") == "swap":
            # As vLLM's default: 4 GiB of pinned host memory per GPU.
            config.setdefault("swap_blocks", int(4 * num_gpus * (1 << 30) // (p.kv_bytes_per_token * block_size)))
        cfg = SimConfig(num_blocks=p.tokens // block_size, block_size=block_size, **config)
        return cls(cfg, ModelCost.of(shape, kv_cache_dtype=kv_cache_dtype),
                   CostModel.for_gpu(gpu, num_gpus, num_layers=shape.num_layers))

    def run(self, requests: list[SimRequest], label: str = "", record_trace: bool = False) -> SimResult:
        cfg = self.config
        bs = cfg.block_size
        paged = cfg.allocator == "paged"
        pool = BlockPool(cfg.num_blocks, bs, cfg.enable_prefix_caching and paged)
        swap = SwapSpace(cfg.swap_blocks) if cfg.preemption_mode == "swap" and cfg.swap_blocks else None
        kv = PagedKVCacheManager(pool, swap) if paged else ContiguousKVCacheManager(pool, cfg.max_model_len, swap)
        sched = Scheduler(kv, cfg.max_num_seqs, cfg.max_num_batched_tokens, policy=cfg.scheduling_policy)
        for spec in cfg.tenants:
            sched.set_tenant(spec.name, spec.weight, spec.max_blocks)
        for r in requests:
            need = min(r.prompt_len + r.max_tokens, cfg.max_model_len or math.inf)
            if -(-need // bs) > cfg.num_blocks:
                raise ValueError(f"request {r.request_id} needs {need} tokens of KV but the pool holds "
                                 f"{cfg.num_blocks * bs}: lower its max_tokens or give more blocks")
        pending = sorted(requests, key=lambda r: r.arrival_s)
        by_id = {r.request_id: r for r in requests}
        first: dict[str, float] = {}
        timings: list[RequestTiming] = []
        result = SimResult(RunSummary(label, timings, 0.0, 0.0, 0))
        meter = UtilisationMeter()
        clock, since, i, steps, max_conc = 0.0, 0.0, 0, 0, 0

        def append(seq: Sequence, token: int) -> None:
            """The request's next predetermined token, at the clock's now; its last one finishes it."""
            req = by_id[seq.request_id]
            seq.token_ids.append(token)
            if seq.num_output_tokens == 1:
                first[req.request_id] = clock
            if seq.num_output_tokens == req.output_len:
                sched.finish(seq, "length" if req.output_len == req.max_tokens else "stop")
                timings.append(RequestTiming(req.request_id, req.arrival_s, first[req.request_id],
                                             clock, req.output_len, req.tenant))
                result.completion_order.append(req.request_id)

        while i < len(pending) or sched.has_work():
            while i < len(pending) and pending[i].arrival_s <= clock:
                r = pending[i]
                params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
                sched.add(Sequence(r.request_id, list(r.prompt_ids), r.prompt_len, params,
                                   kv.new_table(), r.arrival_s, r.priority, tenant=r.tenant))
                i += 1
            if not sched.has_work():
                clock = pending[i].arrival_s
                continue
            out = sched.schedule()
            if out.is_empty:
                raise RuntimeError("the scheduler could not run any request: the pool is too small")
            shape = [(c.start, c.num_tokens, c.samples) for c in out.chunks]
            work = self.model.work(shape, len(out.swap_out) + len(out.swap_in), bs)
            dt = self.cost.step_time(work)
            running = sched.num_running
            max_conc = max(max_conc, running)
            clock += dt
            steps += 1
            if record_trace:
                result.trace.append(dataclasses.replace(out.record(), duration_s=dt))
            sched.update_from_output(out, functools.partial(_next_tokens, out, by_id), append)
            # Occupancy after the step (as the real-engine driver measures it), sampled on a
            # stride and weighted by the time since the last sample.
            for tenant, held in pool.held.items():
                result.block_steps[tenant] += held
            since += dt
            if steps % max(1, running // 4) == 0:
                stored, held = occupancy(pool, sched.live)
                meter.add(stored, held, since)
                since = 0.0
        pool.check_invariants(Counter())   # every request finished: nothing may stay referenced
        start = min((r.arrival_s for r in requests), default=0.0)
        result.summary = RunSummary(label, timings, clock - start, meter.value, max_conc,
                                    sched.num_preemptions)
        result.num_steps = steps
        return result


def _next_tokens(out: SchedulerOutput, by_id: dict[str, SimRequest]) -> list[SampledTokens]:
    """Each sampling chunk's next token, from its request's predetermined output."""
    return [SampledTokens(c.seq, [by_id[c.seq.request_id].output_ids[c.seq.num_output_tokens]])
            for c in out.chunks if c.samples]
