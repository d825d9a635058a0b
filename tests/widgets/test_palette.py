"""The block states' colours stay apart for the common colour-vision deficiencies, in both themes.

Each colour of the monitor's table (read from palette.js, as pool_figure reads it) is passed through
Machado, Oliveira and Fernandes' (2009) simulation of full protanopia, deuteranopia and tritanopia,
a linear map in linear-light sRGB, and every pair of states must stay at least MIN_DE apart in
CIEDE2000 (about 2.3 is "just noticeable"; neighbouring cells need far more than that to be told
apart at a glance). "Free" is checked as the light and the dark JupyterLab theme paint it: their
`--jp-layout-color2`, read from the installed theme CSS. The palette this replaced (green used beside
orange shared) is kept here as the check that the test can fail: protanopia brought it down to 6.5.
"""
from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import pytest

from jupyter_pagedkv.widgets.pool_figure import STATIC, state_colours

# Machado et al. 2009, severity 1.0 (linear RGB).
DEFICIENCIES = {
    "protanopia": [[0.152286, 1.052583, -0.204868], [0.114503, 0.786281, 0.099216],
                   [-0.003882, -0.048116, 1.051998]],
    "deuteranopia": [[0.367322, 0.860646, -0.227968], [0.280085, 0.672501, 0.047413],
                     [-0.011820, 0.042940, 0.968881]],
    "tritanopia": [[1.255528, -0.076749, -0.178779], [-0.078411, 0.930809, 0.147602],
                   [0.004733, 0.691367, 0.303900]],
    "normal vision": np.eye(3).tolist(),
}
MIN_DE = 15.0
OLD = {"free": (229, 231, 235), "cached": (147, 197, 253), "used": (22, 163, 74),
       "shared": (249, 115, 22), "swapped": (139, 92, 246), "speculative": (234, 179, 8)}


def linear(rgb) -> np.ndarray:
    c = np.asarray(rgb, dtype=float) / 255
    return np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)


