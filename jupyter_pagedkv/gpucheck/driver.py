"""`python3 -m jupyter_pagedkv.bench gpu`: one command that turns a lent GPU's minutes into a report.

`--quick` (the default, at most ~4 minutes on an H200): environment, the kernels compiled for the
device's architecture, the kernel tests on the device, exactness against transformers (greedy and
seeded sampled requests), one end-to-end point with CUDA graphs off and on. `--rest` (at most ~9
minutes): what `--quick` leaves out, the kernel benchmark, the graphs part, both throughput shapes
and the architecture matrix; on a 15-minute lease, `--quick` and then `--rest` are two calls of
the device tool, each under its 10-minute limit. `--full` runs both in one command (~13 minutes: for
a machine that is not on such a lease). The plan (parts, slices, total) is printed first.

Each part runs in its own process under its own time slice, so a hang or crash (a kernel that
never returns, an out-of-memory error) costs that part only. A part appends what it measures to
`rows.jsonl` the moment it is measured, and the driver rebuilds `report.json` and `report.md` from
that file every few seconds and after every part, so a part cut off by its slice (or the whole
command killed) still leaves its rows in the report. The report folder is `--out` (default
`$OUT`, else `build/gpu-check`); `parts.log` holds every part's output as it came.

`--smoke` is the rehearsal: the same parts, the same code, at sizes a CPU finishes in minutes,
the Triton kernels in Triton's interpreter (`make gpu-rehearsal` runs it in a venv shaped like the
GPU image). Needs only what that image has: torch, triton, transformers, accelerate, pytest.

Hook for tests: `main(argv, parts=...)` runs another list of `Part`s; a `Part`'s `command` names
the program its process runs (default: this package's `parts`).
"""
from __future__ import annotations

import argparse
import codecs
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .report import EVENTS_FILE, PASS, fold

REPO = Path(__file__).resolve().parents[2]
logger = logging.getLogger(__name__)

# Slices were measured on the first lent H200 (2026-12-04): each part's time there plus a margin.
QUICK_BUDGET_S = 250.0
REST_BUDGET_S = 560.0
FULL_BUDGET_S = QUICK_BUDGET_S + REST_BUDGET_S
BUDGETS = {"quick": QUICK_BUDGET_S, "rest": REST_BUDGET_S, "full": FULL_BUDGET_S}
# Left out of the slices for the driver itself: starting each part's process, folding the report.
DRIVER_MARGIN_S = 20.0
REFRESH_S = 5.0            # how often the report is rebuilt while a part runs
MIN_SLICE_S = 5.0          # a part the budget leaves less than this (or its slice) is not started


@dataclass(frozen=True)
class Part:
    name: str
    title: str
    slice_s: float            # on a GPU
    smoke_slice_s: float      # in the CPU rehearsal
    quick: bool = True        # in --quick (else in --rest; every part is in --full)
    interpreter: bool = True  # on a CPU, run Triton in its interpreter (the compile part must not)
    command: tuple[str, ...] = ("-m", "jupyter_pagedkv.gpucheck.parts")


# In order of value per second: what must be known first runs first.
PARTS: tuple[Part, ...] = (
    Part("env", "Environment", 15, 60),
    Part("compile", "Triton kernels compiled for the device's architecture (ptxas: registers, spills, "
                    "shared memory)", 30, 300, interpreter=False),
    Part("kernel_tests", "Kernel tests on the device (no interpreter on CUDA)", 85, 300),
    Part("exactness", "Exactness against transformers on the same device: seeded sampled requests, "
                      "greedy on both backends", 55, 480),
    Part("e2e", "One end-to-end point: CUDA graphs off and on", 45, 300),
    Part("kernel_bench", "Decode kernel: paged vs contiguous SDPA, share of copy bandwidth", 50, 120, quick=False),
    Part("graphs", "Decode steps as CUDA graphs: replay vs eager, speed-up, host share", 65, 300, quick=False),
    Part("throughput_small", "End to end, SmolLM2-135M shape: ours vs transformers", 160, 480, quick=False),
    Part("throughput_large", "End to end, Llama-3-8B shape: ours vs transformers", 230, 480, quick=False),
    Part("architectures", "The architecture matrix's exact models on the device (Triton backend)", 35, 240,
         quick=False),
)


def _parse(argv: list[str], parts: Sequence[Part]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python3 -m jupyter_pagedkv.bench gpu", description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick",
                      help=f"the essentials, at most {QUICK_BUDGET_S:.0f} s on a GPU (default)")
    mode.add_argument("--rest", dest="mode", action="store_const", const="rest",
                      help=f"the parts --quick leaves out, at most {REST_BUDGET_S:.0f} s on a GPU")
    mode.add_argument("--full", dest="mode", action="store_const", const="full",
                      help=f"every part, at most {FULL_BUDGET_S:.0f} s on a GPU")
    ap.set_defaults(mode="quick")
    ap.add_argument("--smoke", action="store_true", help="rehearsal sizes (a CPU finishes in minutes)")
    ap.add_argument("--out", type=Path, default=None, help="report folder (default $OUT, else build/gpu-check)")
    ap.add_argument("--parts", nargs="+", choices=[p.name for p in parts], default=None,
                    help="run only these parts (in the plan's order)")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds for all parts together (default: {QUICK_BUDGET_S:.0f} with --quick, "
                         f"{REST_BUDGET_S:.0f} with --rest, {FULL_BUDGET_S:.0f} with --full; none with --smoke)")
    return ap.parse_args(argv)


