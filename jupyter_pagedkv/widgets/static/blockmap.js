// The block-pool monitor's drawing code, one module for two hosts: its default export is the
// anywidget module of jupyter_pagedkv.widgets.BlockPoolMonitor (no build step), and the JupyterLab
// side panel (labextension/src/index.ts) imports the named exports. Plain ES2020, no imports.
//
// Data: frames from jupyter_pagedkv/monitor/feed.py. A full frame replaces the picture; a diff
// (`prev` = the seq it applies on) carries parallel arrays ids (uint32), codes (uint8, index into
// `legend`) and refs (uint8, ref count capped at 255) for the blocks that changed, and `owners` /
// `tenants` ({block: [request ids]}, {block: [tenant names]}) for those of them in use.

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
const STACK = ["shared", "speculative", "used", "swapped", "cached", "free"];
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
const BACKGROUND = [255, 255, 255];
const HISTORY = 240;
/** The colours taken from the host page; this default is JupyterLab's light theme. */
export const LIGHT = { background: BACKGROUND, free: COLORS.free, ink: [17, 17, 17] };

export function colorOf(state) {
  if (COLORS[state]) return COLORS[state];
  let h = 0;
  for (const ch of String(state)) h = (h * 31 + ch.charCodeAt(0)) >>> 0;
  return [64 + (h & 127), 64 + ((h >> 7) & 127), 64 + ((h >> 14) & 127)];
}

const css = (rgb) => `rgb(${rgb[0]},${rgb[1]},${rgb[2]})`;
// Tenant names are the user's text: never HTML.
const escapeHtml = (text) => String(text).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);

function bytesOf(x) {
  if (!x) return new Uint8Array(0);
  if (x instanceof Uint8Array) return x;
  if (ArrayBuffer.isView(x)) return new Uint8Array(x.buffer, x.byteOffset, x.byteLength);
  if (x instanceof ArrayBuffer) return new Uint8Array(x);
  return Uint8Array.from(x);
}

function u32Of(x) {
  if (Array.isArray(x)) return Uint32Array.from(x); // block ids themselves, not their bytes
  const b = bytesOf(x).slice(); // a fresh, aligned copy
  return new Uint32Array(b.buffer, 0, b.byteLength >> 2);
}

export function createStore() {
  return {
    seq: -1, numBlocks: 0, blockSize: 0, legend: [], codes: new Uint8Array(0),
    refs: new Uint8Array(0), owners: new Map(), tenants: new Map(), gauges: null, history: [], closed: false,
  };
}

/** Fold one frame into the store: "ok", "stale" (older than what we have), "gap" (a diff whose
 * base we never saw: ask for a full frame) or "skip" (not a frame). */
export function applyFrame(store, frame) {
  if (!frame || typeof frame !== "object") return "skip";
  if (frame.closed) {
    // The feed is gone; the next one (a reloaded engine, another kernel) numbers its frames
    // from 0 again, so its first full frame must not look stale.
    store.closed = true;
    store.seq = -1;
    return "ok";
  }
  if (typeof frame.seq !== "number") return "skip";
  if (frame.full) {
    if (frame.seq < store.seq) return "stale";
    store.numBlocks = frame.num_blocks;
    store.blockSize = frame.block_size;
    store.legend = frame.legend.slice();
    store.codes = bytesOf(frame.codes).slice();
    store.refs = bytesOf(frame.refs).slice();
    store.owners = new Map(Object.entries(frame.owners || {}).map(([k, v]) => [Number(k), v]));
    store.tenants = new Map(Object.entries(frame.tenants || {}).map(([k, v]) => [Number(k), v]));
    store.gauges = frame.gauges;
    store.history = (frame.history || []).slice(-HISTORY);
    store.seq = frame.seq;
    store.closed = false;
    return "ok";
  }
  if (frame.seq <= store.seq) return "stale";
  if (frame.prev !== store.seq) return "gap";
  const ids = u32Of(frame.ids);
  const codes = bytesOf(frame.codes);
  const refs = bytesOf(frame.refs);
  for (let i = 0; i < ids.length; i++) {
    store.codes[ids[i]] = codes[i];
    store.refs[ids[i]] = refs[i];
  }
  for (const key of ["owners", "tenants"]) {
    for (const [k, v] of Object.entries(frame[key] || {})) {
      if (v.length) store[key].set(Number(k), v);
      else store[key].delete(Number(k));
    }
  }
  store.legend = frame.legend.slice();
  store.gauges = frame.gauges;
  store.history.push(frame.gauges.kv_cache_usage);
  if (store.history.length > HISTORY) store.history.splice(0, store.history.length - HISTORY);
  store.seq = frame.seq;
  return "ok";
}

