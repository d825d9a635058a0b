// Unit tests of the block-pool monitor's drawing module (jupyter_pagedkv/widgets/static/blockmap.js),
// run by Node's built-in test runner: `node --test tests/widgets/blockmap.test.mjs` (no npm packages).
// tests/widgets/test_blockmap_js.py runs this file under pytest. Frames are built with the shape of
// jupyter_pagedkv/monitor/feed.py's Frame.to_state(): the JSON header plus ids (uint32 little-endian
// bytes), codes (uint8) and refs (uint8).
import { test } from "node:test";
import assert from "node:assert/strict";

import {
  COLORS,
  LIGHT,
  MARK,
  STRIPE,
  applyFrame,
  createStore,
  describe,
  drawBlocks,
  gaugeRows,
  layout,
  parseColor,
  sparkLabel,
  statusText,
  themeOf,
} from "../../jupyter_pagedkv/widgets/static/blockmap.js";

// feed.py's KNOWN_STATES: the legend every feed starts with.
const LEGEND = ["free", "cached", "used", "shared", "swapped", "speculative"];
const CODE = Object.fromEntries(LEGEND.map((s, i) => [s, i]));

/** A frame's gauges as feed.gauges() makes them: dataclasses.asdict(EngineStats) + prefix_hit_rate. */
function makeGauges(over = {}) {
  return {
    num_blocks: 8, block_size: 16, num_free: 8, num_used: 0, num_cached: 0, num_shared: 0,
    kv_cache_usage: 0.0, tokens_stored: 0, slots_allocated: 0, internal_waste: 0,
    prefix_cache_queries: 0, prefix_cache_hits: 0, num_running: 0, num_waiting: 0,
    num_preempted: 0, num_preemptions: 0, num_swapped_blocks: 0, tokens_per_s: 0.0,
    num_generated_tokens: 0, num_finished: 0, latency_percentiles: {}, num_block_refs: 0,
    spec_num_verifications: 0, spec_proposed_tokens: 0, spec_accepted_tokens: 0,
    spec_acceptance_rate: 0.0, spec_mean_accepted_length: 0.0, states: {}, num_steps: 0,
    num_padded_steps: 0, num_graph_replays: 0, prefix_hit_rate: 0.0,
    ...over,
  };
}

/** ids as Frame.buffers() sends them: uint32 little-endian bytes. */
function u32le(ids) {
  const out = new Uint8Array(4 * ids.length);
  const view = new DataView(out.buffer);
  ids.forEach((id, i) => view.setUint32(4 * i, id, true));
  return out;
}

/** Frame.to_state() of a full frame (MonitorFeed.full_frame: prev -1, ids = all blocks). */
function fullFrame({ seq, states, refs, owners = {}, gauges = makeGauges(), history = [], legend = LEGEND,
  blockSize = 16 }) {
  const n = states.length;
  return {
    seq, prev: -1, full: true, num_blocks: n, block_size: blockSize, legend: legend.slice(),
    owners, gauges, history,
    ids: u32le(Array.from({ length: n }, (_, i) => i)),
    codes: Uint8Array.from(states, (s) => legend.indexOf(s)),
    refs: Uint8Array.from(refs || states.map((s) => (s === "used" ? 1 : s === "shared" ? 2 : 0))),
  };
}

/** Frame.to_state() of a diff (MonitorFeed._emit): the changed blocks only, history empty. */
function diffFrame({ seq, prev, numBlocks = 8, changes = [], owners = {}, gauges = makeGauges(), legend = LEGEND }) {
  return {
    seq, prev, full: false, num_blocks: numBlocks, block_size: 16, legend: legend.slice(),
    owners, gauges, history: [],
    ids: u32le(changes.map(([id]) => id)),
    codes: Uint8Array.from(changes, ([, state]) => legend.indexOf(state)),
    refs: Uint8Array.from(changes, ([, , ref]) => ref),
  };
}

const FREE8 = Array(8).fill("free");

/** A store holding a full frame of 8 blocks at `seq`: block 3 used by r0, the rest free. */
function storeAt(seq) {
  const store = createStore();
  const states = FREE8.slice();
  states[3] = "used";
  assert.equal(applyFrame(store, fullFrame({ seq, states, owners: { 3: ["r0"] },
    gauges: makeGauges({ num_used: 1, kv_cache_usage: 0.125 }), history: [0.125] })), "ok");
  return store;
}

