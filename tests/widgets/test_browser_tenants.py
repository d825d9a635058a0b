"""The monitor coloured by tenant, in a real browser: the notebook widget and the JupyterLab side panel.

A kernel builds an engine on a tiny random model (no weights to load) with three tenants whose
prompts share a prefix under prefix_cache_scope="global", finishes one short request each for
alice and bob (so their TTFT is known), then leaves three requests half done: the pool holds
blocks of each tenant and prefix blocks two or three tenants share, and nothing moves until a cell
steps the engine. Both views are switched to "colour by: tenant" with their own toggle and checked
from the rendered result: each tenant's colour on the canvas, blocks split between two tenants,
the tenant legend and gauges, the hover text; the mode survives new frames. Screenshots go to
test-artifacts/browser/tenants-*.png.

The server, page and cell helpers come from browser_lab.py; it skips where test_browser_monitor.py does.
"""
from __future__ import annotations

import re
import time

import pytest
from browser_lab import ARTIFACTS, _why_skip, jupyter_server, lab_page, run_cell, settle, write_notebook

from jupyter_pagedkv.widgets.pool_figure import STATIC

# JupyterLab and Chromium start in the module's first test (its fixtures' setup counts).
pytestmark = [pytest.mark.slow, pytest.mark.browser, pytest.mark.timeout(1200)]

SETUP = """\
from jupyter_pagedkv import Engine, SamplingParams
from jupyter_pagedkv.testing.models import tiny_model
from jupyter_pagedkv.notebook.session import current

engine = Engine(tiny_model("llama", seed=3), None, block_size=4, num_blocks=96, kv_cache_memory="64MiB",
                prefix_cache_scope="global", scheduling_policy="fair")
engine.set_tenant("alice", weight=2.0, max_blocks=48)
prefix = list(range(3, 35))                       # 8 blocks every tenant's prompt starts with
short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
for tenant, suffix in (("alice", [90]), ("bob", [91]), ("bob", list(range(140, 160)))):
    engine.generate([prefix + suffix], short, tenant=tenant)   # TTFTs; bob's last leaves cached blocks
long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
engine.add_request(prefix + list(range(40, 60)), long, tenant="alice")
engine.add_request(prefix + list(range(60, 88)), long, tenant="bob")
engine.add_request(prefix[:12] + list(range(100, 136)), SamplingParams(n=2, max_tokens=60, temperature=0.8,
                   seed=1, ignore_eos=True), tenant="carol")
for _ in range(6):
    engine.step()
current().engine = engine                         # what the side panel's channel shows
engine.monitor()"""
CELLS = ["%load_ext jupyter_pagedkv", SETUP, "for _ in range(2):\n    engine.step()"]
TENANTS = ["alice", "bob", "carol"]              # EngineStats.tenants' order: their colours' order
WIDGET = ".jp-OutputArea .pkv-root"
PANEL = "#jupyter-pagedkv-panel .pkv-root"


def js_colour(name: str) -> list:
    js = (STATIC / "palette.js").read_text()
    block = js[js.index(f"export const {name} = "):]
    block = block[:block.index(";")]
    found = [list(map(int, m)) for m in re.findall(r"\[(\d+), (\d+), (\d+)\]", block)]
    return found if name == "TENANT_COLORS" else found[0]


