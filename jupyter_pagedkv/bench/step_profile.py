"""Where a decode step goes: our engine at batch 32, pure-decode steps under torch.profiler.

Why: tokens/s alone does not say whether a step is bound by the GEMMs (then the machine's GEMM
peak is the ceiling), by attention and KV traffic, or by Python around the ops. The profiler's
op self times are split into those parts; whatever the step's wall time holds beyond all op
self time is Python and framework overhead. The profiler slows each op call a little, so the
step time reported is a separate, unprofiled timing of as many steps.
"""
from __future__ import annotations

import time
from typing import Any, Iterable

import torch
from torch import nn

# Op names (profiler keys) per part; everything else that is an op is "other".
GEMM_OPS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::scaled_dot_product_attention",
                 "aten::_scaled_dot_product_attention_math", "aten::_scaled_dot_product_flash_attention",
                 "pagedkv::paged_decode_attention")
KV_OPS = ("aten::index_select", "aten::index_copy_", "aten::index_copy")
PARTS = ("gemm", "attention", "kv", "other", "overhead")


def part_of(op: str) -> str:
    """The part an op's self time counts towards."""
    if op in GEMM_OPS:
        return "gemm"
    if op in ATTENTION_OPS or "scaled_dot_product" in op:
        return "attention"
    if op in KV_OPS:
        return "kv"
    return "other"


def breakdown(op_self_us: Iterable[tuple[str, float]], wall_s: float, steps: int) -> dict[str, Any]:
    """Split `steps` profiled steps of `wall_s` seconds into the PARTS: ms per step and percent
    of the wall time. `op_self_us` holds (op name, self CPU microseconds) over all the steps;
    overhead is the wall time no op accounts for (negative only if the profiler double counts)."""
    sums = {p: 0.0 for p in PARTS}
    for op, us in op_self_us:
        sums[part_of(op)] += us / 1e6
    sums["overhead"] = wall_s - sum(sums[p] for p in PARTS if p != "overhead")
    out: dict[str, Any] = {"steps": steps, "profiled_ms_per_step": wall_s / steps * 1e3}
    for p in PARTS:
        out[f"{p}_ms"] = sums[p] / steps * 1e3
        out[f"{p}_pct"] = 100 * sums[p] / wall_s if wall_s > 0 else 0.0
    return out


def linear_weight_elements(model: nn.Module) -> int:
    """Weights every token multiplies through once per forward: all nn.Linear layers, lm_head
    included (counted once even when tied to the embedding, which is no Linear)."""
    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, nn.Linear) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            total += m.weight.numel()
    return total


def decode_flops(model: nn.Module, batch: int) -> int:
    """GEMM FLOPs of one decode step of `batch` sequences (lm_head runs for every row)."""
    return 2 * batch * linear_weight_elements(model)


def _prompts(tokenizer, vocab: int, batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    from .long_prompt import random_prompt

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(prompt_len - 4, prompt_len + 4, (batch,), generator=g).tolist()
    return [random_prompt(n, vocab, tokenizer, seed + i) for i, n in enumerate(lengths)]


def profile_decode(model, tokenizer, batch: int = 32, prompt_len: int = 64, steps: int = 10,
                   seed: int = 0) -> dict[str, Any]:
    """Fill an engine with `batch` requests, step until all decode, then time `steps` steps
    plainly and `steps` more under the profiler; returns the breakdown and ms_per_step."""
    from torch.profiler import ProfilerActivity, profile

    from ..core.sampling_params import SamplingParams
    from ..engine.engine import Engine

    engine = Engine(model, tokenizer, max_num_seqs=64, max_num_batched_tokens=2048)
    warm = 3
    params = SamplingParams(max_tokens=2 * steps + warm + 8, temperature=0.0, ignore_eos=True)
    ids = {engine.add_request(p, params) for p in _prompts(tokenizer, model.config.vocab_size, batch,
                                                            prompt_len, seed)}
    decoding: set[str] = set()
    with torch.inference_mode():
        while decoding != ids:          # prefill (possibly in chunks) until every one has a token
            decoding |= {o.request_id for o in engine.step() if o.token_ids}
        for _ in range(warm):
            engine.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            _full_step(engine, batch)
        plain_s = time.perf_counter() - t0
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                _full_step(engine, batch)
            wall_s = time.perf_counter() - t0
    ops = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
    out = breakdown(ops, wall_s, steps)
    out.update(batch=batch, ms_per_step=plain_s / steps * 1e3,
               gemm_s_per_step=out["gemm_ms"] / 1e3)
    for rid in ids:
        engine.abort(rid)
    return out


def _full_step(engine, batch: int) -> None:
    """One step that must still be a pure decode of the whole batch (else the numbers mislead)."""
    outs = engine.step()
    if len(outs) != batch or any(o.finished for o in outs):
        raise RuntimeError(f"expected a decode step of {batch} running requests, got {len(outs)} outputs")
