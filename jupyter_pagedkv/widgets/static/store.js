// The monitor's picture of the pool (part of blockmap.js): a store that full frames and diffs from
// jupyter_pagedkv/monitor/feed.py fold into. A full frame replaces the picture; a diff (`prev` =
// the seq it applies on) carries parallel arrays ids (uint32), codes (uint8, index into `legend`)
// and refs (uint8, ref count capped at 255) for the blocks that changed, and `owners` / `tenants`
// ({block: [request ids]}, {block: [tenant names]}) for those of them in use. `why` ({request id:
// text}) says why a request's prompt missed the prefix cache: every owner's in a full frame, the
// newly seen ones in a diff; the hover shows it.

// How many gauge readings the sparkline keeps.
export const HISTORY = 240;

export function bytesOf(x) {
  if (!x) return new Uint8Array(0);
  if (x instanceof Uint8Array) return x;
  if (ArrayBuffer.isView(x)) return new Uint8Array(x.buffer, x.byteOffset, x.byteLength);
  if (x instanceof ArrayBuffer) return new Uint8Array(x);
  return Uint8Array.from(x);
}

export function u32Of(x) {
  if (Array.isArray(x)) return Uint32Array.from(x); // block ids themselves, not their bytes
  const b = bytesOf(x).slice(); // a fresh, aligned copy
  return new Uint32Array(b.buffer, 0, b.byteLength >> 2);
}

export function createStore() {
  return {
    seq: -1, numBlocks: 0, blockSize: 0, legend: [], codes: new Uint8Array(0),
    refs: new Uint8Array(0), owners: new Map(), tenants: new Map(), why: new Map(), gauges: null, history: [],
    closed: false,
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
    store.why = new Map(Object.entries(frame.why || {}));
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
  for (const [rid, text] of Object.entries(frame.why || {})) store.why.set(rid, text);
  if (store.why.size > 1024) {
    // Keep the reports of requests still holding blocks (what a hover can reach).
    const live = new Set([...store.owners.values()].flat());
    for (const rid of [...store.why.keys()]) if (!live.has(rid)) store.why.delete(rid);
  }
  store.legend = frame.legend.slice();
  store.gauges = frame.gauges;
  store.history.push(frame.gauges.kv_cache_usage);
  if (store.history.length > HISTORY) store.history.splice(0, store.history.length - HISTORY);
  store.seq = frame.seq;
  return "ok";
}

/** Whether a view that found a gap asks for a full frame now: at most once per `minGapMs` until
 * a full frame arrives (`reset`). A request waits behind a running cell, and each one queued would
 * be answered with a whole frame; the kernel also refreshes `base` every few seconds. */
export function resyncGate(minGapMs = 2000) {
  let last = -Infinity;
  return {
    want(now) {
      if (now - last < minGapMs) return false;
      last = now;
      return true;
    },
    reset() {
      last = -Infinity;
    },
  };
}

/** The tenants in the order of their colours: EngineStats.tenants' (by name, the unnamed last),
 * then, sorted, any a block names that the gauges do not. */
export function tenantNames(store) {
  const names = Object.keys((store.gauges && store.gauges.tenants) || {});
  const extra = new Set();
  for (const list of store.tenants.values()) for (const t of list) if (!names.includes(t)) extra.add(t);
  return names.concat([...extra].sort());
}