test("a full frame replaces the whole store", () => {
  const store = createStore();
  applyFrame(store, fullFrame({ seq: 2, states: ["used", "used"], owners: { 0: ["old"] } }));
  applyFrame(store, { closed: true });
  const gauges = makeGauges({ num_blocks: 6, num_used: 2, num_shared: 1, kv_cache_usage: 2 / 6 });
  const frame = fullFrame({
    seq: 9, blockSize: 32,
    states: ["free", "used", "shared", "cached", "swapped", "speculative"],
    refs: [0, 1, 3, 0, 0, 1],
    owners: { 1: ["req-a"], 2: ["req-a", "req-b"] },
    gauges, history: [0.1, 0.2, 2 / 6],
  });
  assert.equal(applyFrame(store, frame), "ok");
  assert.equal(store.numBlocks, 6);
  assert.equal(store.blockSize, 32);
  assert.deepEqual(store.legend, LEGEND);
  assert.deepEqual(Array.from(store.codes), [0, 2, 3, 1, 4, 5]);
  assert.deepEqual(Array.from(store.refs), [0, 1, 3, 0, 0, 1]);
  assert.deepEqual(store.owners, new Map([[1, ["req-a"]], [2, ["req-a", "req-b"]]]));
  assert.deepEqual(store.gauges, gauges);
  assert.deepEqual(store.history, [0.1, 0.2, 2 / 6]);
  assert.equal(store.seq, 9);
  assert.equal(store.closed, false);
});

test("a full frame keeps the last 240 history entries", () => {
  const store = createStore();
  const history = Array.from({ length: 300 }, (_, i) => i / 1000);
  applyFrame(store, fullFrame({ seq: 0, states: FREE8, history }));
  assert.equal(store.history.length, 240);
  assert.deepEqual(store.history, history.slice(-240));
});

test("a diff changes only the listed blocks' codes and refs", () => {
  const store = storeAt(4);
  const result = applyFrame(store, diffFrame({ seq: 5, prev: 4, changes: [[1, "shared", 2], [6, "cached", 0]] }));
  assert.equal(result, "ok");
  assert.deepEqual(Array.from(store.codes), [0, CODE.shared, 0, CODE.used, 0, 0, CODE.cached, 0]);
  assert.deepEqual(Array.from(store.refs), [0, 2, 0, 1, 0, 0, 0, 0]);
  assert.equal(store.seq, 5);
  assert.equal(store.numBlocks, 8);
});

test("a diff sets owners and an empty owner list deletes the entry", () => {
  const store = storeAt(4);
  applyFrame(store, diffFrame({
    seq: 5, prev: 4, changes: [[1, "used", 1], [3, "free", 0]], owners: { 1: ["r1", "r2"], 3: [] },
  }));
  assert.deepEqual(store.owners, new Map([[1, ["r1", "r2"]]]));
});

test("a diff replaces legend and gauges and appends kv_cache_usage to the history", () => {
  const store = storeAt(4);
  const legend = [...LEGEND, "offloaded"];
  const gauges = makeGauges({ num_used: 2, kv_cache_usage: 0.25, num_running: 2 });
  applyFrame(store, diffFrame({ seq: 5, prev: 4, legend, gauges, changes: [[7, "offloaded", 0]] }));
  assert.deepEqual(store.legend, legend);
  assert.equal(store.gauges, gauges);
  assert.deepEqual(store.history, [0.125, 0.25]);
  assert.equal(store.codes[7], 6);
});

test("history grows by one per diff and is capped at 240 entries", () => {
  const store = storeAt(0);
  for (let seq = 1; seq <= 300; seq++) {
    const r = applyFrame(store, diffFrame({ seq, prev: seq - 1, gauges: makeGauges({ kv_cache_usage: seq / 1000 }) }));
    assert.equal(r, "ok");
    if (seq === 100) assert.equal(store.history.length, 101);
  }
  assert.equal(store.history.length, 240);
  assert.equal(store.history[239], 0.3);
  assert.equal(store.history[0], 61 / 1000);
  assert.equal(store.seq, 300);
});

test("a diff whose prev is not the store's seq is a gap and leaves the store untouched", () => {
  const store = storeAt(5);
  const before = structuredClone(store);
  const r = applyFrame(store, diffFrame({ seq: 7, prev: 6, changes: [[0, "used", 1]], owners: { 0: ["x"] },
    gauges: makeGauges({ kv_cache_usage: 0.9 }) }));
  assert.equal(r, "gap");
  assert.deepEqual(store, before);
});

