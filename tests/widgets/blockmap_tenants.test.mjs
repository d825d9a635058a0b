// Unit tests of the monitor's "colour by tenant" mode (jupyter_pagedkv/widgets/static/blockmap.js),
// run by Node's built-in test runner like the other blockmap_*.test.mjs (tests/widgets/test_blockmap_js.py
// runs them all). Frames have the shape of feed.py's Frame.to_state(), with `tenants` ({block: [names]}) and
// the per-tenant gauges (EngineStats.tenants as dataclasses.asdict gives them).
import { test } from "node:test";
import assert from "node:assert/strict";

import {
  COLORS,
  LIGHT,
  MARK,
  STRIPE,
  TENANT_COLORS,
  applyFrame,
  createStore,
  cueOn,
  drawBlocks,
  layout,
  paintPlan,
  tenantLegend,
  tenantNames,
  tenantRows,
} from "../../jupyter_pagedkv/widgets/static/blockmap.js";

const LEGEND = ["free", "cached", "used", "shared", "swapped", "speculative"];

function tenantStats(name, over = {}) {
  return {
    name, weight: 1.0, max_blocks: null, share: 4.0, blocks_used: 0, blocks_shared: 0, cached_tokens: 0,
    num_running: 0, num_waiting: 0, num_preempted: 0, num_finished: 0, ttft_p50: null, ttft_p99: null,
    e2e_p99: null, tail_name: "max", tokens_per_s: 0.0, ...over,
  };
}

/** A full frame of `states` whose per-block tenants are `tenants`, gauges naming `names`' stats. */
function frame({ seq = 0, states, refs, tenants = {}, owners = {}, stats = {} }) {
  const n = states.length;
  const ids = new Uint8Array(4 * n);                              // uint32 little-endian 0..n-1
  for (let i = 0; i < n; i++) new DataView(ids.buffer).setUint32(4 * i, i, true);
  return {
    seq, prev: -1, full: true, num_blocks: n, block_size: 4, legend: LEGEND.slice(), owners, tenants,
    gauges: { num_blocks: n, kv_cache_usage: 0, tenants: stats, scheduling_policy: "fair" }, history: [],
    ids, codes: Uint8Array.from(states, (s) => LEGEND.indexOf(s)),
    refs: Uint8Array.from(refs || states.map((s) => (s === "used" ? 1 : s === "shared" ? 2 : 0))),
  };
}

function fakeCanvas() {
  const ctx = {
    image: null, texts: [],
    createImageData: (w, h) => ({ width: w, height: h, data: new Uint8ClampedArray(w * h * 4) }),
    putImageData(img) { this.image = img; },
    fillText(text) { this.texts.push([text, this.fillStyle]); },
    strokeRect() {}, clearRect() {}, beginPath() {}, moveTo() {}, lineTo() {}, stroke() {},
  };
  return { width: 0, height: 0, style: {}, ctx, getContext: (kind) => (kind === "2d" ? ctx : null) };
}

function cellPixels(img, lay, b) {
  const inner = lay.cell - lay.gap;
  const x0 = (b % lay.cols) * lay.cell, y0 = Math.floor(b / lay.cols) * lay.cell;
  const out = [];
  for (let y = 0; y < inner; y++) {
    for (let x = 0; x < inner; x++) {
      const o = ((y0 + y) * img.width + x0 + x) * 4;
      out.push(`${img.data[o]},${img.data[o + 1]},${img.data[o + 2]}`);
    }
  }
  return out;
}

// Blocks 0-1 alice, 2 bob, 3 held by both (a prefix shared across tenants), 4 cached, 5 free, 6 unnamed.
const STATES = ["used", "shared", "used", "shared", "cached", "free", "used", "free"];
const TENANTS = { 0: ["alice"], 1: ["alice"], 2: ["bob"], 3: ["alice", "bob"], 6: ["(unnamed)"] };
const STATS = { alice: tenantStats("alice"), bob: tenantStats("bob"), "(unnamed)": tenantStats("(unnamed)") };

function tenantStore() {
  const store = createStore();
  assert.equal(applyFrame(store, frame({ states: STATES, tenants: TENANTS, stats: STATS })), "ok");
  return store;
}

const count = (px, rgb) => px.filter((p) => p === rgb.join()).length;

test("a full frame's tenants fill the store and a diff updates or deletes them", () => {
  const store = tenantStore();
  assert.deepEqual(store.tenants.get(3), ["alice", "bob"]);
  const diff = { ...frame({ seq: 1, states: [] }), full: false, prev: 0, num_blocks: 8, ids: new Uint8Array(0),
    codes: new Uint8Array(0), refs: new Uint8Array(0), tenants: { 3: [], 5: ["bob"] } };
  assert.equal(applyFrame(store, diff), "ok");
  assert.equal(store.tenants.has(3), false);
  assert.deepEqual(store.tenants.get(5), ["bob"]);
});

test("tenants take their colours in the gauges' order, then any other a block names", () => {
  const store = tenantStore();
  store.tenants.set(7, ["zed"]);
  assert.deepEqual(tenantNames(store), ["alice", "bob", "(unnamed)", "zed"]);
  const plan = paintPlan(store, LIGHT, "tenant");
  assert.deepEqual(plan.colors[plan.index.get("alice")], TENANT_COLORS[0]);
  assert.deepEqual(plan.colors[plan.index.get("(unnamed)")], TENANT_COLORS[2]);
  assert.equal(plan.cls[3], plan.cross);
  assert.equal(plan.cls[4], LEGEND.indexOf("cached"));        // unheld blocks keep their state
  assert.equal(paintPlan(store, LIGHT, "state").cls, store.codes);
});

