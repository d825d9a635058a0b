// Unit tests of the block-pool monitor's drawing module (jupyter_pagedkv/widgets/static/blockmap.js):
// the text it shows: the status bar, the gauge rows, the sparkline label, the hover.
// Run by Node's built-in test runner (no npm packages); tests/widgets/test_blockmap_js.py runs every
// tests/widgets/*.test.mjs under pytest. Frames come from blockmap_fixtures.mjs (feed.py's Frame.to_state()).
import { test } from "node:test";
import assert from "node:assert/strict";

import {
  applyFrame,
  createStore,
  describe,
  gaugeRows,
  layout,
  sparkLabel,
  statusText,
} from "../../jupyter_pagedkv/widgets/static/blockmap.js";
import { diffFrame, fullFrame, makeGauges } from "./blockmap_fixtures.mjs";

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
