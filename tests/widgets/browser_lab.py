"""The JupyterLab side of the browser tests: a real `jupyter lab` (or `jupyter notebook`) server,
the system Chromium on one of its notebooks through Playwright, and the helpers that run a cell,
wait for it, read its text and read the monitor's canvas pixels and drawn peaks.

`lab` serves the monitor notebook (CELLS) that test_browser_monitor.py runs; test_browser_markdown,
test_browser_tenants and test_browser_notebook7 reuse the server, page and cell helpers. The
fixtures are imported by name (`from browser_lab import lab  # noqa: F401`). Needs /usr/bin/chromium
(`apt-get install -y chromium`; `.ci/run` does it) and the labextension built by `pip install -e .`;
`_why_skip` says what is missing. Never `playwright install`.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts" / "browser"
CHROMIUM = os.environ.get("PAGEDKV_CHROMIUM", "/usr/bin/chromium")
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--no-first-run"]
WIDGET_CANVAS = ".jp-OutputArea .pkv-root canvas.pkv-blocks"
PANEL_CANVAS = "#jupyter-pagedkv-panel canvas.pkv-blocks"

PROMPTS = ["Name three rivers in Europe.", "Write a short poem about the sea.",
           "What is a prime number?", "List four colours of the rainbow."]
LONG_PROMPT = ("You are reading a long report about lighthouses: their history, the keepers who lived "
               "in them, the lenses that made their light visible far out at sea, and the ships they "
               "saved. Summarise the report in two sentences.")
CELLS = [
    "%load_ext jupyter_pagedkv",
    "%pagedkv load --kv-cache-memory 96MiB --dtype float32",
    "%pagedkv monitor",
    "%%generate --max-tokens 40\n" + "\n---\n".join(PROMPTS),
    "%%generate --max-tokens 24 --n 3 --temperature 0.8 --seed 1\n" + LONG_PROMPT,
]


def _why_skip() -> str | None:
    if not Path(CHROMIUM).exists():
        return (f"no Chromium at {CHROMIUM}: install it with `apt-get install -y chromium` "
                f"(or set PAGEDKV_CHROMIUM) to run the browser tests")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Python playwright is missing: pip install -e '.[test]'"
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        return "jupyterlab is missing: pip install -e '.[test]'"
    if not (ROOT / "jupyter_pagedkv" / "labextension" / "package.json").exists():
        return "the labextension is not built: run `pip install -e .` (it runs the npm build)"
    return None


def palette() -> dict[str, tuple[int, int, int]]:
    """The state colours, read from the drawing module itself so the test cannot drift from it."""
    js = (ROOT / "jupyter_pagedkv" / "widgets" / "static" / "palette.js").read_text()
    block = js[js.index("export const COLORS = {"):]
    block = block[:block.index("};")]
    return {k: tuple(map(int, v.split(","))) for k, v in re.findall(r"(\w+): \[([\d, ]+)\]", block)}


COUNT_PIXELS = """([selector, colors]) => {
  const canvas = document.querySelector(selector);
  if (!canvas || !canvas.width || !canvas.height) return null;
  const d = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
  const counts = Object.fromEntries(Object.keys(colors).map(k => [k, 0]));
  for (let i = 0; i < d.length; i += 4) {
    for (const k in colors) {
      const c = colors[k];
      if (d[i] === c[0] && d[i + 1] === c[1] && d[i + 2] === c[2]) { counts[k]++; break; }
    }
  }
  return counts;
}"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_notebook(path: Path, cells: list[str]) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


@contextlib.contextmanager
def jupyter_server(app: str, root: Path, home: Path, args: list[str], log_name: str, env: dict | None = None):
    """`python -m <app>` (jupyterlab or notebook) serving `root` with no token and no news toast
    (it can cover cells and its buttons race the tests); yields its URL once /api/status answers,
    and keeps its log in ARTIFACTS/<log_name>."""
    notification = home / "settings" / "@jupyterlab" / "apputils-extension"
    notification.mkdir(parents=True)
    (notification / "notification.jupyterlab-settings").write_text(
        '{"fetchNews": "false", "checkForUpdates": false}')
    port = free_port()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false",
           "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"),
           "JUPYTER_RUNTIME_DIR": str(home / "runtime"), **(env or {})}
    log = open(root / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", app, "--allow-root", "--no-browser", "--ServerApp.token=",
         "--ServerApp.password=", "--ServerApp.ip=127.0.0.1", f"--port={port}",
         "--ServerApp.port_retries=0", f"--ServerApp.root_dir={root}", *args],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status", timeout=2)
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"{app} did not start: {(root / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
    try:
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        if ARTIFACTS.exists():
            shutil.copy(root / "server.log", ARTIFACTS / log_name)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    reason = _why_skip()
    if reason:
        pytest.skip(reason)   # no chromium / playwright here: the reason says how to enable them
    root = tmp_path_factory.mktemp("lab")
    write_notebook(root / "monitor.ipynb", CELLS)
    args = ["--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            # window.jupyterapp: the theme test switches themes with JupyterLab's own command.
            "--LabApp.expose_app_in_browser=True"]
    with jupyter_server("jupyterlab", root, tmp_path_factory.mktemp("jupyter-home"), args, "server.log") as url:
        yield url


