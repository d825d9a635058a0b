"""EngineInspection: what monitors, tables and status lines read off an engine, each under the
engine's lock so that it describes one instant: gauges (`core.stats`, the one place they are
computed), pool snapshots, the monitor feed's observations, request rows, the engine's identity
and execution plan, the invariants; plus the listener hooks monitors wake on."""
from __future__ import annotations

import functools
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Iterable

import torch

from ..config import format_bytes
from ..core.block_pool import BlockPool
from ..core.invariants import check_invariants
from ..core.miss_report import MissReport, PrefixLedger
from ..core.scheduler import Scheduler
from ..core.stats import EngineCounters, EngineStats, engine_stats, pool_snapshot
from ..core.swap_space import SwapSpace
from ..decoding.speculative import Speculator
from ..worker.kv_cache import KVCache
from ..worker.model_runner import ModelRunner
from ..worker.plan import Decision
from ..worker.quant_linear import describe_blocks, logical_parameters, packed_bytes
from .block_tables import SeqBlocks, block_tables
from .outputs import EngineInfo, Observation, QueueHead, RequestRow
from .request import Request


@dataclass(eq=False)
class EngineInspection:
    """Reads the engine's parts, given explicitly (the same objects the engine steps); the
    identity fields (name ... dtype_reason) describe the engine for `info()`."""

    _lock: threading.RLock
    pool: BlockPool
    scheduler: Scheduler
    counters: EngineCounters
    swap: SwapSpace | None
    speculator: Speculator
    runner: ModelRunner
    kv_cache: KVCache
    _requests: dict[str, Request]
    finished_requests: deque[Request]
    _step_listeners: list[Callable[[], None]]
    _shutdown_listeners: list[Callable[[], None]]
    warmed_kernels: list[str]           # Triton variants launched by warm_up (filled in place)
    name: str
    device: torch.device
    dtype: torch.dtype
    block_size: int
    max_model_len: int
    dtype_reason: str

    def stats(self) -> EngineStats:
        with self._lock:
            return self._stats_locked()

    def _stats_locked(self) -> EngineStats:
        return engine_stats(self.pool, self.scheduler, self.counters,
                            num_swapped_blocks=self.swap.num_used if self.swap is not None else 0,
                            speculative=self.speculator.stats, padded=self.runner.padded,
                            finished=[r for r in self.finished_requests if r.error is None])

    def pool_snapshot(self, block_ids: Iterable[int] | None = None) -> dict:
        """Per-block state ('free', 'cached', 'used', 'shared'), ref counts and owners; with
        `block_ids`, only those blocks, in that order (a monitor's diff: O(changed blocks))."""
        with self._lock:
            snap = pool_snapshot(self.pool, self.scheduler.live, block_ids)
            spec = self.speculator.stats
            # Drafts live only inside a locked step, so no block is ever "speculative" here;
            # what the last step did with its drafts is reported instead.
            snap["speculative"] = {"proposed": spec.num_proposed, "accepted": spec.num_accepted,
                                   "acceptance_rate": spec.acceptance_rate,
                                   "mean_accepted_length": spec.mean_accepted_length,
                                   "last_step_draft_slots": spec.last_step_draft_slots,
                                   "last_step_rolled_back_slots": spec.last_step_rolled_back,
                                   "last_step_freed_blocks": list(spec.last_step_freed_blocks)}
            return snap

    def observe(self, full: bool = False) -> Observation:
        """The monitor feed's one look, under one lock: gauges, the blocks touched since the last
        observation (drained) and their snapshot (every block's when `full`)."""
        t0 = time.perf_counter()
        with self._lock:
            waited = time.perf_counter() - t0
            touched = sorted(self.pool.drain_touched())
            snap = None
            if full or touched:
                snap = pool_snapshot(self.pool, self.scheduler.live, None if full else touched)
            return Observation(self.counters.num_steps, self._stats_locked(), None if full else touched,
                               snap, waited)

    def request_rows(self, finished: int = 20) -> list[RequestRow]:
        """Live requests, oldest first, then the last `finished` finished ones."""
        def row(req: Request, state: str) -> RequestRow:
            seq = req.seqs[0]
            return RequestRow(req.request_id, state, len(req.prompt_token_ids), seq.num_output_tokens,
                              0 if seq.is_finished else len(seq.block_table.blocks), seq.num_cached_tokens,
                              req.metrics.ttft, seq.finish_reason, req.error, req.tenant)
        with self._lock:
            return ([row(r, r.seqs[0].status.value) for r in self._requests.values()]
                    + [row(r, "failed" if r.error is not None else "done")
                       for r in (list(self.finished_requests)[-finished:] if finished > 0 else [])])

    def block_tables(self) -> list[SeqBlocks]:
        """Every live sequence's block table (oldest request first), copied in one look."""
        with self._lock:
            return block_tables(self._requests.values())

    def queue_head(self) -> QueueHead | None:
        """The waiting request admission tries next (None if none waits), what it needs, and how
        the free blocks lie: the contiguous baseline's external fragmentation made visible."""
        with self._lock:
            sched = self.scheduler
            if not sched.waiting:
                return None
            seq = sched.waiting[0]
            return QueueHead(seq.request_id, sched.kv.blocks_wanted(seq), sched.kv.num_free, sched.kv.free_runs())

    def info(self) -> EngineInfo:
        """What the engine is: its model, KV geometry and execution plan, in one summary line."""
        dtype = str(self.dtype).replace("torch.", "")
        n, bs, kv = self.pool.num_blocks, self.block_size, self.kv_cache
        packed = self.runner.packed
        params, weight_bytes, gguf_blocks = self._weights
        summary = (f"{self.name} on {self.device.type} ({dtype}): {n:,} blocks × {bs} = {n * bs:,} tokens "
                   f"of KV{_quantized(kv.spec)}, {kv.bytes_per_block:,} bytes per block, "
                   f"{format_bytes(kv.nbytes)} KV memory, "
                   f"prefix caching {'on' if self.pool.enable_prefix_caching else 'off'}"
                   + (f", GEMMs on packed weights ({_packing_cost(packed)})" if packed.layers else "")
                   + (f", {gguf_blocks}" if gguf_blocks else "")
                   + _step_loop(self.runner.lean)
                   + (f", {_prefill_phrase(self.runner.plan.prefill_attention)}" if self.device.type == "cpu" else "")
                   + (f", {len(self.warmed_kernels)} Triton kernel launches warmed up" if self.warmed_kernels else "")
                   + _decode_steps(self.runner.padded, self.device.type, self.runner.backend)
                   + _dtype_note(dtype, self.dtype_reason))
        return EngineInfo(self.name, self.device.type, dtype, n, bs, summary, kv.bytes_per_block, kv.nbytes,
                          prefix_caching=self.pool.enable_prefix_caching, max_model_len=self.max_model_len,
                          swap_blocks=self.swap.num_slots if self.swap is not None else 0,
                          plan=self.runner.plan.lines(), kv_dtype=kv.spec.dtype_name,
                          num_parameters=params, weight_bytes=weight_bytes)

    @functools.cached_property
    def _weights(self) -> tuple[int, int, str | None]:
        """(parameters, bytes a forward reads of them, the GGUF blocks' description): the model's
        layers do not change under an engine, and monitors ask info() for every frame."""
        model = self.runner.model
        params, in_blocks = logical_parameters(model)
        weight_bytes = packed_bytes(model) if in_blocks else params * self.dtype.itemsize
        return params, weight_bytes, describe_blocks(model)

    def add_step_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener()` after every step, in the stepping thread: monitors wake on it instead
        of polling. It runs under the engine lock, so it must be cheap (set an Event)."""
        with self._lock:
            self._step_listeners.append(listener)

    def remove_step_listener(self, listener: Callable[[], None]) -> None:
        with self._lock:
            if listener in self._step_listeners:
                self._step_listeners.remove(listener)

    def add_shutdown_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener()` once when the engine shuts down (a monitor feed closes on it)."""
        with self._lock:
            self._shutdown_listeners.append(listener)

    def check_invariants(self) -> None:
        """Assert the invariants of docs/design.md; an AssertionError names the broken one."""
        with self._lock:
            check_invariants(self.scheduler, self.swap)

    def reset_prefix_cache(self) -> int:
        with self._lock:
            return self.pool.reset_cache()

    def why(self, request_id: str | None, tokenizer) -> MissReport:
        """The miss report a request got at its first admission (None: the newest request), with
        the text around its first differing token decoded (outside the lock)."""
        with self._lock:
            known = [*self.finished_requests, *self._requests.values()]
            if request_id is None:
                req = max(known, key=lambda r: r.metrics.arrival_time, default=None)
                if req is None:
                    raise ValueError("no request yet: run one, then ask why it missed the prefix cache")
            else:
                req = next((r for r in known if r.request_id == request_id), None)
                if req is None:
                    raise ValueError(f"no request {request_id!r}: the engine keeps live requests and the "
                                     f"last {self.finished_requests.maxlen} finished (see %pagedkv requests)")
            report = next((s.miss for s in req.seqs if s.miss is not None), None)
            if report is None:
                raise ValueError(f"request {req.request_id!r} has not been admitted yet: ask again once it runs")
            prompt = list(req.prompt_token_ids)
        t = report.first_difference
        if t is None or tokenizer is None:
            return report
        before, after = tokenizer.decode(prompt[max(0, t - 16):t]), tokenizer.decode(prompt[t:t + 16])
        return replace(report, snippet=f"...{before[-24:]}▸{after[:24]}...")

    def prefix_ledger(self, revision: str | None, previous: PrefixLedger | None) -> PrefixLedger:
        """Remember `previous`'s chains (another model, revision or dtype) for `why`; this engine's own."""
        identity = f"{self.name}@{revision or 'main'} ({str(self.dtype).replace('torch.', '')})"
        with self._lock:
            if previous is not None and previous.identity != identity:
                self.scheduler.kv.remember_foreign(previous.identity, list(previous.hashes))
            return PrefixLedger(identity, tuple(self.scheduler.kv.cached_hashes()))


def _quantized(spec) -> str:
    """' in fp8_e4m3 with ...' for a quantized cache; nothing for the model's dtype (already named).
    Bytes per token are left to `EngineInfo.kv_phrase`, which `%pagedkv status` prints beneath."""
    if not spec.quantized:
        return ""
    return f" in {spec.kv_cache_dtype} with a float16 scale per token and KV head"


def _packing_cost(packed) -> str:
    """'held once' or what the packed copies cost beside the plain weights."""
    extra = packed.extra_bytes
    return f"+{format_bytes(extra)} beside the plain weights" if extra else "each weight held once"


def _prefill_phrase(decision: Decision) -> str:
    """How the summary line has always named prefill attention on the CPU."""
    if decision.choice == "native":
        return "prefill attention in C++ (prefill_attention.cpp)"
    return "prefill attention by torch's SDPA" + ("" if decision.reason == "prefill_attention='torch'"
                                                  else f" ({decision.reason})")


def _decode_steps(padded, device: str, backend: str) -> str:
    """Whether decode steps replay CUDA graphs, and why not where a GPU could have them."""
    if padded is not None:
        return f", {padded.describe()}"
    if device != "cuda":
        return ""
    why = "the torch attention backend reads lengths on the host" if backend != "triton" else "cuda_graphs=False"
    return f", decode steps eager ({why})"


def _step_loop(lean) -> str:
    """How steps run, when not through the model's own forward (worker/lean_forward.py)."""
    if lean is None:
        return ""
    native = lean.native is not None and lean.native.enabled
    return ", steps in the lean loop" + (" (decode steps in C++)" if native else "")


def _dtype_note(dtype: str, reason: str) -> str:
    """Why the engine computes in its dtype, where that is worth a word: what "auto" chose, or a
    dtype asked for that this machine computes slowly."""
    if reason.startswith("auto: "):
        return f"; {dtype} because {reason[len('auto: '):]}"
    if reason.startswith("asked for: "):
        return f"; {dtype} as asked, but {reason[len('asked for: '):]}"
    return ""
