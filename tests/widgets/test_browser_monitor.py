"""The monitor in a real browser: Playwright drives the system Chromium against a real `jupyter lab`.

One notebook, run cell by cell: load the extension and the embedded model, show the monitor widget,
run a `%%generate` with several prompts while reading the widget's canvas pixels (used blocks must
appear during the run and turn free/cached after it), run parallel samples (the shared prompt must
show shared blocks), then open the "KV cache" side panel and read the status bar. Screenshots go
to test-artifacts/browser/.

Needs /usr/bin/chromium (`apt-get install -y chromium`; `.ci/run` does it) and the labextension
built by `pip install -e .`; otherwise the tests skip and say so. Never `playwright install`.
"""
from __future__ import annotations

import contextlib
import json
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

# JupyterLab and Chromium start in the module's first test (its fixtures' setup counts).
pytestmark = [pytest.mark.slow, pytest.mark.browser, pytest.mark.timeout(1200)]
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


def test_the_widget_shows_blocks_in_use_during_a_run_and_freed_after(page):
    run_cell(page, 0, timeout=float(os.environ.get("PAGEDKV_FIRST_CELL_TIMEOUT", 180)))
    run_cell(page, 1, timeout=240)
    assert "loaded SmolLM2-135M-Instruct" in cell_text(page, 1), cell_text(page, 1)
    run_cell(page, 2)
    page.wait_for_selector(WIDGET_CANVAS)
    before = watch(page, WIDGET_CANVAS, lambda c: c["free"] > 0, timeout=30)[-1]
    assert before["used"] == 0 and before["shared"] == 0, before
    reset_peaks(page, WIDGET_ROOT)
    run_cell(page, 3, wait=False)
    during = wait_for_peak(page, WIDGET_ROOT, "peakUsed")
    page.locator(".jp-Notebook .jp-Cell").nth(2).screenshot(path=str(ARTIFACTS / "widget-during-run.png"))
    page.screenshot(path=str(ARTIFACTS / "notebook-during-run.png"))
    assert during["peakRunning"] > 0
    wait_done(page, 3)
    after = watch(page, WIDGET_CANVAS, lambda c: c["used"] == 0 and c["shared"] == 0, timeout=30)[-1]
    assert after["cached"] > 0 and after["free"] > 0, after     # finished blocks keep their prefix
    text = cell_text(page, 3)
    assert text.count("tokens generated") == len(PROMPTS), text
    # The answers are Markdown, rendered by JupyterLab: one rendered document per prompt's column.
    answers = page.locator(".jp-Notebook .jp-Cell").nth(3).locator(".jp-RenderedMarkdown")
    assert answers.count() == len(PROMPTS), answers.count()
    page.locator(".jp-Notebook .jp-Cell").nth(3).screenshot(path=str(ARTIFACTS / "markdown-answers.png"))
    gauges = page.locator(".jp-OutputArea .pkv-gauges").first.inner_text()
    assert "0 running" in gauges and "KV used" in gauges, gauges
    page.locator(".jp-Notebook .jp-Cell").nth(2).screenshot(path=str(ARTIFACTS / "widget-after-run.png"))


def test_parallel_samples_show_their_shared_prompt_blocks(page):
    reset_peaks(page, WIDGET_ROOT)
    run_cell(page, 4, wait=False)
    assert wait_for_peak(page, WIDGET_ROOT, "peakShared")["peakShared"] > 0
    page.locator(".jp-Notebook .jp-Cell").nth(2).screenshot(path=str(ARTIFACTS / "widget-shared.png"))
    wait_done(page, 4)
    watch(page, WIDGET_CANVAS, lambda c: c["shared"] == 0 and c["used"] == 0, timeout=30)


def test_side_panel_draws_the_pool_and_the_status_bar_reads_usage(page):
    page.locator('li[data-id="jupyter-pagedkv-panel"]').click()
    page.wait_for_selector(PANEL_CANVAS)
    counts = watch(page, PANEL_CANVAS, lambda c: c["cached"] > 0, timeout=30)[-1]
    assert counts["used"] == 0
    status = page.locator(".pkv-status").inner_text().strip()
    assert re.fullmatch(r"KV \d+(\.\d)?% · \d+ running( · \d+ waiting)?", status), status
    assert "idle" not in status.lower()
    title = page.locator("#jupyter-pagedkv-panel .pkv-title").inner_text()
    assert "SmolLM2-135M-Instruct" in title, title
    # Every text the status bar shows from now on, recorded in the page as it changes.
    page.evaluate("() => { window.pkvStatusTexts = []; const el = document.querySelector('.pkv-status');"
                  " new MutationObserver(() => window.pkvStatusTexts.push(el.textContent))"
                  ".observe(el, {childList: true, characterData: true, subtree: true}); }")
    reset_peaks(page, PANEL_ROOT)
    run_cell(page, 3, wait=False)        # the same prompts again: the panel follows the run too
    assert wait_for_peak(page, PANEL_ROOT, "peakUsed")["peakRunning"] > 0
    page.screenshot(path=str(ARTIFACTS / "side-panel-during-run.png"))
    wait_done(page, 3)
    texts = page.evaluate("() => window.pkvStatusTexts")
    busy = next((t.strip() for t in texts if re.search(r"· [1-9]\d* running", t)), None)
    assert busy and re.fullmatch(r"KV \d+(\.\d)?% · [1-9]\d* running( · \d+ waiting)?", busy), texts
    watch(page, PANEL_CANVAS, lambda c: c["used"] == 0, timeout=30)
    (ARTIFACTS / "status.json").write_text(json.dumps({"idle_text": status, "busy_text": busy}))


