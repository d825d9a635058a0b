// Frames for the tests of the block-pool monitor's drawing module (jupyter_pagedkv/widgets/static/blockmap.js):
// built with the shape of jupyter_pagedkv/monitor/feed.py's Frame.to_state(): the JSON header plus ids
// (uint32 little-endian bytes), codes (uint8) and refs (uint8). Imported by the blockmap_*.test.mjs files;
// not a test file itself (node --test runs *.test.mjs).
import assert from "node:assert/strict";

import { applyFrame, createStore } from "../../jupyter_pagedkv/widgets/static/blockmap.js";

// feed.py's KNOWN_STATES: the legend every feed starts with.
export const LEGEND = ["free", "cached", "used", "shared", "swapped", "speculative"];
export const CODE = Object.fromEntries(LEGEND.map((s, i) => [s, i]));

/** A frame's gauges as feed.gauges() makes them: dataclasses.asdict(EngineStats) + prefix_hit_rate. */
export function makeGauges(over = {}) {
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
export function u32le(ids) {
  const out = new Uint8Array(4 * ids.length);
  const view = new DataView(out.buffer);
  ids.forEach((id, i) => view.setUint32(4 * i, id, true));
  return out;
}

/** Frame.to_state() of a full frame (MonitorFeed.full_frame: prev -1, ids = all blocks). */
export function fullFrame({ seq, states, refs, owners = {}, gauges = makeGauges(), history = [], legend = LEGEND,
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
export function diffFrame({ seq, prev, numBlocks = 8, changes = [], owners = {}, gauges = makeGauges(), legend = LEGEND }) {
  return {
    seq, prev, full: false, num_blocks: numBlocks, block_size: 16, legend: legend.slice(),
    owners, gauges, history: [],
    ids: u32le(changes.map(([id]) => id)),
    codes: Uint8Array.from(changes, ([, state]) => legend.indexOf(state)),
    refs: Uint8Array.from(changes, ([, , ref]) => ref),
  };
}

export const FREE8 = Array(8).fill("free");

/** A store holding a full frame of 8 blocks at `seq`: block 3 used by r0, the rest free. */
export function storeAt(seq) {
  const store = createStore();
  const states = FREE8.slice();
  states[3] = "used";
  assert.equal(applyFrame(store, fullFrame({ seq, states, owners: { 3: ["r0"] },
    gauges: makeGauges({ num_used: 1, kv_cache_usage: 0.125 }), history: [0.125] })), "ok");
  return store;
}
