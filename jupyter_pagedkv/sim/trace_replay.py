"""A recorded trace (engine/trace.py) as requests again: the arms of an A/B replay (`--vary`), the
prompts (kept, or rebuilt from block hashes) and the simulator's requests.

Prompts without their tokens: each full block of a request's prompt + output has a chained hash,
so the replay draws that block's tokens from a generator seeded by the hash. Equal hashes give
equal blocks, and since the hashes chain, equal prefixes; different hashes give different blocks
(random ids over the vocabulary). The rebuilt requests therefore share exactly the blocks the
recorded ones shared (system prompts, a chat's earlier turns, a document asked about twice), at
the recording's block size; a partial last block is drawn from the prompt's own hash, so equal
prompts stay equal. Output tokens are drawn the same way, so in the simulator a later chat turn
hits the blocks of the reply it repeats, as it did when recorded.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from ..config import EngineConfig
from ..core.tenancy import TenantSpec
from ..engine.trace import Trace, TraceRequest
from .workload import SimRequest

# --vary KEY -> the EngineConfig field it sets, and how a value is read.
_ONOFF = {"on": True, "off": False, "true": True, "false": False}
VARY_KEYS = {"allocator": "allocator", "scheduling": "scheduling_policy", "block_size": "block_size",
             "prefix_caching": "enable_prefix_caching", "preemption": "preemption_mode"}


@dataclass(frozen=True)
class Arm:
    """One configuration of an A/B replay: a label and the engine options it changes."""

    label: str
    options: tuple[tuple[str, object], ...]

    @property
    def as_dict(self) -> dict:
        return dict(self.options)


def _value(key: str, text: str):
    if key == "block_size":
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"--vary block_size={text!r}: give positive integers, e.g. block_size=8,16,32")
        return int(text)
    if key == "prefix_caching":
        if text.lower() not in _ONOFF:
            raise ValueError(f"--vary prefix_caching={text!r}: give on or off")
        return _ONOFF[text.lower()]
    return text


def parse_vary(items: list[str], base: EngineConfig) -> list[Arm]:
    """`["allocator=paged,contiguous", "scheduling=fcfs,fair"]` -> every combination, in order;
    each arm's options are checked by EngineConfig (its choices), so a policy added there is a
    value here. No item: one arm, as recorded. A bad key or value is one ValueError line."""
    axes: list[tuple[str, list]] = []
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not values:
            raise ValueError(f"--vary {item!r}: write KEY=V1,V2 (keys: {', '.join(VARY_KEYS)})")
        if key not in VARY_KEYS:
            raise ValueError(f"--vary: unknown key {key!r}; choose from {', '.join(VARY_KEYS)}")
        if key in (k for k, _ in axes):
            raise ValueError(f"--vary: {key} is given twice; list all its values once, e.g. {key}=a,b")
        axes.append((key, [_value(key, v.strip()) for v in values.split(",") if v.strip()]))
    arms = []
    for combo in itertools.product(*(vals for _, vals in axes)):
        options = tuple((VARY_KEYS[k], v) for (k, _), v in zip(axes, combo))
        try:
            base.replace(**dict(options))
        except (ValueError, TypeError) as err:
            raise ValueError(f"--vary: {err}") from None
        label = " ".join(f"{k}={_show(v)}" for (k, _), v in zip(axes, combo)) or "as recorded"
        arms.append(Arm(label, options))
    return arms


def _show(v) -> str:
    return {True: "on", False: "off"}.get(v, str(v)) if isinstance(v, bool) else str(v)


def config_of(trace: Trace, **override) -> EngineConfig:
    """The recording engine's options (those EngineConfig knows), with `override` on top."""
    known = {f for f in EngineConfig.__dataclass_fields__}
    recorded = {k: v for k, v in trace.header.config.items() if k in known and k not in ("device", "dtype")}
    return EngineConfig(**recorded).replace(**override)


def tenant_specs(trace: Trace) -> tuple[TenantSpec, ...]:
    return tuple(TenantSpec(name, t.get("weight", 1.0), t.get("max_blocks")) for name, t in trace.header.tenants.items())


def _draw(seed_hex: str, n: int, vocab: int) -> list[int]:
    low = min(100, max(3, vocab // 8))            # clear of the special tokens at the bottom of a vocabulary
    return np.random.default_rng(int(seed_hex, 16)).integers(low, vocab, n).tolist()


def rebuilt_tokens(r: TraceRequest, block_size: int, vocab: int) -> tuple[list[int], list[int]]:
    """(prompt, output) of one request: its kept ids, else drawn from its block hashes."""
    out_len = r.output_len or 0
    if r.prompt_token_ids is not None and (r.output_token_ids is not None or not out_len):
        return list(r.prompt_token_ids), list(r.output_token_ids or [])
    total = r.prompt_len + out_len
    tokens = [t for h in r.block_hashes for t in _draw(h, block_size, vocab)]
    tokens += _draw(r.prompt_hash, total - len(tokens), vocab)
    return tokens[:r.prompt_len], tokens[r.prompt_len:total]


def sim_requests(trace: Trace, vocab: int, clock: str = "steps", repeat: int = 1) -> list[SimRequest]:
    """The trace's finished requests for the simulator, arriving at their recorded step (clock
    "steps": a cost model of one second per step then counts steps) or second ("s"). `repeat`
    copies each request that many times at the same arrival (the rate times `repeat`), each copy
    keeping its blocks' sharing structure."""
    out = []
    for r in trace.finished:
        prompt, output = rebuilt_tokens(r, trace.header.block_size, vocab)
        at = float(r.arrival_step) if clock == "steps" else r.arrival_s
        for k in range(repeat):
            rid = r.request_id if repeat == 1 else f"{r.request_id}#{k}"
            out.append(SimRequest(rid, at, prompt, output, r.max_tokens, r.priority, r.tenant))
    return out


def trace_of(requests: list[SimRequest], block_size: int, keep_prompts: bool = True, model: str = "synthetic",
             vocab: int = 32000, tenants: dict | None = None, config: dict | None = None) -> Trace:
    """A trace of a generated workload (`synthetic`, `noisy_neighbour`): what `bench tail` and
    `bench tenants` serve, so a replay of it can be checked against their figures. Arrival seconds
    are kept; steps are the seconds rounded down."""
    from ..engine.trace import BlockHasher, TraceHeader

    hasher = BlockHasher(block_size)
    reqs = []
    for r in requests:
        ids = list(r.prompt_ids) + list(r.output_ids)
        hashes = hasher.block_hashes(ids)
        reqs.append(TraceRequest(r.request_id, r.arrival_s, int(r.arrival_s), r.prompt_len, hashes,
                                 hasher.prompt_hash(r.prompt_ids, hashes[:r.prompt_len // block_size]),
                                 {"temperature": 0.0}, r.max_tokens, r.tenant, r.priority, r.output_len,
                                 "length" if r.output_len == r.max_tokens else "stop",
                                 prompt_token_ids=list(r.prompt_ids) if keep_prompts else None,
                                 output_token_ids=list(r.output_ids) if keep_prompts else None))
    return Trace(TraceHeader(model, None, block_size, vocab, keep_prompts, config or {}, tenants or {}), reqs)
