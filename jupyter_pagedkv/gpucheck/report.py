"""What the parts of the GPU check found, written the moment it is found.

Every part appends events, one JSON object a line, to one file (`rows.jsonl` in the report
folder): a summary line, a measured row, a fact, the part's status. A line is flushed as soon as
it is written, so a part killed by its time slice (SIGKILL: no chance to save anything) has
already handed over everything it measured; `fold` turns the file back into per-part results,
skipping a last line cut in half. One shared file rather than one per part because the device
machine hands back at most 8 files from `$OUT`.
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
from pathlib import Path
from typing import Callable

EVENTS_FILE = "rows.jsonl"
PASS = "pass"


def append_event(path: Path, event: dict) -> None:
    """One JSON line, written and flushed at once (open/append/close: nothing kept in a buffer)."""
    with open(path, "a") as f:
        f.write(json.dumps(event, default=str) + "\n")
        f.flush()


class Report:
    """What one part found: summary lines for report.md, rows (one per measurement), facts, and
    finally its status; each goes to the events file the moment it is known."""

    def __init__(self, part: str, events: Path, folder: Path, deadline: float | None = None) -> None:
        self.part = part
        self.events = events
        self.folder = folder          # for files a part's tools write themselves (junit XML, ...)
        self.deadline = deadline      # time.time() by which the driver kills this part
        self.data: dict = {"status": "running", "summary": [], "facts": {}}

    def _emit(self, kind: str, **fields) -> None:
        append_event(self.events, {"part": self.part, "kind": kind, "t": round(time.time(), 3), **fields})

    def line(self, text: str = "") -> None:
        print(text, flush=True)
        self.data["summary"].append(text)
        self._emit("line", text=text)

    def row(self, table: str, data: dict) -> None:
        """One measurement, kept even if the part dies right after."""
        self._emit("row", table=table, data=data)

    def put(self, key: str, value) -> None:
        """A fact about the whole part (the last value of a key wins)."""
        self.data["facts"][key] = value
        self._emit("fact", key=key, value=value)

    def finish(self, ok: bool, why: str = "") -> None:
        self.data["status"] = PASS if ok else ("fail: " + why if why else "fail")
        self._emit("status", status=self.data["status"])

    @property
    def status(self) -> str:
        return self.data["status"]

    def seconds_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.time()

    def file(self, name: str) -> Path:
        """A path inside this part's own folder (created on first use)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        return self.folder / name


def read_jsonl(path: Path) -> list[dict]:
    """Every complete JSON object line of `path`; a line cut by a kill (or not an object) is skipped."""
    if not path.exists():
        return []
    found = []
    for text in path.read_text(errors="replace").splitlines():
        try:
            obj = json.loads(text)
        except ValueError:
            continue
        if isinstance(obj, dict):
            found.append(obj)
    return found


def fold(events: Path, folders: dict[str, Path]) -> dict[str, dict]:
    """Per part: its summary lines, facts, rows by table, last reported status and the files in its
    folder. Lines of any other `*.jsonl` file a part's tools wrote into its folder become rows of a
    table named after the file (e.g. `compile` from `compile.jsonl`)."""
    parts: dict[str, dict] = {}

    def entry(name: str) -> dict:
        return parts.setdefault(name, {"reported": None, "summary": [], "facts": {}, "rows": {}, "files": []})

    for ev in read_jsonl(events):
        p = entry(str(ev.get("part")))
        kind = ev.get("kind")
        if kind == "line":
            p["summary"].append(ev.get("text", ""))
        elif kind == "row":
            p["rows"].setdefault(ev.get("table", "rows"), []).append(ev.get("data"))
        elif kind == "fact":
            p["facts"][ev.get("key")] = ev.get("value")
        elif kind == "status":
            p["reported"] = ev.get("status")
    for name, folder in folders.items():
        if not folder.is_dir():
            continue
        p = entry(name)
        for f in sorted(folder.iterdir()):
            p["files"].append(f"{folder.name}/{f.name}")
            if f.suffix == ".jsonl":
                p["rows"].setdefault(f.stem, []).extend(read_jsonl(f))
    return parts


def run_child(argv: list[str], parts: dict[str, Callable[[Report, bool], None]], prog: str) -> int:
    """The child side of the driver's protocol: `NAME --events FILE --dir FOLDER [--deadline T]
    [--smoke]` runs `parts[NAME]` with a `Report`. An exception is recorded as the part's status
    before it propagates (exit 1), so the report says what stopped the part. Free of torch, so
    that a stand-in part (tests) starts in a blink."""
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("part")
    ap.add_argument("--events", type=Path, required=True, help="the check's events file (JSON lines)")
    ap.add_argument("--dir", type=Path, required=True, help="this part's folder for its tools' own files")
    ap.add_argument("--deadline", type=float, default=None, help="time.time() at which the driver kills the part")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.part not in parts:
        print(f"unknown part {args.part!r}: one of {sorted(parts)}", file=sys.stderr)
        return 2
    report = Report(args.part, args.events, args.dir, args.deadline)
    t0 = time.perf_counter()
    try:
        parts[args.part](report, args.smoke)
    except BaseException as err:
        report.line(f"raised {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        report.finish(False, f"raised {type(err).__name__}")
        raise
    print(f"[{args.part}: {time.perf_counter() - t0:.1f} s]", flush=True)
    return 0 if report.status == PASS else 1


def device():
    import torch
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cpu_isa() -> str:
    """The vector extensions that decide CPU speed (benchmarks print them beside their tables)."""
    try:
        flags = set(re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M).group(1).split())
    except (OSError, AttributeError):
        return platform.machine()
    names = ["avx2", "avx512f", "avx512_bf16", "amx_bf16"]
    return ", ".join(n for n in names if n in flags) or "no AVX2"
