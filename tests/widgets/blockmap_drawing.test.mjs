// Unit tests of the block-pool monitor's drawing module (jupyter_pagedkv/widgets/static/blockmap.js):
// the layout of the map, the pixels drawBlocks paints (states, marks, stripes), the theme.
// Run by Node's built-in test runner (no npm packages); tests/widgets/test_blockmap_js.py runs every
// tests/widgets/*.test.mjs under pytest. Frames come from blockmap_fixtures.mjs (feed.py's Frame.to_state()).
import { test } from "node:test";
import assert from "node:assert/strict";

import {
  COLORS,
  LIGHT,
  MARK,
  STRIPE,
  applyFrame,
  createStore,
  drawBlocks,
  layout,
  parseColor,
  themeOf,
} from "../../jupyter_pagedkv/widgets/static/blockmap.js";
import { LEGEND, fullFrame } from "./blockmap_fixtures.mjs";

test("a one-block-per-cell layout never exceeds the height it is given", () => {
  for (const [n, w, h] of [[1161, 640, 220], [1351, 636, 420], [1, 640, 220], [5000, 300, 100]]) {
    const lay = layout(n, w, h);
    assert.ok(lay.height <= h, `layout(${n}, ${w}, ${h}) is ${lay.height} px tall`);
    assert.ok(lay.width <= w && lay.cells * lay.group >= n);
  }
  for (let n = 1; n <= 200000; n += 997) {
    assert.ok(layout(n, 640, 220).height <= 220, `layout(${n}, 640, 220) overflows`);
  }
});

test("a 100,000-block pool is grouped into 3 px cells that fit the canvas", () => {
  const lay = layout(100000, 640, 220);
  assert.ok(lay.group > 1, `group ${lay.group}`);
  assert.equal(lay.cell, 3);
  assert.ok(lay.cells * lay.group >= 100000);
  assert.equal(lay.cells, Math.ceil(100000 / lay.group));
  assert.ok(lay.cols * lay.cell <= 640);
  assert.ok(lay.rows * lay.cell <= 220, `height ${lay.rows * lay.cell}`);
  assert.equal(lay.width, lay.cols * lay.cell);
  assert.equal(lay.height, lay.rows * lay.cell);
  assert.ok(lay.rows * lay.cols >= lay.cells);
});

test("a 1,000-block pool is drawn one block per cell", () => {
  const lay = layout(1000, 640, 220);
  assert.equal(lay.group, 1);
  assert.equal(lay.cells, 1000);
  assert.ok(lay.cell >= 3 && lay.cell <= 14, `cell ${lay.cell}`);
  assert.ok(lay.cols * lay.cell <= 640);
  assert.ok(lay.rows * lay.cols >= 1000);
});

/** Just enough of an HTMLCanvasElement for drawBlocks: the ImageData it puts is kept. */
function fakeCanvas() {
  const ctx = {
    image: null,
    createImageData: (w, h) => ({ width: w, height: h, data: new Uint8ClampedArray(w * h * 4) }),
    putImageData(img) { this.image = img; },
    strokeRect() {}, fillText() {}, clearRect() {}, beginPath() {}, moveTo() {}, lineTo() {}, stroke() {},
  };
  return { width: 0, height: 0, style: {}, ctx, getContext: (kind) => (kind === "2d" ? ctx : null) };
}

function pixel(img, x, y) {
  const o = (y * img.width + x) * 4;
  return [img.data[o], img.data[o + 1], img.data[o + 2]];
}

test("a grouped 100,000-block map draws used, free and mixed cells in their colours", () => {
  const n = 100000;
  const usedEnd = 30000; // blocks [0, 30000) used, the rest free
  const store = createStore();
  const states = Array.from({ length: n }, (_, i) => (i < usedEnd ? "used" : "free"));
  applyFrame(store, fullFrame({ seq: 0, states }));
  const lay = layout(n, 640, 220);
  const canvas = fakeCanvas();
  drawBlocks(canvas, store, lay, null);
  const img = canvas.ctx.image;
  assert.ok(img, "drawBlocks put no image");
  assert.equal(canvas.width, lay.width);
  assert.equal(canvas.height, lay.height);
  assert.equal(canvas.style.width, `${lay.width}px`);
  assert.equal(img.data.length, lay.width * lay.height * 4);

  const inner = lay.cell - lay.gap;
  const origin = (c) => [(c % lay.cols) * lay.cell, Math.floor(c / lay.cols) * lay.cell];
  const column = (c) => {
    const [x0, y0] = origin(c);
    return Array.from({ length: inner }, (_, k) => pixel(img, x0, y0 + k));
  };
  const bottom = (c) => { const [x0, y0] = origin(c); return pixel(img, x0, y0 + inner - 1); };

  // Cells fully inside the used range: used colour at the bottom (and all the way up).
  for (const c of [0, 1, lay.cols + 5, Math.floor(usedEnd / lay.group) - 2]) {
    assert.ok((c + 1) * lay.group <= usedEnd);
    assert.deepEqual(bottom(c), COLORS.used, `cell ${c}`);
    assert.deepEqual(column(c), Array(inner).fill(COLORS.used), `cell ${c}`);
  }
  // Cells fully inside the free range: free colour.
  for (const c of [Math.ceil(usedEnd / lay.group) + 1, Math.floor(lay.cells / 2), lay.cells - 2]) {
    assert.ok(c * lay.group >= usedEnd);
    assert.deepEqual(bottom(c), COLORS.free, `cell ${c}`);
  }
  // The cell holding the boundary mixes both: a stacked bar, used at the bottom, free above.
  const mixed = Math.floor(usedEnd / lay.group);
  assert.ok(mixed * lay.group < usedEnd && (mixed + 1) * lay.group > usedEnd, "the boundary is inside a cell");
  const col = column(mixed);
  assert.ok(col.some((p) => p.join() === COLORS.used.join()), `used in ${JSON.stringify(col)}`);
  assert.ok(col.some((p) => p.join() === COLORS.free.join()), `free in ${JSON.stringify(col)}`);
  assert.deepEqual(bottom(mixed), COLORS.used);
});