def select(parts: Sequence[Part], mode: str, names: list[str] | None) -> list[Part]:
    """The parts `mode` ("quick", "rest" or "full") runs, or those named, in the plan's order."""
    if names is not None:
        return [p for p in parts if p.name in names]
    return [p for p in parts if mode == "full" or p.quick == (mode == "quick")]


def plan_lines(parts: Sequence[Part], smoke: bool, budget: float | None, mode: str) -> list[str]:
    slices = [p.smoke_slice_s if smoke else p.slice_s for p in parts]
    lines = [f"GPU check plan ({mode}{', smoke sizes' if smoke else ''}): {len(parts)} parts, slices "
             f"{sum(slices):.0f} s in all, budget " + (f"{budget:.0f} s" if budget is not None else "none")]
    lines += [f"  {p.name:<18} {s:>5.0f} s  {p.title}" for p, s in zip(parts, slices)]
    return lines


def _child_env(part: Part, smoke: bool, cuda: bool) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.pop("JUPYTER_PAGEDKV_BACKEND", None)
    if smoke and not cuda and part.interpreter:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@dataclass
class Outcome:
    """How a part's process ended, as the driver saw it."""
    status: str
    seconds: float
    limit_s: float


def status_of(reported: str | None, returncode: int | None, timed_out: bool, limit_s: float) -> str:
    """One status string: the part's own when it exited cleanly, else what stopped it."""
    if timed_out:
        return f"timed out after {limit_s:.0f} s"
    if returncode == 0:
        return reported or "exit 0 without a status"
    if returncode == 1 and reported and reported.startswith("fail"):     # how a failed part exits
        return reported
    how = f"killed by signal {-returncode}" if returncode is not None and returncode < 0 else f"exit {returncode}"
    return f"{reported} ({how})" if reported and reported not in (PASS, "running") else how