# WCAG 2.x contrast of every text the monitor shows against what is painted behind it, from the
# rendered styles: the text's computed colour (faded by any opacity on its way up) over the first
# ancestor backgrounds that add up to an opaque one. Returns one row per visible text element.
CONTRAST = """(selectors) => {
  const parse = (s) => { const m = /rgba?\\(([^)]*)\\)/.exec(s); if (!m) return null;
    const p = m[1].split(/[\\s,\\/]+/).filter(Boolean).map(Number); return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1]; };
  const over = (top, under) => top.slice(0, 3).map((c, i) => c * top[3] + under[i] * (1 - top[3]));
  const lum = (rgb) => rgb.map((c) => { const v = c / 255; return v <= 0.04045 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; })
    .reduce((s, v, i) => s + v * [0.2126, 0.7152, 0.0722][i], 0);
  const backdrop = (el) => { const layers = [];
    for (let e = el; e; e = e.parentElement) { const c = parse(getComputedStyle(e).backgroundColor);
      if (c && c[3] > 0) { layers.push(c); if (c[3] >= 1) break; } }
    let bg = [255, 255, 255]; for (const c of layers.reverse()) bg = over(c, bg); return bg; };
  const rows = [];
  for (const sel of selectors) for (const el of document.querySelectorAll(sel)) {
    if (!el.offsetParent || !el.textContent.trim()) continue;
    // An opacity on the text or an ancestor fades it into the backdrop as much as an alpha would.
    let fade = 1;
    for (let e = el; e; e = e.parentElement) fade *= Number(getComputedStyle(e).opacity);
    const ink = parse(getComputedStyle(el).color);
    const bg = backdrop(el), fg = over([ink[0], ink[1], ink[2], ink[3] * fade], bg);
    const [a, b] = [lum(fg), lum(bg)].sort((x, y) => y - x);
    rows.push({ sel, text: el.textContent.trim().slice(0, 40), fg: fg.map(Math.round), bg: bg.map(Math.round),
                ratio: (a + 0.05) / (b + 0.05) });
  }
  return rows;
}"""
TEXTS = [f"{root} {part}" for root in (WIDGET_ROOT, PANEL_ROOT)
         for part in (".pkv-title", ".pkv-gauges span", ".pkv-legend span", ".pkv-hover", ".pkv-note")] + [
    ".pkv-status", ".pkv-panel-note"]


def assert_readable(page, theme: str) -> list[dict]:
    rows = page.evaluate(CONTRAST, TEXTS)
    seen = {r["sel"] for r in rows}
    for must in (f"{WIDGET_ROOT} .pkv-gauges span", f"{PANEL_ROOT} .pkv-gauges span", f"{WIDGET_ROOT} .pkv-legend span",
                 f"{PANEL_ROOT} .pkv-title", ".pkv-status"):
        assert must in seen, f"{theme}: nothing visible matched {must}: {sorted(seen)}"
    low = [r for r in rows if r["ratio"] < 4.5]
    assert not low, f"{theme} theme: text below WCAG AA 4.5:1: {low}"
    return rows


def test_light_and_dark_themes_keep_states_apart_and_text_readable(page):
    """The widget, the side panel and the status bar follow JupyterLab's theme: in the light and
    the dark theme every text keeps 4.5:1 contrast (computed from the rendered styles), and the map
    paints free blocks in the theme's own grey, apart from every other state."""
    light = assert_readable(page, "light")
    page.evaluate("() => window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Dark'})")
    page.wait_for_selector("body[data-jp-theme-light='false']", state="attached", timeout=30_000)
    page.wait_for_timeout(1000)                  # the theme's stylesheet is in once the attribute is set
    dark_free = page.evaluate("""() => { const c = document.createElement('canvas').getContext('2d');
        c.fillStyle = getComputedStyle(document.body).getPropertyValue('--jp-layout-color2').trim();
        const n = parseInt(c.fillStyle.slice(1), 16); return [n >> 16, (n >> 8) & 255, n & 255]; }""")
    colors = {**{k: list(v) for k, v in palette().items()}, "free": dark_free}
    assert dark_free != colors["cached"] and sum(dark_free) < sum(palette()["free"]), dark_free
    # The map repaints on the theme change alone (no new frame): free cells in the dark grey.
    for selector in (WIDGET_CANVAS, PANEL_CANVAS):
        deadline = time.monotonic() + 20
        while (page.evaluate(COUNT_PIXELS, [selector, colors]) or {}).get("free", 0) == 0:
            assert time.monotonic() < deadline, f"{selector} never repainted free blocks in {dark_free}"
            time.sleep(0.2)
    reset_peaks(page, WIDGET_ROOT)
    run_cell(page, 4, wait=False)                 # samples: used and shared blocks, in the dark
    wait_for_peak(page, WIDGET_ROOT, "peakShared")
    counts = page.evaluate(COUNT_PIXELS, [WIDGET_CANVAS, colors])
    page.locator(".jp-Notebook .jp-Cell").nth(2).screenshot(path=str(ARTIFACTS / "dark-widget.png"))
    page.screenshot(path=str(ARTIFACTS / "dark-lab.png"))
    page.locator("#jupyter-pagedkv-panel").screenshot(path=str(ARTIFACTS / "dark-side-panel.png"))
    dark = assert_readable(page, "dark")
    wait_done(page, 4)
    assert counts["free"] > 0, counts
    assert {r["bg"][0] for r in dark if r["sel"].endswith(".pkv-gauges span")} != {255}, dark
    (ARTIFACTS / "contrast.json").write_text(json.dumps({"light": light, "dark": dark}, indent=1))
    page.evaluate("() => window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Light'})")
    page.wait_for_selector("body[data-jp-theme-light='true']", state="attached", timeout=30_000)