def lab(lin: np.ndarray) -> np.ndarray:
    """CIELAB (D65) of a linear-light sRGB colour."""
    xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]]) @ lin
    t = xyz / np.array([0.95047, 1.0, 1.08883])
    f = np.where(t > (6 / 29) ** 3, np.cbrt(t), t / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def ciede2000(p: np.ndarray, q: np.ndarray) -> float:
    """CIEDE2000 colour difference (Sharma, Wu and Dalal's formulation)."""
    (l1, a1, b1), (l2, a2, b2) = p, q
    cbar = (np.hypot(a1, b1) + np.hypot(a2, b2)) / 2
    g = 0.5 * (1 - np.sqrt(cbar ** 7 / (cbar ** 7 + 25 ** 7)))
    a1, a2 = (1 + g) * a1, (1 + g) * a2
    c1, c2 = np.hypot(a1, b1), np.hypot(a2, b2)
    h1, h2 = np.degrees(np.arctan2(b1, a1)) % 360, np.degrees(np.arctan2(b2, a2)) % 360
    dh = 0.0 if c1 * c2 == 0 else (h2 - h1 + 180) % 360 - 180
    dl, dc = l2 - l1, c2 - c1
    dhh = 2 * np.sqrt(c1 * c2) * np.sin(np.radians(dh / 2))
    lbar, cbarp = (l1 + l2) / 2, (c1 + c2) / 2
    if c1 * c2 == 0:
        hbar = h1 + h2
    elif abs(h1 - h2) <= 180:
        hbar = (h1 + h2) / 2
    else:
        hbar = (h1 + h2 + 360) / 2 if h1 + h2 < 360 else (h1 + h2 - 360) / 2
    t = (1 - 0.17 * np.cos(np.radians(hbar - 30)) + 0.24 * np.cos(np.radians(2 * hbar))
         + 0.32 * np.cos(np.radians(3 * hbar + 6)) - 0.20 * np.cos(np.radians(4 * hbar - 63)))
    sl = 1 + 0.015 * (lbar - 50) ** 2 / np.sqrt(20 + (lbar - 50) ** 2)
    sc, sh = 1 + 0.045 * cbarp, 1 + 0.015 * cbarp * t
    rt = (-np.sin(np.radians(60 * np.exp(-(((hbar - 275) / 25) ** 2))))
          * 2 * np.sqrt(cbarp ** 7 / (cbarp ** 7 + 25 ** 7)))
    return float(np.sqrt((dl / sl) ** 2 + (dc / sc) ** 2 + (dhh / sh) ** 2 + rt * (dc / sc) * (dhh / sh)))


def seen(rgb, deficiency: str) -> np.ndarray:
    return lab(np.clip(np.array(DEFICIENCIES[deficiency]) @ linear(rgb), 0, 1))


def closest_pair(palette: dict[str, tuple[int, int, int]], deficiency: str) -> tuple[float, str, str]:
    return min((ciede2000(seen(palette[a], deficiency), seen(palette[b], deficiency)), a, b)
               for a, b in itertools.combinations(palette, 2))


def theme_free(theme: str) -> tuple[int, int, int]:
    """`--jp-layout-color2` of an installed JupyterLab theme: the grey the map paints free blocks."""
    jupyterlab = pytest.importorskip("jupyterlab", reason="jupyterlab is missing: pip install -e '.[test]'")
    from jupyter_core.paths import jupyter_path

    names = [Path(p) / "lab" / "themes" / "@jupyterlab" / f"theme-{theme}-extension" / "index.css"
             for p in jupyter_path()]
    names.append(Path(jupyterlab.__file__).parent / "themes" / "@jupyterlab" / f"theme-{theme}-extension" / "index.css")
    css = next((p.read_text() for p in names if p.exists()), None)
    assert css is not None, f"no installed {theme} theme CSS in {names}"
    m = re.search(r"--jp-layout-color2:\s*var\(--md-grey-\d+,\s*#([0-9a-fA-F]{6}|[0-9a-fA-F]{3})\)", css)
    assert m, f"the {theme} theme has no --jp-layout-color2 of the form var(--md-grey-N, #rgb)"
    digits = m.group(1) if len(m.group(1)) == 6 else "".join(2 * d for d in m.group(1))
    n = int(digits, 16)
    return (n >> 16, (n >> 8) & 255, n & 255)


def palettes() -> dict[str, dict[str, tuple[int, int, int]]]:
    table = {k: tuple(round(255 * c) for c in v) for k, v in state_colours().items()}
    return {theme: {**table, "free": theme_free(theme)} for theme in ("light", "dark")}


@pytest.mark.parametrize("deficiency", list(DEFICIENCIES))
def test_every_pair_of_states_stays_apart(deficiency):
    for theme, palette in palettes().items():
        de, a, b = closest_pair(palette, deficiency)
        assert de >= MIN_DE, (f"{theme} theme, {deficiency}: {a} and {b} are only {de:.1f} apart "
                              f"(CIEDE2000, need {MIN_DE})")


def test_the_light_themes_free_grey_is_the_tables_free():
    assert palettes()["light"]["free"] == tuple(round(255 * c) for c in state_colours()["free"])


def test_the_replaced_palette_fails_the_same_check():
    de, a, b = closest_pair(OLD, "protanopia")
    assert de < MIN_DE and {a, b} == {"used", "shared"}, (de, a, b)


def test_the_second_cues_differ_in_lightness_from_their_state():
    """The shared mark and the swapped stripes must show under any deficiency (lightness survives
    them all): at least 30 L* apart from the colour they sit on."""
    js = (STATIC / "palette.js").read_text()
    cue = {name: tuple(map(int, re.search(rf"export const {name} = \[(\d+), (\d+), (\d+)\];", js).groups()))
           for name in ("MARK", "STRIPE")}
    table = palettes()["light"]
    for deficiency in DEFICIENCIES:
        for mark, state in (("MARK", "shared"), ("STRIPE", "swapped")):
            dl = abs(seen(cue[mark], deficiency)[0] - seen(table[state], deficiency)[0])
            assert dl >= 30, f"{deficiency}: the {state} cue is only {dl:.1f} L* from its state colour"


def test_ciede2000_matches_published_pairs():
    """Three pairs of Sharma, Wu and Dalal's (2005) test data, so the metric itself is right."""
    cases = [((50.0, 2.6772, -79.7751), (50.0, 0.0, -82.7485), 2.0425),
             ((50.0, 2.5, 0.0), (73.0, 25.0, -18.0), 27.1492),
             ((60.2574, -34.0099, 36.2677), (60.4626, -34.1751, 39.4387), 1.2644)]
    for p, q, want in cases:
        assert ciede2000(np.array(p), np.array(q)) == pytest.approx(want, abs=1e-4)


def tenant_colours() -> list[tuple[int, int, int]]:
    """palette.js's TENANT_COLORS, one [r, g, b] per line (the colour-by-tenant mode)."""
    js = (STATIC / "palette.js").read_text()
    block = js[js.index("export const TENANT_COLORS = ["):]
    block = block[:block.index("];")]
    return [tuple(map(int, m)) for m in re.findall(r"\[(\d+), (\d+), (\d+)\]", block)]


@pytest.mark.parametrize("deficiency", list(DEFICIENCIES))
def test_the_first_six_tenants_stay_apart_from_each_other_and_from_cached_and_free(deficiency):
    """In tenant mode free and cached blocks keep their state colours beside the tenants' ones."""
    tenants = tenant_colours()
    assert len(tenants) >= 6
    for theme, states in palettes().items():
        palette = {**{f"tenant {i}": c for i, c in enumerate(tenants[:6])},
                   "free": states["free"], "cached": states["cached"]}
        de, a, b = closest_pair(palette, deficiency)
        assert de >= MIN_DE, (f"{theme} theme, {deficiency}: {a} and {b} are only {de:.1f} apart "
                              f"(CIEDE2000, need {MIN_DE})")


def test_the_cue_drawn_on_each_tenant_colour_differs_from_it_in_lightness():
    """blockmap.js draws the shared mark (and the ref count) on a tenant's colour in MARK or STRIPE,
    whichever has the higher WCAG contrast (cueOn): that one must be 30 L* away under any deficiency."""
    js = (STATIC / "palette.js").read_text()
    cue = {name: tuple(map(int, re.search(rf"export const {name} = \[(\d+), (\d+), (\d+)\];", js).groups()))
           for name in ("MARK", "STRIPE")}

    def luminance(rgb) -> float:
        return float(np.dot(linear(rgb), [0.2126, 0.7152, 0.0722]))

    for colour in tenant_colours():
        lum = luminance(colour) + 0.05
        light = (luminance(cue["MARK"]) + 0.05) / lum >= lum / (luminance(cue["STRIPE"]) + 0.05)
        mark = cue["MARK"] if light else cue["STRIPE"]
        for deficiency in DEFICIENCIES:
            dl = abs(seen(mark, deficiency)[0] - seen(colour, deficiency)[0])
            assert dl >= 30, f"{deficiency}: the cue on tenant colour {colour} is only {dl:.1f} L* away"