# Per tenant colour, its pixels on the canvas; and "splits": pixels of the dashed light/dark line
# that splits a cell between two tenants' colours, with the first one's position, for hovering.
READ_CANVAS = """([selector, tenants, cues]) => {
  const canvas = document.querySelector(selector);
  if (!canvas || !canvas.width) return null;
  const w = canvas.width, d = canvas.getContext('2d').getImageData(0, 0, w, canvas.height).data;
  const which = (i) => tenants.findIndex(c => d[i] === c[0] && d[i + 1] === c[1] && d[i + 2] === c[2]);
  const isCue = (i) => cues.some(c => d[i] === c[0] && d[i + 1] === c[1] && d[i + 2] === c[2]);
  const counts = tenants.map(() => 0);
  let splits = 0, at = null;
  for (let i = 0; i < d.length; i += 4) {
    const t = which(i);
    if (t >= 0) { counts[t]++; continue; }
    const x = (i / 4) % w;
    if (x === 0 || x === w - 1 || !isCue(i)) continue;
    // Left of the line one tenant, right of it and below it another; the line goes on down-left
    // (which the background between two cells of different tenants does not).
    const a = which(i - 4), b = which(i + 4), below = i + 4 * w;
    if (a >= 0 && b >= 0 && a !== b && below < d.length && which(below) === b && isCue(below - 4)) {
      splits++;
      if (!at) at = [x, Math.floor(i / 4 / w)];
    }
  }
  return { counts, splits, at };
}"""


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    reason = _why_skip()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("lab-tenants")
    write_notebook(root / "tenants.ipynb", CELLS)
    args = ["--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.expose_app_in_browser=True"]       # window.jupyterapp, to switch themes
    home = tmp_path_factory.mktemp("jupyter-home-tenants")
    with jupyter_server("jupyterlab", root, home, args, "server-tenants.log") as url:
        with lab_page(url, "tenants.ipynb", {"width": 1400, "height": 1000}) as pg:
            run_cell(pg, 0)
            run_cell(pg, 1, timeout=120)
            pg.wait_for_selector(f"{WIDGET} canvas.pkv-blocks")
            yield pg


def read(page, root: str) -> dict:
    return page.evaluate(READ_CANVAS, [f"{root} canvas.pkv-blocks", js_colour("TENANT_COLORS")[:3],
                                       [js_colour("MARK"), js_colour("STRIPE")]])


def switch_to_tenants(page, root: str) -> dict:
    """Click the view's own "tenant" toggle; returns the canvas reading once it is repainted."""
    page.locator(f"{root} .pkv-mode button[data-mode='tenant']").click()
    deadline = time.monotonic() + 120
    while True:
        seen = read(page, root)
        if page.evaluate("sel => document.querySelector(sel).dataset.mode", root) == "tenant" and seen \
                and all(seen["counts"]):
            return seen
        assert time.monotonic() < deadline, f"{root} never drew every tenant's colour: {seen}"
        time.sleep(0.1)


def assert_tenant_view(page, root: str, seen: dict) -> None:
    assert seen["splits"] > 0, f"{root}: no block drawn split between two tenants: {seen}"
    legend = page.locator(f"{root} .pkv-legend").inner_text()
    for label in ["free", *TENANTS, "several tenants"]:
        assert label in legend, legend
    gauges = page.locator(f"{root} .pkv-tenants").inner_text()
    for name in TENANTS:
        assert name in gauges, gauges
    assert re.search(r"alice\s+\d+ blocks \(\d+ shared\), share \d+, cap 48 · 1 running · 0 waiting · "
                     r"TTFT \d+ ms / max \d+ ms", gauges), gauges
    assert "tenants\n3 · fair scheduling" in page.locator(f"{root} .pkv-gauges").inner_text()
    # The pressed toggle is readable: its text colour on its own background, WCAG AA.
    ratio = page.evaluate("""sel => { const b = document.querySelector(sel);
      const rgb = s => s.match(/[\\d.]+/g).slice(0, 3).map(Number).map(c => c / 255)
        .map(v => v <= 0.04045 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4);
      const lum = s => rgb(s).reduce((a, v, i) => a + v * [0.2126, 0.7152, 0.0722][i], 0);
      const [x, y] = [lum(getComputedStyle(b).color), lum(getComputedStyle(b).backgroundColor)].sort((p, q) => q - p);
      return (x + 0.05) / (y + 0.05); }""", f"{root} .pkv-mode button[aria-pressed='true']")
    assert ratio >= 4.5, ratio


def hover_text(page, root: str, at: list, ok=lambda text: "tenant" in text) -> str:
    """The hover line over the block at `at`, read until `ok` holds (60 s: a starved browser may
    deliver the mouse move frames later); the last reading either way, for the caller to judge."""
    canvas = page.locator(f"{root} canvas.pkv-blocks")
    canvas.scroll_into_view_if_needed()
    box = canvas.bounding_box()
    # Down-left along the line, clear of the cell's edge (mouse events land on whole pixels).
    page.mouse.move(box["x"] + at[0] - 2, box["y"] + at[1] + 3)
    return settle(lambda: page.locator(f"{root} .pkv-hover").inner_text(), ok)


