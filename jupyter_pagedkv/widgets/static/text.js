// The monitor's words (part of blockmap.js): the status-bar text, gauge and tenant rows, legends,
// a block's description on hover, and the widget's stylesheet.

import { LIGHT, MARK, STRIPE, colorOf, css, cueOn, tenantColor } from "./palette.js";
import { HISTORY, tenantNames } from "./store.js";

// Tenant names are the user's text: never HTML.
export const escapeHtml = (text) => String(text).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);

export const pct = (x) => `${(100 * x).toFixed(x > 0 && x < 0.1 ? 1 : 0)}%`;

/** The words beside the sparkline: what it plots and over which window. Frames come only when the
 * pool changed (at most 10 a second), so the window is counted in updates, not seconds. */
export function sparkLabel(history) {
  if (history.length < 2) return `KV usage over the last updates (up to ${HISTORY}): none yet`;
  const peak = Math.max(...history);
  return `KV usage over the last ${history.length} updates (up to ${HISTORY}, one per change): ` +
    `${pct(history[history.length - 1])} now, peak ${pct(peak)}`;
}

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
export const STYLE = `
.pkv-root { font: 12px/1.4 var(--jp-ui-font-family, sans-serif); color: var(--jp-ui-font-color1, currentColor); }
.pkv-title { font-weight: 600; margin-bottom: 4px; }
.pkv-bar { display: flex; height: 8px; border-radius: 3px; overflow: hidden; margin: 4px 0 6px; background: var(--jp-layout-color2, rgb(238,238,238)); }
.pkv-gauges { display: grid; grid-template-columns: max-content 1fr; gap: 0 10px; margin-bottom: 6px; }
.pkv-gauges .pkv-k, .pkv-legend, .pkv-hover, .pkv-note { color: var(--jp-ui-font-color2, currentColor); }
.pkv-blocks { display: block; cursor: crosshair; image-rendering: pixelated; }
.pkv-legend { display: flex; flex-wrap: wrap; gap: 2px 10px; margin-top: 4px; }
.pkv-legend i { display: inline-block; width: 10px; height: 10px; margin-right: 3px; vertical-align: -1px; }
.pkv-hover { min-height: 1.4em; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.pkv-why { color: var(--jp-ui-font-color2, currentColor); }
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
export function swatch(state, theme) {
  const color = css(state === "free" ? theme.free : colorOf(state));
  if (state === "shared") return `linear-gradient(135deg, ${css(MARK)} 0 35%, transparent 35%), ${color}`;
  if (state === "swapped") {
    return `repeating-linear-gradient(135deg, ${css(STRIPE)} 0 1px, transparent 1px 3px), ${color}`;
  }
  return color;
}

export function ensureStyle(doc) {
  if (doc.getElementById("pkv-style")) return;
  const s = doc.createElement("style");
  s.id = "pkv-style";
  s.textContent = STYLE;
  doc.head.appendChild(s);
}

export function describe(store, lay, cellIndex) {
  const start = cellIndex * lay.group;
  if (!(start >= 0 && start < store.numBlocks)) return { text: "", owner: null, why: "" };
  if (lay.group === 1) {
    const state = store.legend[store.codes[start]];
    const ref = store.refs[start];
    const owners = store.owners.get(start) || [];
    const refText = ref > 1 ? ` ×${ref}` : "";
    const who = owners.length ? ` — ${owners.join(", ")}` : "";
    const tenants = store.tenants.get(start) || [];
    const whose = tenants.length ? ` · tenant${tenants.length > 1 ? "s" : ""} ${tenants.join(", ")}` : "";
    const why = owners.length ? store.why.get(owners[0]) || "" : "";
    return { text: `block ${start}: ${state}${refText}${whose}${who}`, owner: owners[0] || null, why };
  }
  const end = Math.min(store.numBlocks, start + lay.group);
  const counts = new Map();
  for (let b = start; b < end; b++) {
    const s = store.legend[store.codes[b]];
    counts.set(s, (counts.get(s) || 0) + 1);
  }
  const parts = [...counts.entries()].sort((a, b) => b[1] - a[1]).map(([s, k]) => `${k} ${s}`);
  return { text: `blocks ${start}–${end - 1}: ${parts.join(", ")}`, owner: null, why: "" };
}

