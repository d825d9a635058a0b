"""The parts of the GPU check (`bench gpu`), one process each: `python -m
jupyter_pagedkv.bench.gpu_parts NAME --json PATH [--smoke]`.

A part fills a `Report`, which is saved after every finding: a part cut off by its time slice
still hands the driver what it had measured. Every part runs unchanged on a CPU with `--smoke`
(the rehearsal), so the code that meets a GPU for the first time has already run end to end.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from .gpu_report import Report, device

REPO = Path(__file__).resolve().parents[2]


def cpu_isa() -> str:
    """The vector extensions that decide CPU speed (benchmarks print them beside their tables)."""
    try:
        flags = set(re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M).group(1).split())
    except (OSError, AttributeError):
        return platform.machine()
    names = ["avx2", "avx512f", "avx512_bf16", "amx_bf16"]
    return ", ".join(n for n in names if n in flags) or "no AVX2"


# -- env --------------------------------------------------------------------------------------
def env(report: Report, smoke: bool) -> None:
    import transformers
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "missing"
    facts = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton_version,
             "transformers": transformers.__version__, "cuda": torch.version.cuda,
             "cpu": f"{platform.processor() or platform.machine()} ({cpu_isa()}), {os.cpu_count()} cores",
             "triton_interpret": os.environ.get("TRITON_INTERPRET", "0")}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                     multiprocessors=props.multi_processor_count,
                     memory_gib=round(props.total_memory / 2**30, 1))
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            facts["nvidia_smi"] = smi.stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as err:
            facts["nvidia_smi"] = f"unavailable: {err}"
    else:
        facts["gpu"] = "none (CPU rehearsal)"
    report.put("facts", facts)
    report.line("| what | value |")
    report.line("|---|---|")
    for key, value in facts.items():
        report.line(f"| {key} | {value} |")
    report.finish(True)


# -- kernel_tests -----------------------------------------------------------------------------
def kernel_tests(report: Report, smoke: bool) -> None:
    """tests/worker/test_kernels.py on the device, ignoring the repository's pytest configuration (its
    addopts name nbval options a bare image cannot parse)."""
    env_vars = dict(os.environ, PAGEDKV_KERNEL_TEST_DEVICE=device().type)
    cmd = [sys.executable, "-m", "pytest", "-c", os.devnull, "--rootdir", str(REPO), "-p", "no:cacheprovider",
           "-q", "-rfE", "--durations=5", str(REPO / "tests" / "worker" / "test_kernels.py")]
    proc = subprocess.run(cmd, cwd=REPO, env=env_vars, capture_output=True, text=True)
    print(proc.stdout[-20000:], proc.stderr[-5000:], flush=True)
    tail = [ln for ln in proc.stdout.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    summary = tail[-1].strip("= ") if tail else f"pytest exited {proc.returncode} without a summary"
    failures = [ln for ln in proc.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    report.put("pytest", {"returncode": proc.returncode, "summary": summary, "failures": failures})
    report.line(f"`pytest tests/worker/test_kernels.py` on {device().type}"
                f"{' (Triton interpreter)' if os.environ.get('TRITON_INTERPRET') == '1' else ''}: {summary}")
    for ln in failures[:20]:
        report.line(f"- {ln}")
    report.finish(proc.returncode == 0)


# -- kernel_bench -----------------------------------------------------------------------------
def kernel_bench(report: Report, smoke: bool) -> None:
    from jupyter_pagedkv.worker.kernels_bridge import kernel_module

    result = kernel_module("bench").measure(["--smoke"] if smoke else [])
    report.put("bench", result)
    report.line(" / ".join(result["header"]))
    report.line(f"copy bandwidth (read + write): {result['copy_bandwidth_gbs']:.1f} GB/s; shape {result['shape']}")
    report.line("")
    report.line("| batch | context | splits | paged ms | paged GB/s | of copy | SDPA ms | paged / SDPA | max diff |")
    report.line("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in result["rows"]:
        if "skipped" in r:
            report.line(f"| {r['batch']} | {r['context']} | skipped: {r['skipped']} | | | | | | |")
            continue
        sdpa = (f"{r['sdpa_ms']:.4f} | {r['paged_over_sdpa']:.2f} | {r['max_diff']:.1e}" if "sdpa_ms" in r
                else "out of memory | | ")
        report.line(f"| {r['batch']} | {r['context']} | {r['splits']} | {r['paged_ms']:.4f} | "
                    f"{r['paged_gbs']:.1f} | {r['of_copy']:.1%} | {sdpa} |")
    if result["device"] == "cuda":
        big = [r for r in result["rows"] if "of_copy" in r and r["batch"] >= 64 and r["context"] >= 2048]
        timed = [r for r in result["rows"] if "paged_over_sdpa" in r]
        report.put("targets", {
            "of_copy_min_at_batch64_ctx2k": min((r["of_copy"] for r in big), default=None),
            "paged_over_sdpa_max": max((r["paged_over_sdpa"] for r in timed), default=None)})
        report.line("")
        report.line(f"targets (H200): of copy >= 80% at batch >= 64, context >= 2k: worst "
                    f"{report.data['targets']['of_copy_min_at_batch64_ctx2k']}; paged/SDPA <= 1.15: worst "
                    f"{report.data['targets']['paged_over_sdpa_max']}")
    report.finish(bool(result["rows"]) and all("paged_ms" in r or "skipped" in r for r in result["rows"]))


# -- exactness --------------------------------------------------------------------------------
def exactness(report: Report, smoke: bool) -> None:
    """Greedy outputs of the engine on the device, Triton and torch backends, against
    transformers `generate` (sdpa) on the same device: token-identical, or the first difference
    a checked near-tie (the oracle's top-2 logit gap below the threshold)."""
    from ..core.sampling_params import SamplingParams
    from ..engine.engine import Engine
    from jupyter_pagedkv.bench.models import TINY_ARCHS, compare_with_oracle, hf_greedy, random_prompts, \
        shaped_model, tiny_model

    dev = device()
    threshold = 1e-3
    n, new, hi = (2, 6, 20) if smoke else (8, 32, 120)
    cases = [(arch, lambda a=arch: tiny_model(a).to(dev), 256) for arch in TINY_ARCHS]
    cases.append(("smollm2-135m shape" + (", 2 layers" if smoke else ""),
                  lambda: shaped_model("smollm2-135m", torch.float32, dev, num_layers=2 if smoke else None,
                                       sharpen=True), 49152))
    report.line(f"fp32, greedy, {n} prompts of 1-{hi - 1} random tokens, {new} new tokens each, EOS "
                f"ignored; near-tie threshold {threshold:g} (top-2 logit gap of the oracle)")
    report.line("")
    report.line("| model | backend | identical | near-ties (gap) | wrong |")
    report.line("|---|---|---:|---|---:|")
    ok = True
    rows = []
    for name, build, vocab in cases:
        model = build()
        prompts = random_prompts(n, vocab, seed=7, lo=1, hi=hi)
        refs = [hf_greedy(model, p, new, stop_at_eos=False) for p in prompts]
        for backend in ("triton", "torch"):
            engine = Engine(model, attention_backend=backend, kv_cache_memory="256MiB", pack_weights=False)
            try:
                outs = engine.generate(prompts, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
                engine.check_invariants()
            finally:
                engine.shutdown()
            found = [compare_with_oracle(model, p, o.token_ids, r) for p, o, r in zip(prompts, outs, refs)]
            same = sum(f.identical for f in found)
            ties = [f for f in found if not f.identical and f.near_tie(threshold)]
            wrong = [f for f in found if not f.near_tie(threshold)]
            ok &= not wrong
            rows.append({"model": name, "backend": backend, "identical": same, "near_ties": len(ties),
                         "wrong": len(wrong), "gaps": [f.gap for f in found if not f.identical]})
            report.put("rows", rows)
            gaps = ", ".join(f"{f.gap:.1e}" for f in ties)
            report.line(f"| {name} | {backend} | {same}/{n} | {len(ties)}{f' ({gaps})' if gaps else ''} | "
                        f"{len(wrong)} |")
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    report.finish(ok)


PARTS = {"env": env, "kernel_tests": kernel_tests, "kernel_bench": kernel_bench, "exactness": exactness}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jupyter_pagedkv.bench.gpu_parts")
    ap.add_argument("part")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    from . import architectures, gpu_graphs, gpu_throughput
    parts = {**PARTS, **gpu_graphs.PARTS, **gpu_throughput.PARTS, **architectures.PARTS}
    if args.part not in parts:
        print(f"unknown part {args.part!r}: one of {sorted(parts)}", file=sys.stderr)
        return 2
    report = Report(args.json)
    t0 = time.perf_counter()
    try:
        parts[args.part](report, args.smoke)
    except BaseException as err:
        report.line(f"raised {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        report.finish(False)
        raise
    print(f"[{args.part}: {time.perf_counter() - t0:.1f} s]")
    return 0 if report.data["status"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
