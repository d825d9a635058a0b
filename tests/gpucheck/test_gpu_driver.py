"""The GPU check's driver (`bench gpu`) survives its parts: a part that hangs, crashes, raises or
exits non-zero costs only itself, and what it measured before that is in report.json."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from jupyter_pagedkv.gpucheck import driver as gpu
from jupyter_pagedkv.gpucheck.driver import Part

STANDIN = (str(Path(__file__).with_name("gpu_standin_parts.py")),)
SLICE_S = 5.0       # a hanging stand-in's slice: its rows come within ~0.1 s of its start
PASS_SLICE_S = 120  # "passes" ends at once; a long slice, so a starved machine cannot cut it


def standin(name: str, slice_s: float = SLICE_S) -> Part:
    return Part(name, name.replace("_", " "), slice_s, slice_s, command=STANDIN)


def run(tmp_path: Path, names: list[str], slice_s: float = SLICE_S) -> tuple[int, dict]:
    parts = [standin(n, PASS_SLICE_S if n == "passes" else slice_s) for n in names]
    code = gpu.main(["--out", str(tmp_path)], parts=parts)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["done"] and list(report["parts"]) == names
    return code, report["parts"]


def test_a_hanging_part_is_cut_at_its_slice_and_keeps_its_rows(tmp_path):
    code, parts = run(tmp_path, ["rows_then_hang", "passes"])
    hung = parts["rows_then_hang"]
    assert hung["status"] == "timed out after 5 s"
    assert hung["rows"]["standin"] == [{"i": 0}, {"i": 1}]
    assert hung["summary"] == ["two rows, then a hang"]
    assert hung["seconds"] < SLICE_S + 60     # cut at its slice, not left to run its hour
    assert parts["passes"]["status"] == "pass"
    assert parts["passes"]["rows"]["standin"] == [{"ok": True}]
    assert code == 1


@pytest.mark.parametrize("name", ["partial_line_then_hang", "closes_output_then_hangs"])
def test_a_hang_without_a_newline_or_without_output_is_still_cut(tmp_path, name):
    _, parts = run(tmp_path, [name, "passes"])
    assert parts[name]["status"] == "timed out after 5 s"
    assert parts[name]["rows"]["standin"] == [{"i": 0}]
    assert parts["passes"]["status"] == "pass"


def test_a_part_raising_timeout_expired_does_not_stop_the_driver(tmp_path):
    _, parts = run(tmp_path, ["raises_timeout_expired", "passes"], slice_s=30)
    assert parts["raises_timeout_expired"]["status"] == "fail: raised TimeoutExpired"
    assert parts["raises_timeout_expired"]["rows"]["standin"] == [{"i": 0}]
    assert parts["passes"]["status"] == "pass"


def test_a_part_exiting_nonzero_does_not_stop_the_driver(tmp_path):
    _, parts = run(tmp_path, ["exits_nonzero", "passes"], slice_s=30)
    assert parts["exits_nonzero"]["status"] == "exit 3"
    assert parts["exits_nonzero"]["rows"]["standin"] == [{"i": 0}]
    assert parts["passes"]["status"] == "pass"
    assert "exit 3" in (tmp_path / "report.md").read_text()


def test_a_half_written_line_is_skipped_and_the_next_part_stays_whole(tmp_path):
    events = tmp_path / "rows.jsonl"
    events.write_text('{"part": "x", "kind": "row", "table": "t", "data": {"i": 0}}\n{"part": "x", "ki')
    gpu._end_line(events)
    from jupyter_pagedkv.gpucheck.report import append_event, fold
    append_event(events, {"part": "y", "kind": "status", "status": "pass"})
    found = fold(events, {})
    assert found["x"]["rows"]["t"] == [{"i": 0}]
    assert found["y"]["reported"] == "pass"


def test_the_plan_fits_each_mode_budget_with_the_driver_margin():
    for mode, budget in gpu.BUDGETS.items():
        parts = gpu.select(gpu.PARTS, mode, None)
        assert sum(p.slice_s for p in parts) <= budget - gpu.DRIVER_MARGIN_S
    # On a 15-minute lease each of --quick and --rest is one call of the device tool (10 minutes
    # at most), with the machine's start and the quick call's time before the second.
    assert gpu.QUICK_BUDGET_S + gpu.REST_BUDGET_S <= 15 * 60 - 60 and gpu.REST_BUDGET_S <= 600 - 30
    quick = [p.name for p in gpu.select(gpu.PARTS, "quick", None)]
    rest = [p.name for p in gpu.select(gpu.PARTS, "rest", None)]
    assert quick == ["env", "compile", "kernel_tests", "exactness", "e2e"]
    assert [p.name for p in gpu.select(gpu.PARTS, "full", None)] == quick + rest
    assert rest == ["kernel_bench", "graphs", "throughput_small", "throughput_large", "architectures"]
