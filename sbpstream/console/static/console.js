// sbpstream web console: reads the PM's /v1 JSON and renders it. No framework, no build step.
// Every value from the cluster goes into the page through textContent (el()), never innerHTML:
// a record value holding HTML or script is shown as text.
// With auth on, the server answers 401 until the user logs in: the login form POSTs the user and
// password to /v1/login (HTTPS), which answers a bearer token. The token is kept in this page's
// memory only (no localStorage, no cookie): a reload or its expiry asks for the password again.
"use strict";

const REFRESH_MS = 1000;
const RATE_POINTS = 120;          // points kept for a stream's rate chart (two minutes at 1 s)
const TAIL_RECORDS = 20;          // latest records shown on a stream page
let timer = null;
let history = { stream: null, points: [] };
let session = null;               // { token, principal }: in memory only

class LoginNeeded extends Error {}
class Forbidden extends Error {}

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function link(href, text) {
  const a = el("a", text);
  a.href = href;
  return a;
}

function fmtBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}

function table(headers, rows, id) {
  const t = el("table");
  if (id) t.id = id;
  const hr = el("tr");
  headers.forEach(h => hr.appendChild(el("th", h)));
  t.appendChild(hr);
  rows.forEach(r => {
    const tr = el("tr");
    r.forEach(c => {
      const td = el("td");
      if (c instanceof Node) td.appendChild(c);
      else { td.textContent = c === null || c === undefined ? "" : String(c);
             if (typeof c === "number") td.className = "num"; }
      tr.appendChild(td);
    });
    t.appendChild(tr);
  });
  return t;
}

async function reasonOf(r) {
  try { const b = await r.json(); return b.reason || b.error || ("HTTP " + r.status); }
  catch (e) { return "HTTP " + r.status; }
}

async function getJSON(path) {
  const headers = session ? { "Authorization": "Bearer " + session.token } : {};
  const r = await fetch(path, { cache: "no-store", headers: headers, credentials: "omit" });
  if (r.status === 401) { session = null; throw new LoginNeeded(await reasonOf(r)); }
  if (r.status === 403) throw new Forbidden(await reasonOf(r));
  if (!r.ok) throw new Error(path + ": HTTP " + r.status);
  return r.json();
}

// A part of a page the user may not see: its reason instead of its figures.
async function orForbidden(promise) {
  try { return await promise; }
  catch (e) { if (e instanceof Forbidden) return { forbidden: e.message }; throw e; }
}

function loginForm(view, reason) {
  const form = el("form");
  form.id = "login";
  form.appendChild(el("h2", "Log in"));
  if (reason) form.appendChild(el("p", reason, "empty"));
  const user = el("input"); user.id = "login-user"; user.autocomplete = "username";
  user.placeholder = "user";
  const pw = el("input"); pw.id = "login-password"; pw.type = "password";
  pw.autocomplete = "current-password"; pw.placeholder = "password";
  const go = el("button", "Log in"); go.type = "submit";
  const msg = el("p", "", "dead"); msg.id = "login-error";
  [user, pw, go, msg].forEach(x => form.appendChild(x));
  form.addEventListener("submit", async ev => {
    ev.preventDefault();
    msg.textContent = "";
    try {
      const r = await fetch("/v1/login", { method: "POST", cache: "no-store", credentials: "omit",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ user: user.value, password: pw.value }) });
      pw.value = "";
      if (!r.ok) { msg.textContent = await reasonOf(r); return; }
      const b = await r.json();
      session = { token: b.token, principal: b.principal };
      showUser();
      loop();
    } catch (e) { msg.textContent = e.message; }
  });
  view.replaceChildren(form);
  user.focus();
}

function showUser() {
  const who = document.getElementById("user");
  who.replaceChildren();
  if (!session) return;
  who.appendChild(el("span", session.principal + " "));
  const out = link("#/", "log out");
  out.id = "logout";
  out.addEventListener("click", ev => { ev.preventDefault(); session = null; showUser(); loop(); });
  who.appendChild(out);
}

