// kv-chunk-fs dashboard: plain JS, no build step. Data comes from the daemon's API through /api/.
"use strict";

const POLL_MS = 2000;
const PAGE_SIZE = 50;
const $ = (sel) => document.querySelector(sel);
const el = (tag, attrs = {}, ...kids) => {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const k of kids) e.append(k);
  return e;
};

// -- formatting --------------------------------------------------------------------------------

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let i = 0, v = Math.abs(n);
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (n < 0 ? "-" : "") + (i === 0 ? String(v) : v.toFixed(v < 10 ? 2 : 1)) + " " + units[i];
}
const num = (n) => (n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"));
function secs(s) {
  if (s === null || s === undefined) return "–";
  return s < 1 ? (s * 1000).toFixed(s < 0.01 ? 2 : 0) + " ms" : s.toFixed(2) + " s";
}
function ago(t) {
  if (!t) return "never";
  const d = Date.now() / 1000 - t;
  if (d < 0) return "in " + span(-d);
  return span(d) + " ago";
}
function span(d) {
  if (d < 90) return Math.round(d) + " s";
  if (d < 5400) return Math.round(d / 60) + " min";
  if (d < 172800) return (d / 3600).toFixed(1) + " h";
  return (d / 86400).toFixed(1) + " d";
}
function setVal(id, value, text) {  // data-value: the raw number, for the tests and for copying
  const e = document.getElementById(id);
  e.dataset.value = value === null || value === undefined ? "" : String(value);
  e.textContent = text;
}

// -- API -----------------------------------------------------------------------------------------

const state = { token: sessionStorage.getItem("kvcfs-token") || "", tokenRequired: false };

// The URL `kv-chunk-fs ui` prints carries the token (?token=...): keep it for this tab, then drop it
// from the address bar and the history.
function takeTokenFromUrl() {
  const url = new URL(location.href);
  const token = url.searchParams.get("token");
  if (!token) return;
  state.token = token;
  sessionStorage.setItem("kvcfs-token", token);
  url.searchParams.delete("token");
  history.replaceState(null, "", url.pathname + url.search + url.hash);
}
takeTokenFromUrl();

async function api(method, path, body) {
  const headers = {};
  if (state.token) headers["Authorization"] = "Bearer " + state.token;
  if (method !== "GET") headers["X-KVCFS-UI"] = "1";
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const r = await fetch("/api" + path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  if (r.status === 401) {
    await askToken("The dashboard needs the API token.");
    return api(method, path, body);
  }
  const type = r.headers.get("content-type") || "";
  const data = type.includes("json") ? await r.json() : await r.text();
  if (!r.ok) throw new Error((data && data.error) || r.status + " " + r.statusText);
  return data;
}

let tokenPrompt = null;
function askToken(message) {
  if (tokenPrompt) return tokenPrompt;  // one prompt for all requests waiting on it
  const input = el("input", { type: "password", id: "token-input", size: "40", autocomplete: "off" });
  tokenPrompt = dialog("API token", [el("p", {}, message, " (the URL kv-chunk-fs ui printed carries it, or api_token_file of the config)"), input], "Use token")
    .then((ok) => {
      tokenPrompt = null;
      if (!ok) throw new Error("no token given");
      state.token = input.value.trim();
      sessionStorage.setItem("kvcfs-token", state.token);
    });
  return tokenPrompt;
}

function dialog(title, bodyNodes, okText = "OK", danger = false) {
  const dlg = $("#dlg");
  $("#dlg-title").textContent = title;
  $("#dlg-body").replaceChildren(...bodyNodes);
  $("#dlg-ok").textContent = okText;
  $("#dlg-ok").className = danger ? "danger" : "";
  return new Promise((resolve) => {
    dlg.addEventListener("close", () => resolve(dlg.returnValue === "ok"), { once: true });
    dlg.returnValue = "";
    dlg.showModal();
    const input = dlg.querySelector("input");
    if (input) input.focus();
  });
}

function status(text, bad = false) {
  const s = $("#status");
  s.textContent = text;
  s.className = "status" + (bad ? " bad" : "");
}

// -- pages ---------------------------------------------------------------------------------------

const pages = {};
let current = null;

function show(name) {
  if (!pages[name]) name = "overview";
  current = name;
  for (const p of document.querySelectorAll(".page")) p.hidden = p.id !== "page-" + name;
  for (const a of document.querySelectorAll("#tabs a")) a.classList.toggle("active", a.dataset.page === name);
  pages[name].load().catch(report);
}

function report(e) { status(String(e.message || e), true); }

// -- overview ------------------------------------------------------------------------------------

let lastStats = null;
let lastChange = "";

pages.overview = {
  async load() { renderOverview(lastStats || (await api("GET", "/stats"))); await overviewExtras(); },
};

function renderOverview(s) {
  setVal("ov-snapshots", s.snapshots, num(s.snapshots));
  $("#ov-broken").textContent = s.broken ? s.broken + " broken" : "";
  setVal("ov-logical", s.logical_bytes, bytes(s.logical_bytes));
  setVal("ov-stored", s.stored_bytes, bytes(s.stored_bytes));
  $("#ov-chunks").textContent = num(s.chunks) + " chunks";
  setVal("ov-dedup", s.dedup_ratio, s.dedup_ratio.toFixed(2) + "×");
  const saved = Math.max(0, s.logical_bytes - s.stored_bytes);
  setVal("ov-saved", saved, bytes(saved) + " saved");
  setVal("ov-packs", s.packs, num(s.packs));
  setVal("ov-pack-bytes", s.pack_bytes, bytes(s.pack_bytes) + " on disk");
  const dead = Math.max(0, s.pack_bytes - s.stored_bytes);
  setVal("ov-dead", dead, bytes(dead));
  const garbage = Math.max(0, s.stored_bytes - s.referenced_bytes);
  setVal("ov-garbage", garbage, "in packs, + " + bytes(garbage) + " collectable");
  const c = s.counters || {};
  setVal("ov-saves", c.saves, num(c.saves));
  setVal("ov-restores", c.restores, num(c.restores));
  const putBacks = (c.restores_to_memory || 0) + (c.restores_to_disk || 0);
  setVal("ov-cache", putBacks, num(putBacks));
  $("#ov-cache-sub").textContent = num(c.restores_to_memory) + " into memory, " + num(c.restores_to_disk) + " on disk";
  if (c.hot_budget !== undefined) {
    setVal("ov-hot", c.hot_bytes, bytes(c.hot_bytes) + " of " + bytes(c.hot_budget));
    $("#ov-hot-sub").textContent = num(c.hot_files) + " copies · " + num(c.hot_hits) + " hits, " + num(c.hot_misses) +
      " misses · " + num(c.hot_evictions) + " evicted" +
      (c.tier_size !== undefined ? " · memory tier " + bytes((c.staged_bytes || 0) + c.hot_bytes) + " of " +
        bytes(c.tier_size) + (c.memory_short ? " · memory short" : "") : "");
    setVal("ov-ingest", c.ingest_queue_bytes, bytes(c.ingest_queue_bytes));
    $("#ov-ingest-sub").textContent = num(c.ingest_queue) + " saves queued · " + num(c.ingest_waits) + " closes waited";
  } else {
    $("#ov-hot").textContent = "–";
    $("#ov-hot-sub").textContent = "not mounted";
    $("#ov-ingest").textContent = "–";
    $("#ov-ingest-sub").textContent = "not mounted";
  }
  const gc = s.gc || {};
  const last = gc.last;
  const parts = [
    num(gc.runs) + (gc.runs === 1 ? " run" : " runs") + " since start" + (gc.idle_skips ? " (+" + num(gc.idle_skips) + " skipped: store unchanged)" : ""),
    "last: " + (gc.last_finished ? ago(gc.last_finished) : "never"),
    "next: " + (gc.next_due ? ago(gc.next_due) : "–"),
  ];
  if (last) parts.push("last freed " + bytes(last.bytes_freed) + " (" + bytes(last.disk_bytes_freed) + " on disk) in " + secs(last.duration_s));
  if (last && last.errors && last.errors.length) parts.push(last.errors.length + " errors");
  $("#ov-gc").textContent = parts.join(" · ");
}

async function overviewExtras() {
  const [hist, errors] = await Promise.all([api("GET", "/history"), api("GET", "/logs?level=error&limit=2000")]);
  const lat = (l) => (l.count ? "p50 " + secs(l.p50) + " · p90 " + secs(l.p90) + " · p99 " + secs(l.p99) : "no timings yet");
  $("#ov-save-lat").textContent = "save time (until stored): " + lat(hist.latency.save);
  $("#ov-close-lat").textContent = "close: " + lat(hist.latency.close);
  $("#ov-restore-lat").textContent = lat(hist.latency.restore);
  setVal("ov-errors", errors.count, num(errors.count));
  $("#ov-errors").classList.toggle("bad", errors.count > 0);
}

$("#gc-now").addEventListener("click", async () => {
  const b = $("#gc-now");
  b.disabled = true;
  $("#gc-result").textContent = "collecting…";
  try {
    const r = await api("POST", "/gc");
    $("#gc-result").textContent = "freed " + bytes(r.bytes_freed) + " (" + bytes(r.disk_bytes_freed) + " on disk) in " + secs(r.duration_s);
    await poll(true);
  } catch (e) {
    $("#gc-result").textContent = "failed: " + e.message;
  } finally {
    b.disabled = false;
  }
});

// Live: /stats every POLL_MS; a change (a save, a delete, a GC) refreshes the page shown.
async function poll(force = false) {
  try {
    const s = await api("GET", "/stats");
    lastStats = s;
    status("live · " + new Date().toLocaleTimeString());
    const c = s.counters || {};
    const key = [s.snapshots, s.logical_bytes, s.stored_bytes, c.saves, c.restores, s.gc && s.gc.runs].join("/");
    const changed = key !== lastChange;
    lastChange = key;
    if (current === "overview") { renderOverview(s); await overviewExtras(); }
    else if (current === "logs" && $("#log-follow").checked) await pages.logs.load();
    else if ((changed || force) && current !== "tree") await pages[current].load();
    else if (changed && current === "tree") await pages.tree.load();
  } catch (e) {
    report(e);
  }
}

// -- charts --------------------------------------------------------------------------------------

const charts = {};
pages.charts = {
  async load() {
    const h = await api("GET", "/history");
    drawCharts(h);
  },
};

function chartWidth() { return Math.max(400, Math.min(1100, document.body.clientWidth - 80)); }

function draw(id, opts, data) {
  if (charts[id]) { charts[id].setData(data); return; }
  charts[id] = new uPlot(Object.assign({ width: chartWidth(), height: 220 }, opts), data, document.getElementById(id));
}

const bytesAxis = { values: (u, vals) => vals.map((v) => bytes(v)), size: 80 };
const secsAxis = { values: (u, vals) => vals.map((v) => secs(v)), size: 70 };

// Time axis: wall-clock labels (HH:MM:SS; HH:MM over hours; the date too over days), never the
// sub-second ":57.150" uPlot picks for events a moment apart, over at least MIN_SPAN_S seconds.
const MIN_SPAN_S = 60;
const two = (n) => String(n).padStart(2, "0");
function timeLabel(t, span) {
  const d = new Date(t * 1000);
  const hm = two(d.getHours()) + ":" + two(d.getMinutes());
  if (span > 2 * 86400) return d.toLocaleDateString(undefined, { month: "short", day: "numeric" }) + " " + hm;
  return span > 3 * 3600 ? hm : hm + ":" + two(d.getSeconds());
}
const timeAxis = {
  values: (u, vals) => vals.map((v) => timeLabel(v, u.scales.x.max - u.scales.x.min)),
  space: 70,
};
const timeScale = {
  time: true,
  range: (u, min, max) => {
    if (min == null || max == null) { const now = Date.now() / 1000; return [now - MIN_SPAN_S, now]; }
    if (max - min >= MIN_SPAN_S) return [min, max];
    const mid = (min + max) / 2;
    return [mid - MIN_SPAN_S / 2, mid + MIN_SPAN_S / 2];
  },
};
// Whole seconds at least: ticks a second apart or more.
const timeIncrs = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800, 604800];

// What an empty chart, or an empty series, lacks: said next to its title.
function note(id, text) {
  const el = document.getElementById(id + "-note");
  el.textContent = text ? "(" + text + ")" : "";
  el.hidden = !text;
}

function timeChart(opts) {
  return Object.assign({ scales: { x: timeScale } }, opts, { axes: [Object.assign({ incrs: timeIncrs }, timeAxis), opts.axes[1]] });
}

window.addEventListener("resize", () => {
  for (const c of Object.values(charts)) c.setSize({ width: chartWidth(), height: 220 });
});

function drawCharts(h) {
  const sv = h.saves;
  $("#charts-empty").hidden = sv.time.length + h.restores.time.length + h.gc.time.length > 0;
  const dedup = sv.size.map((n, i) => Math.max(0, n - sv.new_bytes[i]));
  const bars = uPlot.paths && uPlot.paths.bars ? uPlot.paths.bars({ size: [0.6, 40] }) : undefined;
  note("chart-bytes", sv.time.length ? "" : "no saves yet");
  draw("chart-bytes", timeChart({
    series: [{}, { label: "new", stroke: "#d9534f", fill: "rgba(217,83,79,0.5)", paths: bars, value: (u, v) => bytes(v) },
      { label: "deduplicated", stroke: "#5cb85c", fill: "rgba(92,184,92,0.4)", paths: bars, value: (u, v) => bytes(v) }],
    axes: [{}, bytesAxis],
  }), [sv.time, sv.new_bytes, dedup]);

  // saves and restores on one time axis (null where the other kind happened)
  const rs = h.restores;
  const times = [...sv.time.map((t, i) => [t, sv.seconds[i], null]), ...rs.time.map((t, i) => [t, null, rs.seconds[i]])]
    .sort((a, b) => a[0] - b[0]);
  const missing = [sv.time.length ? "" : "saves", rs.time.length ? "" : "restores"].filter(Boolean);
  note("chart-durations", missing.length ? "no " + missing.join(" or ") + " yet" : "");
  draw("chart-durations", timeChart({
    series: [{}, { label: "save", stroke: "#337ab7", points: { show: true }, spanGaps: true, value: (u, v) => secs(v) },
      { label: "restore", stroke: "#f0ad4e", points: { show: true }, spanGaps: true, value: (u, v) => secs(v) }],
    axes: [{}, secsAxis],
  }), [times.map((r) => r[0]), times.map((r) => r[1]), times.map((r) => r[2])]);

  const gc = h.gc;
  const store = [...sv.time.map((t, i) => [t, sv.store_bytes[i]]), ...gc.time.map((t, i) => [t, gc.store_bytes[i]])]
    .filter((r) => r[1] !== null).sort((a, b) => a[0] - b[0]);
  note("chart-store", store.length ? "" : "no saves or GC runs yet: the size now");
  if (lastStats) store.push([Date.now() / 1000, lastStats.stored_bytes]);  // now, also when nothing happened yet
  draw("chart-store", timeChart({
    series: [{}, { label: "chunk bytes", stroke: "#6f42c1", fill: "rgba(111,66,193,0.15)", value: (u, v) => bytes(v) }],
    axes: [{}, bytesAxis],
  }), [store.map((r) => r[0]), store.map((r) => r[1])]);
}

// -- snapshots -----------------------------------------------------------------------------------

const table = { sort: "path", order: "asc", offset: 0, prefix: "", label: "", total: 0, rows: [], selected: new Map() };

pages.snapshots = { load: loadSnapshots };

function tableQuery() {
  const q = new URLSearchParams({ sort: table.sort, order: table.order, limit: String(PAGE_SIZE), offset: String(table.offset) });
  if (table.prefix) q.set("prefix", table.prefix);
  if (table.label) {
    const [k, ...rest] = table.label.split("=");
    if (rest.length) q.set("label." + k.trim(), rest.join("=").trim());
    else q.set("has_label", k.trim());
  }
  return q.toString();
}

async function loadSnapshots() {
  const r = await api("GET", "/snapshots?" + tableQuery());
  table.total = r.total;
  if (table.offset >= r.total && r.total > 0) {  // the page emptied (deletes): back to the last one
    table.offset = Math.floor((r.total - 1) / PAGE_SIZE) * PAGE_SIZE;
    return loadSnapshots();
  }
  table.rows = r.snapshots;
  renderTable();
}

function renderTable() {
  const tbody = $("#snap-table tbody");
  const rows = table.rows.map((s) => {
    const box = el("input", { type: "checkbox", class: "sel" });
    box.checked = table.selected.has(s.path);
    box.addEventListener("change", () => { box.checked ? table.selected.set(s.path, s) : table.selected.delete(s.path); updateSelection(); });
    const total = Math.max(1, s.unique_bytes + s.shared_bytes);
    const bar = el("div", { class: "bar", title: bytes(s.unique_bytes) + " unique, " + bytes(s.shared_bytes) + " shared" },
      el("span", { class: "u", style: "width:" + (100 * s.unique_bytes / total).toFixed(1) + "%" }),
      el("span", { class: "s", style: "width:" + (100 * s.shared_bytes / total).toFixed(1) + "%" }));
    const labels = el("td", { class: "labels" }, ...Object.entries(s.labels || {}).map(([k, v]) => el("span", { class: "chip" }, k + "=" + v)));
    const edit = el("button", { class: "link", title: "edit labels" }, "✎");
    edit.addEventListener("click", () => editLabels(s).catch(report));
    const del = el("button", { class: "link danger", title: "delete" }, "✕");
    del.addEventListener("click", () => confirmDelete([s]).catch(report));
    return el("tr", { "data-path": s.path },
      el("td", {}, box),
      el("td", { class: "path" + (s.error || s.broken ? " broken" : ""), title: s.error || (s.broken ? "broken (cannot be read in full): " + s.broken + " — `kv-chunk-fs fsck` says what to do" : s.path) },
        s.path + (s.error ? " ⚠" : s.broken ? " ⚠ broken" : "")),
      el("td", { class: "num", "data-value": String(s.size) }, bytes(s.size)),
      el("td", {}, bar, el("small", {}, bytes(s.unique_bytes) + " / " + bytes(s.shared_bytes))),
      el("td", { class: "num" }, num(s.use_count)),
      el("td", { title: s.last_use ? new Date(s.last_use * 1000).toISOString() : "" }, ago(s.last_use)),
      el("td", { class: "num", "data-value": String(s.score) }, Number(s.score).toPrecision(3)),
      labels,
      el("td", { class: "actions" }, edit, del));
  });
  tbody.replaceChildren(...rows);
  if (!rows.length) tbody.append(el("tr", {}, el("td", { colspan: "9", class: "empty" }, "no snapshots match")));
  for (const th of document.querySelectorAll("#snap-table th[data-sort]")) {
    th.classList.toggle("sorted", th.dataset.sort === table.sort);
    th.dataset.arrow = th.dataset.sort === table.sort ? (table.order === "asc" ? "▲" : "▼") : "";
  }
  const first = table.total ? table.offset + 1 : 0;
  $("#pager-info").textContent = first + "–" + (table.offset + table.rows.length) + " of " + num(table.total);
  $("#pg-prev").disabled = table.offset === 0;
  $("#pg-next").disabled = table.offset + PAGE_SIZE >= table.total;
  $("#sel-page").checked = table.rows.length > 0 && table.rows.every((s) => table.selected.has(s.path));
  updateSelection();
}

let previewSeq = 0;
async function updateSelection() {
  const n = table.selected.size;
  $("#selection").hidden = n === 0;
  if (!n) return;
  const seq = ++previewSeq;
  const sum = [...table.selected.values()].reduce((a, s) => a + s.size, 0);
  $("#sel-info").textContent = n + " selected (" + bytes(sum) + ") · computing what deleting them frees…";
  const p = await api("POST", "/deletion-preview", { paths: [...table.selected.keys()] });
  if (seq !== previewSeq) return;  // a newer selection is being computed
  const info = $("#sel-info");
  info.dataset.freed = String(p.freed_bytes);
  info.textContent = n + " selected (" + bytes(sum) + ") · deleting them together frees " + bytes(p.freed_bytes) + " at the next GC";
}

async function confirmDelete(rows) {
  const p = await api("POST", "/deletion-preview", { paths: rows.map((s) => s.path) });
  const list = el("ul", { class: "dlg-list" }, ...rows.slice(0, 12).map((s) => el("li", {}, s.path)));
  if (rows.length > 12) list.append(el("li", {}, "… and " + (rows.length - 12) + " more"));
  const ok = await dialog("Delete " + rows.length + " snapshot" + (rows.length > 1 ? "s" : "") + "?",
    [list, el("p", {}, "Frees " + bytes(p.freed_bytes) + " at the next GC. This cannot be undone.")], "Delete", true);
  if (!ok) return;
  const failed = [];
  for (const s of rows) {
    try { await api("DELETE", "/snapshots/" + encodePath(s)); table.selected.delete(s.path); }
    catch (e) { failed.push(s.path + ": " + e.message); }
  }
  if (failed.length) status("delete failed: " + failed.join("; "), true);
  await loadSnapshots();
}

async function editLabels(s) {
  const input = el("input", { id: "labels-input", size: "50", value: Object.entries(s.labels || {}).map(([k, v]) => k + "=" + v).join(", ") });
  const ok = await dialog("Labels of " + s.path, [el("p", {}, "key=value pairs, comma-separated; remove one to drop it."), input], "Save");
  if (!ok) return;
  const wanted = {};
  for (const part of input.value.split(",")) {
    const [k, ...rest] = part.split("=");
    if (k.trim()) wanted[k.trim()] = rest.join("=").trim();
  }
  const changes = Object.assign({}, wanted);
  for (const k of Object.keys(s.labels || {})) if (!(k in wanted)) changes[k] = null;
  await api("PATCH", "/snapshots/" + encodePath(s), { labels: changes });
  await loadSnapshots();
}

function encodePath(s) {  // a name that is not UTF-8 is named by its exact bytes (path_b64)
  if (s.path_b64) {
    return [...atob(s.path_b64)].map((c) => (c === "/" ? "/" : "%" + c.charCodeAt(0).toString(16).padStart(2, "0"))).join("");
  }
  return s.path.split("/").map(encodeURIComponent).join("/");
}

for (const th of document.querySelectorAll("#snap-table th[data-sort]")) {
  th.addEventListener("click", () => {
    const f = th.dataset.sort;
    if (table.sort === f) table.order = table.order === "asc" ? "desc" : "asc";
    else { table.sort = f; table.order = f === "path" ? "asc" : "desc"; }
    table.offset = 0;
    loadSnapshots().catch(report);
  });
}
function applyFilter() {
  table.prefix = $("#f-prefix").value.trim();
  table.label = $("#f-label").value.trim();
  table.offset = 0;
  loadSnapshots().catch(report);
}
$("#f-apply").addEventListener("click", applyFilter);
for (const id of ["#f-prefix", "#f-label"]) $(id).addEventListener("keydown", (e) => { if (e.key === "Enter") applyFilter(); });
$("#pg-prev").addEventListener("click", () => { table.offset = Math.max(0, table.offset - PAGE_SIZE); loadSnapshots().catch(report); });
$("#pg-next").addEventListener("click", () => { table.offset += PAGE_SIZE; loadSnapshots().catch(report); });
$("#sel-page").addEventListener("change", (e) => {
  for (const s of table.rows) e.target.checked ? table.selected.set(s.path, s) : table.selected.delete(s.path);
  renderTable();
});
$("#sel-clear").addEventListener("click", () => { table.selected.clear(); renderTable(); });
$("#sel-delete").addEventListener("click", () => confirmDelete([...table.selected.values()]).catch(report));

// -- prefix tree ---------------------------------------------------------------------------------

let treeKey = "";
pages.tree = {
  async load() {
    if (!$("#tree").childElementCount) $("#tree").textContent = "reading the snapshots' token prefixes…";
    const t = await api("GET", "/prefix-tree");
    // Redrawn only when the tree itself changed: a GC run or a restore elsewhere must not collapse
    // what the user expanded (nor swap the nodes under a click).
    const key = JSON.stringify([t.snapshots, t.tree]);
    if (key === treeKey && $("#tree").childElementCount) return;  // keep what is expanded
    treeKey = key;
    const root = t.tree;
    const maxDepth = Math.max(1, deepest(root));
    const box = $("#tree");
    box.replaceChildren(treeNode(root, maxDepth, true));
    if (t.skipped && t.skipped.length) box.append(el("p", { class: "hint" }, t.skipped.length + " snapshots without a token prefix (not llama.cpp state files)"));
  },
};

function deepest(n) {
  let best = n.prefix_tokens, stack = [n];
  while (stack.length) { const c = stack.pop(); best = Math.max(best, c.prefix_tokens); stack.push(...c.children); }
  return best;
}

function treeNode(n, maxDepth, isRoot = false) {
  const li = el("div", { class: "tnode" });
  const kids = el("div", { class: "tkids" });
  const open = isRoot;  // collapsed below the root: a 10,000-snapshot tree stays small
  const toggle = el("span", { class: "toggle" }, n.children.length ? (open ? "▾" : "▸") : "·");
  const start = 100 * (n.prefix_tokens - n.edge_tokens) / maxDepth;
  const width = Math.max(0.5, 100 * n.edge_tokens / maxDepth);
  const bar = el("div", { class: "tbar" }, el("span", { style: "margin-left:" + start.toFixed(2) + "%;width:" + width.toFixed(2) + "%" }));
  const label = isRoot
    ? "all snapshots (" + num(n.shared_count) + ")"
    : "+" + num(n.edge_tokens) + " tokens → " + num(n.prefix_tokens) + " · shared by " + num(n.shared_count)
      + (n.children.length ? " · " + n.children.length + " branch" + (n.children.length > 1 ? "es" : "") : "")
      + (n.ends_here.length ? " · ends: " + n.ends_here.slice(0, 2).join(", ") + (n.ends_here.length > 2 ? " …" : "") : "");
  const row = el("div", { class: "trow", "data-prefix": String(n.prefix_tokens), "data-shared": String(n.shared_count) }, toggle, el("span", { class: "tlabel" }, label), bar);
  let built = false;
  const expand = (on) => {
    if (on && !built) { kids.replaceChildren(...n.children.map((c) => treeNode(c, maxDepth))); built = true; }
    kids.hidden = !on;
    toggle.textContent = n.children.length ? (on ? "▾" : "▸") : "·";
  };
  toggle.addEventListener("click", (e) => { e.stopPropagation(); expand(kids.hidden); });
  row.addEventListener("click", () => {
    for (const r of document.querySelectorAll(".trow.picked")) r.classList.remove("picked");
    row.classList.add("picked");
    treeDetail(n);
  });
  expand(open);
  li.append(row, kids);
  return li;
}

function treeDetail(n) {
  const d = $("#tree-detail");
  // Each name is in the ends_here of the node its tokens end at: collect them below this node.
  const names = [], stack = [n];
  while (stack.length) { const c = stack.pop(); names.push(...c.ends_here); stack.push(...c.children); }
  names.sort();
  const ends = new Set(n.ends_here);
  const shown = names.slice(0, 500);
  d.replaceChildren(
    el("h3", {}, num(n.prefix_tokens) + " tokens shared by " + num(names.length) + " snapshot" + (names.length === 1 ? "" : "s")),
    el("p", { class: "hint" }, "first tokens of this run: " + n.first_tokens.join(" ") + (n.edge_tokens > n.first_tokens.length ? " …" : "")),
    el("ul", { class: "tree-list" }, ...shown.map((p) => el("li", { class: ends.has(p) ? "ends" : "" }, p))),
    names.length > shown.length ? el("p", {}, "… and " + (names.length - shown.length) + " more") : "");
}

// -- logs ----------------------------------------------------------------------------------------

pages.logs = {
  async load() {
    const r = await api("GET", "/logs?level=" + $("#log-level").value + "&limit=2000");
    const box = $("#log-box");
    const atBottom = box.scrollTop + box.clientHeight >= box.scrollHeight - 20;
    $("#log-table tbody").replaceChildren(...r.lines.map((l) => el("tr", { class: "lvl-" + l.level },
      el("td", { class: "time" }, new Date(l.time * 1000).toLocaleTimeString()),
      el("td", { class: "level" }, l.level), el("td", { class: "logger" }, l.logger), el("td", {}, l.message))));
    $("#log-count").textContent = r.count + " lines";
    if ($("#log-follow").checked && (atBottom || !box.dataset.seen)) box.scrollTop = box.scrollHeight;
    box.dataset.seen = "1";
  },
};
$("#log-level").addEventListener("change", () => pages.logs.load().catch(report));

// -- start ---------------------------------------------------------------------------------------

async function start() {
  const cfg = await (await fetch("/ui-config")).json();
  state.tokenRequired = cfg.token_required;
  if (cfg.token_required && !state.token) await askToken("This dashboard is protected by the API token.");
  window.addEventListener("hashchange", () => show(location.hash.slice(1)));
  show(location.hash.slice(1) || "overview");
  setInterval(poll, POLL_MS);
  poll();
}
start().catch(report);