@contextlib.contextmanager
def lab_page(lab: str, notebook: str, viewport: dict):
    """Chromium on JupyterLab's page of `notebook`, once its kernel is idle (JupyterLab drops an
    execution sent too early)."""
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        pg = browser.new_page(viewport=viewport)
        pg.set_default_timeout(60_000)
        pg.goto(f"{lab}/lab/workspaces/{uuid.uuid4().hex}/tree/{notebook}?reset")
        pg.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
        pg.locator("#jp-main-statusbar").get_by_text("Idle").wait_for(timeout=90_000)
        try:
            yield pg
        finally:
            browser.close()


@pytest.fixture(scope="module")
def page(lab):
    with lab_page(lab, "monitor.ipynb", {"width": 1400, "height": 1000}) as pg:
        yield pg


def dismiss_news(page) -> None:
    """Close a news toast if one shows anyway; one that vanishes or will not take a click is no
    reason to fail a test about the monitor."""
    from playwright.sync_api import Error as PlaywrightError

    button = page.get_by_role("button", name="No", exact=True)
    for i in range(button.count()):
        try:
            if button.nth(i).is_visible():
                button.nth(i).click(timeout=5000)
        except PlaywrightError:
            pass


def run_cell(page, index: int, wait: bool = True, timeout: float = 180) -> None:
    """Select cell `index` and run it with Shift+Enter; optionally wait until it has finished."""
    dismiss_news(page)
    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")
    if wait:
        wait_done(page, index, timeout)


def wait_done(page, index: int, timeout: float = 180) -> None:
    prompt = page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-InputPrompt")
    deadline = time.monotonic() + timeout
    while not re.fullmatch(r"\[\d+\]:", prompt.inner_text().strip()):
        if time.monotonic() > deadline:
            page.screenshot(path=str(ARTIFACTS / f"timeout-cell-{index}.png"))
            pytest.fail(f"cell {index} still running after {timeout} s (prompt "
                        f"{prompt.inner_text().strip()!r}); screenshot in {ARTIFACTS}")
        time.sleep(0.2)


def seqs_until_done(page, root: str, index: int, timeout: float = 180, after: float = 2.0) -> list[int]:
    """The frame numbers a view draws (its data-seq), read every few ms until `after` seconds
    past the end of cell `index` (as wait_done, which it replaces)."""
    read = ("([sel, i]) => [Number(document.querySelector(sel).dataset.seq),"
            " document.querySelectorAll('.jp-Notebook .jp-Cell')[i].querySelector('.jp-InputPrompt').innerText.trim()]")
    seqs: list[int] = []
    deadline, done_at = time.monotonic() + timeout, None
    while done_at is None or time.monotonic() - done_at < after:
        seq, prompt = page.evaluate(read, [root, index])
        if seq == seq and (not seqs or seq != seqs[-1]):      # NaN before the first draw
            seqs.append(seq)
        if done_at is None and re.fullmatch(r"\[\d+\]:", prompt):
            done_at = time.monotonic()
        if time.monotonic() > deadline:
            wait_done(page, index, timeout=0)     # fails with its screenshot
        time.sleep(0.005)
    return seqs


def cell_text(page, index: int) -> str:
    """The text of a cell's own output area (a `%%generate` cell of several prompts nests output
    widgets, each with an `.jp-OutputArea` of its own, inside it)."""
    return page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-Cell-outputArea").inner_text()


def pixels(page, selector: str) -> dict[str, int] | None:
    return page.evaluate(COUNT_PIXELS, [selector, {k: list(v) for k, v in palette().items()}])


def watch(page, selector: str, until, timeout: float, every: float = 0.15) -> list[dict[str, int]]:
    """Read the canvas repeatedly until `until(counts)` holds; returns every reading."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counts = pixels(page, selector)
        if counts is not None:
            seen.append(counts)
            if until(counts):
                return seen
        time.sleep(every)
    pytest.fail(f"the canvas {selector} never showed the expected state; last readings: {seen[-3:]}")


def settle(read, ok, timeout: float = 60, every: float = 0.2):
    """Read until `ok(reading)` holds or `timeout` passes; returns the last reading either way, for
    the caller's assertions to judge. For what the front end finishes on its own after a cell's
    prompt number appears (a render, a highlight, a repaint): a starved browser may take seconds."""
    deadline = time.monotonic() + timeout
    reading = read()
    while not ok(reading) and time.monotonic() < deadline:
        time.sleep(every)
        reading = read()
    return reading


WIDGET_ROOT = ".jp-OutputArea .pkv-root"
PANEL_ROOT = "#jupyter-pagedkv-panel .pkv-root"


def peaks(page, root: str) -> dict[str, int]:
    """The highest used / shared / running counts a view has drawn (its data-peak-* attributes)."""
    data = page.evaluate("sel => ({...document.querySelector(sel).dataset})", root)
    return {k: int(data.get(k, 0)) for k in ("peakUsed", "peakShared", "peakRunning")}


def wait_for_peak(page, root: str, key: str, timeout: float = 120) -> dict[str, int]:
    """Wait until the view has drawn a frame with `key` > 0 (it keeps the peak, so a run that is
    over before we look still counts)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = peaks(page, root)
        if seen[key] > 0:
            return seen
        time.sleep(0.2)
    pytest.fail(f"{root} never drew a frame with {key} > 0: {peaks(page, root)}")


def reset_peaks(page, root: str) -> None:
    page.evaluate("sel => { const d = document.querySelector(sel).dataset;"
                  " delete d.peakUsed; delete d.peakShared; delete d.peakRunning; }", root)
