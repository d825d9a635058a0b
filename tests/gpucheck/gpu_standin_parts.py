"""Stand-in parts for test_gpu_driver.py: each misbehaves in one way a real part could on a GPU.

The driver runs this file as a part's program (`Part.command`), and it answers through the same
child-side code as the real parts (`gpu_report.run_child`), so the test exercises the real
protocol: events file, status, exit code.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

from jupyter_pagedkv.gpucheck.report import Report, run_child

HANG_S = 3600


def rows_then_hang(report: Report, smoke: bool) -> None:
    report.line("two rows, then a hang")
    report.row("standin", {"i": 0})
    report.row("standin", {"i": 1})
    time.sleep(HANG_S)


def partial_line_then_hang(report: Report, smoke: bool) -> None:
    """pytest's progress dots: output with no newline, then a test that never returns."""
    report.row("standin", {"i": 0})
    print("....", end="", flush=True)
    time.sleep(HANG_S)


def closes_output_then_hangs(report: Report, smoke: bool) -> None:
    report.row("standin", {"i": 0})
    os.close(1)
    os.close(2)
    time.sleep(HANG_S)


def raises_timeout_expired(report: Report, smoke: bool) -> None:
    report.row("standin", {"i": 0})
    raise subprocess.TimeoutExpired(["pytest"], 1)


def exits_nonzero(report: Report, smoke: bool) -> None:
    """A hard crash: no status recorded, a bare exit code."""
    report.row("standin", {"i": 0})
    sys.stdout.flush()
    os._exit(3)


def passes(report: Report, smoke: bool) -> None:
    report.row("standin", {"ok": True})
    report.finish(True)


PARTS = {f.__name__: f for f in (rows_then_hang, partial_line_then_hang, closes_output_then_hangs,
                                 raises_timeout_expired, exits_nonzero, passes)}

if __name__ == "__main__":
    sys.exit(run_child(sys.argv[1:], PARTS, "gpu_standin_parts.py"))
