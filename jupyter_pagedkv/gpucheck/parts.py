"""The parts of the GPU check (`bench gpu`), one process each:
`python -m jupyter_pagedkv.gpucheck.parts NAME --events FILE --dir FOLDER [--deadline T] [--smoke]`.

A part fills a `Report`, which appends every finding to the events file the moment it is found:
a part cut off by its time slice still hands the driver what it had measured. Every part runs
unchanged on a CPU with `--smoke` (the rehearsal), so the code that meets a GPU for the first time
has already run end to end.
"""
from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch

from .report import Report, cpu_isa, device, run_child

REPO = Path(__file__).resolve().parents[2]
# What a part needs after its last action to record it and exit, inside its slice.
EXIT_MARGIN_S = 8.0


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


# -- compile ----------------------------------------------------------------------------------
COMPILE_CHECK = "compile_check"


def device_arch() -> str:
    """The compute capability to compile for: the device's, or sm_90 (H100/H200) without one.
    Read through nvidia-smi, so this process never starts CUDA before the compile check forks
    its workers (a forked child cannot use CUDA its parent started)."""
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        cap = smi.stdout.strip().splitlines()[0].strip() if smi.returncode == 0 and smi.stdout.strip() else ""
    except (OSError, subprocess.TimeoutExpired):
        cap = ""
    return cap.replace(".", "") if cap.replace(".", "").isdigit() else "90"


def compile_kernels(report: Report, smoke: bool) -> None:
    """Every kernel variant compiled by Triton's own compiler (ptxas) for the device's architecture,
    through the kernels package's `compile_check` module; its rows land in `compile/compile.jsonl`
    one by one."""
    from jupyter_pagedkv.worker.kernels_bridge import KERNELS_PACKAGE, kernel_module

    arch = device_arch()
    rows = report.file("compile.jsonl")
    try:
        check = kernel_module(COMPILE_CHECK)
    except ModuleNotFoundError as err:
        if err.name != f"{KERNELS_PACKAGE}.{COMPILE_CHECK}":
            raise
        report.line(f"compile_check missing: no kernels/{COMPILE_CHECK}.py in this checkout, nothing compiled")
        report.finish(False, "compile_check missing")
        return
    argv = ["--quick", "--arch", arch, "--jsonl", str(rows)]
    report.line(f"`kernels/{COMPILE_CHECK}.py {' '.join(argv)}` (sm_{arch})")
    code = check.main(argv)
    variants = sum(1 for _ in open(rows)) if rows.exists() else 0
    report.put("compile", {"arch": arch, "exit": code, "variants": variants})
    report.line(f"exit {code}; {variants} variant rows in {rows.parent.name}/{rows.name}")
    report.finish(code == 0, "" if code == 0 else f"compile_check exit {code}")


# -- kernel_tests -----------------------------------------------------------------------------
def run_pytest(report: Report, tests: list[str], extra_env: dict[str, str] | None = None) -> int | None:
    """pytest on `tests` with the repository's configuration ignored (its addopts name nbval
    options the bare image cannot parse). Each test's outcome is appended as a row the moment it
    ends (pytest_plugin), junit XML goes into the part's folder, the output flows to the driver as it
    comes, and pytest gets its own timeout inside the part's slice: on it, SIGINT (pytest then
    writes its junit file for the tests that ran), then a kill. Returns pytest's exit status, or
    None when it was cut off."""
    from .pytest_plugin import EVENTS_ENV, PART_ENV

    env_vars = dict(os.environ, **(extra_env or {}), **{EVENTS_ENV: str(report.events), PART_ENV: report.part})
    cmd = [sys.executable, "-m", "pytest", "-c", os.devnull, "-o", "addopts=", "--rootdir", str(REPO),
           "-p", "no:cacheprovider", "-p", "jupyter_pagedkv.gpucheck.pytest_plugin", "-q", "-rfE", "--durations=5",
           "--junitxml", str(report.file("junit.xml")), *tests]
    left = report.seconds_left()
    timeout = None if left is None else max(1.0, left - EXIT_MARGIN_S)
    report.line(f"`pytest {' '.join(os.path.relpath(t, REPO) for t in tests)}` on {device().type}"
                f"{' (Triton interpreter)' if os.environ.get('TRITON_INTERPRET') == '1' else ''}"
                + (f", timeout {timeout:.0f} s" if timeout else ""))
    sys.stdout.flush()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env_vars)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=EXIT_MARGIN_S / 2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        report.line(f"pytest cut off after its {timeout:.0f} s timeout")
        return None


