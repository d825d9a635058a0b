"""The monitor widget in Jupyter Notebook 7: Playwright drives the system Chromium against a real
`jupyter notebook` (the `notebook` package, 7.x), whose users get the same widget through anywidget.

One notebook, run cell by cell: load the extension and the embedded model, show the monitor widget,
run a `%%generate` with several prompts. The widget's canvas must show free blocks before the run,
blocks in use during it (read from the busiest frame the drawing module recorded in `.pkv-root`'s
data-peak-* attributes, so a quick run is not missed) and none in use, but cached ones, after it.
Screenshots go to test-artifacts/browser/notebook7-*.png.

The helpers (palette, canvas reading, running a cell, waiting for a cell, a cell's text) come from
browser_lab.py, shared with test_browser_monitor.py, the JupyterLab test: Notebook 7 builds its
notebook from the same JupyterLab components (`.jp-Notebook .jp-Cell`, `.jp-InputPrompt`,
`.jp-OutputArea`). What differs is the shell: no status bar, so the kernel is idle when the top
bar's `.jp-NotebookKernelStatus` has left its "Kernel Connecting"/"Kernel Starting" text (only
`-fade`, no `-info`/`-warn`/`-error` class, no text) and the notebook toolbar's
`.jp-Notebook-ExecutionIndicator` reads data-status="idle" (that indicator alone says "idle"
before any kernel is attached).

Needs /usr/bin/chromium, playwright, and `notebook>=7` (`pip install -e '.[test]'`); otherwise the
tests skip and say so. Never `playwright install`.
"""
from __future__ import annotations

import os

import pytest
from browser_lab import (
    ARTIFACTS,
    CHROMIUM,
    LAUNCH_ARGS,
    PROMPTS,
    WIDGET_CANVAS,
    WIDGET_ROOT,
    _why_skip,
    cell_text,
    jupyter_server,
    reset_peaks,
    run_cell,
    settle,
    wait_done,
    wait_for_peak,
    watch,
    write_notebook,
)

# JupyterLab and Chromium start in the module's first test (its fixtures' setup counts).
pytestmark = [pytest.mark.slow, pytest.mark.browser, pytest.mark.timeout(1200)]

CELLS = [
    "%load_ext jupyter_pagedkv",
    "%pagedkv load --kv-cache-memory 96MiB --dtype float32",
    "%pagedkv monitor",
    "%%generate --max-tokens 40\n" + "\n---\n".join(PROMPTS),
]
MONITOR_CELL, GENERATE_CELL = 2, 3
NOTEBOOK = "monitor.ipynb"

# The kernel is up and idle (see the module docstring for why both conditions).
KERNEL_IDLE = """() => {
  const status = document.querySelector('.jp-NotebookKernelStatus');
  const indicator = document.querySelector('.jp-NotebookPanel .jp-Notebook-ExecutionIndicator');
  if (!status || !indicator) return false;
  const live = status.classList.contains('jp-NotebookKernelStatus-fade')
    && !['info', 'warn', 'error'].some(k => status.classList.contains('jp-NotebookKernelStatus-' + k))
    && !status.textContent.trim();
  return live && indicator.dataset.status === 'idle';
}"""


def _why_skip_notebook7() -> str | None:
    reason = _why_skip()
    if reason:
        return reason
    try:
        import notebook
    except ImportError:
        return "the `notebook` package (Notebook 7) is missing: pip install -e '.[test]'"
    if int(notebook.__version__.split(".")[0]) != 7:
        return f"notebook {notebook.__version__} is installed, this test needs Notebook 7 (notebook>=7,<8)"
    return None


