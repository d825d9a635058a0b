"""pytest plugin for the GPU check (`-p jupyter_pagedkv.gpucheck.pytest_plugin`): one row per test, appended
to the check's events file the moment the test ends.

pytest writes `--junitxml` only when the session ends, so a run cut off by its time slice would
otherwise leave nothing; these rows survive the kill. Only pytest's own hooks are used: it works
with the image's pytest and needs no extra package. The events file and the part's name come from
the environment (`PAGEDKV_GPU_EVENTS`, `PAGEDKV_GPU_PART`); without them the plugin does nothing.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from .report import append_event

EVENTS_ENV = "PAGEDKV_GPU_EVENTS"
PART_ENV = "PAGEDKV_GPU_PART"
TABLE = "tests"


def pytest_runtest_logreport(report) -> None:
    """A test's outcome is its call phase's, or a setup/teardown phase's that failed or skipped."""
    events = os.environ.get(EVENTS_ENV)
    if not events or (report.when != "call" and report.passed):
        return
    row = {"test": report.nodeid, "phase": report.when, "outcome": report.outcome,
           "seconds": round(report.duration, 3)}
    if report.failed:
        text = (report.longreprtext or "").strip().splitlines()
        errors = [ln[1:].strip() for ln in text if ln.startswith("E ")]       # pytest's own error lines
        row["message"] = (errors[0] if errors else text[-1] if text else "")[:300]
    append_event(Path(events), {"part": os.environ.get(PART_ENV, "pytest"), "kind": "row", "table": TABLE,
                                "t": round(time.time(), 3), "data": row})