/** Cells of `cell` px in rows of `cols`; one block per cell, or `group` blocks per cell when the
 * pool has more blocks than fit at 3 px each (then a cell is a stacked bar of its states). */
export function layout(numBlocks, width, maxHeight) {
  const n = Math.max(1, numBlocks);
  let cell = Math.min(14, Math.floor(Math.sqrt((width * maxHeight) / n)));
  // Whole columns waste width, so the first guess can overflow the height: shrink until it fits.
  while (cell > 3 && Math.ceil(n / Math.floor(width / cell)) * cell > maxHeight) cell--;
  let group = 1;
  if (cell < 3 || Math.ceil(n / Math.floor(width / cell)) * cell > maxHeight) {
    cell = 3;
    const capacity = Math.floor(width / cell) * Math.floor(maxHeight / cell);
    group = Math.ceil(n / Math.max(1, capacity));
  }
  const cols = Math.max(1, Math.floor(width / cell));
  const cells = Math.ceil(n / group);
  const rows = Math.ceil(cells / cols);
  return { cell, cols, rows, group, cells, width: cols * cell, height: rows * cell, gap: cell >= 5 ? 1 : 0 };
}

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
const luminance = (rgb) => rgb.slice(0, 3).map((c) => {
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

/** The tenants in the order of their colours: EngineStats.tenants' (by name, the unnamed last),
 * then, sorted, any a block names that the gauges do not. */
export function tenantNames(store) {
  const names = Object.keys((store.gauges && store.gauges.tenants) || {});
  const extra = new Set();
  for (const list of store.tenants.values()) for (const t of list) if (!names.includes(t)) extra.add(t);
  return names.concat([...extra].sort());
}

export const tenantColor = (i, name) => (i < TENANT_COLORS.length ? TENANT_COLORS[i] : colorOf(`tenant ${name}`));

/** MARK or STRIPE, whichever stands out more on `rgb` (WCAG contrast: lightness, which every
 * colour deficiency keeps): the cue drawn on a tenant's colour, light or dark. */
export function cueOn(rgb) {
  const l = luminance(rgb) + 0.05;
  return (luminance(MARK) + 0.05) / l >= l / (luminance(STRIPE) + 0.05) ? MARK : STRIPE;
}

/** How blocks are painted in `mode`: a class per block (`cls`) and per class a colour, stripes and a
 * stacking rank. "state": the classes are the legend's states. "tenant": a block one tenant's
 * requests hold is that tenant's class, one several tenants hold the class `cross` (drawn in bands
 * of their colours, or as a light and dark hatch in a stacked bar); unheld blocks (free, cached)
 * keep their state. */
export function paintPlan(store, theme = LIGHT, mode = "state") {
  const colors = store.legend.map((s) => (s === "free" ? theme.free : colorOf(s)));
  const striped = store.legend.map((s) => s === "swapped");
  const rank = store.legend.map((s) => (STACK.indexOf(s) < 0 ? 1.5 : STACK.indexOf(s)));
  const plan = { cls: store.codes, colors, striped, rank, names: [], index: new Map(), cross: -1,
    barMark: store.legend.indexOf("shared"), cue: () => MARK };
  if (mode !== "tenant") return plan;
  const names = tenantNames(store);
  names.forEach((n, i) => {
    plan.index.set(n, colors.length);
    colors.push(tenantColor(i, n));
    striped.push(false);
    rank.push(-1);
  });
  plan.cross = colors.length;
  colors.push(MARK);
  striped.push(true);
  rank.push(-2);
  const cls = Uint16Array.from(store.codes);
  for (const [b, list] of store.tenants) {
    if (b < cls.length && list.length) cls[b] = list.length > 1 ? plan.cross : plan.index.get(list[0]);
  }
  return { ...plan, cls, names, barMark: -1, cue: cueOn };
}

/** Paint the block map into `canvas` (1 canvas px per CSS px, so pixels can be checked), in the
 * colours of `theme` (themeOf; LIGHT when not given), coloured by state or by tenant (`mode`). */
export function drawBlocks(canvas, store, lay, highlight, theme = LIGHT, mode = "state") {
  canvas.width = lay.width;
  canvas.height = lay.height;
  canvas.style.width = `${lay.width}px`;
  canvas.style.height = `${lay.height}px`;
  const ctx = canvas.getContext("2d");
  if (!ctx || !lay.width || !lay.height) return;
  const img = ctx.createImageData(lay.width, lay.height);
  const px = img.data;
  const bg = theme.background;
  for (let i = 0; i < px.length; i += 4) {
    px[i] = bg[0]; px[i + 1] = bg[1]; px[i + 2] = bg[2]; px[i + 3] = 255;
  }
  const set = (x, y, rgb) => {
    const o = (y * lay.width + x) * 4;
    px[o] = rgb[0]; px[o + 1] = rgb[1]; px[o + 2] = rgb[2];
  };
  // Stripes run along x + y in canvas coordinates, so neighbouring swapped cells join up into one
  // hatched area, and a 3 px cell still gets a stripe pixel in each row.
  const fill = (x0, y0, w, h, rgb, striped) => {
    for (let y = y0; y < y0 + h; y++) {
      for (let x = x0; x < x0 + w; x++) set(x, y, striped && (x + y) % 3 === 0 ? STRIPE : rgb);
    }
  };
  const plan = paintPlan(store, theme, mode);
  const { colors, striped, rank, cls, cue } = plan;
  const { cell, gap, group, cols } = lay;
  const inner = cell - gap;
  // The shared mark: a corner triangle about 2/5 of the cell wide (3 px of a 3 px cell).
  const corner = Math.max(2, Math.round(inner * 0.4));
  const order = colors.map((_, i) => i).sort((a, b) => rank[a] - rank[b]);
  const counts = new Uint32Array(colors.length);
  const freeCode = store.legend.indexOf("free");
  const sharedCode = plan.barMark;
  const labels = [];
  for (let c = 0; c < lay.cells; c++) {
    const x0 = (c % cols) * cell;
    const y0 = Math.floor(c / cols) * cell;
    const start = c * group;
    if (group === 1) {
      const code = cls[start];
      let color = colors[code] || bg;
      if (code === plan.cross) {
        // Several tenants: diagonal bands of their colours (two: the cell split in half; at most
        // four), each border a dashed light-and-dark line that shows on any pair of colours.
        const bands = store.tenants.get(start).slice(0, 4).map((t) => colors[plan.index.get(t)]);
        const n = bands.length, total = 2 * inner - 1;
        for (let y = 0; y < inner; y++) {
          for (let x = 0; x < inner; x++) {
            const band = Math.floor(((x + y) * n) / total);
            const border = band !== Math.floor(((x + y + 1) * n) / total) && x + y < total - 1;
            set(x0 + x, y0 + y, border ? (x % 2 ? STRIPE : MARK) : bands[band]);
          }
        }
        color = bands[0];
      } else {
        fill(x0, y0, inner, inner, color, striped[code]);
      }
      const ref = store.refs[start];
      if (ref > 1) {
        const mark = cue(color);
        for (let y = 0; y < corner; y++) for (let x = 0; x < corner - y; x++) set(x0 + x, y0 + y, mark);
        // A block of several tenants already shows its bands: no count on top of them.
        if (inner >= 10 && code !== plan.cross) labels.push([x0, y0, ref, cue(color)]);
      }
      continue;
    }
    counts.fill(0);
    const end = Math.min(store.numBlocks, start + group);
    for (let b = start; b < end; b++) counts[cls[b]]++;
    // Stacked from the bottom, busiest states first; a state present gets at least 1 px.
    let y = y0 + inner;
    let left = inner;
    const total = end - start;
    for (const code of order) {
      if (!counts[code] || left <= 0) continue;
      let h = Math.round((counts[code] / total) * inner);
      if (h === 0 && code !== freeCode) h = 1;
      h = Math.min(h, left);
      if (h > 0) {
        fill(x0, y - h, inner, h, colors[code], striped[code]);
        // A bar segment has no corner: its shared part gets the mark as its left pixel column.
        if (code === sharedCode) fill(x0, y - h, 1, h, MARK, false);
      }
      y -= h;
      left -= h;
    }
  }
  ctx.putImageData(img, 0, 0);
  if (highlight && highlight.size && group === 1) {
    ctx.strokeStyle = css(theme.ink);
    ctx.lineWidth = 1;
    for (const b of highlight) {
      ctx.strokeRect((b % cols) * cell + 0.5, Math.floor(b / cols) * cell + 0.5, inner - 1, inner - 1);
    }
  }
  if (labels.length) {
    // The count goes bottom-right, clear of the corner mark; MARK on the dark shared colour (a
    // tenant's colour gets whichever of MARK and STRIPE shows more).
    ctx.font = `${Math.max(7, inner - 4)}px sans-serif`;
    ctx.textAlign = "center";
    ctx.textBaseline = "middle";
    for (const [x, y, ref, color] of labels) {
      ctx.fillStyle = css(color);
      ctx.fillText(ref > 9 ? "+" : String(ref), x + inner * 0.58, y + inner * 0.58 + 0.5);
    }
  }
}

/** The words beside the sparkline: what it plots and over which window. Frames come only when the
 * pool changed (at most 10 a second), so the window is counted in updates, not seconds. */
export function sparkLabel(history) {
  if (history.length < 2) return `KV usage over the last updates (up to ${HISTORY}): none yet`;
  const peak = Math.max(...history);
  return `KV usage over the last ${history.length} updates (up to ${HISTORY}, one per change): ` +
    `${pct(history[history.length - 1])} now, peak ${pct(peak)}`;
}

/** A sparkline of KV usage over the recent frames: 0 at the bottom line, 100% at the dotted top
 * line (axes, not a box, so it does not read as a text field). */
export function drawSparkline(canvas, history) {
  const w = canvas.width, h = canvas.height;
  const ctx = canvas.getContext("2d");
  if (!ctx) return;
  ctx.clearRect(0, 0, w, h);
  ctx.strokeStyle = "rgba(128,128,128,0.45)";
  ctx.lineWidth = 1;
  ctx.beginPath();
  ctx.moveTo(0, h - 0.5);
  ctx.lineTo(w, h - 0.5);
  ctx.stroke();
  ctx.setLineDash([2, 3]);
  ctx.beginPath();
  ctx.moveTo(0, 0.5);
  ctx.lineTo(w, 0.5);
  ctx.stroke();
  ctx.setLineDash([]);
  if (history.length < 2) return;
  ctx.strokeStyle = css(COLORS.used);
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  history.forEach((v, i) => {
    const x = (i / (HISTORY - 1)) * (w - 2) + 1 + (w - 2) * (1 - (history.length - 1) / (HISTORY - 1));
    const y = h - 1 - v * (h - 2);
    if (i) ctx.lineTo(x, y);
    else ctx.moveTo(x, y);
  });
  ctx.stroke();
}

const pct = (x) => `${(100 * x).toFixed(x > 0 && x < 0.1 ? 1 : 0)}%`;

/** The status-bar text, e.g. "KV 43% · 12 running" (never the word the test tools wait for). */
export function statusText(gauges) {
  if (!gauges) return "KV –";
  const queued = gauges.num_waiting ? ` · ${gauges.num_waiting} waiting` : "";
  return `KV ${pct(gauges.kv_cache_usage)} · ${gauges.num_running} running${queued}`;
}

/** Gauge rows as [label, value] pairs (the same numbers EngineStats defines). */
export function gaugeRows(g) {
  if (!g) return [];
  const n = g.num_blocks || 1;
  const rows = [
    ["KV used", `${pct(g.kv_cache_usage)} (${g.num_used.toLocaleString()} of ${n.toLocaleString()} blocks)`],
    ["cached", `${pct(g.num_cached / n)} (${g.num_cached.toLocaleString()} blocks)`],
    ["shared", `${g.num_shared.toLocaleString()} block${g.num_shared === 1 ? "" : "s"}`],
    ["internal waste", `${g.internal_waste.toLocaleString()} of ${g.slots_allocated.toLocaleString()} slots` +
      (g.slots_allocated ? ` (${pct(g.internal_waste / g.slots_allocated)})` : "")],
    ["prefix hit rate", pct(g.prefix_hit_rate)],
    ["requests", `${g.num_running} running · ${g.num_waiting} waiting · ${g.num_preempted} preempted`],
    ["tokens/s", g.tokens_per_s.toFixed(1)],
  ];
  if (g.num_swapped_blocks) rows.push(["swapped out", `${g.num_swapped_blocks.toLocaleString()} blocks`]);
  if (g.spec_proposed_tokens) {
    rows.push(["speculation", `${g.spec_accepted_tokens.toLocaleString()} of ` +
      `${g.spec_proposed_tokens.toLocaleString()} drafts kept (${pct(g.spec_acceptance_rate)}), ` +
      `${g.spec_mean_accepted_length.toFixed(2)} per verification`]);
  }
  return rows;
}

const ms = (s) => (s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(2)} s`);

/** Per-tenant gauges (EngineStats.tenants), one row each: { name, text, used, share, cap }. */
export function tenantRows(g) {
  return Object.values((g && g.tenants) || {}).map((t) => {
    const shared = t.blocks_shared ? ` (${t.blocks_shared} shared)` : "";
    const cap = t.max_blocks == null ? "" : `, cap ${t.max_blocks}`;
    const preempted = t.num_preempted ? ` · ${t.num_preempted} preempted` : "";
    const ttft = t.ttft_p50 == null ? "" : ` · TTFT ${ms(t.ttft_p50)} / ${t.tail_name} ${ms(t.ttft_p99)}`;
    return {
      name: t.name, used: t.blocks_used, share: t.share, cap: t.max_blocks,
      text: `${t.blocks_used} block${t.blocks_used === 1 ? "" : "s"}${shared}, share ${Math.round(t.share)}${cap}` +
        ` · ${t.num_running} running · ${t.num_waiting} waiting${preempted}${ttft}`,
    };
  });
}

// Colours come from JupyterLab's theme variables; where a host has none (VS Code, Colab) text
// falls back to the colour it inherits, which the host keeps readable on its own background.
// Secondary text uses --jp-ui-font-color2, which the JupyterLab themes keep at 4.5:1 or more on
// their backgrounds (WCAG AA), rather than an opacity that would fade it below that.
const STYLE = `
.pkv-root { font: 12px/1.4 var(--jp-ui-font-family, sans-serif); color: var(--jp-ui-font-color1, currentColor); }
.pkv-title { font-weight: 600; margin-bottom: 4px; }
.pkv-bar { display: flex; height: 8px; border-radius: 3px; overflow: hidden; margin: 4px 0 6px; background: var(--jp-layout-color2, rgb(238,238,238)); }
.pkv-gauges { display: grid; grid-template-columns: max-content 1fr; gap: 0 10px; margin-bottom: 6px; }
.pkv-gauges .pkv-k, .pkv-legend, .pkv-hover, .pkv-note { color: var(--jp-ui-font-color2, currentColor); }
.pkv-blocks { display: block; cursor: crosshair; image-rendering: pixelated; }
.pkv-legend { display: flex; flex-wrap: wrap; gap: 2px 10px; margin-top: 4px; }
.pkv-legend i { display: inline-block; width: 10px; height: 10px; margin-right: 3px; vertical-align: -1px; }
.pkv-hover { min-height: 1.4em; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.pkv-note { font-style: italic; }
.pkv-spark-row { display: flex; flex-wrap: wrap; align-items: center; gap: 2px 8px; margin-top: 4px; }
.pkv-spark-label { color: var(--jp-ui-font-color2, currentColor); }
.pkv-keys { display: flex; flex-wrap: wrap; align-items: baseline; gap: 2px 12px; margin-top: 4px; }
.pkv-keys .pkv-legend { margin-top: 0; flex: 1 1 auto; }
.pkv-mode { white-space: nowrap; color: var(--jp-ui-font-color2, currentColor); }
.pkv-mode button { font: inherit; color: var(--jp-ui-font-color1, currentColor); background: transparent; cursor: pointer;
  border: 1px solid var(--jp-border-color1, currentColor); padding: 0 6px; margin: 0; }
.pkv-mode button + button { border-left: none; }
.pkv-mode button[aria-pressed="true"] { background: var(--jp-layout-color2, rgb(238,238,238)); font-weight: 600; }
.pkv-tenants { margin-bottom: 6px; }
.pkv-trow { display: flex; flex-wrap: wrap; align-items: center; gap: 0 8px; }
.pkv-trow .pkv-k { color: var(--jp-ui-font-color2, currentColor); white-space: nowrap; }
.pkv-trow i { display: inline-block; width: 10px; height: 10px; margin-right: 3px; vertical-align: -1px; }
.pkv-trow .pkv-tt { flex: 1 1 20em; }
.pkv-tbar { position: relative; display: block; flex: 0 0 48px; height: 6px; background: var(--jp-layout-color2, rgb(238,238,238)); }
.pkv-tbar b { position: absolute; left: 0; top: 0; bottom: 0; }
.pkv-tbar em { position: absolute; top: -2px; bottom: -2px; width: 1px; background: var(--jp-ui-font-color1, currentColor); }
`;

/** The tenant legend: free and cached as in state mode, each tenant's colour, the mark of a block
 * several tenants hold and of a shared one, as [CSS background, label] pairs. */
export function tenantLegend(store, theme = LIGHT) {
  const names = tenantNames(store);
  const colors = names.map((n, i) => css(tenantColor(i, n)));
  const keys = ["free", "cached"].filter((s) => store.legend.includes(s)).map((s) => [swatch(s, theme), s]);
  names.forEach((n, i) => keys.push([colors[i], n]));
  if (names.length > 1) {
    keys.push([`linear-gradient(to bottom right, ${colors[0]} 0 40%, ${css(MARK)} 40% 50%, ${css(STRIPE)} 50% 60%, ` +
      `${colors[1]} 60%)`, "several tenants"]);
  }
  if (names.length) {
    const mark = css(cueOn(tenantColor(0, names[0])));
    keys.push([`linear-gradient(135deg, ${mark} 0 35%, transparent 35%), ${colors[0]}`, "shared"]);
  }
  return keys;
}

/** A legend swatch's CSS background: the state's colour with the same second cue as the map. */
function swatch(state, theme) {
  const color = css(state === "free" ? theme.free : colorOf(state));
  if (state === "shared") return `linear-gradient(135deg, ${css(MARK)} 0 35%, transparent 35%), ${color}`;
  if (state === "swapped") {
    return `repeating-linear-gradient(135deg, ${css(STRIPE)} 0 1px, transparent 1px 3px), ${color}`;
  }
  return color;
}

function ensureStyle(doc) {
  if (doc.getElementById("pkv-style")) return;
  const s = doc.createElement("style");
  s.id = "pkv-style";
  s.textContent = STYLE;
  doc.head.appendChild(s);
}

function describe(store, lay, cellIndex) {
  const start = cellIndex * lay.group;
  if (!(start >= 0 && start < store.numBlocks)) return { text: "", owner: null };
  if (lay.group === 1) {
    const state = store.legend[store.codes[start]];
    const ref = store.refs[start];
    const owners = store.owners.get(start) || [];
    const refText = ref > 1 ? ` ×${ref}` : "";
    const who = owners.length ? ` — ${owners.join(", ")}` : "";
    const tenants = store.tenants.get(start) || [];
    const whose = tenants.length ? ` · tenant${tenants.length > 1 ? "s" : ""} ${tenants.join(", ")}` : "";
    return { text: `block ${start}: ${state}${refText}${whose}${who}`, owner: owners[0] || null };
  }
  const end = Math.min(store.numBlocks, start + lay.group);
  const counts = new Map();
  for (let b = start; b < end; b++) {
    const s = store.legend[store.codes[b]];
    counts.set(s, (counts.get(s) || 0) + 1);
  }
  const parts = [...counts.entries()].sort((a, b) => b[1] - a[1]).map(([s, k]) => `${k} ${s}`);
  return { text: `blocks ${start}–${end - 1}: ${parts.join(", ")}`, owner: null };
}

/** Build the monitor's DOM inside `el`; returns { apply(frame), store, setMode(mode), dispose() }.
 * The picture is redrawn at most once per animation frame however fast frames arrive. The "colour
 * by" toggle shows once the engine knows tenants; its choice stays for the view's life. */
export function mount(el, opts = {}) {
  const doc = el.ownerDocument || document;
  ensureStyle(doc);
  const maxHeight = opts.height || 220;
  const store = createStore();
  const root = doc.createElement("div");
  root.className = "pkv-root";
  root.innerHTML = `<div class="pkv-title"></div><div class="pkv-bar"></div><div class="pkv-gauges"></div>
    <div class="pkv-tenants"></div><canvas class="pkv-blocks"></canvas><div class="pkv-hover"></div>
    <div class="pkv-spark-row"><canvas class="pkv-spark" width="240" height="28" role="img"></canvas><span
    class="pkv-spark-label"></span></div><div class="pkv-keys"><span class="pkv-mode"
    role="group" aria-label="colour blocks by">colour by <button type="button" data-mode="state">state</button><button
    type="button" data-mode="tenant">tenant</button></span><div class="pkv-legend"></div></div>`;
  el.appendChild(root);
  const q = (sel) => root.querySelector(sel);
  const title = q(".pkv-title"), bar = q(".pkv-bar"), gauges = q(".pkv-gauges");
  const blocks = q(".pkv-blocks"), hover = q(".pkv-hover"), spark = q(".pkv-spark"), legend = q(".pkv-legend");
  const sparkText = q(".pkv-spark-label");
  const tenantBox = q(".pkv-tenants"), modeBox = q(".pkv-mode");
  let mode = MODES.includes(opts.mode) ? opts.mode : "state";
  title.textContent = opts.title || "KV cache";
  let lay = layout(1, 1, 1);
  let highlight = null;
  let pending = 0;
  let disposed = false;
  const width = () => Math.max(120, Math.floor((el.clientWidth || root.clientWidth || 640) - 4));

  function render() {
    pending = 0;
    if (disposed) return;
    if (store.closed) {
      gauges.innerHTML = `<span class="pkv-note">the engine was unloaded</span>`;
      return;
    }
    if (!store.gauges) return;
    const g = store.gauges;
    lay = layout(store.numBlocks, width(), maxHeight);
    const theme = themeOf(root);
    const tenants = tenantRows(g);
    const shown = tenants.length ? mode : "state";
    drawBlocks(blocks, store, lay, highlight, theme, shown);
    const n = g.num_blocks || 1;
    const shares = [["shared", g.num_shared], ["used", g.num_used - g.num_shared], ["cached", g.num_cached]];
    bar.innerHTML = shares.filter(([, k]) => k > 0)
      .map(([s, k]) => `<span style="width:${(100 * k) / n}%;background:${css(colorOf(s))}"></span>`).join("");
    bar.style.background = css(theme.free);
    const rows = gaugeRows(g);
    if (tenants.length) rows.push(["tenants", `${tenants.length} · ${g.scheduling_policy} scheduling`]);
    gauges.innerHTML = rows.map(([k, v]) => `<span class="pkv-k">${k}</span><span>${v}</span>`).join("");
    // Per tenant: its blocks against its fair share (the tick) and cap, its queue and TTFT.
    const names = tenantNames(store);
    tenantBox.style.display = tenants.length ? "" : "none";
    modeBox.style.display = tenants.length ? "" : "none";
    // One scale for every tenant's bar, so they compare; the tick is the tenant's fair share.
    const top = Math.max(1, ...tenants.map((t) => Math.max(t.used, t.share, t.cap || 0)));
    const nameWidth = Math.max(...tenants.map((t) => t.name.length)) + 2;
    tenantBox.innerHTML = tenants.map((t) => {
      const i = names.indexOf(t.name);
      const color = css(shown === "tenant" ? tenantColor(i, t.name) : COLORS.used);
      const key = shown === "tenant" ? `<i style="background:${color}"></i>` : "";
      return `<div class="pkv-trow"><span class="pkv-k" style="min-width:${nameWidth}ch">${key}${escapeHtml(t.name)}</span>` +
        `<span class="pkv-tbar" style="background:${css(theme.free)}"><b style="width:${(100 * t.used) / top}%;` +
        `background:${color}"></b><em style="left:${(100 * t.share) / top}%"></em></span><span class="pkv-tt">${t.text}</span></div>`;
    }).join("");
    for (const b of modeBox.querySelectorAll("button")) b.setAttribute("aria-pressed", String(b.dataset.mode === shown));
    root.dataset.mode = shown;
    const by = shown === "tenant" ? "tenant" : "state";
    const scale = lay.group === 1 ? "one cell per block" : `one cell per ${lay.group} blocks (stacked by ${by})`;
    const keys = shown === "tenant" ? tenantLegend(store, theme)
      : store.legend.filter((s) => s in COLORS || (g.states && g.states[s])).map((s) => [swatch(s, theme), s]);
    legend.innerHTML = keys.map(([bgc, label]) => `<span><i style="background:${bgc}"></i>${escapeHtml(label)}</span>`).join("") +
      `<span>${scale} · ${store.numBlocks.toLocaleString()} blocks × ${store.blockSize} tokens</span>`;
    drawSparkline(spark, store.history);
    sparkText.textContent = sparkLabel(store.history);
    spark.setAttribute("aria-label", sparkText.textContent);
    root.dataset.seq = String(store.seq);
    // The highest gauges this view has drawn (data-peak-used, ...): what a run looked like at its
    // busiest, readable after it ended however fast it was (the browser tests read them).
    for (const [key, value] of [["peakUsed", g.num_used], ["peakShared", g.num_shared],
      ["peakRunning", g.num_running]]) {
      if (value > Number(root.dataset[key] || 0)) root.dataset[key] = String(value);
    }
  }

  function schedule() {
    if (pending || disposed) return;
    const raf = doc.defaultView && doc.defaultView.requestAnimationFrame;
    pending = raf ? raf(render) : setTimeout(render, 16);
  }

  modeBox.addEventListener("click", (ev) => {
    const next = ev.target && ev.target.dataset ? ev.target.dataset.mode : null;
    if (MODES.includes(next) && next !== mode) {
      mode = next;
      schedule();
    }
  });
  blocks.addEventListener("mousemove", (ev) => {
    const r = blocks.getBoundingClientRect();
    const col = Math.floor((ev.clientX - r.left) / lay.cell);
    const row = Math.floor((ev.clientY - r.top) / lay.cell);
    const d = describe(store, lay, col >= 0 && col < lay.cols ? row * lay.cols + col : -1);
    hover.textContent = d.text;
    const next = new Set();
    if (d.owner) for (const [b, owners] of store.owners) if (owners.includes(d.owner)) next.add(b);
    if (next.size || (highlight && highlight.size)) {
      highlight = next;
      schedule();
    }
  });
  blocks.addEventListener("mouseleave", () => {
    hover.textContent = "";
    highlight = null;
    schedule();
  });
  const resize = typeof ResizeObserver !== "undefined" ? new ResizeObserver(() => schedule()) : null;
  if (resize) resize.observe(el);
  // A theme switch changes no frame: redraw when the page says the theme changed. JupyterLab sets
  // data-jp-theme-* on <body> once the new theme's CSS is in, VS Code swaps <body>'s class, and
  // other hosts follow the system's colour scheme.
  const win = doc.defaultView;
  const themeWatch = win && win.MutationObserver && doc.body ? new win.MutationObserver(() => schedule()) : null;
  if (themeWatch) {
    themeWatch.observe(doc.body, { attributes: true, attributeFilter: ["data-jp-theme-name", "data-jp-theme-light", "class"] });
  }
  const scheme = win && win.matchMedia ? win.matchMedia("(prefers-color-scheme: dark)") : null;
  if (scheme && scheme.addEventListener) scheme.addEventListener("change", schedule);

  return {
    store,
    setTitle(text) {
      title.textContent = text;
    },
    setMode(next) {
      if (MODES.includes(next)) mode = next;
      schedule();
    },
    apply(frame) {
      const result = applyFrame(store, frame);
      if (result === "ok") schedule();
      return result;
    },
    dispose() {
      disposed = true;
      if (resize) resize.disconnect();
      if (themeWatch) themeWatch.disconnect();
      if (scheme && scheme.removeEventListener) scheme.removeEventListener("change", schedule);
      root.remove();
    },
  };
}

// anywidget entry point: traits "base" (a full frame) and "frame" (the latest diff).
export default {
  render({ model, el }) {
    const view = mount(el, { title: model.get("title"), height: model.get("height") });
    const onBase = () => view.apply(model.get("base"));
    const onFrame = () => {
      if (view.apply(model.get("frame")) === "gap") model.send({ request: "resync" });
    };
    onBase();
    onFrame();
    model.on("change:base", onBase);
    model.on("change:frame", onFrame);
    return () => {
      model.off("change:base", onBase);
      model.off("change:frame", onFrame);
      view.dispose();
    };
  },
};
