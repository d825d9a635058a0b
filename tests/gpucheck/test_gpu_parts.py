"""Parts of the GPU check that can be checked off the GPU: the compile part through the
`compile_check` interface (a stand-in module here), and pytest's per-test rows surviving a cut."""
from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from jupyter_pagedkv.gpucheck import parts as gpu_parts
from jupyter_pagedkv.gpucheck.report import Report, fold
from jupyter_pagedkv.worker import kernels_bridge


def report_in(tmp_path: Path, name: str, seconds: float | None = None) -> Report:
    return Report(name, tmp_path / "rows.jsonl", tmp_path / name,
                  None if seconds is None else time.time() + seconds)


def found(tmp_path: Path, name: str) -> dict:
    return fold(tmp_path / "rows.jsonl", {name: tmp_path / name})[name]


def stand_in_compile_check(code: int, calls: list):
    def main(argv: list[str]) -> int:
        calls.append(argv)
        path = Path(argv[argv.index("--jsonl") + 1])
        with open(path, "a") as f:
            for kernel in ("paged_attention", "write_kv"):
                f.write(json.dumps({"kernel": kernel, "arch": argv[argv.index("--arch") + 1], "spills": 0}) + "\n")
        return code
    return SimpleNamespace(main=main)


@pytest.mark.parametrize("code", [0, 1])
def test_compile_part_runs_compile_check_for_sm90_and_keeps_its_rows(tmp_path, monkeypatch, code):
    calls: list = []
    monkeypatch.setattr(gpu_parts.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(kernels_bridge, "kernel_module",
                        lambda name: stand_in_compile_check(code, calls) if name == "compile_check" else None)
    report = report_in(tmp_path, "compile")
    gpu_parts.compile_kernels(report, smoke=True)
    jsonl = str(tmp_path / "compile" / "compile.jsonl")
    assert calls == [["--quick", "--arch", "90", "--jsonl", jsonl]]
    part = found(tmp_path, "compile")
    assert [r["kernel"] for r in part["rows"]["compile"]] == ["paged_attention", "write_kv"]
    assert part["reported"] == ("pass" if code == 0 else "fail: compile_check exit 1")


def test_compile_part_reports_a_missing_compile_check_as_a_failure(tmp_path, monkeypatch):
    def missing(name):
        raise ModuleNotFoundError(f"No module named {kernels_bridge.KERNELS_PACKAGE}.{name}",
                                  name=f"{kernels_bridge.KERNELS_PACKAGE}.{name}")
    monkeypatch.setattr(kernels_bridge, "kernel_module", missing)
    gpu_parts.compile_kernels(report_in(tmp_path, "compile"), smoke=True)
    part = found(tmp_path, "compile")
    assert part["reported"] == "fail: compile_check missing"
    assert "compile_check missing" in part["summary"][0]


SAMPLE = """
import os, signal
def test_passes():
    assert True
def test_fails():
    assert 1 == 2
def test_stops():
    os.kill(os.getpid(), signal.{signal})
"""


def run_sample(tmp_path: Path, signal: str) -> tuple[int | None, list[dict]]:
    tests = tmp_path / "test_sample.py"
    tests.write_text(SAMPLE.format(signal=signal))
    report = report_in(tmp_path, "kernel_tests", seconds=600)
    code = gpu_parts.run_pytest(report, [str(tests)], {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    rows = found(tmp_path, "kernel_tests")["rows"]["tests"]
    return code, [(r["test"].split("::")[1], r["outcome"], r.get("message", "")) for r in rows]


def test_pytest_rows_are_written_as_each_test_ends_and_survive_a_kill(tmp_path):
    code, rows = run_sample(tmp_path, "SIGKILL")
    assert code == -9
    assert rows == [("test_passes", "passed", ""), ("test_fails", "failed", "assert 1 == 2")]


def test_pytest_interrupted_as_on_its_timeout_still_writes_junit(tmp_path):
    """run_pytest's timeout sends SIGINT first, so that pytest ends its session and writes junit."""
    code, rows = run_sample(tmp_path, "SIGINT")
    assert code == 2
    assert [r[:2] for r in rows] == [("test_passes", "passed"), ("test_fails", "failed")]
    junit = (tmp_path / "kernel_tests" / "junit.xml").read_text()
    assert 'name="test_passes"' in junit and 'name="test_fails"' in junit