class Driver:
    """Runs parts one after another and keeps `report.json`/`report.md` current."""

    def __init__(self, out: Path, parts: Sequence[Part], smoke: bool, mode: str, budget: float | None) -> None:
        self.out, self.parts, self.smoke, self.mode, self.budget = out, list(parts), smoke, mode, budget
        self.events = out / EVENTS_FILE
        self.outcomes: dict[str, Outcome] = {}
        self.running: str | None = None
        self.started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        self.t0 = time.perf_counter()
        self.cuda = _has_cuda() if smoke else True     # only the rehearsal asks (for Triton's interpreter)

    def slice_of(self, part: Part) -> float:
        return part.smoke_slice_s if self.smoke else part.slice_s

    def run(self) -> dict:
        self.events.unlink(missing_ok=True)
        for part in self.parts:          # an earlier run's junit or compile rows must not be folded in
            shutil.rmtree(self.out / part.name, ignore_errors=True)
            (self.out / part.name).mkdir()
        with open(self.out / "parts.log", "w") as log:
            for line in plan_lines(self.parts, self.smoke, self.budget, self.mode):
                print(line, flush=True)
                log.write(line + "\n")
            for part in self.parts:
                limit = self.slice_of(part)
                if self.budget is not None:
                    limit = min(limit, self.budget - (time.perf_counter() - self.t0))
                if limit < min(MIN_SLICE_S, self.slice_of(part)):
                    self.outcomes[part.name] = Outcome("not run: no time left in the budget", 0.0, limit)
                    continue
                try:
                    self.outcomes[part.name] = self.run_part(part, limit, log)
                except Exception as err:     # the driver's own trouble costs this part, never the rest
                    logger.exception("the GPU check's driver failed on part %s", part.name)
                    self.outcomes[part.name] = Outcome(f"driver error: {type(err).__name__}: {err}", 0.0, limit)
                self.running = None
                self.write_report()
        return self.write_report(done=True)

    def run_part(self, part: Part, limit_s: float, log) -> Outcome:
        header = f"\n===== {part.name}: {part.title} (slice {limit_s:.0f} s)\n"
        print(header, end="", flush=True)
        log.write(header)
        log.flush()
        self.running = part.name
        t0 = time.perf_counter()
        cmd = [sys.executable, *part.command, part.name, "--events", str(self.events),
               "--dir", str(self.out / part.name), "--deadline", f"{time.time() + limit_s:.3f}"]
        if self.smoke:
            cmd.append("--smoke")
        proc = subprocess.Popen(cmd, cwd=REPO, env=_child_env(part, self.smoke, self.cuda), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        timed_out = not self._pump(proc, log, t0 + limit_s)
        _kill(proc)         # the part, or whatever it left running in its process group
        proc.stdout.close()
        seconds = time.perf_counter() - t0
        _end_line(self.events)
        reported = fold(self.events, {}).get(part.name, {}).get("reported")
        outcome = Outcome(status_of(reported, proc.returncode, timed_out, limit_s), round(seconds, 1), limit_s)
        line = f"----- {part.name}: {outcome.status} in {seconds:.1f} s\n"
        print(line, end="", flush=True)
        log.write(line)
        log.flush()
        return outcome

    def _pump(self, proc: subprocess.Popen, log, deadline: float) -> bool:
        """Copy the child's output to our stdout and the log as it comes (raw reads: a partial line,
        such as pytest's progress dots before a hang, never blocks the driver), rebuilding the report
        every few seconds, until the child exits (True) or the deadline passes (False). A child that
        closes its output but keeps running is still held to the deadline."""
        fd = proc.stdout.fileno()
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        sel = selectors.DefaultSelector()
        sel.register(fd, selectors.EVENT_READ)
        open_ = True
        next_refresh = time.perf_counter() + REFRESH_S
        while True:
            now = time.perf_counter()
            if now >= deadline:
                return False
            if now >= next_refresh:
                self.write_report()
                next_refresh = now + REFRESH_S
            wait = min(deadline - now, 1.0)
            if not open_:
                try:
                    proc.wait(timeout=wait)
                    return True
                except subprocess.TimeoutExpired:
                    continue
            if not sel.select(timeout=wait):
                if proc.poll() is not None:     # exited; what still holds the pipe is its leftovers
                    return True
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                open_ = False
                sel.unregister(fd)
                continue
            text = decoder.decode(chunk)
            sys.stdout.write(text)
            sys.stdout.flush()
            log.write(text)
            log.flush()

    def write_report(self, done: bool = False) -> dict:
        found = fold(self.events, {p.name: self.out / p.name for p in self.parts})
        parts = {}
        for p in self.parts:
            f = found.get(p.name, {"summary": [], "facts": {}, "rows": {}, "files": [], "reported": None})
            o = self.outcomes.get(p.name)
            if o is not None:
                status, seconds = o.status, o.seconds
            elif p.name == self.running:
                status, seconds = "running", None
            else:
                status, seconds = "not run yet", None
            parts[p.name] = {"title": p.title, "status": status, "seconds": seconds,
                             "slice_s": o.limit_s if o else self.slice_of(p), "summary": f["summary"],
                             "facts": f["facts"], "rows": f["rows"], "files": f["files"]}
        report = {"mode": self.mode, "smoke": self.smoke, "started": self.started, "done": done,
                  "seconds": round(time.perf_counter() - self.t0, 1), "budget_s": self.budget,
                  "plan": [{"name": p.name, "slice_s": self.slice_of(p)} for p in self.parts], "parts": parts}
        _write_atomic(self.out / "report.json", json.dumps(report, indent=1, default=str))
        _write_atomic(self.out / "report.md", render(report))
        return report


def render(report: dict) -> str:
    """The markdown report: every part's status and its own summary lines."""
    smoke = report["smoke"]
    lines = [f"# GPU check report ({report['mode']}{', CPU rehearsal, smoke sizes' if smoke else ''})", "",
             f"started {report['started']}, {report['seconds']:.0f} s {'in all' if report['done'] else 'so far'}; "
             f"command: "
             f"`python3 -m jupyter_pagedkv.bench gpu --{report['mode']}{' --smoke' if smoke else ''}`", "",
             "| part | status | seconds | slice | rows |", "|---|---|---:|---:|---|"]
    for name, r in report["parts"].items():
        rows = ", ".join(f"{t} {len(v)}" for t, v in r["rows"].items()) or "-"
        seconds = "-" if r["seconds"] is None else f"{r['seconds']}"
        lines.append(f"| {name} | {r['status']} | {seconds} | {r['slice_s']:.0f} | {rows} |")
    for name, r in report["parts"].items():
        if r["summary"] or r["files"]:
            lines += ["", f"## {name}: {r['title']}", "", *r["summary"]]
            if r["files"]:
                lines += ["", "files: " + ", ".join(r["files"])]
    return "\n".join(lines) + "\n"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _end_line(path: Path) -> None:
    """A part killed mid-write leaves half a line: end it, so the next part's first line stays whole."""
    if path.exists() and path.stat().st_size:
        with open(path, "rb+") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:     # stuck in the driver: leave it, the next part must start
        logger.warning("part process %d did not exit 10 s after SIGKILL; moving on", proc.pid)


def main(argv: list[str] | None = None, parts: Sequence[Part] = PARTS) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv, parts)
    out = args.out or Path(os.environ.get("OUT") or REPO / "build" / "gpu-check")
    out.mkdir(parents=True, exist_ok=True)
    mode = args.mode
    chosen = select(parts, mode, args.parts)
    budget = args.budget if args.budget is not None else (None if args.smoke else BUDGETS[mode])
    report = Driver(out, chosen, args.smoke, mode, budget).run()
    print("\n" + render(report))
    print(f"report: {out / 'report.md'}, {out / 'report.json'}, {out / EVENTS_FILE}, {out / 'parts.log'}")
    failed = [name for name, r in report["parts"].items() if r["status"] != PASS]
    if failed:
        print(f"parts that did not pass: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
