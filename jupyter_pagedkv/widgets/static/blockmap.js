// The block-pool monitor's drawing code, one module for two hosts: its default export is the
// anywidget module of jupyter_pagedkv.widgets.BlockPoolMonitor, and the JupyterLab side panel
// (labextension/src/index.ts) imports the named exports. Plain ES2020 in five modules (this one
// re-exports the others): palette.js (colours, theme), store.js (frames folded into a store),
// draw.js (the canvases), text.js (gauges, legends, style). No build step: the labextension's
// bundler follows the imports, and the widget's Python side inlines them (widgets/esm.py).

import { COLORS, MODES, colorOf, css, tenantColor, themeOf } from "./palette.js";
import { applyFrame, createStore, resyncGate, tenantNames } from "./store.js";
import { drawBlocks, drawSparkline, layout } from "./draw.js";
import { describe, ensureStyle, escapeHtml, gaugeRows, sparkLabel, swatch, tenantLegend, tenantRows } from "./text.js";

export * from "./palette.js";
export * from "./store.js";
export * from "./draw.js";
export * from "./text.js";

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
    <div class="pkv-tenants"></div><canvas class="pkv-blocks"></canvas><div class="pkv-hover"></div><div class="pkv-why"></div>
    <div class="pkv-spark-row"><canvas class="pkv-spark" width="240" height="28" role="img"></canvas><span
    class="pkv-spark-label"></span></div><div class="pkv-keys"><span class="pkv-mode"
    role="group" aria-label="colour blocks by">colour by <button type="button" data-mode="state">state</button><button
    type="button" data-mode="tenant">tenant</button></span><div class="pkv-legend"></div></div>`;
  el.appendChild(root);
  const q = (sel) => root.querySelector(sel);
  const title = q(".pkv-title"), bar = q(".pkv-bar"), gauges = q(".pkv-gauges");
  const blocks = q(".pkv-blocks"), hover = q(".pkv-hover"), spark = q(".pkv-spark"), legend = q(".pkv-legend");
  const sparkText = q(".pkv-spark-label"), whyBox = q(".pkv-why");
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
    whyBox.textContent = d.why;   // why the hovered request's prompt hit the prefix cache or not
    const next = new Set();
    if (d.owner) for (const [b, owners] of store.owners) if (owners.includes(d.owner)) next.add(b);
    if (next.size || (highlight && highlight.size)) {
      highlight = next;
      schedule();
    }
  });
  blocks.addEventListener("mouseleave", () => {
    hover.textContent = "";
    whyBox.textContent = "";
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
    const gate = resyncGate();
    const onBase = () => {
      gate.reset();
      view.apply(model.get("base"));
    };
    const onFrame = () => {
      if (view.apply(model.get("frame")) === "gap" && gate.want(performance.now())) model.send({ request: "resync" });
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
