"""Runs the JavaScript unit tests of the monitor's drawing module (`node --test`): blockmap.test.mjs
(frames, layout, state colours, theme) and blockmap_tenants.test.mjs (the colour-by-tenant mode).
Outside a browser the code that folds frames and draws the block map runs nowhere else."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("tests", ["tests/widgets/blockmap.test.mjs", "tests/widgets/blockmap_tenants.test.mjs"])
def test_blockmap_js(tests: str) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the blockmap.js tests need Node.js (node --test)")
    run = subprocess.run([node, "--test", tests], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"node --test {tests} failed (exit {run.returncode}):\n{run.stdout}\n{run.stderr}"
