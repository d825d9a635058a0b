"""The suite fails instead of hanging or looking away: a test that hangs fails at its limit
(pytest-timeout, configured in pyproject.toml), and in CI a module that skips while it is
collected fails like a skipped test does (tests/conftest.py). Each runs a small pytest of its own."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent


def pytest_run(tmp_path: Path, source: str, *options: str, ci: bool = False) -> tuple[int, str]:
    """Run one test module with this project's pytest configuration and our conftest's hooks."""
    (tmp_path / "test_case.py").write_text(source)
    env = {**os.environ, "CI": "1" if ci else "0",
           "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                           "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), *options,
                           str(tmp_path / "test_case.py")],
                          capture_output=True, text=True, env=env, timeout=240)
    return proc.returncode, proc.stdout + proc.stderr


def test_the_project_configures_a_per_test_limit():
    pytest.importorskip("pytest_timeout", reason="pytest-timeout is missing: pip install -e '.[test]'")
    text = (ROOT / "pyproject.toml").read_text()
    assert "\ntimeout = " in text and "pytest-timeout" in text


def test_a_hanging_test_fails_at_its_limit(tmp_path):
    pytest.importorskip("pytest_timeout", reason="pytest-timeout is missing: pip install -e '.[test]'")
    start = time.monotonic()
    rc, out = pytest_run(tmp_path, "import threading\n\n"
                                   "def test_hangs():\n    threading.Event().wait()\n", "-o", "timeout=5")
    # Its limit counts the test's set-up too: on a loaded machine it may strike there (an error).
    assert rc == 1 and "Timeout (>5.0s) from pytest-timeout" in out and ("1 failed" in out or "1 error" in out), out
    assert time.monotonic() - start < 300     # cut at its 5 s limit, not left to hang


@pytest.mark.parametrize("skip", ["pytest.importorskip('no_such_module_here')",
                                  "pytest.skip('no GPU', allow_module_level=True)"])
def test_a_module_that_skips_while_collected_fails_in_ci(tmp_path, skip):
    source = f"import pytest\n{skip}\n\ndef test_never_runs():\n    pass\n"
    rc, out = pytest_run(tmp_path, source, ci=True)
    assert rc != 0 and "skipped in CI, where every capability must run" in out, out
    rc, out = pytest_run(tmp_path, source, ci=False)
    assert rc in (0, 5) and "1 skipped" in out, out   # 5: nothing left to run
