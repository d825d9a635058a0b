"""Pure parts of `bench throughput`: which dtypes run, per-round ratios, the tables and the JSON.

Kept apart from the measuring code so that tests can check the arithmetic without loading a
model, and so that the printed report and the JSON are built from the same numbers.
"""
from __future__ import annotations

import datetime
import platform
import statistics
from typing import Any

from ..worker import loader
from ..gpucheck.report import cpu_isa

ALL_DTYPES = ("float32", "bfloat16")


def choose_dtypes(requested: list[str] | None) -> tuple[list[str], str | None]:
    """The dtypes to measure and a note to print. Asked-for dtypes run as asked; by default bf16
    runs only where the CPU computes it natively (elsewhere torch emulates it, slower than fp32,
    and that row would only measure the emulation)."""
    if requested:
        return list(dict.fromkeys(requested)), None
    if loader.native_bf16():
        return list(ALL_DTYPES), None
    return ["float32"], (f"bfloat16 rows skipped: this CPU lacks native bf16 (no AMX or AVX-512 BF16; "
                         f"ISA: {cpu_isa()})")


def machine_info(model: str, torch_version: str, threads: int) -> dict[str, Any]:
    """The facts printed atop the report and stored under "machine"."""
    return {"cpu": _cpu_name(), "isa": cpu_isa(), "native_bf16": loader.native_bf16(),
            "threads": threads, "torch": torch_version, "model": model,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def per_round_ratios(ours_tokens: int, ours_s: list[float], peer_tokens: int,
                     peer_s: list[float]) -> list[float]:
    """ours tokens/s over the peer's, round i against round i (the shorter list sets the count)."""
    return [(ours_tokens / a) / (peer_tokens / b) for a, b in zip(ours_s, peer_s)]


def ratio_line(label: str, ratios: list[float]) -> str:
    """`ours / HF per round: 1.71x, 1.74x; median 1.72x`."""
    if not ratios:
        return f"ours / {label}: no rounds to pair"
    return (f"ours / {label} per round: {', '.join(f'{r:.2f}x' for r in ratios)}; "
            f"median {statistics.median(ratios):.2f}x")


def system_row(system: str, tokens: int, round_seconds: list[float], ours_tokens: int,
               ours_round_seconds: list[float]) -> dict[str, Any]:
    """One table row. `seconds` is the median round; `ours_over` the median of the per-round
    ratios (what the per-round line prints), so one noisy round cannot set it alone."""
    seconds = statistics.median(round_seconds)
    ratios = per_round_ratios(ours_tokens, ours_round_seconds, tokens, round_seconds)
    return {"system": system, "tokens": tokens, "round_seconds": list(round_seconds), "seconds": seconds,
            "tokens_per_s": tokens / seconds, "ours_over": statistics.median(ratios) if ratios else None,
            "ours_over_per_round": ratios}


def throughput_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| system | tokens | seconds | tokens/s | ours / system |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        over = f"{r['ours_over']:.2f}x" if r["ours_over"] is not None else "-"
        lines.append(f"| {r['system']} | {r['tokens']} | {r['seconds']:.1f} | {r['tokens_per_s']:.1f} | {over} |")
    return lines


def agreement_lines(dtype: str, outputs: dict[str, list[list[int]]], ours: str) -> list[str]:
    """Greedy-output agreement of every peer with ours, in this dtype."""
    ref = outputs.get(ours)
    if ref is None:
        return []
    return [f"{dtype}: greedy outputs identical to ours: {name}: "
            f"{sum(a == b for a, b in zip(ref, outs))}/{len(outs)}"
            for name, outs in outputs.items() if name != ours]


def long_entry(ours_s: list[float], hf_s: list[float], ours_token: int | None,
               hf_token: int | None, cached_s: list[float] = (), lone_s: list[float] = ()) -> dict[str, Any]:
    """One prompt length in one dtype: TTFT pairs, their ratios, and the first tokens; and, per
    round, the TTFT of a few new tokens over the cached prompt against the same tokens alone."""
    ratios = [a / b for a, b in zip(ours_s, hf_s)]
    over = [c / lone for c, lone in zip(cached_s, lone_s)]
    return {"ours_s": list(ours_s), "hf_s": list(hf_s), "ratio_per_round": ratios,
            "ratio_median": statistics.median(ratios) if ratios else None,
            "ours_first_token": ours_token, "hf_first_token": hf_token,
            "same_first_token": ours_token == hf_token,
            "cached_prefix_s": list(cached_s), "new_tokens_alone_s": list(lone_s),
            "cached_over_alone_per_round": over,
            "cached_over_alone_median": statistics.median(over) if over else None}


def long_table(results: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """results[dtype][length] -> rows: every pair's times and ratio, and the median ratio."""
    lines = ["| dtype | prompt tokens | ours TTFT s per round | transformers prefill s per round "
             "| ours / transformers per round | median | new tokens over the cached prompt, ms "
             "| the same alone, ms |", "|---|---:|---|---|---|---:|---|---|"]
    for dtype, by_len in results.items():
        for length, e in by_len.items():
            med = f"{e['ratio_median']:.2f}x" if e["ratio_median"] is not None else "-"
            cached = [s * 1e3 for s in e.get("cached_prefix_s", [])]
            lone = [s * 1e3 for s in e.get("new_tokens_alone_s", [])]
            lines.append(f"| {dtype} | {length} | {_join(e['ours_s'], '{:.2f}')} | {_join(e['hf_s'], '{:.2f}')} "
                         f"| {_join(e['ratio_per_round'], '{:.2f}x')} | {med} | {_join(cached, '{:.0f}') or '-'} "
                         f"| {_join(lone, '{:.0f}') or '-'} |")
    return lines


def step_table(step: dict[str, dict[str, Any]], gemm: dict[str, dict[str, Any]]) -> list[str]:
    """"Where the step goes": one row per dtype, shares of the profiled decode step's wall time."""
    lines = ["| dtype | ms/step | GEMMs | attention | KV gather/write | other ops | Python/framework "
             "| GEMM GFLOP/s | peak GFLOP/s | of peak |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for dtype, s in step.items():
        g = gemm.get(dtype, {})
        lines.append(f"| {dtype} | {s['ms_per_step']:.1f} | {s['gemm_pct']:.0f}% | {s['attention_pct']:.0f}% "
                     f"| {s['kv_pct']:.0f}% | {s['other_pct']:.0f}% | {s['overhead_pct']:.0f}% "
                     f"| {_num(g.get('decode_gflops'))} | {_num(g.get('peak_gflops'))} "
                     f"| {_pct(g.get('fraction'))} |")
    return lines


def gemm_entry(peak_gflops: float, peak_rows: int, flops_per_step: int,
               gemm_s_per_step: float) -> dict[str, Any]:
    """The decode step's GEMM rate and its share of the machine's measured peak."""
    decode = flops_per_step / gemm_s_per_step / 1e9 if gemm_s_per_step > 0 else None
    return {"peak_gflops": peak_gflops, "peak_rows": peak_rows, "flops_per_step": flops_per_step,
            "decode_gflops": decode, "fraction": decode / peak_gflops if decode and peak_gflops else None}


def assemble(machine: dict, throughput: dict, long_prompt: dict, gemm: dict, step: dict,
             agreement: dict | None = None, notes: list[str] | None = None) -> dict[str, Any]:
    """The JSON document, keys in a fixed order (see throughput.py's docstring)."""
    return {"machine": machine, "throughput": throughput, "agreement": dict(agreement or {}),
            "long_prompt": long_prompt, "gemm": gemm, "step": step, "notes": list(notes or [])}


def _join(xs: list[float], fmt: str) -> str:
    return ", ".join(fmt.format(x) for x in xs)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def shape_row(shape: str, requests: int, tokens: int, ours_s: list[float], peer_tokens: int | None,
              peer_s: list[float]) -> dict[str, Any]:
    """One workload shape: ours (median round) and the peer's, and ours over it round by round."""
    ratios = per_round_ratios(tokens, ours_s, peer_tokens, peer_s) if peer_tokens else []
    ours = tokens / statistics.median(ours_s)
    peer = peer_tokens / statistics.median(peer_s) if peer_tokens and peer_s else None
    return {"shape": shape, "requests": requests, "tokens": tokens, "ours_round_seconds": list(ours_s),
            "ours_tokens_per_s": ours, "peer_round_seconds": list(peer_s), "peer_tokens_per_s": peer,
            "ours_over_per_round": ratios, "ours_over": statistics.median(ratios) if ratios else None}


def shapes_table(rows: list[dict[str, Any]], peer: str) -> list[str]:
    lines = [f"| shape | requests | tokens | ours tokens/s | {peer} tokens/s | ours / peer per round | median |",
             "|---|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        over = f"{r['ours_over']:.2f}x" if r["ours_over"] is not None else "-"
        lines.append(f"| {r['shape']} | {r['requests']} | {r['tokens']} | {r['ours_tokens_per_s']:.1f} "
                     f"| {_num(r['peer_tokens_per_s'])} | {_join(r['ours_over_per_round'], '{:.2f}x') or '-'} "
                     f"| {over} |")
    return lines


def minimum_ratio(rows: list[dict[str, Any]]) -> tuple[float, str] | None:
    """The acceptance figure: the smallest median ratio over the shapes, and its shape."""
    measured = [(r["ours_over"], r["shape"]) for r in rows if r["ours_over"] is not None]
    return min(measured) if measured else None