def test_the_widget_colours_blocks_by_tenant_and_marks_those_tenants_share(page):
    assert page.locator(f"{WIDGET} .pkv-mode").is_visible()
    assert page.evaluate("sel => document.querySelector(sel).dataset.mode", WIDGET) == "state"
    assert read(page, WIDGET)["counts"] == [0, 0, 0]           # by state: no tenant colour yet
    seen = switch_to_tenants(page, WIDGET)
    assert_tenant_view(page, WIDGET, seen)
    line = r"block \d+: shared ×\d · tenants (alice, bob|alice, bob, carol) — req-\d+"
    hover = hover_text(page, WIDGET, seen["at"], lambda text: re.search(line, text))
    assert re.search(line, hover), hover
    page.locator(".jp-Notebook .jp-Cell").nth(1).locator(".jp-OutputArea").screenshot(
        path=str(ARTIFACTS / "tenants-widget.png"))
    # New frames (two more steps) redraw the map; the view stays coloured by tenant.
    seq = int(page.evaluate("sel => document.querySelector(sel).dataset.seq", WIDGET))
    run_cell(page, 2)
    deadline = time.monotonic() + 120
    while int(page.evaluate("sel => document.querySelector(sel).dataset.seq", WIDGET)) == seq:
        assert time.monotonic() < deadline, "the widget got no frame after two steps"
        time.sleep(0.1)
    assert page.evaluate("sel => document.querySelector(sel).dataset.mode", WIDGET) == "tenant"
    assert all(read(page, WIDGET)["counts"])


def test_the_side_panel_colours_blocks_by_tenant_too(page):
    page.locator('li[data-id="jupyter-pagedkv-panel"]').click()
    page.wait_for_selector(f"{PANEL} canvas.pkv-blocks")
    deadline = time.monotonic() + 120
    while not page.locator(f"{PANEL} .pkv-mode").is_visible():   # the panel's comm retries every 2 s
        assert time.monotonic() < deadline, "the side panel never showed the colour-by toggle"
        time.sleep(0.2)
    seen = switch_to_tenants(page, PANEL)
    assert_tenant_view(page, PANEL, seen)
    assert "tenant" in hover_text(page, PANEL, seen["at"])
    page.locator("#jupyter-pagedkv-panel").screenshot(path=str(ARTIFACTS / "tenants-side-panel.png"))
    page.mouse.move(0, 0)
    page.screenshot(path=str(ARTIFACTS / "tenants-lab.png"))


def test_both_views_stay_coloured_by_tenant_through_a_theme_switch(page):
    """A theme change repaints the map (free in the dark grey) and keeps each view's choice."""
    page.evaluate("() => window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Dark'})")
    page.wait_for_selector("body[data-jp-theme-light='false']", state="attached", timeout=120_000)
    def free() -> list[int]:
        return page.evaluate("""() => { const c = document.createElement('canvas').getContext('2d');
            c.fillStyle = getComputedStyle(document.body).getPropertyValue('--jp-layout-color2').trim();
            const n = parseInt(c.fillStyle.slice(1), 16); return [n >> 16, (n >> 8) & 255, n & 255]; }""")

    def read(root: str) -> dict:
        return page.evaluate(READ_CANVAS, [f"{root} canvas.pkv-blocks", js_colour("TENANT_COLORS")[:3] + [free()],
                                           [js_colour("MARK"), js_colour("STRIPE")]])

    try:
        for root in (WIDGET, PANEL):
            assert page.evaluate("sel => document.querySelector(sel).dataset.mode", root) == "tenant"
            # The repaint follows the theme's CSS on the next animation frame: poll until it shows.
            seen = settle(lambda: read(root), lambda s: all(s["counts"]) and s["splits"] > 0, timeout=120)
            assert all(seen["counts"]) and seen["splits"] > 0, (root, free(), seen)   # the last: dark free
        page.screenshot(path=str(ARTIFACTS / "tenants-lab-dark.png"))
    finally:
        page.evaluate("() => window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Light'})")
        page.wait_for_selector("body[data-jp-theme-light='true']", state="attached", timeout=120_000)
