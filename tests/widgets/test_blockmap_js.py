"""Runs the JavaScript unit tests of the monitor's drawing module (blockmap.test.mjs, `node --test`):
outside a browser the code that folds frames and draws the block map runs nowhere else."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = "tests/widgets/blockmap.test.mjs"


def test_blockmap_js() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the blockmap.js tests need Node.js (node --test)")
    run = subprocess.run([node, "--test", TESTS], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"node --test {TESTS} failed (exit {run.returncode}):\n{run.stdout}\n{run.stderr}"