function setStatus(text) { document.getElementById("status").textContent = text; }

async function overview(view) {
  const [nodes, streams] = await Promise.all([orForbidden(getJSON("/v1/nodes")),
                                             getJSON("/v1/streams?top=100")]);
  const frag = document.createDocumentFragment();
  frag.appendChild(el("h2", "Nodes"));
  if (nodes.forbidden) frag.appendChild(el("p", "not shown: " + nodes.forbidden, "empty"));
  else frag.appendChild(table(
    ["node", "address", "state", "last heartbeat (s)", "ranges", "writable", "primary",
     "append req/s", "disk in B/s", "disk free", "memory"],
    nodes.nodes.map(n => {
      const m = n.metrics || {};
      let state = n.live ? "live" : (n.dead ? "dead" : "silent");
      if (n.draining) state += n.ranges_left ? " draining (" + n.ranges_left + " left)" : " drained";
      return [n.node_id, n.address, el("span", state, n.live ? "live" : "dead"),
              n.last_heartbeat_s, n.ranges, n.writable_ranges, n.primary_ranges,
              m.network_append_rate ?? "", m.disk_in_rate ?? "",
              m.disk_free_space !== undefined ? fmtBytes(m.disk_free_space) : "",
              m.memory_used !== undefined ? fmtBytes(m.memory_used) : ""];
    }), "nodes"));
  frag.appendChild(el("h2", "Streams (top " + streams.streams.length + " by rate)"));
  frag.appendChild(table(
    ["stream", "replicas", "ranges", "start", "next", "records/min in", "bytes/min in",
     "records/min out", "size appended", "last append"],
    streams.streams.map(s => [link("#/stream/" + s.stream_id, String(s.stream_id)), s.replica_nums,
      s.ranges, s.start_offset, s.next_offset, s.per_minute.records_appended,
      fmtBytes(s.per_minute.bytes_appended), s.per_minute.records_fetched,
      fmtBytes(s.bytes_appended), s.last_append_ms ? new Date(s.last_append_ms).toISOString() : ""]),
    "streams"));
  if (!nodes.forbidden) {
    frag.appendChild(el("h2", "Under-replicated ranges"));
    if (nodes.under_replicated.length === 0) frag.appendChild(el("p", "none", "empty"));
    else frag.appendChild(table(["stream", "range", "replicas", "live", "wanted"],
      nodes.under_replicated.map(u => [u.stream_id, u.range_index, u.replicas.join(", "),
        u.live_replicas.join(", "), u.replica_nums]), "under"));
    frag.appendChild(el("h2", "Clients"));
    frag.appendChild(table(["id", "peer", "client id", "age (s)"],
      nodes.clients.map(c => [c.id, c.peer, c.client_id, c.age_s]), "clients"));
  }
  view.replaceChildren(frag);
}

function drawChart(canvas, points) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  const max = Math.max(1, ...points.map(p => p.rate));
  ctx.strokeStyle = "#ccc";
  ctx.beginPath(); ctx.moveTo(40, h - 20); ctx.lineTo(w, h - 20); ctx.stroke();
  ctx.fillStyle = "#555";
  ctx.font = "11px sans-serif";
  ctx.fillText(max.toFixed(0) + " rec/s", 2, 12);
  ctx.fillText("0", 2, h - 22);
  if (points.length < 2) return;
  ctx.strokeStyle = "#36c";
  ctx.lineWidth = 2;
  ctx.beginPath();
  points.forEach((p, i) => {
    const x = 40 + (w - 40) * i / (RATE_POINTS - 1);
    const y = (h - 20) - (h - 30) * p.rate / max;
    if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
  });
  ctx.stroke();
}

