"""The monitor in a real browser: Playwright drives the system Chromium against a real `jupyter lab`.

One notebook, run cell by cell: load the extension and the embedded model, show the monitor widget,
run a `%%generate` with several prompts while reading the widget's canvas pixels (used blocks must
appear during the run and turn free/cached after it), run parallel samples (the shared prompt must
show shared blocks), then open the "KV cache" side panel and read the status bar. Screenshots go
to test-artifacts/browser/.

Needs /usr/bin/chromium (`apt-get install -y chromium`; `.ci/run` does it) and the labextension
built by `pip install -e .`; otherwise the tests skip and say so. Never `playwright install`.

The server, page, cell and canvas helpers are in browser_lab.py.
"""
from __future__ import annotations

import json
import os
import re
import time

import pytest
from browser_lab import (  # noqa: F401  (lab: a fixture)
    ARTIFACTS,
    COUNT_PIXELS,
    PANEL_CANVAS,
    PANEL_ROOT,
    PROMPTS,
    WIDGET_CANVAS,
    WIDGET_ROOT,
    cell_text,
    lab,
    lab_page,
    palette,
    reset_peaks,
    run_cell,
    seqs_until_done,
    settle,
    wait_done,
    wait_for_peak,
    watch,
)

# JupyterLab and Chromium start in the module's first test (its fixtures' setup counts).
pytestmark = [pytest.mark.slow, pytest.mark.browser, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def page(lab):
    with lab_page(lab, "monitor.ipynb", {"width": 1400, "height": 1000}) as pg:
        yield pg


def test_the_widget_shows_blocks_in_use_during_a_run_and_freed_after(page):
    run_cell(page, 0, timeout=float(os.environ.get("PAGEDKV_FIRST_CELL_TIMEOUT", 180)))
    run_cell(page, 1, timeout=240)
    assert "loaded SmolLM2-135M-Instruct" in cell_text(page, 1), cell_text(page, 1)
    run_cell(page, 2)
    page.wait_for_selector(WIDGET_CANVAS)
    before = watch(page, WIDGET_CANVAS, lambda c: c["free"] > 0, timeout=120)[-1]
    assert before["used"] == 0 and before["shared"] == 0, before
    reset_peaks(page, WIDGET_ROOT)
    run_cell(page, 3, wait=False)
    during = wait_for_peak(page, WIDGET_ROOT, "peakUsed")
    page.locator(".jp-Notebook .jp-Cell").nth(2).screenshot(path=str(ARTIFACTS / "widget-during-run.png"))
    page.screenshot(path=str(ARTIFACTS / "notebook-during-run.png"))
    assert during["peakRunning"] > 0
    # The cell's end re-renders the view (its still image is refreshed): it must go on from the
    # pool now, never back to an older frame (it once drew the empty pool of display time).
    seqs = seqs_until_done(page, WIDGET_ROOT, 3)
    assert all(a <= b for a, b in zip(seqs, seqs[1:])), f"the view went back to an older frame: {seqs}"
    after = watch(page, WIDGET_CANVAS, lambda c: c["used"] == 0 and c["shared"] == 0, timeout=120)[-1]
    assert after["cached"] > 0 and after["free"] > 0, after     # finished blocks keep their prefix
    text = settle(lambda: cell_text(page, 3), lambda t: t.count("tokens generated") == len(PROMPTS))
    assert text.count("tokens generated") == len(PROMPTS), text
    # The answers are Markdown, rendered by JupyterLab: one rendered document per prompt's column.
    answers = page.locator(".jp-Notebook .jp-Cell").nth(3).locator(".jp-RenderedMarkdown")
    assert settle(answers.count, lambda n: n == len(PROMPTS)) == len(PROMPTS), answers.count()
    page.locator(".jp-Notebook .jp-Cell").nth(3).screenshot(path=str(ARTIFACTS / "markdown-answers.png"))
    gauges = settle(page.locator(".jp-OutputArea .pkv-gauges").first.inner_text, lambda g: "0 running" in g)
    assert "0 running" in gauges and "KV used" in gauges, gauges
    page.locator(".jp-Notebook .jp-Cell").nth(2).screenshot(path=str(ARTIFACTS / "widget-after-run.png"))


def test_parallel_samples_show_their_shared_prompt_blocks(page):
    reset_peaks(page, WIDGET_ROOT)
    run_cell(page, 4, wait=False)
    assert wait_for_peak(page, WIDGET_ROOT, "peakShared")["peakShared"] > 0
    page.locator(".jp-Notebook .jp-Cell").nth(2).screenshot(path=str(ARTIFACTS / "widget-shared.png"))
    wait_done(page, 4)
    watch(page, WIDGET_CANVAS, lambda c: c["shared"] == 0 and c["used"] == 0, timeout=120)


def test_side_panel_draws_the_pool_and_the_status_bar_reads_usage(page):
    page.locator('li[data-id="jupyter-pagedkv-panel"]').click()
    page.wait_for_selector(PANEL_CANVAS)
    counts = watch(page, PANEL_CANVAS, lambda c: c["cached"] > 0, timeout=120)[-1]
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
    watch(page, PANEL_CANVAS, lambda c: c["used"] == 0, timeout=120)
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
    page.wait_for_selector("body[data-jp-theme-light='false']", state="attached", timeout=120_000)
    # The theme's stylesheet may land after the attribute: read its grey until it is the dark one.
    dark_free = settle(lambda: page.evaluate("""() => { const c = document.createElement('canvas').getContext('2d');
        c.fillStyle = getComputedStyle(document.body).getPropertyValue('--jp-layout-color2').trim();
        const n = parseInt(c.fillStyle.slice(1), 16); return [n >> 16, (n >> 8) & 255, n & 255]; }"""),
                       lambda rgb: sum(rgb) < sum(palette()["free"]), timeout=120)
    colors = {**{k: list(v) for k, v in palette().items()}, "free": dark_free}
    assert dark_free != colors["cached"] and sum(dark_free) < sum(palette()["free"]), dark_free
    # The map repaints on the theme change alone (no new frame): free cells in the dark grey.
    for selector in (WIDGET_CANVAS, PANEL_CANVAS):
        deadline = time.monotonic() + 120
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
    page.wait_for_selector("body[data-jp-theme-light='true']", state="attached", timeout=120_000)
