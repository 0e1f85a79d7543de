// gpuguard's page: reads the daemon's own API (same origin only), draws SVG charts by hand
// (no library, no CDN: air-gapped hosts), refreshes every 2 s. Actions are POSTs with the
// bearer token typed in the page; nothing changes state from a GET.
"use strict";

const SVGNS = "http://www.w3.org/2000/svg";
const PALETTE = ["#0072b2", "#d55e00", "#009e73", "#cc79a7", "#e69f00", "#56b4e9", "#000000"];
const REFRESH_MS = 2000;

const state = {
  range: 900, hist: null, histOk: null, lastT: 0, live: {}, status: null, engines: null, incidents: null, pcie: null,
  profiles: null, config: null, events: [], lastEventT: 0, view: "gpus", pcieAt: 0,
};

function $(id) { return document.getElementById(id); }
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k === "text") e.textContent = v; else e.setAttribute(k, v);
  }
  for (const k of kids) if (k != null) e.append(k);
  return e;
}
function svg(tag, attrs) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  return e;
}
function fmt(v, digits) { return v == null ? "–" : Number(v).toFixed(digits || 0); }
function clock(t) { return new Date(t * 1000).toLocaleTimeString([], { hour12: false }); }
function setStatus(msg, bad) { const s = $("status"); s.textContent = msg; s.classList.toggle("bad", !!bad); }

async function getJSON(path) {
  const r = await fetch(path, { headers: authHeaders(), cache: "no-store" });
  if (!r.ok) { const err = new Error(`${path}: HTTP ${r.status}`); err.status = r.status; throw err; }
  return r.json();
}
function authHeaders() {
  const tok = sessionStorage.getItem("gpuguard-token");
  return tok ? { Authorization: "Bearer " + tok } : {};
}

// ---- charts -------------------------------------------------------------------------
function niceTicks(lo, hi, n) {
  const span = hi - lo;
  if (!(span > 0)) return [lo];
  const raw = span / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map(m => m * mag).find(s => s >= raw);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + 1e-9; v += step) out.push(+v.toFixed(10));
  return out;
}