async function streamPage(view, sid) {
  const [s, tail] = await Promise.all([getJSON("/v1/streams/" + sid),
    orForbidden(getJSON("/v1/streams/" + sid + "/tail?n=" + TAIL_RECORDS))]);
  if (history.stream !== sid) history = { stream: sid, points: [] };
  const now = performance.now();
  const pts = history.points;
  const last = pts.length ? pts[pts.length - 1] : null;
  const rate = last ? Math.max(0, (s.records_appended - last.total) * 1000 / (now - last.t)) : 0;
  pts.push({ t: now, total: s.records_appended, rate: rate });
  while (pts.length > RATE_POINTS) pts.shift();

  const frag = document.createDocumentFragment();
  frag.appendChild(el("h2", "Stream " + s.stream_id));
  frag.appendChild(table(["replicas", "start", "next", "records appended", "bytes appended",
                          "records fetched", "records/min in", "retention (ms)"],
    [[s.replica_nums, s.start_offset, s.next_offset, s.records_appended, fmtBytes(s.bytes_appended),
      s.records_fetched, s.per_minute.records_appended, s.retention_period_ms]], "stream"));
  frag.appendChild(el("h2", "Append rate (records/s, sampled every second)"));
  const canvas = el("canvas");
  canvas.id = "rate";
  canvas.width = 640; canvas.height = 160;
  frag.appendChild(canvas);
  frag.appendChild(el("h2", "Ranges"));
  frag.appendChild(table(["range", "start", "next", "end", "replicas"],
    s.ranges.map(r => [r.range_index, r.start_offset, r.next_offset,
      r.writable ? "(writable)" : r.end_offset,
      r.replicas.map(x => x.node_id + (x.primary ? "*" : "") + (x.live ? "" : " (down)")).join(", ")]),
    "ranges"));
  frag.appendChild(el("h2", "Latest records"));
  if (tail.forbidden) frag.appendChild(el("p", "not shown: " + tail.forbidden, "empty"));
  if (tail.error) frag.appendChild(el("p", tail.error, "dead"));
  frag.appendChild(table(["offset", "time", "key", "value"],
    (tail.records || []).map(r => [r.offset, new Date(r.timestamp_ms).toISOString(),
      r.key === null ? "" : r.key, el("pre", r.value === null ? "" : r.value, "value")]), "tail"));
  view.replaceChildren(frag);
  drawChart(canvas, pts);
}

async function connectionsPage(view) {
  const c = await getJSON("/v1/connections");
  const frag = document.createDocumentFragment();
  frag.appendChild(el("h2", "Connections to the PM (" + c.connection_count + ")"));
  frag.appendChild(table(["id", "peer", "client id", "role", "age (s)", "bytes in", "bytes out",
                          "requests", "in flight", "subscriptions", "sessions", "throttle (ms)"],
    c.connections.map(x => [x.id, x.peer, x.client_id, x.client_role, x.age_s, x.bytes_in,
      x.bytes_out, x.requests, x.requests_in_flight, x.subscriptions, x.sessions,
      x.throttle_time_ms]), "connections"));
  view.replaceChildren(frag);
}

async function render() {
  const view = document.getElementById("view");
  const hash = location.hash || "#/";
  const m = hash.match(/^#\/stream\/(-?\d+)$/);
  try {
    if (m) await streamPage(view, m[1]);
    else if (hash === "#/connections") await connectionsPage(view);
    else await overview(view);
    setStatus("updated " + new Date().toLocaleTimeString());
    document.body.dataset.ready = "1";
  } catch (e) {
    if (e instanceof LoginNeeded) {
      clearTimeout(timer);
      timer = null;
      showUser();
      setStatus("login needed");
      loginForm(view, e.message);
      return false;
    }
    if (e instanceof Forbidden) view.replaceChildren(el("p", "not allowed: " + e.message, "dead"));
    setStatus("error: " + e.message);
  }
  return true;
}

function loop() {
  clearTimeout(timer);
  render().then(again => { if (again) timer = setTimeout(loop, REFRESH_MS); },
                () => { timer = setTimeout(loop, REFRESH_MS); });
}

window.addEventListener("hashchange", loop);
loop();
