// Unit tests of the block-pool monitor's drawing module (jupyter_pagedkv/widgets/static/blockmap.js):
// folding frames into the store: full frames, diffs, gaps, stale and closed frames, ids.
// Run by Node's built-in test runner (no npm packages); tests/widgets/test_blockmap_js.py runs every
// tests/widgets/*.test.mjs under pytest. Frames come from blockmap_fixtures.mjs (feed.py's Frame.to_state()).
import { test } from "node:test";
import assert from "node:assert/strict";

import {
  applyFrame,
  createStore,
  resyncGate,
} from "../../jupyter_pagedkv/widgets/static/blockmap.js";
import { CODE, FREE8, LEGEND, diffFrame, fullFrame, makeGauges, storeAt, u32le } from "./blockmap_fixtures.mjs";

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

test("a view in a gap asks for a full frame once per interval, and again at once after one came", () => {
  // Requests queue behind a running cell: one per diff would each be answered with a whole frame.
  const gate = resyncGate(2000);
  assert.equal(gate.want(10_000), true);
  assert.equal(gate.want(10_100), false);
  assert.equal(gate.want(11_999), false);
  assert.equal(gate.want(12_000), true);
  gate.reset();
  assert.equal(gate.want(12_001), true);
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