test("after a gap, a fresh full frame lets diffs apply again", () => {
  const store = storeAt(5);
  assert.equal(applyFrame(store, diffFrame({ seq: 7, prev: 6, changes: [[0, "used", 1]] })), "gap");
  assert.equal(applyFrame(store, diffFrame({ seq: 8, prev: 7, changes: [[0, "used", 1]] })), "gap");
  const states = FREE8.slice();
  states[0] = "used";
  assert.equal(applyFrame(store, fullFrame({ seq: 8, states })), "ok");
  assert.equal(applyFrame(store, diffFrame({ seq: 9, prev: 8, changes: [[2, "shared", 2]] })), "ok");
  assert.equal(store.seq, 9);
  assert.deepEqual(Array.from(store.codes), [CODE.used, 0, CODE.shared, 0, 0, 0, 0, 0]);
});

test("a full frame older than the store is stale and changes nothing", () => {
  const store = storeAt(5);
  const before = structuredClone(store);
  assert.equal(applyFrame(store, fullFrame({ seq: 4, states: Array(3).fill("used") })), "stale");
  assert.deepEqual(store, before);
});

test("a diff with seq <= the store's seq is stale and changes nothing", () => {
  const store = storeAt(5);
  const before = structuredClone(store);
  assert.equal(applyFrame(store, diffFrame({ seq: 5, prev: 4, changes: [[0, "used", 1]] })), "stale");
  assert.equal(applyFrame(store, diffFrame({ seq: 3, prev: 2, changes: [[1, "used", 1]] })), "stale");
  assert.deepEqual(store, before);
});

test("things that are not frames are skipped", () => {
  const store = storeAt(5);
  const before = structuredClone(store);
  for (const x of [null, undefined, 42, "frame", {}, { full: true, legend: [] }, { seq: "3", prev: 2 }]) {
    assert.equal(applyFrame(store, x), "skip", `applyFrame(${JSON.stringify(x)})`);
  }
  assert.deepEqual(store, before);
});

test("a {closed: true} frame marks the store closed and keeps the last picture", () => {
  const store = storeAt(5);
  assert.equal(applyFrame(store, { closed: true }), "ok");
  assert.equal(store.closed, true);
  assert.equal(store.numBlocks, 8);
});

test("after a closed frame the next feed's first full frame is taken, though its seq restarts at 0", () => {
  // A reloaded engine (or another kernel) gets a new feed that numbers its frames from 0 again.
  const store = storeAt(50);
  applyFrame(store, { closed: true });
  const fresh = fullFrame({ seq: 0, states: ["used", "used", "free"] });
  assert.equal(applyFrame(store, fresh), "ok");
  assert.equal(store.closed, false);
  assert.equal(store.seq, 0);
  assert.equal(store.numBlocks, 3);
  // ... and a diff of the old feed can no longer land on the new picture.
  assert.equal(applyFrame(store, diffFrame({ seq: 51, prev: 50, numBlocks: 3 })), "gap");
});

test("ids given as a plain array are block numbers", () => {
  const store = storeAt(0);
  const frame = { seq: 1, prev: 0, full: false, num_blocks: 8, block_size: 16, legend: LEGEND.slice(),
    owners: {}, gauges: makeGauges(), history: [], ids: [5], codes: [CODE.used], refs: [1] };
  assert.equal(applyFrame(store, frame), "ok");
  assert.equal(store.codes[5], CODE.used);
  assert.equal(store.refs[5], 1);
});

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

