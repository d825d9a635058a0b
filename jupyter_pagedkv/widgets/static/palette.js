// The monitor's colours (part of blockmap.js): the state and tenant palettes, their second cues, and
// the theme read from the page. pool_figure.py and the palette tests parse the tables here, one
// colour a line.

/** RGB of each known state; any other state name gets a stable colour from its name. The Okabe-Ito
 * palette, chosen so the states stay apart with protanopia, deuteranopia and tritanopia in both
 * JupyterLab themes (tests/widgets/test_palette.py simulates them: every pair at least 15 CIEDE2000
 * apart): used its bluish green, cached its sky blue lightened, shared its vermillion darkened (apart
 * from used in lightness, which red-green deficiencies keep), swapped its reddish purple,
 * speculative its yellow. Free is the light theme's --jp-layout-color2, the "empty" grey; at render
 * time the theme's own value replaces it (themeOf). One state per line: pool_figure.py and tests
 * parse it. */
export const COLORS = {
  free: [238, 238, 238],
  cached: [137, 203, 240],
  used: [0, 158, 115],
  shared: [170, 75, 0],
  swapped: [204, 121, 167],
  speculative: [240, 228, 66],
};
// Bottom-to-top order of the stacked bars drawn when one cell stands for several blocks.
export const STACK = ["shared", "speculative", "used", "swapped", "cached", "free"];
// Second cues, for the states that matter most, so they never rest on hue alone: shared blocks get
// a light corner mark (and their ref count where a cell has room), swapped blocks dark diagonal
// stripes. Both differ from their state colour in lightness, which every colour deficiency keeps.
export const MARK = [255, 255, 255];
export const STRIPE = [72, 28, 56];
/** Tenant colours in "colour by tenant" mode, in the order tenants are listed (EngineStats.tenants:
 * by name, the unnamed last): every pair of the first six, with cached and both themes' free grey,
 * at least 15 CIEDE2000 apart under protanopia, deuteranopia and tritanopia
 * (tests/widgets/test_palette.py); ordered so the first few are farthest apart. Okabe-Ito's yellow,
 * bluish green and reddish purple, Paul Tol's muted indigo, his vibrant red, IBM's violet. A seventh
 * tenant on gets a colour from its name. One tenant per line: the palette test parses it. */
export const TENANT_COLORS = [
  [51, 34, 136],
  [240, 228, 66],
  [204, 51, 17],
  [120, 94, 240],
  [0, 158, 115],
  [204, 121, 167],
];
export const MODES = ["state", "tenant"];
export const BACKGROUND = [255, 255, 255];
/** The colours taken from the host page; this default is JupyterLab's light theme. */
export const LIGHT = { background: BACKGROUND, free: COLORS.free, ink: [17, 17, 17] };

export function colorOf(state) {
  if (COLORS[state]) return COLORS[state];
  let h = 0;
  for (const ch of String(state)) h = (h * 31 + ch.charCodeAt(0)) >>> 0;
  return [64 + (h & 127), 64 + ((h >> 7) & 127), 64 + ((h >> 14) & 127)];
}

export const css = (rgb) => `rgb(${rgb[0]},${rgb[1]},${rgb[2]})`;

/** "rgb(r, g, b)", "rgba(r, g, b, a)" or "#rrggbb" (what getComputedStyle and a canvas context
 * give back) as [r, g, b, a]; null for anything else. */
export function parseColor(text) {
  const s = String(text || "").trim();
  let m = /^#([0-9a-f]{6})$/i.exec(s);
  if (m) {
    const n = parseInt(m[1], 16);
    return [n >> 16, (n >> 8) & 255, n & 255, 1];
  }
  m = /^rgba?\(([^)]*)\)$/i.exec(s);
  if (!m) return null;
  const p = m[1].split(/[\s,/]+/).filter(Boolean).map(Number);
  if (p.length < 3 || p.some(Number.isNaN)) return null;
  return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1];
}

const over = (top, under) => top.slice(0, 3).map((c, i) => Math.round(c * top[3] + under[i] * (1 - top[3])));
// Relative luminance (WCAG 2.x): which of two colours is the darker one.
export const luminance = (rgb) => rgb.slice(0, 3).map((c) => {
  const v = c / 255;
  return v <= 0.04045 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4;
}).reduce((sum, v, i) => sum + v * [0.2126, 0.7152, 0.0722][i], 0);

// A canvas context turns any CSS colour (a name, #eee, hsl()) into "#rrggbb" or "rgba(...)".
let parser = null;
function colorParser(doc) {
  if (!parser || parser.canvas.ownerDocument !== doc) parser = doc.createElement("canvas").getContext("2d");
  return parser;
}

/** The colours the map takes from the page around `el`, read at render time so a theme switch
 * reaches it: the background actually behind it (the first ancestor that paints one), the text
 * colour, and "free" = the JupyterLab theme's --jp-layout-color2 (the grey its themes raise panels
 * with, apart from both of their backgrounds). Hosts without JupyterLab's variables (VS Code,
 * Colab) get a free grey mixed from their own background and text colour. */
export function themeOf(el) {
  const view = el.ownerDocument && el.ownerDocument.defaultView;
  if (!view || !view.getComputedStyle) return LIGHT;
  const style = view.getComputedStyle(el);
  const layers = [];
  for (let e = el; e && e.nodeType === 1; e = e.parentElement) {
    const c = parseColor(view.getComputedStyle(e).backgroundColor);
    if (c && c[3] > 0) layers.push(c);
    if (c && c[3] >= 1) break;
  }
  const text = parseColor(style.color);
  // Nothing paints behind us: guess the page's colour from the text, dark text meaning light page.
  let background = text && luminance(text) > 0.5 ? [30, 30, 30] : BACKGROUND;
  for (const c of layers.reverse()) background = over(c, background);
  const ink = text ? over(text, background) : LIGHT.ink;
  let free = null;
  const probe = colorParser(el.ownerDocument);
  const themed = style.getPropertyValue("--jp-layout-color2").trim();
  if (probe && themed) {
    probe.fillStyle = "rgba(0, 0, 0, 0)"; // stays so when the variable is no colour
    probe.fillStyle = themed;
    const c = parseColor(probe.fillStyle);
    if (c && c[3] > 0) free = over(c, background);
  }
  if (!free) free = luminance(background) < luminance(ink) ? over([...ink, 0.2], background) : COLORS.free;
  return { background, free, ink };
}

export const tenantColor = (i, name) => (i < TENANT_COLORS.length ? TENANT_COLORS[i] : colorOf(`tenant ${name}`));

/** MARK or STRIPE, whichever stands out more on `rgb` (WCAG contrast: lightness, which every
 * colour deficiency keeps): the cue drawn on a tenant's colour, light or dark. */
export function cueOn(rgb) {
  const l = luminance(rgb) + 0.05;
  return (luminance(MARK) + 0.05) / l >= l / (luminance(STRIPE) + 0.05) ? MARK : STRIPE;
}