def kernel_tests(report: Report, smoke: bool) -> None:
    # the model-dtype cache's kernels, then a quantized cache's (fp8 e4m3 and int8 codes)
    code = run_pytest(report, [str(REPO / "tests" / "worker" / name) for name in ("test_kernels.py",
                                                                                 "test_kernels_quant.py")],
                      {"PAGEDKV_KERNEL_TEST_DEVICE": device().type})
    from .report import fold
    tests = fold(report.events, {}).get(report.part, {}).get("rows", {}).get("tests", [])
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    report.put("pytest", {"exit": code, **counts})
    report.line("outcomes: " + (", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "none"))
    for t in tests:
        if t["outcome"] == "failed":
            report.line(f"- FAILED {t['test']} ({t['phase']}): {t.get('message', '')}")
    report.finish(code == 0, "pytest cut off" if code is None else f"pytest exit {code}")


# -- kernel_bench -----------------------------------------------------------------------------
def kernel_bench(report: Report, smoke: bool) -> None:
    """The decode kernel benchmark one batch x context at a time, each row saved as it is measured."""
    from jupyter_pagedkv.worker.kernels_bridge import kernel_module

    bench = kernel_module("bench")
    batches = (1, 2) if smoke else bench.FULL_BATCHES
    contexts = (40, 100) if smoke else bench.FULL_CONTEXTS
    rows, first = [], None
    for batch in batches:
        for context in contexts:
            result = bench.measure((["--smoke"] if smoke else []) + ["--batches", str(batch),
                                                                     "--contexts", str(context)])
            if first is None:
                first = result
                report.line(" / ".join(result["header"]))
                report.line(f"shape {result['shape']}")
                report.line("")
                report.line("times: CUDA-graph replays (the device's time); eager launch: one paged call "
                            "launched from Python, as an eager step pays it" if result["device"] == "cuda"
                            else "times: wall clock, Triton's interpreter (meaningless for speed)")
                report.line("")
                report.line("| batch | context | splits | paged ms | paged GB/s | of copy | SDPA ms | paged / SDPA "
                            "| max diff | eager launch ms |")
                report.line("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            for r in result["rows"]:
                r = {**r, "copy_bandwidth_gbs": result["copy_bandwidth_gbs"]}
                rows.append(r)
                report.row("kernel_bench", r)
                report.line(_bench_line(r))
            if result["device"] == "cuda":
                torch.cuda.empty_cache()
    if first is not None and first["device"] == "cuda":
        big = [r for r in rows if "of_copy" in r and r["batch"] >= 64 and r["context"] >= 2048]
        timed = [r for r in rows if "paged_over_sdpa" in r]
        targets = {"of_copy_min_at_batch64_ctx2k": min((r["of_copy"] for r in big), default=None),
                   "paged_over_sdpa_max": max((r["paged_over_sdpa"] for r in timed), default=None)}
        report.put("targets", targets)
        report.line("")
        report.line(f"targets (H200): of copy >= 80% at batch >= 64, context >= 2k: worst "
                    f"{targets['of_copy_min_at_batch64_ctx2k']}; paged/SDPA <= 1.15: worst "
                    f"{targets['paged_over_sdpa_max']}")
    report.finish(bool(rows) and all("paged_ms" in r or "skipped" in r for r in rows))


def _bench_line(r: dict) -> str:
    if "skipped" in r:
        return f"| {r['batch']} | {r['context']} | skipped: {r['skipped']} | | | | | | | |"
    sdpa = (f"{r['sdpa_ms']:.4f} | {r['paged_over_sdpa']:.2f} | {r['max_diff']:.1e}" if "sdpa_ms" in r
            else "out of memory | | ")
    launch = f"{r['launch_ms']:.4f}" if "launch_ms" in r else r.get("timing", "-")
    return (f"| {r['batch']} | {r['context']} | {r['splits']} | {r['paged_ms']:.4f} | {r['paged_gbs']:.1f} | "
            f"{r['of_copy']:.1%} | {sdpa} | {launch} |")


# -- e2e --------------------------------------------------------------------------------------
def e2e(report: Report, smoke: bool) -> None:
    """One end-to-end point, CUDA graphs off then on (`cuda_graphs=False/True`), each after a
    warm-up run: tokens/s and the graph replays that show graphs were used. On a CPU graphs cannot
    be captured, so "on" runs the same padded decode path eagerly."""
    from .throughput import run_ours, workload
    from ..testing.models import shaped_model

    dev = device()
    on_gpu = dev.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    model = shaped_model("smollm2-135m", dtype, dev, num_layers=1 if smoke else None)
    n = 4 if smoke else 32
    budget = 8192 if on_gpu else 512
    prompts, limits = workload(n, model.config.vocab_size, smoke, seed=n)
    warm_prompts, warm_limits = workload(2, model.config.vocab_size, True, seed=99)
    modes = {False: {"cuda_graphs": False},
             True: {"cuda_graphs": True} if on_gpu else {"cuda_graphs": False, "pad_decode": True}}
    report.line(f"SmolLM2-135M shape{', 1 layer' if smoke else ''}, random weights, "
                f"{str(dtype).replace('torch.', '')}, {n} requests, {sum(limits)} tokens, greedy, Triton "
                f"attention on {dev.type}; each mode warmed up first"
                + ("" if on_gpu else "; graphs 'on' runs padded eagerly here (no CUDA)"))
    report.line("")
    report.line("| CUDA graphs | tokens | seconds | tokens/s | graphs captured | graph replays |")
    report.line("|---|---:|---:|---:|---:|---:|")
    ok, outputs = True, {}
    with torch.inference_mode():
        for graphs_on, options in modes.items():
            run_ours(model, warm_prompts, warm_limits, backend="triton", budget_tokens=budget, timings=None, **options)
            outs, facts = run_ours(model, prompts, limits, backend="triton", budget_tokens=budget, timings=None,
                                   **options)
            outputs[graphs_on] = outs
            produced = sum(len(o) for o in outs)
            row = {"cuda_graphs": graphs_on, "options": options, "requests": n, "tokens": produced,
                   "seconds": facts["seconds"], "tokens_per_s": produced / facts["seconds"],
                   "graphs_captured": facts["graphs_captured"], "graph_replays": facts["graph_replays"]}
            report.row("e2e", row)
            report.line(f"| {'on' if graphs_on else 'off'} | {produced} | {facts['seconds']:.2f} | "
                        f"{row['tokens_per_s']:.0f} | {facts['graphs_captured']} | {facts['graph_replays']} |")
            ok &= produced == sum(limits)
            if graphs_on and on_gpu and not facts["graph_replays"]:
                report.line("graphs were asked for but no step was replayed from one (captures failed or "
                            "were refused: see the part's log)")
                ok = False
    agree = sum(a == b for a, b in zip(outputs[False], outputs[True]))
    report.put("agreement", {"identical": agree, "of": n})
    report.line("")
    report.line(f"graphs on vs off: {agree}/{n} token-identical"
                + (" (bf16: reduction order may flip near-ties)" if on_gpu else " (fp32 on a CPU: must be all)"))
    ok &= on_gpu or agree == n
    report.finish(ok)


PARTS = {"env": env, "compile": compile_kernels, "kernel_tests": kernel_tests, "e2e": e2e,
         "kernel_bench": kernel_bench}


def all_parts() -> dict[str, Callable[[Report, bool], None]]:
    from . import architectures, exactness, graphs, throughput
    return {**PARTS, **exactness.PARTS, **graphs.PARTS, **throughput.PARTS, **architectures.PARTS}


def main(argv: list[str] | None = None) -> int:
    return run_child(sys.argv[1:] if argv is None else argv, all_parts(), "python -m jupyter_pagedkv.gpucheck.parts")


if __name__ == "__main__":
    sys.exit(main())