test("ids in a Uint8Array view with a non-zero byteOffset are read correctly", () => {
  const store = createStore();
  applyFrame(store, fullFrame({ seq: 0, states: Array(70000).fill("free") }));
  const ids = [1, 300, 65537, 69999];
  // One comm buffer holding a junk byte, then the ids: the slice starts at byte 1 (unaligned).
  const wire = new Uint8Array(1 + 4 * ids.length + 3);
  wire[0] = 0xee;
  wire.set(u32le(ids), 1);
  wire.fill(0xee, 1 + 4 * ids.length);
  const frame = diffFrame({ seq: 1, prev: 0, numBlocks: 70000, changes: ids.map((id) => [id, "used", 1]) });
  frame.ids = new Uint8Array(wire.buffer, 1, 4 * ids.length);
  assert.equal(frame.ids.byteOffset, 1);
  assert.equal(applyFrame(store, frame), "ok");
  const used = [];
  store.codes.forEach((c, i) => c === CODE.used && used.push(i));
  assert.deepEqual(used, ids);
  assert.deepEqual(ids.map((i) => store.refs[i]), [1, 1, 1, 1]);
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

// -- status text and gauge rows ------------------------------------------------------------------

test("the status text never says Idle", () => {
  const cases = [
    makeGauges(),
    makeGauges({ kv_cache_usage: 0.43, num_used: 3, num_running: 12 }),
    makeGauges({ kv_cache_usage: 1, num_running: 0, num_waiting: 5 }),
    makeGauges({ kv_cache_usage: 0.05, num_running: 1, num_preempted: 2 }),
  ];
  for (const g of cases) assert.doesNotMatch(statusText(g), /idle/i);
  assert.doesNotMatch(statusText(null), /idle/i);
});

test("the status text shows waiting requests only when there are some", () => {
  assert.equal(statusText(makeGauges({ kv_cache_usage: 0.43, num_running: 12 })), "KV 43% · 12 running");
  assert.equal(statusText(makeGauges({ kv_cache_usage: 0.43, num_running: 12, num_waiting: 3 })),
    "KV 43% · 12 running · 3 waiting");
  assert.doesNotMatch(statusText(makeGauges({ num_running: 1 })), /waiting/);
});

test("gauge rows add swapped and speculation rows only when those counters are non-zero", () => {
  const base = makeGauges({ num_blocks: 8, num_used: 2, num_shared: 1, num_cached: 1, kv_cache_usage: 0.25,
    slots_allocated: 32, internal_waste: 8, num_running: 2, tokens_per_s: 12.345 });
  const labels = (rows) => rows.map(([k]) => k);
  const plain = gaugeRows(base);
  assert.deepEqual(labels(plain),
    ["KV used", "cached", "shared", "internal waste", "prefix hit rate", "requests", "tokens/s"]);
  assert.equal(Object.fromEntries(plain)["KV used"], "25% (2 of 8 blocks)");
  assert.equal(Object.fromEntries(plain)["tokens/s"], "12.3");

  const swapped = gaugeRows({ ...base, num_swapped_blocks: 12 });
  assert.deepEqual(labels(swapped), [...labels(plain), "swapped out"]);
  assert.equal(Object.fromEntries(swapped)["swapped out"], "12 blocks");

  const spec = gaugeRows({ ...base, spec_proposed_tokens: 100, spec_accepted_tokens: 60,
    spec_acceptance_rate: 0.6, spec_mean_accepted_length: 1.5 });
  assert.deepEqual(labels(spec), [...labels(plain), "speculation"]);
  assert.equal(Object.fromEntries(spec).speculation, "60 of 100 drafts kept (60%), 1.50 per verification");

  assert.deepEqual(labels(gaugeRows({ ...base, num_swapped_blocks: 3, spec_proposed_tokens: 4,
    spec_accepted_tokens: 1, spec_acceptance_rate: 0.25, spec_mean_accepted_length: 0.5 })),
  [...labels(plain), "swapped out", "speculation"]);
  assert.deepEqual(gaugeRows(null), []);
});

test("the sparkline says what it plots, over which window, and its current and peak value", () => {
  assert.equal(sparkLabel([]), "KV usage over the last updates (up to 240): none yet");
  assert.equal(sparkLabel([0.1, 0.5, 0.25]),
    "KV usage over the last 3 updates (up to 240, one per change): 25% now, peak 50%");
  const store = createStore();
  for (let seq = 0; seq < 300; seq++) store.history.push(seq === 10 ? 0.9 : 0.02);
  store.history.splice(0, 60);
  assert.match(sparkLabel(store.history), /^KV usage over the last 240 updates .*: 2\.0% now, peak 2\.0%$/);
});

test("the hover names a request's prefix-cache report: full frames set them, diffs add new ones", () => {
  const store = createStore();
  const full = fullFrame({ seq: 1, states: ["used", "free", "free", "free", "free", "free", "free", "free"],
    owners: { 0: ["req-0"] } });
  full.why = { "req-0": "req-0: 0 of 1 prompt blocks hit the prefix cache" };
  assert.equal(applyFrame(store, full), "ok");
  const one = layout(8, 640, 220);
  assert.equal(one.group, 1);
  assert.equal(describe(store, one, 0).why, "req-0: 0 of 1 prompt blocks hit the prefix cache");
  assert.equal(describe(store, one, 1).why, "");                 // a free block: nobody to explain
  const diff = diffFrame({ seq: 2, prev: 1, changes: [[1, "used", 1]], owners: { 1: ["req-1"] } });
  diff.why = { "req-1": "req-1: 2 of 3 prompt blocks hit the prefix cache: block 2 partial" };
  assert.equal(applyFrame(store, diff), "ok");
  assert.match(describe(store, one, 1).why, /block 2 partial/);
  assert.match(describe(store, one, 0).why, /req-0/);            // a diff keeps what it did not name
});
