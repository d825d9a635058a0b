// The monitor's canvases (part of blockmap.js): the cells' layout, what colour each block takes in
// state or tenant mode, the block map and the usage sparkline.

import { COLORS, LIGHT, MARK, STACK, STRIPE, colorOf, css, cueOn, tenantColor } from "./palette.js";
import { HISTORY, tenantNames } from "./store.js";

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

