"""Runs the JavaScript unit tests of the monitor's drawing module (`node --test`), every
tests/widgets/*.test.mjs: blockmap_frames (folding frames), blockmap_drawing (layout, state colours,
theme), blockmap_text (status bar, gauges, sparkline, hover) and blockmap_tenants (the
colour-by-tenant mode). Outside a browser the code that folds frames and draws the block map runs
nowhere else."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JS_TESTS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "widgets").glob("*.test.mjs"))


@pytest.mark.parametrize("tests", JS_TESTS)
def test_blockmap_js(tests: str) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the blockmap.js tests need Node.js (node --test)")
    run = subprocess.run([node, "--test", tests], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"node --test {tests} failed (exit {run.returncode}):\n{run.stdout}\n{run.stderr}"


def test_the_widget_module_is_one_text_with_the_same_exports_as_the_files(tmp_path) -> None:
    """anywidget gets blockmap.js with its imports inlined (widgets/esm.py): no relative import is
    left, and Node sees exactly the exports the files on disk give the labextension."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the blockmap.js tests need Node.js")
    from jupyter_pagedkv.widgets.esm import inlined_module

    static = ROOT / "jupyter_pagedkv" / "widgets" / "static"
    text = inlined_module(static / "blockmap.js")
    assert './' not in "".join(line for line in text.splitlines() if line.startswith("import"))
    (tmp_path / "widget.mjs").write_text(text)
    names = ("const m = await import(process.argv[1]); "
             "console.log(Object.keys(m).sort().join(','), typeof m.default.render);")
    seen = [subprocess.run([node, "--input-type=module", "-e", names, str(url)], capture_output=True, text=True,
                           timeout=60) for url in ((tmp_path / "widget.mjs").as_uri(), (static / "blockmap.js").as_uri())]
    assert all(r.returncode == 0 for r in seen), [r.stderr for r in seen]
    assert seen[0].stdout == seen[1].stdout and "mount" in seen[0].stdout and seen[0].stdout.endswith("function\n")


def test_an_import_cycle_between_the_modules_is_refused(tmp_path) -> None:
    from jupyter_pagedkv.widgets.esm import inlined_module

    (tmp_path / "a.js").write_text('import { b } from "./b.js";\nexport const a = 1;\n')
    (tmp_path / "b.js").write_text('import { a } from "./a.js";\nexport const b = 2;\n')
    with pytest.raises(ValueError, match="import cycle between the monitor's modules: a.js -> b.js -> a.js"):
        inlined_module(tmp_path / "a.js")
