"""`python -m jupyter_pagedkv.bench gpu`: one command that turns a lent GPU's minutes into a report.

Each part runs in its own process under its own time slice, so one hang or crash (a kernel that
never returns, an out-of-memory error) costs that part only; a part writes its JSON as it goes,
so even a part cut off by its slice reports what it had measured. The report (`report.md`,
`report.json`, and every part's output in `parts.log`) goes to `--out` (default `$OUT`, else
`build/gpu-check`).

`--smoke` is the rehearsal: the same parts, the same code, at sizes a CPU finishes in minutes,
the Triton kernels in Triton's interpreter (`make gpu-rehearsal` runs it in a venv shaped like the
GPU image). Needs only what that image has: torch, triton, transformers, accelerate, pytest.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Part:
    name: str
    title: str
    slice_s: int          # on a GPU
    smoke_slice_s: int    # in the CPU rehearsal


# In order of value per second: what must be known first runs first.
PARTS = (
    Part("env", "Environment", 20, 60),
    Part("kernel_tests", "Kernel tests on the device (no interpreter on CUDA)", 100, 300),
    Part("exactness", "Engine exactness against transformers generate (sdpa), same device", 80, 420),
    Part("kernel_bench", "Decode kernel: paged vs contiguous SDPA, share of copy bandwidth", 50, 120),
    Part("graphs", "Decode steps as CUDA graphs: replay vs eager, speed-up, host share", 70, 300),
    Part("throughput_small", "End to end, SmolLM2-135M shape: ours vs transformers", 70, 300),
    Part("throughput_large", "End to end, Llama-3-8B shape: ours vs transformers", 150, 300),
    Part("architectures", "The architecture matrix's exact models on the device (Triton backend)", 40, 240),
)


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m jupyter_pagedkv.bench gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="rehearsal sizes (a CPU finishes in minutes)")
    ap.add_argument("--out", type=Path, default=None, help="report folder (default $OUT, else build/gpu-check)")
    ap.add_argument("--parts", nargs="+", choices=[p.name for p in PARTS], default=None,
                    help="run only these parts")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for all parts together (default: 540 on a GPU, none in --smoke)")
    return ap.parse_args(argv)


def _child_env(smoke: bool) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.pop("JUPYTER_PAGEDKV_BACKEND", None)
    if smoke and not _has_cuda():
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def run_part(part: Part, smoke: bool, out: Path, limit_s: float, log) -> dict:
    """Run one part in a child process for at most `limit_s`; returns its result (or why none)."""
    result_path = out / f".{part.name}.json"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "jupyter_pagedkv.bench.gpu_parts", part.name, "--json", str(result_path)]
    if smoke:
        cmd.append("--smoke")
    header = f"\n===== {part.name}: {part.title} (slice {limit_s:.0f} s)\n"
    print(header, end="", flush=True)
    log.write(header)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=_child_env(smoke), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    timed_out = False
    try:
        _pump(proc, log, t0 + limit_s)
    except TimeoutError:
        timed_out = True
        _kill(proc)
    seconds = time.perf_counter() - t0
    result = json.loads(result_path.read_text()) if result_path.exists() else {}
    result_path.unlink(missing_ok=True)
    if timed_out:
        result["status"] = "timeout"
        result.setdefault("summary", []).append(f"cut off by its {limit_s:.0f} s slice")
    elif proc.returncode != 0 and result.get("status") != "fail":
        result["status"] = "crash"
        result.setdefault("summary", []).append(f"exited with status {proc.returncode} (see parts.log)")
    result.setdefault("status", "crash")
    result["seconds"] = round(seconds, 1)
    line = f"----- {part.name}: {result['status']} in {seconds:.1f} s\n"
    print(line, end="", flush=True)
    log.write(line)
    return result


def _pump(proc: subprocess.Popen, log, deadline: float) -> None:
    """Copy the child's output to our stdout and the log until it exits or the deadline passes."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            raise TimeoutError
        if sel.select(timeout=min(left, 1.0)):
            line = proc.stdout.readline()
            if not line:
                break
            sys.stdout.write(line)
            sys.stdout.flush()
            log.write(line)
            log.flush()
    proc.wait(timeout=max(1.0, deadline - time.perf_counter()))


def _kill(proc: subprocess.Popen) -> None:
    import signal
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def render(results: dict[str, dict], smoke: bool, started: str, total_s: float) -> str:
    """The markdown report: every part's status and its own summary lines."""
    lines = [f"# GPU check report{' (CPU rehearsal, smoke sizes)' if smoke else ''}", "",
             f"started {started}, {total_s:.0f} s in all; command: "
             f"`python -m jupyter_pagedkv.bench gpu{' --smoke' if smoke else ''}`", "",
             "| part | status | seconds |", "|---|---|---:|"]
    for part in PARTS:
        if part.name in results:
            r = results[part.name]
            lines.append(f"| {part.title} | {r['status']} | {r['seconds']} |")
    for part in PARTS:
        if part.name in results:
            lines += ["", f"## {part.title}", ""] + results[part.name].get("summary", [])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    out = args.out or Path(os.environ.get("OUT") or REPO / "build" / "gpu-check")
    out.mkdir(parents=True, exist_ok=True)
    parts = [p for p in PARTS if args.parts is None or p.name in args.parts]
    budget = args.budget if args.budget is not None else (None if args.smoke else 540.0)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    t0 = time.perf_counter()
    results: dict[str, dict] = {}
    with open(out / "parts.log", "w") as log:
        for part in parts:
            limit = part.smoke_slice_s if args.smoke else part.slice_s
            if budget is not None:
                limit = min(limit, budget - (time.perf_counter() - t0))
            if limit < 5:
                results[part.name] = {"status": "not run", "seconds": 0,
                                      "summary": ["no time left in the command's budget"]}
                continue
            results[part.name] = run_part(part, args.smoke, out, limit, log)
            (out / "report.json").write_text(json.dumps(results, indent=1, default=str))
    total = time.perf_counter() - t0
    report = render(results, args.smoke, started, total)
    (out / "report.md").write_text(report)
    (out / "report.json").write_text(json.dumps({"smoke": args.smoke, "started": started,
                                                  "seconds": round(total, 1), "parts": results},
                                                 indent=1, default=str))
    print("\n" + report)
    print(f"report: {out / 'report.md'}, {out / 'report.json'}, {out / 'parts.log'}")
    failed = [name for name, r in results.items() if r["status"] != "pass"]
    if failed:
        print(f"parts that did not pass: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