// series: [{label, colour, t, v, dashed}]; limits: [{label, value, colour}]
function chart(title, unit, series, limits, t0, t1) {
  const W = 360, H = 150, L = 42, R = 8, T = 18, B = 20;
  const vals = [];
  for (const s of series) for (const v of s.v) if (v != null) vals.push(v);
  for (const l of limits || []) if (l.value != null) vals.push(l.value);
  let lo = Math.min(0, ...vals), hi = vals.length ? Math.max(...vals) : 1;
  if (hi - lo < 1e-9) hi = lo + 1;
  const yt = niceTicks(lo, hi * 1.05, 4);
  hi = Math.max(hi, yt[yt.length - 1]);
  const x = t => L + (t - t0) / ((t1 - t0) || 1) * (W - L - R);
  const y = v => H - B - (v - lo) / ((hi - lo) || 1) * (H - T - B);
  const root = svg("svg", { class: "chart", viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": title,
                            "data-title": title });
  root.append(svg("rect", { x: L, y: T, width: W - L - R, height: H - T - B, fill: "#fcfcfc", stroke: "#ddd" }));
  const tt = svg("text", { x: 4, y: 12, class: "title" }); tt.textContent = `${title} (${unit})`; root.append(tt);
  let lx = 14 + 6.5 * (title.length + unit.length + 3);
  for (const v of yt) {
    root.append(svg("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), stroke: "#eee" }));
    const t = svg("text", { x: L - 3, y: y(v) + 3, "text-anchor": "end", class: "ylabel" });
    t.textContent = Math.abs(v) >= 1e4 ? v.toExponential(1) : String(+v.toFixed(2)); root.append(t);
  }
  const span = t1 - t0;
  const step = [10, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200].find(s => span / s <= 5) || 21600;
  for (let t = Math.ceil(t0 / step) * step; t <= t1; t += step) {
    root.append(svg("line", { x1: x(t), x2: x(t), y1: T, y2: H - B, stroke: "#f0f0f0" }));
    const edge = x(t) > W - R - 24 ? "end" : x(t) < L + 24 ? "start" : "middle";
    const lab = svg("text", { x: x(t), y: H - 6, "text-anchor": edge, class: "xlabel" });
    lab.textContent = clock(t).slice(0, step >= 60 ? 5 : 8); root.append(lab);
  }
  let lxEnd = W - R - 2;
  for (const l of limits || []) {
    if (l.value == null) continue;
    root.append(svg("line", { x1: L, x2: W - R, y1: y(l.value), y2: y(l.value), stroke: l.colour || "#b00020",
                              "stroke-dasharray": "4,3", class: "limit", "data-label": l.label }));
    // limits often sit together (edge and junction crit): their labels side by side, not on top
    const t = svg("text", { x: lxEnd, y: y(l.value) + 10, "text-anchor": "end", fill: l.colour || "#b00020" });
    t.textContent = l.label;
    lxEnd -= 6 * l.label.length + 8;
    root.append(t);
  }
  for (const s of series) {
    let d = "", pen = false;
    for (let i = 0; i < s.t.length; i++) {
      const v = s.v[i];
      if (v == null || s.t[i] < t0) { pen = false; continue; }
      d += (pen ? "L" : "M") + x(s.t[i]).toFixed(1) + "," + y(v).toFixed(1);
      pen = true;
    }
    const p = svg("path", { d, fill: "none", stroke: s.colour, "stroke-width": 1.5, class: "series",
                           "data-label": s.label, "data-points": String(s.v.filter(v => v != null).length) });
    if (s.dashed) p.setAttribute("stroke-dasharray", "5,3");
    root.append(p);
    const lg = svg("text", { x: lx, y: 12, fill: s.colour }); lg.textContent = "— " + s.label; root.append(lg);
    lx += 18 + 6 * s.label.length;
  }
  return root;
}

// ---- data ---------------------------------------------------------------------------
function now() { return Date.now() / 1000; }

async function loadHistory(full) {
  const end = now();
  const since = full || !state.hist ? end - state.range : state.lastT + 0.001;
  let doc;
  try {
    doc = await getJSON(`/v1/history?since=${since}&until=${end}&points=300`);
    state.histOk = true;
  } catch (e) {
    if (e.status === 501) { state.histOk = false; return; }  // recorder off: sample live
    throw e;
  }
  if (full || !state.hist) { state.hist = { gpus: doc.gpus, engines: doc.engines }; state.events = doc.events; }
  else {
    for (const [kind, key] of [["gpus", "gpus"], ["engines", "engines"]]) {
      for (const [name, g] of Object.entries(doc[kind])) {
        const cur = state.hist[key][name];
        if (!cur) { state.hist[key][name] = g; continue; }
        for (const k of Object.keys(g)) if (Array.isArray(g[k])) cur[k].push(...g[k]);
      }
    }
    const seen = new Set(state.events.map(e => e.id));
    for (const e of doc.events) if (!seen.has(e.id)) state.events.push(e);
  }
  for (const group of [state.hist.gpus, state.hist.engines]) {
    for (const g of Object.values(group)) {
      const cut = g.t.findIndex(t => t >= end - state.range);
      if (cut > 0) for (const k of Object.keys(g)) if (Array.isArray(g[k])) g[k].splice(0, cut);
      if (g.t.length) state.lastT = Math.max(state.lastT, g.t[g.t.length - 1]);
    }
  }
  state.events = state.events.filter(e => e.time >= end - Math.max(state.range, 3600)).slice(-500);
}

function sampleLive(gpus) {
  // Without a recorder the page keeps what it saw since it was opened.
  if (!state.hist) state.hist = { gpus: {}, engines: {} };
  for (const g of gpus) {
    const h = state.hist.gpus[g.name] || (state.hist.gpus[g.name] = { bdf: g.bdf, t: [], up: [], power_w: [], cap_w: [],
      edge_c: [], junction_c: [], mem_c: [], sclk_hz: [], mclk_hz: [], fan_rpm: [], busy: [], vram_used: [] });
    const tc = g.temperatures_celsius || {};
    h.t.push(g.time); h.up.push(g.up ? 1 : 0); h.power_w.push(g.power_watts); h.cap_w.push(g.power_cap_watts);
    h.edge_c.push(tc.edge ?? null); h.junction_c.push(tc.junction ?? null); h.mem_c.push(tc.mem ?? null);
    h.sclk_hz.push((g.clocks_hz || {}).sclk ?? null); h.mclk_hz.push((g.clocks_hz || {}).mclk ?? null);
    h.fan_rpm.push(g.fan_rpm); h.busy.push(g.busy_ratio); h.vram_used.push(g.vram_used_bytes);
  }
}

async function loadLiveEvents() {
  const evs = await getJSON(`/v1/events?since=${state.lastEventT}`);
  for (const e of evs) if (e.time > state.lastEventT) state.events.push(e);
  if (evs.length) state.lastEventT = evs[evs.length - 1].time;
}

// ---- views --------------------------------------------------------------------------
// The time axis: the chosen range, or less when the history is younger than that (a
// daemon started a minute ago draws its minute across the whole width).
function axis() {
  const t1 = now();
  let first = Infinity;
  for (const group of [state.hist ? state.hist.gpus : {}, state.hist ? state.hist.engines : {}])
    for (const g of Object.values(group)) if (g.t.length) first = Math.min(first, g.t[0]);
  return [Math.max(t1 - state.range, Math.min(first - 5, t1 - 60)), t1];
}

function profileFor(gpu) {
  const entry = ((state.config || {}).gpus || []).find(g => g.name === gpu);
  const name = entry && entry.profile;
  const p = (state.profiles || []).find(p => p.name === name);
  return p ? { name, settings: p.settings || {} } : null;
}

function renderGpus() {
  const box = $("gpu-cards");
  const gpus = (state.status && state.status.gpus) || [];
  const [t0, t1] = axis();
  const frag = document.createDocumentFragment();
  for (const g of gpus) {
    const h = (state.hist && state.hist.gpus[g.name]) || { t: [] };
    const col = k => h[k] || [];
    const lim = g.temperature_limits_celsius || {};
    const prof = profileFor(g.name);
    const badge = g.up ? el("span", { class: "badge", text: "up" }) : el("span", { class: "badge bad", text: "DOWN" });
    const card = el("article", { class: "card gpu", "data-gpu": g.name },
      el("h2", {}, g.name, badge),
      el("div", { class: "meta", text: `${g.model} · ${g.bdf} · ${fmt(g.power_watts, 0)} W of ${fmt(g.power_cap_watts, 0)} W · ` +
        `VRAM ${fmt((g.vram_used_bytes || 0) / 2 ** 30, 1)}/${fmt((g.vram_total_bytes || 0) / 2 ** 30, 1)} GiB` +
        (prof ? ` · profile ${prof.name}` : "") }));
    const charts = el("div", { class: "charts" });
    charts.append(chart("power", "W", [
      { label: "power", colour: PALETTE[0], t: h.t, v: col("power_w") },
      { label: "cap", colour: PALETTE[1], t: h.t, v: col("cap_w"), dashed: true },
    ], prof && prof.settings.power_cap_w ? [{ label: `profile ${prof.settings.power_cap_w} W`, value: prof.settings.power_cap_w }] : [], t0, t1));
    charts.append(chart("temperature", "°C", [
      { label: "edge", colour: PALETTE[0], t: h.t, v: col("edge_c") },
      { label: "junction", colour: PALETTE[1], t: h.t, v: col("junction_c") },
      { label: "mem", colour: PALETTE[2], t: h.t, v: col("mem_c") },
    ], [["edge", PALETTE[0]], ["junction", PALETTE[1]], ["mem", PALETTE[2]]]
      .filter(([s]) => lim[`${s}/crit`] != null).map(([s, c]) => ({ label: `${s} crit`, value: lim[`${s}/crit`], colour: c })), t0, t1));
    const mhz = k => col(k).map(v => v == null ? null : v / 1e6);
    const clockLimits = [];
    if (prof && prof.settings.sclk_max_mhz) clockLimits.push({ label: `profile sclk ≤ ${prof.settings.sclk_max_mhz}`, value: prof.settings.sclk_max_mhz });
    charts.append(chart("clocks", "MHz", [
      { label: "sclk", colour: PALETTE[0], t: h.t, v: mhz("sclk_hz") },
      { label: "mclk", colour: PALETTE[1], t: h.t, v: mhz("mclk_hz") },
    ], clockLimits, t0, t1));
    charts.append(chart("fan", "rpm", [{ label: "fan", colour: PALETTE[0], t: h.t, v: col("fan_rpm") }], [], t0, t1));
    const total = g.vram_total_bytes || null;
    charts.append(chart("busy and VRAM", "%", [
      { label: "busy", colour: PALETTE[0], t: h.t, v: col("busy").map(v => v == null ? null : v * 100) },
      { label: "VRAM", colour: PALETTE[3], t: h.t, v: col("vram_used").map(v => v == null || !total ? null : 100 * v / total) },
    ], [], t0, t1));
    card.append(charts);
    frag.append(card);
  }
  if (!gpus.length) frag.append(el("p", { text: "no GPUs yet" }));
  box.replaceChildren(frag);
}

function reportLink(e) {
  if (!["alert", "critical"].includes(e.severity)) return null;
  if (state.histOk === false) return null;
  const href = e.id != null ? `/report?event=${e.id}` : `/report?at=${e.time}`;
  return el("a", { href, class: "report", target: "_blank", rel: "noopener", text: "report" });
}

function renderEvents() {
  const body = $("event-table").tBodies[0];
  const frag = document.createDocumentFragment();
  for (const e of [...state.events].reverse()) {
    const where = [e.gpu, e.engine].filter(Boolean).join(" ") || e.bdf || "";
    frag.append(el("tr", { class: e.severity, "data-kind": e.kind },
      el("td", { text: clock(e.time) }), el("td", { class: "sev", text: e.severity }), el("td", { text: e.kind }),
      el("td", { text: where }), el("td", { class: "msg", text: e.message }), el("td", {}, reportLink(e))));
  }
  if (!state.events.length) frag.append(el("tr", {}, el("td", { colspan: "6", text: "no events in this window" })));
  body.replaceChildren(frag);
}

function renderEngines() {
  const box = $("engine-box");
  const engines = state.engines || [];
  const frag = document.createDocumentFragment();
  const table = el("table", { id: "engine-table" }, el("thead", {}, el("tr", {},
    ...["engine", "state", "tokens/s", "no progress", "running", "waiting", "GPUs", ""].map(h => el("th", { text: h })))));
  const tb = el("tbody");
  for (const e of engines) {
    const kill = el("button", { class: "kill", "data-engine": e.name, text: "kill" });
    kill.addEventListener("click", () => act(`/v1/engines/${encodeURIComponent(e.name)}/kill`, {}, `kill ${e.name}`));
    tb.append(el("tr", { class: ["stalled", "unhealthy", "down"].includes(e.state) ? "alert" : "", "data-engine": e.name },
      el("td", { text: e.name }), el("td", { class: "sev", text: e.state }), el("td", { text: fmt(e.tokens_per_second, 1) }),
      el("td", { text: fmt(e.no_progress_seconds, 1) + " s" }), el("td", { text: fmt(e.requests_running) }),
      el("td", { text: fmt(e.requests_waiting) }), el("td", { text: (e.gpus || []).join(", ") }), el("td", {}, kill)));
  }
  table.append(tb);
  frag.append(table);
  const [t0, t1] = axis();
  const hist = (state.hist && state.hist.engines) || {};
  const names = Object.keys(hist).sort();
  if (names.length) {
    const charts = el("div", { class: "charts" });
    charts.append(chart("tokens/s", "tok/s", names.map((n, i) => ({ label: n, colour: PALETTE[i % 7], t: hist[n].t, v: hist[n].tokens_per_s })), [], t0, t1));
    charts.append(chart("no progress", "s", names.map((n, i) => ({ label: n, colour: PALETTE[i % 7], t: hist[n].t, v: hist[n].no_progress_s })), [], t0, t1));
    frag.append(charts);
  }
  if (!engines.length) frag.append(el("p", { text: "no engines configured (engines: in gpuguard.yaml)" }));
  if (state.incidents) frag.append(incidentTable(state.incidents));
  box.replaceChildren(frag);
}

// The evidence each stall (and kill) left under state_dir/incidents, newest first; the
// link renders the bundle as a report (the same as `gpuguard report --incident NAME`).
function incidentState(b) {
  if (!b.complete) return "writing";
  const abandoned = (b.notes || []).filter(n => n.includes("abandoned")).length;
  return abandoned ? `abandoned (${abandoned} part${abandoned > 1 ? "s" : ""})` : "complete";
}
function incidentTable(bundles) {
  const tb = el("tbody");
  for (const b of [...bundles].reverse()) {
    const link = el("a", { href: `/incident?name=${encodeURIComponent(b.name)}`, class: "report", target: "_blank",
      rel: "noopener", text: "report" });
    const st = incidentState(b);
    tb.append(el("tr", { "data-incident": b.name, class: st === "complete" ? "" : "warning" },
      el("td", { text: b.engine || "" }), el("td", { text: b.time != null ? clock(b.time) : b.name }),
      el("td", { text: b.reason || "" }), el("td", { class: "sev", text: st }), el("td", {}, link)));
  }
  if (!bundles.length) tb.append(el("tr", {}, el("td", { colspan: "5", text: "no incident bundles yet" })));
  return el("div", { class: "incidents" }, el("h2", { text: "Incident bundles" }),
    el("table", { id: "incident-table" }, el("thead", {}, el("tr", {},
      ...["engine", "time", "reason", "bundle", "report"].map(h => el("th", { text: h })))), tb));
}

function renderPcie() {
  const box = $("pcie-box");
  const doc = state.pcie;
  if (!doc) { box.replaceChildren(el("p", { text: "PCIe walk not available yet" })); return; }
  const names = {};
  for (const g of (state.status && state.status.gpus) || []) names[g.bdf] = g.name;
  const frag = document.createDocumentFragment();
  const cards = el("div", { class: "cards" });
  for (const g of doc.gpus || []) {
    const card = el("article", { class: "card pcie", "data-bdf": g.bdf }, el("h2", { text: `${names[g.bdf] || g.bdf} · ${g.bdf}` }));
    const n = g.narrowest;
    if (n) card.append(el("div", { class: "meta narrowest", text: `narrowest hop: ${n.upper} → ${n.lower}, ${fmt(n.bytes_per_second / 1e9, 2)} GB/s` +
      (n.limited_by ? ` (limited by ${n.limited_by})` : "") }));
    const list = el("ol", { class: "hops" });
    for (const h of g.hops || []) {
      const cls = "hop" + (h.narrowest ? " narrowest" : "") + (h.downgraded ? " downgraded" : "");
      list.append(el("li", { class: cls, text: `${h.bdf} ${h.role} ${h.current_speed_gts ?? "?"}/${h.max_speed_gts ?? "?"} GT/s ` +
        `x${h.current_width ?? "?"}/x${h.max_width ?? "?"}${h.downgraded ? " DOWNGRADED" : ""}${h.narrowest ? " ← narrowest" : ""}` }));
    }
    card.append(list);
    const mine = (doc.findings || []).filter(f => (f.where || "").startsWith(g.bdf));
    const fl = el("ul", { class: "findings" });
    for (const f of mine) fl.append(el("li", { class: "finding " + f.level, text: `${f.level} ${f.check}: ${f.what}${f.todo ? " — " + f.todo : ""}` }));
    card.append(fl);
    cards.append(card);
  }
  frag.append(cards);
  const pairs = el("ul", { class: "pairs" });
  for (const p of doc.pairs || []) pairs.append(el("li", { text: `${names[p.a] || p.a} ↔ ${names[p.b] || p.b}: ${p.verdict}` }));
  frag.append(el("h2", { text: "GPU pairs" }), pairs);
  box.replaceChildren(frag);
}

function renderProfiles() {
  const box = $("profile-box");
  const st = (state.status && state.status.profiles) || {};
  const results = st.gpus || {};
  const frag = document.createDocumentFragment();
  if (st.safe_mode) frag.append(el("p", { class: "summary bad", text: `safe mode: ${JSON.stringify(st.safe_mode)}` }));
  if (st.wait) frag.append(el("p", { class: "meta", text: st.wait }));
  const table = el("table", { id: "profile-table" }, el("thead", {}, el("tr", {},
    ...["GPU", "profile", "verified", "detail", "actions"].map(h => el("th", { text: h })))));
  const tb = el("tbody");
  for (const g of (state.status && state.status.gpus) || []) {
    const r = results[g.name] || {};
    const prof = profileFor(g.name);
    const sel = el("select", { "data-gpu": g.name });
    for (const p of state.profiles || []) sel.append(el("option", { value: p.name, text: p.name }));
    if (prof) sel.value = prof.name;
    const apply = el("button", { text: "apply" });
    apply.addEventListener("click", () => act(`/v1/gpus/${encodeURIComponent(g.name)}/apply`, { profile: sel.value }, `apply ${sel.value} to ${g.name}`));
    const reset = el("button", { text: "reset to stock" });
    reset.addEventListener("click", () => act(`/v1/gpus/${encodeURIComponent(g.name)}/reset`, {}, `reset ${g.name}`));
    const verified = r.verified === true ? "yes" : r.verified === false ? "NO" : "–";
    // expected vs read back, setting by setting: "Applied" means read back equal
    const expected = r.expected || (prof ? prof.settings : {});
    const values = Object.entries(expected).map(([k, v]) => {
      const got = r.readback ? r.readback[k] : undefined;
      return got === undefined ? `${k} ${v}` : got === v ? `${k} ${v} ✓` : `${k} ${v} ≠ ${got}`;
    }).join(", ");
    const detail = el("td", { class: "msg" }, el("div", { text: [r.message, ...(r.errors || [])].filter(Boolean).join("; ") || "not applied" }),
      el("div", { text: values }));
    if (r.written && r.written.length) detail.append(el("details", {}, el("summary", { text: `${r.written.length} writes` }),
      el("div", { text: r.written.join(" · ") })));
    tb.append(el("tr", { class: r.verified === false ? "alert" : "" }, el("td", { text: g.name }),
      el("td", { text: r.profile || (prof ? prof.name : "–") }), el("td", { class: "sev", text: verified }),
      detail, el("td", {}, sel, apply, reset)));
  }
  table.append(tb);
  frag.append(table);
  for (const f of st.findings || []) frag.append(el("p", { class: "finding WARN", text: f }));
  box.replaceChildren(frag);
}

async function act(path, body, what) {
  const tok = sessionStorage.getItem("gpuguard-token");
  if (!tok) { setStatus(`${what}: type an API token under "actions" first`, true); $("tokenbox").open = true; return; }
  if (!window.confirm(`${what}?`)) return;
  const r = await fetch(path, { method: "POST", headers: { "Content-Type": "application/json", ...authHeaders() },
                                body: JSON.stringify({ ...body, reason: "from the gpuguard page" }) });
  const doc = await r.json().catch(() => ({}));
  setStatus(r.ok ? `${what}: done` : `${what}: HTTP ${r.status} ${typeof doc.detail === "string" ? doc.detail : ""}`, !r.ok);
}

function render() {
  const s = state.status;
  if (s) { $("summary").textContent = s.summary; $("summary").classList.toggle("bad", /down|stalled|unverified/.test(s.summary)); }
  ({ gpus: renderGpus, events: renderEvents, engines: renderEngines, pcie: renderPcie, profiles: renderProfiles })[state.view]();
}

function showView() {
  const v = (location.hash || "#gpus").slice(1);
  state.view = ["gpus", "events", "engines", "pcie", "profiles"].includes(v) ? v : "gpus";
  for (const sec of document.querySelectorAll("section.view")) sec.hidden = sec.id !== "view-" + state.view;
  for (const a of document.querySelectorAll("#nav a")) a.classList.toggle("active", a.dataset.view === state.view);
  render();
}

async function refresh(full) {
  try {
    const optional = p => getJSON(p).catch(e => (e.status === 501 || e.status === 503 ? null : Promise.reject(e)));
    // every read at once: the first paint waits for the slowest, not for their sum
    const wantConfig = full || !state.config, wantPcie = full || now() - state.pcieAt > 10;
    const [status, engines, config, profiles, pcie, , incidents] = await Promise.all([
      getJSON("/v1/status"), optional("/v1/engines"),
      wantConfig ? optional("/v1/config") : state.config, wantConfig ? optional("/v1/profiles") : state.profiles,
      wantPcie ? optional("/v1/pcie") : state.pcie,
      state.histOk !== false ? loadHistory(full) : null,
      optional("/v1/incidents"),
    ]);
    Object.assign(state, { status, engines, config, profiles, pcie, incidents });
    if (wantPcie) state.pcieAt = now();
    if (state.histOk === false) { sampleLive(status.gpus); await loadLiveEvents(); }
    setStatus(`updated ${clock(now())}`);
    performance.mark("gpuguard-data");
  } catch (e) {
    setStatus(`cannot reach gpuguard: ${e.message}`, true);
  }
  render();
  if (!document.body.dataset.loaded) { performance.mark("gpuguard-drawn"); document.body.dataset.loaded = "1"; }
}

function main() {
  // ?range=3600 opens the page on that range (links, bookmarks, the page-load benchmark)
  const asked = +new URLSearchParams(location.search).get("range");
  if (asked > 0) {
    state.range = asked;
    if (![...$("range").options].some(o => +o.value === asked)) $("range").append(el("option", { value: String(asked), text: `${asked} s` }));
    $("range").value = String(asked);
  }
  $("range").addEventListener("change", () => { state.range = +$("range").value; state.hist = null; refresh(true); });
  const tok = $("token");
  tok.value = sessionStorage.getItem("gpuguard-token") || "";
  tok.addEventListener("change", () => sessionStorage.setItem("gpuguard-token", tok.value.trim()));
  $("tokenform").addEventListener("submit", ev => { ev.preventDefault(); sessionStorage.setItem("gpuguard-token", tok.value.trim()); });
  window.addEventListener("hashchange", showView);
  showView();
  refresh(true).then(() => setInterval(() => refresh(false), REFRESH_MS));
}

main();
