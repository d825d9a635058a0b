"""The parts of the GPU check (`bench gpu`), one process each:
`python -m jupyter_pagedkv.bench.gpu_parts NAME --events FILE --dir FOLDER [--deadline T] [--smoke]`.

A part fills a `Report`, which appends every finding to the events file the moment it is found:
a part cut off by its time slice still hands the driver what it had measured. Every part runs
unchanged on a CPU with `--smoke` (the rehearsal), so the code that meets a GPU for the first time
has already run end to end.
"""
from __future__ import annotations

import os
import platform
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch

from .gpu_report import Report, device, run_child

REPO = Path(__file__).resolve().parents[2]
# What a part needs after its last action to record it and exit, inside its slice.
EXIT_MARGIN_S = 8.0


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
    ends (gpu_pytest), junit XML goes into the part's folder, the output flows to the driver as it
    comes, and pytest gets its own timeout inside the part's slice: on it, SIGINT (pytest then
    writes its junit file for the tests that ran), then a kill. Returns pytest's exit status, or
    None when it was cut off."""
    from .gpu_pytest import EVENTS_ENV, PART_ENV

    env_vars = dict(os.environ, **(extra_env or {}), **{EVENTS_ENV: str(report.events), PART_ENV: report.part})
    cmd = [sys.executable, "-m", "pytest", "-c", os.devnull, "-o", "addopts=", "--rootdir", str(REPO),
           "-p", "no:cacheprovider", "-p", "jupyter_pagedkv.bench.gpu_pytest", "-q", "-rfE", "--durations=5",
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
    code = run_pytest(report, [str(REPO / "tests" / "worker" / "test_kernels.py")],
                      {"PAGEDKV_KERNEL_TEST_DEVICE": device().type})
    from .gpu_report import fold
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
                report.line("| batch | context | splits | paged ms | paged GB/s | of copy | SDPA ms | paged / SDPA "
                            "| max diff |")
                report.line("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
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
        return f"| {r['batch']} | {r['context']} | skipped: {r['skipped']} | | | | | | |"
    sdpa = (f"{r['sdpa_ms']:.4f} | {r['paged_over_sdpa']:.2f} | {r['max_diff']:.1e}" if "sdpa_ms" in r
            else "out of memory | | ")
    return (f"| {r['batch']} | {r['context']} | {r['splits']} | {r['paged_ms']:.4f} | {r['paged_gbs']:.1f} | "
            f"{r['of_copy']:.1%} | {sdpa} |")


# -- exactness --------------------------------------------------------------------------------
def exactness(report: Report, smoke: bool) -> None:
    """Seeded sampled requests first (the sampler on the device: reproducible alone, twice, and
    inside any batch; top_k=1 equal to transformers' greedy), then greedy outputs on both backends
    against transformers `generate` (sdpa) on the same device: token-identical, or the first
    difference a checked near-tie (the oracle's top-2 logit gap below the threshold)."""
    ok = sampled(report, smoke)
    ok &= greedy(report, smoke)
    report.finish(ok, "" if ok else "a check found a difference (rows above)")


THRESHOLD = 1e-3


def _generate(model, backend: str, prompts: list[list[int]], params) -> list[list[int]]:
    from ..engine.engine import Engine

    # As many rows as the batch: graph buckets (captured and verified at build on CUDA) only for it.
    engine = Engine(model, attention_backend=backend, kv_cache_memory="256MiB", pack_weights=False,
                    max_num_seqs=max(1, len(prompts)))
    try:
        outs = engine.generate(prompts, params)
        engine.check_invariants()
    finally:
        engine.shutdown()
    return [o.token_ids for o in outs]


def sampled(report: Report, smoke: bool) -> bool:
    """The sampler on the model's device, with the oracle independent of it: a seeded request's
    tokens must not depend on what shares its batch or on being run again, and top_k=1 at a
    temperature must equal transformers' greedy decoding."""
    from ..core.sampling_params import SamplingParams
    from .models import compare_with_oracle, hf_greedy, random_prompts, tiny_model

    dev = device()
    backend = "triton"
    new = 8 if smoke else 24
    model = tiny_model("llama").to(dev)
    vocab = model.config.vocab_size
    prompts = random_prompts(6, vocab, seed=11, lo=3, hi=30)
    has_min_p = "min_p" in SamplingParams.__dataclass_fields__
    seeded = SamplingParams(max_tokens=new, temperature=0.8, top_p=0.9, top_k=40, seed=1234, ignore_eos=True)
    others = [SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=new + 3, temperature=1.0, seed=99, ignore_eos=True),
              SamplingParams(max_tokens=new - 2, temperature=0.7, top_p=0.5, ignore_eos=True),   # unseeded
              SamplingParams(max_tokens=new, temperature=1.3, top_k=5, seed=7, ignore_eos=True,
                             **({"min_p": 0.05} if has_min_p else {}))]
    report.line(f"sampled: tiny llama (vocab {vocab}) fp32 on {dev.type}, {backend} attention, {new} new "
                f"tokens; seeded request: temperature 0.8, top-p 0.9, top-k 40, seed 1234")
    report.line("")
    report.line("| check | result | detail |")
    report.line("|---|---|---|")
    ok = True

    def record(check: str, passed: bool, detail: str) -> None:
        nonlocal ok
        ok &= passed
        report.row("sampled", {"check": check, "ok": passed, "detail": detail, "device": dev.type})
        report.line(f"| {check} | {'ok' if passed else 'DIFFERENT'} | {detail} |")

    def attempt(check: str, fn: Callable[[], tuple[bool, str]]) -> None:
        try:
            passed, detail = fn()
        except Exception as err:        # the old sampler raised on CUDA: that is this check's finding
            passed, detail = False, f"raised {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        record(check, passed, detail)

    with torch.inference_mode():
        alone: list[list[int]] = []

        def run_alone() -> tuple[bool, str]:
            alone.extend(_generate(model, backend, [prompts[0]], [seeded]))
            return len(alone[0]) == new and all(0 <= t < vocab for t in alone[0]), f"tokens {alone[0]}"

        def run_twice() -> tuple[bool, str]:
            again = _generate(model, backend, [prompts[0]], [seeded])[0]
            return again == alone[0], f"first difference at {_first_diff(again, alone[0])}" if again != alone[0] else "same"

        def in_batch(order: list[int]) -> Callable[[], tuple[bool, str]]:
            def run() -> tuple[bool, str]:
                ps = [prompts[0] if i < 0 else prompts[1 + i] for i in order]
                params = [seeded if i < 0 else others[i] for i in order]
                outs = _generate(model, backend, ps, params)
                mine = outs[order.index(-1)]
                lengths = all(len(o) == p.max_tokens for o, p in zip(outs, params))
                in_vocab = all(0 <= t < vocab for o in outs for t in o)
                same = mine == alone[0]
                detail = "same" if same else f"first difference at {_first_diff(mine, alone[0])}"
                if not (lengths and in_vocab):
                    detail += "; other requests' lengths or token ids wrong"
                return same and lengths and in_vocab, detail
            return run

        attempt("seeded, alone (draws on the device without raising)", run_alone)
        if alone:
            attempt("seeded, twice in a row", run_twice)
            attempt("seeded, in a batch of 5 (greedy, seeded, unseeded, top-k"
                    f"{', min-p' if has_min_p else ''} neighbours)", in_batch([0, -1, 1, 2, 3]))
            attempt("seeded, in another batch (first, 2 neighbours)", in_batch([-1, 2, 1]))

        def top_k1() -> tuple[bool, str]:
            limits = [new] * 3
            ours = _generate(model, backend, prompts[3:6],
                             [SamplingParams(max_tokens=m, temperature=0.8, top_k=1, seed=3 + i, ignore_eos=True)
                              for i, m in enumerate(limits)])
            refs = [hf_greedy(model, p, m, stop_at_eos=False) for p, m in zip(prompts[3:6], limits)]
            found = [compare_with_oracle(model, p, o, r) for p, o, r in zip(prompts[3:6], ours, refs)]
            wrong = [f for f in found if not f.near_tie(THRESHOLD)]
            return not wrong, (f"{sum(f.identical for f in found)}/3 identical to transformers greedy, "
                               f"{len(found) - len(wrong) - sum(f.identical for f in found)} near-ties")

        attempt("top_k=1 at temperature 0.8 equals transformers greedy", top_k1)
    del model
    _empty_cache()
    report.line("")
    return ok


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def greedy(report: Report, smoke: bool) -> bool:
    from ..core.sampling_params import SamplingParams
    from .models import TINY_ARCHS, compare_with_oracle, hf_greedy, random_prompts, shaped_model, tiny_model

    dev = device()
    n, new, hi = (2, 6, 20) if smoke else (8, 32, 120)
    cases = [(arch, lambda a=arch: tiny_model(a).to(dev), 256) for arch in TINY_ARCHS]
    cases.append(("smollm2-135m shape" + (", 2 layers" if smoke else ""),
                  lambda: shaped_model("smollm2-135m", torch.float32, dev, num_layers=2 if smoke else None,
                                       sharpen=True), 49152))
    report.line(f"greedy: fp32, {n} prompts of 1-{hi - 1} random tokens, {new} new tokens each, EOS "
                f"ignored; near-tie threshold {THRESHOLD:g} (top-2 logit gap of the oracle)")
    report.line("")
    report.line("| model | backend | identical | near-ties (gap) | wrong |")
    report.line("|---|---|---:|---|---:|")
    ok = True
    for name, build, vocab in cases:
        model = build()
        prompts = random_prompts(n, vocab, seed=7, lo=1, hi=hi)
        refs = [hf_greedy(model, p, new, stop_at_eos=False) for p in prompts]
        for backend in ("triton", "torch"):
            outs = _generate(model, backend, prompts, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
            found = [compare_with_oracle(model, p, o, r) for p, o, r in zip(prompts, outs, refs)]
            same = sum(f.identical for f in found)
            ties = [f for f in found if not f.identical and f.near_tie(THRESHOLD)]
            wrong = [f for f in found if not f.near_tie(THRESHOLD)]
            ok &= not wrong
            report.row("greedy", {"model": name, "backend": backend, "identical": same, "of": n,
                                  "near_ties": len(ties), "wrong": len(wrong),
                                  "gaps": [f.gap for f in found if not f.identical]})
            gaps = ", ".join(f"{f.gap:.1e}" for f in ties)
            report.line(f"| {name} | {backend} | {same}/{n} | {len(ties)}{f' ({gaps})' if gaps else ''} | "
                        f"{len(wrong)} |")
        del model
        _empty_cache()
    return ok


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- e2e --------------------------------------------------------------------------------------
def e2e(report: Report, smoke: bool) -> None:
    """One end-to-end point, CUDA graphs off then on (`cuda_graphs=False/True`), each after a
    warm-up run: tokens/s and the graph replays that show graphs were used. On a CPU graphs cannot
    be captured, so "on" runs the same padded decode path eagerly."""
    from .gpu_throughput import run_ours, workload
    from .models import shaped_model

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


PARTS = {"env": env, "compile": compile_kernels, "kernel_tests": kernel_tests, "exactness": exactness,
         "e2e": e2e, "kernel_bench": kernel_bench}


def all_parts() -> dict[str, Callable[[Report, bool], None]]:
    from . import architectures, gpu_graphs, gpu_throughput
    return {**PARTS, **gpu_graphs.PARTS, **gpu_throughput.PARTS, **architectures.PARTS}


def main(argv: list[str] | None = None) -> int:
    return run_child(sys.argv[1:] if argv is None else argv, all_parts(), "python -m jupyter_pagedkv.bench.gpu_parts")


if __name__ == "__main__":
    sys.exit(main())