@pytest.fixture(scope="module")
def notebook7(tmp_path_factory):
    reason = _why_skip_notebook7()
    if reason:
        pytest.skip(reason)   # no chromium / playwright / notebook here: the reason says what to install
    root = tmp_path_factory.mktemp("notebook7")
    write_notebook(root / NOTEBOOK, CELLS)
    home = tmp_path_factory.mktemp("notebook7-home")
    (home / "config").mkdir()
    # Notebook 7 reads its settings where JupyterLab does (the same "no news toast" seed); no
    # user-level jupyter config from this machine (~/.jupyter), the venv's own is still read.
    with jupyter_server("notebook", root, home, [], "notebook7-server.log",
                        env={"JUPYTER_CONFIG_DIR": str(home / "config")}) as url:
        yield url


@pytest.fixture(scope="module")
def nb7_page(notebook7):
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        pg = browser.new_page(viewport={"width": 1400, "height": 1000})
        pg.set_default_timeout(60_000)
        pg.goto(f"{notebook7}/notebooks/{NOTEBOOK}")  # Notebook 7's page of one notebook
        pg.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=90_000)
        # Run nothing before the kernel is up: an execution sent too early is dropped.
        try:
            pg.wait_for_function(KERNEL_IDLE, timeout=90_000)
        except PlaywrightError:
            pg.screenshot(path=str(ARTIFACTS / "notebook7-kernel-not-idle.png"))
            raise
        yield pg
        browser.close()


def shot(page, name: str, cell: int | None = None) -> None:
    target = page if cell is None else page.locator(".jp-Notebook .jp-Cell").nth(cell)
    target.screenshot(path=str(ARTIFACTS / f"notebook7-{name}.png"))


def test_the_page_is_notebook7(nb7_page):
    config = nb7_page.evaluate(
        "() => JSON.parse(document.getElementById('jupyter-config-data').textContent)")
    assert config["appName"] == "Jupyter Notebook", config.get("appName")
    assert config["appVersion"].startswith("7."), config.get("appVersion")
    # Notebook 7's own shell (logo, top bar), not JupyterLab's (status bar, side bars' tabs).
    assert nb7_page.locator("#jp-NotebookLogo").is_visible()
    assert nb7_page.locator("#jp-main-statusbar").count() == 0


def test_the_widget_shows_blocks_in_use_during_a_run_and_freed_after(nb7_page):
    page = nb7_page
    run_cell(page, 0, timeout=float(os.environ.get("PAGEDKV_FIRST_CELL_TIMEOUT", 180)))
    run_cell(page, 1, timeout=240)
    assert "loaded SmolLM2-135M-Instruct" in cell_text(page, 1), cell_text(page, 1)
    run_cell(page, MONITOR_CELL)
    page.wait_for_selector(WIDGET_CANVAS)
    before = watch(page, WIDGET_CANVAS, lambda c: c["free"] > 0, timeout=120)[-1]
    assert before["used"] == 0 and before["shared"] == 0, before
    shot(page, "widget-before-run", MONITOR_CELL)

    reset_peaks(page, WIDGET_ROOT)
    run_cell(page, GENERATE_CELL, wait=False)
    during = wait_for_peak(page, WIDGET_ROOT, "peakUsed", timeout=240)
    assert during["peakRunning"] > 0, during
    shot(page, "widget-during-run", MONITOR_CELL)
    shot(page, "notebook-during-run")

    wait_done(page, GENERATE_CELL, timeout=300)
    after = watch(page, WIDGET_CANVAS, lambda c: c["used"] == 0 and c["shared"] == 0, timeout=120)[-1]
    assert after["cached"] > 0 and after["free"] > 0, after     # finished blocks keep their prefix
    text = settle(lambda: cell_text(page, GENERATE_CELL), lambda t: t.count("tokens generated") == len(PROMPTS))
    assert text.count("tokens generated") == len(PROMPTS), text
    gauges = settle(page.locator(".jp-OutputArea .pkv-gauges").first.inner_text, lambda g: "0 running" in g)
    assert "0 running" in gauges and "KV used" in gauges, gauges
    shot(page, "widget-after-run", MONITOR_CELL)
    shot(page, "notebook-after-run")