test("in a grouped map a lone used block among free ones still gets a pixel", () => {
  const n = 100000;
  const store = createStore();
  const states = Array(n).fill("free");
  const lay = layout(n, 640, 220);
  const c = 1234;
  states[c * lay.group + 1] = "used"; // 1 of `group` (7) blocks: rounds to 0 px without the minimum
  applyFrame(store, fullFrame({ seq: 0, states }));
  const canvas = fakeCanvas();
  drawBlocks(canvas, store, lay, null);
  const img = canvas.ctx.image;
  const x0 = (c % lay.cols) * lay.cell, y0 = Math.floor(c / lay.cols) * lay.cell;
  assert.deepEqual(pixel(img, x0, y0 + lay.cell - lay.gap - 1), COLORS.used);
  assert.deepEqual(pixel(img, x0, y0), COLORS.free);
});

test("a one-block-per-cell map draws each block's state colour", () => {
  const states = Array.from({ length: 1000 }, (_, i) => LEGEND[i % LEGEND.length]);
  const store = createStore();
  applyFrame(store, fullFrame({ seq: 0, states }));
  const lay = layout(1000, 640, 220);
  const canvas = fakeCanvas();
  drawBlocks(canvas, store, lay, new Set([4]));
  const img = canvas.ctx.image;
  const inner = lay.cell - lay.gap;
  for (const b of [0, 1, 2, 4, 5, 997]) {
    const x0 = (b % lay.cols) * lay.cell, y0 = Math.floor(b / lay.cols) * lay.cell;
    assert.deepEqual(pixel(img, x0 + inner - 1, y0 + inner - 1), COLORS[states[b]], `block ${b}`);
  }
});

/** Every pixel of block `b`'s cell (one block per cell) as "r,g,b" strings. */
function cellPixels(img, lay, b) {
  const inner = lay.cell - lay.gap;
  const x0 = (b % lay.cols) * lay.cell, y0 = Math.floor(b / lay.cols) * lay.cell;
  const out = [];
  for (let y = 0; y < inner; y++) for (let x = 0; x < inner; x++) out.push(pixel(img, x0 + x, y0 + y).join());
  return out;
}

test("shared blocks carry a corner mark and swapped blocks stripes, at every cell size", () => {
  for (const n of [16, 300, 4000]) {               // big cells (with labels) down to 3 px cells
    const states = Array.from({ length: n }, (_, i) => ["used", "shared", "swapped", "free"][i % 4]);
    const store = createStore();
    applyFrame(store, fullFrame({ seq: 0, states }));
    const lay = layout(n, 640, 220);
    assert.equal(lay.group, 1, `n=${n} fits one block per cell`);
    const canvas = fakeCanvas();
    drawBlocks(canvas, store, lay, null);
    const img = canvas.ctx.image;
    const count = (px, rgb) => px.filter((p) => p === rgb.join()).length;
    for (let b = 0; b < Math.min(n, 12); b++) {
      const px = cellPixels(img, lay, b);
      const state = states[b];
      // The mark sits in the top-left corner; the rest of the cell keeps the state colour.
      assert.equal(px[0] === MARK.join(), state === "shared", `n=${n} block ${b} (${state}) corner`);
      assert.ok(count(px, COLORS[state]) > px.length / 3, `n=${n} block ${b} keeps its colour`);
      const stripes = count(px, STRIPE);
      if (state === "swapped") assert.ok(stripes >= lay.cell - lay.gap, `n=${n} block ${b}: ${stripes} stripe px`);
      else assert.equal(stripes, 0, `n=${n} block ${b} (${state}) has no stripes`);
      if (state !== "shared") assert.equal(count(px, MARK), 0, `n=${n} block ${b} (${state}) has no mark`);
    }
  }
});

