"""The tutorials as committed read on a static page (GitHub, nbviewer), where no widget runs:
no saved progress bar (frozen wherever widgets do not run), and every widget output carries a
still image or its real text, never only a repr such as `BlockPoolMonitor(...)` or `HBox(...)`,
and no saved block-pool monitor shows an empty pool."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
BARE_REPR = re.compile(r"^\s*[A-Z]\w*\(.*\)\s*$", re.S)
PROGRESS = ("FloatProgressModel", "IntProgressModel")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_static_page_shows_no_frozen_bar_and_no_bare_widget(path):
    nb = json.loads(path.read_text())
    state = nb["metadata"].get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    bars = [k for k, m in state.items() if m.get("model_name") in PROGRESS]
    assert not bars, f"{path.name}: {len(bars)} progress bars saved in the widget state (frozen on a static page)"
    for i, cell in enumerate(nb["cells"]):
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if out.get("name") == "stderr":
                assert "%|" not in "".join(out["text"]), f"{path.name} cell {i}: a tqdm bar in stderr"
            if "application/vnd.jupyter.widget-view+json" in data and "image/png" not in data:
                text = "".join(data.get("text/plain", ""))
                assert text.strip() and not BARE_REPR.match(text), (
                    f"{path.name} cell {i}: a widget with no still image and only {text[:40]!r} as text")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_saved_monitor_shows_an_empty_pool(path):
    """A monitor's still image is refreshed to the pool's busiest moment after each cell
    (BlockPoolMonitor._refresh_still), and says so in the output's metadata: one saved with
    nothing in use or cached is the all-grey "free N" grid a static page should never show."""
    nb = json.loads(path.read_text())
    for i, cell in enumerate(nb["cells"]):
        for out in cell.get("outputs", []):
            if not "".join(out.get("data", {}).get("text/plain", "")).startswith("BlockPoolMonitor("):
                continue
            shown = out.get("metadata", {}).get("jupyter_pagedkv")
            assert shown is not None, f"{path.name} cell {i}: a monitor saved by an older version: re-execute it"
            assert shown["blocks_in_use"] + shown["blocks_cached"] > 0, (
                f"{path.name} cell {i}: the monitor's still image is an empty pool ({shown['still']})")