test("in tenant mode each tenant's blocks are its colour, free and cached stay as in state mode", () => {
  const store = tenantStore();
  const lay = layout(STATES.length, 640, 220);
  const canvas = fakeCanvas();
  drawBlocks(canvas, store, lay, null, LIGHT, "tenant");
  const img = canvas.ctx.image;
  const main = (b) => cellPixels(img, lay, b).at(-1);          // bottom-right: clear of any mark
  assert.equal(main(0), TENANT_COLORS[0].join());
  assert.equal(main(1), TENANT_COLORS[0].join());
  assert.equal(main(2), TENANT_COLORS[1].join());
  assert.equal(main(6), TENANT_COLORS[2].join());
  assert.equal(main(4), COLORS.cached.join());
  assert.ok(cellPixels(img, lay, 5).every((p) => p === COLORS.free.join()));
  assert.notEqual(main(0), main(2));
  // The same store in state mode: the state colours.
  drawBlocks(canvas, store, lay, null, LIGHT, "state");
  assert.equal(cellPixels(canvas.ctx.image, lay, 0).at(-1), COLORS.used.join());
});

test("a block several tenants hold is split between them by a dashed light and dark line", () => {
  for (const n of [8, 300, 4000]) {                              // big cells down to 3 px cells
    const states = Array.from({ length: n }, (_, i) => STATES[i % 8]);
    const tenants = Object.fromEntries(Object.entries(TENANTS));
    const store = createStore();
    applyFrame(store, frame({ states, tenants, stats: STATS }));
    const lay = layout(n, 640, 220);
    assert.equal(lay.group, 1);
    const canvas = fakeCanvas();
    drawBlocks(canvas, store, lay, null, LIGHT, "tenant");
    const px = cellPixels(canvas.ctx.image, lay, 3);
    assert.ok(count(px, TENANT_COLORS[1]) > 0, `n=${n}: bob's half`);
    assert.ok(count(px, MARK) > 0 && count(px, STRIPE) > 0, `n=${n}: the dashed split`);
    // A block of one tenant has neither the split nor bob's colour.
    const alone = cellPixels(canvas.ctx.image, lay, 0);
    assert.equal(count(alone, TENANT_COLORS[1]) + count(alone, STRIPE), 0, `n=${n}`);
  }
});

test("a block three tenants hold shows all three colours in bands", () => {
  const store = tenantStore();
  store.tenants.set(3, ["alice", "bob", "(unnamed)"]);
  const lay = layout(STATES.length, 640, 220);
  const canvas = fakeCanvas();
  drawBlocks(canvas, store, lay, null, LIGHT, "tenant");
  const px = cellPixels(canvas.ctx.image, lay, 3);
  for (const rgb of TENANT_COLORS.slice(0, 3)) assert.ok(count(px, rgb) > 10, `${rgb} in ${px.join(" ")}`);
});

test("the shared corner mark and the ref count show on light and dark tenant colours alike", () => {
  const store = tenantStore();
  store.tenants.set(1, ["bob"]);                                 // block 1 (ref 2) now bob's: yellow
  const lay = layout(STATES.length, 640, 220);
  const canvas = fakeCanvas();
  drawBlocks(canvas, store, lay, null, LIGHT, "tenant");
  assert.equal(cellPixels(canvas.ctx.image, lay, 1)[0], cueOn(TENANT_COLORS[1]).join());
  assert.deepEqual(cueOn(TENANT_COLORS[1]), STRIPE);             // dark on yellow
  assert.deepEqual(cueOn(TENANT_COLORS[0]), MARK);               // light on indigo
  // Block 1's count, dark on yellow; block 3 (alice and bob) shows its bands without a count.
  assert.deepEqual(canvas.ctx.texts, [["2", "rgb(72,28,56)"]]);
});

test("a grouped map stacks tenants and hatches the blocks several tenants hold", () => {
  const n = 100000;
  const lay = layout(n, 640, 220);
  assert.ok(lay.group > 1);
  const states = Array(n).fill("free");
  const tenants = {};
  for (let i = 0; i < lay.group; i++) {
    states[i] = "used";
    tenants[i] = i % 2 ? ["alice"] : ["alice", "bob"];
  }
  const store = createStore();
  applyFrame(store, frame({ states, tenants, stats: STATS }));
  const canvas = fakeCanvas();
  drawBlocks(canvas, store, lay, null, LIGHT, "tenant");
  const px = cellPixels(canvas.ctx.image, lay, 0);
  assert.ok(count(px, TENANT_COLORS[0]) > 0 && count(px, STRIPE) > 0 && count(px, MARK) > 0, px.join(" "));
});

test("the tenant legend lists free, cached, every tenant and both marks", () => {
  const labels = tenantLegend(tenantStore()).map(([, label]) => label);
  assert.deepEqual(labels, ["free", "cached", "alice", "bob", "(unnamed)", "several tenants", "shared"]);
});

test("tenant gauge rows give blocks against share and cap, the queue and TTFT when known", () => {
  const rows = tenantRows({ tenants: {
    alice: tenantStats("alice", { blocks_used: 12, blocks_shared: 3, share: 20.4, max_blocks: 30, num_running: 2,
      num_waiting: 1, ttft_p50: 0.04, ttft_p99: 1.5, tail_name: "max" }),
    bob: tenantStats("bob", { blocks_used: 1, num_preempted: 2 }),
  } });
  assert.equal(rows[0].text, "12 blocks (3 shared), share 20, cap 30 · 2 running · 1 waiting · TTFT 40 ms / max 1.50 s");
  assert.equal(rows[1].text, "1 block, share 4 · 0 running · 0 waiting · 2 preempted");
  assert.deepEqual([rows[0].used, rows[0].cap, rows[1].cap], [12, 30, null]);
  assert.deepEqual(tenantRows({ tenants: {} }), []);
  assert.deepEqual(tenantRows(null), []);
});