test("a grouped cell's shared part is marked and its swapped part striped", () => {
  const n = 100000;
  const lay = layout(n, 640, 220);
  assert.ok(lay.group > 1);
  const states = Array(n).fill("free");
  for (let i = 0; i < lay.group; i++) states[i] = i % 2 ? "shared" : "swapped";   // cell 0: half each
  const store = createStore();
  applyFrame(store, fullFrame({ seq: 0, states }));
  const canvas = fakeCanvas();
  drawBlocks(canvas, store, lay, null);
  const inner = lay.cell - lay.gap;
  const column = (x) => Array.from({ length: inner }, (_, y) => pixel(canvas.ctx.image, x, y).join());
  assert.ok(column(0).includes(MARK.join()), `left column ${column(0)}`);
  assert.ok(column(1).includes(COLORS.shared.join()), `shared segment ${column(1)}`);
  assert.ok([...Array(inner).keys()].some((x) => column(x).includes(STRIPE.join())), "no stripes");
});

test("the map paints the theme's background and free colour, not the light defaults", () => {
  const dark = { background: [17, 17, 17], free: [66, 66, 66], ink: [230, 230, 230] };
  const states = ["free", "used", "free", "cached"];
  const store = createStore();
  applyFrame(store, fullFrame({ seq: 0, states }));
  const lay = layout(states.length, 640, 220);
  const canvas = fakeCanvas();
  drawBlocks(canvas, store, lay, null, dark);
  const img = canvas.ctx.image;
  assert.ok(cellPixels(img, lay, 0).every((p) => p === "66,66,66"));
  assert.ok(cellPixels(img, lay, 1).every((p) => p === COLORS.used.join()));
  if (lay.gap) assert.deepEqual(pixel(img, lay.cell - 1, 0), dark.background);   // the gap between cells
  assert.deepEqual(LIGHT.free, COLORS.free);
});

test("parseColor reads what getComputedStyle and a canvas give back", () => {
  assert.deepEqual(parseColor("rgb(33, 33, 33)"), [33, 33, 33, 1]);
  assert.deepEqual(parseColor("rgba(0, 0, 0, 0)"), [0, 0, 0, 0]);
  assert.deepEqual(parseColor("rgb(10 20 30 / 0.5)"), [10, 20, 30, 0.5]);
  assert.deepEqual(parseColor("#424242"), [66, 66, 66, 1]);
  assert.equal(parseColor("var(--x)"), null);
  assert.equal(parseColor(""), null);
});

/** Elements as themeOf sees them: computed background, text colour and CSS variables. */
function fakeElement(chain) {
  const nodes = chain.map((style) => ({ nodeType: 1, style }));
  nodes.forEach((n, i) => { n.parentElement = nodes[i + 1] || null; });
  const doc = {
    defaultView: {
      getComputedStyle: (e) => ({
        backgroundColor: e.style.background || "rgba(0, 0, 0, 0)",
        color: e.style.color || "rgb(0, 0, 0)",
        getPropertyValue: (name) => (e.style.vars || {})[name] || "",
      }),
    },
    createElement: () => ({ getContext: () => ({ canvas: { ownerDocument: doc }, set fillStyle(v) { this._f = parseColor(v) ? v : this._f; }, get fillStyle() { return this._f; } }) }),
  };
  nodes.forEach((n) => { n.ownerDocument = doc; });
  return nodes[0];
}

test("themeOf takes the background behind the map and the theme's --jp-layout-color2", () => {
  const el = fakeElement([
    { color: "rgb(224, 224, 224)", vars: { "--jp-layout-color2": "#424242" } },   // the map's root
    { background: "rgba(0, 0, 0, 0)" },                                            // transparent output area
    { background: "rgb(17, 17, 17)" },                                             // the dark notebook
  ]);
  const theme = themeOf(el);
  assert.deepEqual(theme.background, [17, 17, 17]);
  assert.deepEqual(theme.free, [66, 66, 66]);
  assert.deepEqual(theme.ink, [224, 224, 224]);
});

test("themeOf without JupyterLab's variables mixes free from the host's own colours", () => {
  const dark = themeOf(fakeElement([{ color: "rgb(240, 240, 240)" }, { background: "rgb(30, 30, 30)" }]));
  assert.deepEqual(dark.background, [30, 30, 30]);
  assert.ok(dark.free[0] > 30 && dark.free[0] < 240, `free ${dark.free} lies between background and text`);
  const light = themeOf(fakeElement([{ color: "rgb(20, 20, 20)" }, { background: "rgb(255, 255, 255)" }]));
  assert.deepEqual(light.free, COLORS.free);
  assert.deepEqual(themeOf({}), LIGHT);                                   // no document: the light default
});
