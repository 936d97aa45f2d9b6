// idem console. Plain JavaScript, no build step, no dependencies.
//
// Every value from the database is put on the page with textContent (never
// innerHTML), so text such as an effect's last error shows as text whatever it
// holds: HTML, script tags, control characters (shown as \xNN).
"use strict";

const state = {
  session: null,
  cursors: { dead: "", stuck: "", groups: "" },
  pending: null, // the effect the confirmation dialog is about
  group: null, // the failure group shown
  action: null, // the failure action the confirmation dialog is about, with its dry run
  followed: null, // the retried effects being followed
  window: "hour", // the activity charts' window
};

// show makes any text visible as text: control characters become \xNN.
function show(s) {
  if (s === null || s === undefined || s === "") return "-";
  return String(s).replace(/[\u0000-\u0008\u000b-\u001f\u007f-\u009f]/g,
    (c) => "\\x" + c.charCodeAt(0).toString(16).padStart(2, "0"));
}

// el builds an element; children are elements or text (set as text nodes).
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    e.append(typeof c === "string" ? document.createTextNode(c) : c);
  }
  return e;
}

function td(text, cls) { return el("td", { class: cls || "", text: text }); }

// sharded reports whether the console reads a shard map: then every list shows
// the shard of each row (a merged failure group, its shards); a single-database
// console has no shard column at all.
function sharded() { return !!(state.session && state.session.shards && state.session.shards.length); }

function shardCell(shard) { return sharded() ? td(show(shard ? String(shard).split(",").join(", ") : ""), "shard") : null; }

// heads makes a table's header cells, the shard's first over a shard map.
function heads(names) {
  const cells = names.map((h) => el("th", { text: h }));
  if (sharded()) cells.unshift(el("th", { class: "shard", text: "Shard" }));
  return cells;
}

// emptyRow spans the whole width of the table whose body it goes in.
function emptyRow(body, text) {
  const cols = body.closest("table").tHead.rows[0].cells.length;
  return el("tr", {}, el("td", { colspan: String(cols), class: "empty", text }));
}

// present drops the null children (replaceChildren would write them as "null").
function present(...nodes) { return nodes.filter((n) => n !== null && n !== undefined); }

function fmtTime(iso) {
  if (!iso) return "-";
  const d = new Date(iso);
  if (isNaN(d)) return show(iso);
  return d.toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z");
}

function fmtAge(seconds) {
  let s = Math.max(0, Math.round(seconds));
  const d = Math.floor(s / 86400); s -= d * 86400;
  const h = Math.floor(s / 3600); s -= h * 3600;
  const m = Math.floor(s / 60); s -= m * 60;
  if (d > 0) return d + "d" + h + "h";
  if (h > 0) return h + "h" + m + "m";
  if (m > 0) return m + "m" + s + "s";
  return s + "s";
}

async function api(path, options) {
  const res = await fetch(path, Object.assign({ headers: { "Accept": "application/json" } }, options || {}));
  let body = null;
  try { body = await res.json(); } catch (e) { /* not JSON */ }
  if (!res.ok) {
    // Errors are RFC 9457 problem details: the text in "detail", the code in "code".
    const err = new Error((body && body.detail) || ("HTTP " + res.status));
    err.code = body && body.code;
    err.status = res.status;
    throw err;
  }
  return body;
}

function showError(err) {
  const p = document.getElementById("error");
  if (!err) { p.hidden = true; p.textContent = ""; return; }
  p.hidden = false;
  p.textContent = show(err.message || String(err));
}

function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== undefined && v !== null) q.set(k, v);
  return q.toString();
}

// --- stats ---

async function loadStats() {
  const s = await api("/api/stats");
  loadShards(s.shards || []);
  const kinds = document.querySelector("#effect-stats tbody");
  kinds.replaceChildren();
  for (const k of s.effects) {
    kinds.append(el("tr", { "data-kind": k.kind },
      td(show(k.kind)), td(String(k.pending), "num"), td(String(k.due), "num"),
      td(String(k.in_flight), "num"), td(String(k.stuck), "num"),
      td(String(k.dead), "num" + (k.dead > 0 ? " state-dead state" : "")), td(String(k.done), "num"),
      td(k.pending > 0 ? fmtAge(k.oldest_pending_age_seconds) : "-", "num")));
  }
  if (s.effects.length === 0) kinds.append(el("tr", {}, el("td", { colspan: "8", class: "empty", text: "no effects" })));
  const consumers = document.querySelector("#consumer-stats tbody");
  consumers.replaceChildren();
  for (const c of s.consumers) {
    consumers.append(el("tr", {},
      td(show(c.consumer)), td(String(c.rows), "num"), td(String(c.completed), "num"),
      td(String(c.failed), "num"), td(String(c.processing), "num"), td(String(c.expired), "num")));
  }
  if (s.consumers.length === 0) consumers.append(el("tr", {}, el("td", { colspan: "6", class: "empty", text: "no inbox rows" })));
  // The Failures page's filters suggest the consumers and kinds there are.
  document.getElementById("known-consumers").replaceChildren(...s.consumers.map((c) => el("option", { value: c.consumer })));
  document.getElementById("known-kinds").replaceChildren(...s.effects.map((k) => el("option", { value: k.kind })));
  document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
}

// Over a shard map: each shard's figures, and which one is down.
function loadShards(shards) {
  document.getElementById("shards-part").hidden = shards.length === 0;
  const body = document.querySelector("#shard-stats tbody");
  body.replaceChildren();
  const sum = (list, f) => list.reduce((n, x) => n + x[f], 0);
  for (const sh of shards) {
    const down = !!sh.error;
    body.append(el("tr", { "data-shard": sh.shard, class: down ? "shard-down" : "shard-up" },
      td(show(sh.shard)), td(show(sh.schema)),
      el("td", { class: down ? "state state-dead" : "state state-done", text: down ? "down: " + show(sh.error) : "up" }),
      td(down ? "-" : String(sum(sh.consumers, "rows")), "num"), td(down ? "-" : String(sum(sh.consumers, "failed")), "num"),
      td(down ? "-" : String(sum(sh.effects, "pending")), "num"), td(down ? "-" : String(sum(sh.effects, "dead")), "num")));
  }
}

// --- effects ---

function stateCell(s) { return el("td", { class: "state state-" + s, text: s }); }

function effectRow(e, opts) {
  const tr = el("tr", { class: "effect", "data-tenant": e.tenant, "data-kind": e.kind, "data-key": e.key });
  fillEffectRow(tr, e, opts);
  return tr;
}

function fillEffectRow(tr, e, opts) {
  tr.replaceChildren(...present(shardCell(e.shard),
    td(show(e.tenant)), td(show(e.kind)), td(show(e.key), "mono"), stateCell(e.state),
    td(e.attempts + "/" + e.max_attempts, "num"), td(fmtTime(e.created_at), "time"),
    td(show(e.last_error), "err")));
  if (opts.why) tr.append(td(show(e.stuck)));
  if (opts.requeue) {
    const cell = el("td");
    if (e.state === "dead" && state.session && !state.session.read_only) {
      cell.append(el("button", { type: "button", class: "requeue", text: "Requeue", onclick: () => confirmRequeue(e, tr, opts) }));
    }
    tr.append(cell);
  }
}

async function loadEffects(which, more) {
  const params = which === "dead" ? { state: "dead" } : { stuck: "1" };
  params.limit = "50";
  if (more) params.after = state.cursors[which];
  const page = await api("/api/effects?" + query(params));
  const body = document.querySelector("#" + which + " tbody");
  if (!more) body.replaceChildren();
  const opts = which === "dead" ? { requeue: true } : { why: true };
  for (const e of page.effects) body.append(effectRow(e, opts));
  if (!more && page.effects.length === 0) {
    body.append(emptyRow(body, "none"));
  }
  state.cursors[which] = page.next || "";
  document.getElementById(which + "-more").hidden = !page.next;
}

// --- requeue ---

function confirmRequeue(e, tr, opts) {
  state.pending = { e, tr, opts };
  const what = document.getElementById("confirm-what");
  what.replaceChildren(
    el("dt", { text: "Tenant" }), el("dd", { text: show(e.tenant) }),
    el("dt", { text: "Kind" }), el("dd", { text: show(e.kind) }),
    el("dt", { text: "Key" }), el("dd", { text: show(e.key) }),
    el("dt", { text: "Last error" }), el("dd", { text: show(e.last_error) }));
  document.getElementById("confirm").showModal();
}

async function requeue(p) {
  const { e, tr, opts } = p;
  const button = tr.querySelector("button.requeue");
  if (button) button.disabled = true;
  try {
    const now = await api("/api/requeue", {
      method: "POST",
      headers: { "Content-Type": "application/json", "X-Idem-Token": state.session.token },
      body: JSON.stringify({ tenant: e.tenant, kind: e.kind, key: e.key }),
    });
    fillEffectRow(tr, now, opts);
    showError(null);
    await follow(now, tr, opts);
  } catch (err) {
    showError(err);
    if (button) button.disabled = false;
  }
}

// follow polls a requeued effect until a dispatcher has sent it (done) or given
// up on it again (dead), for up to two minutes.
async function follow(e, tr, opts) {
  const id = query({ tenant: e.tenant, kind: e.kind, key: e.key });
  const deadline = Date.now() + 120000;
  while (Date.now() < deadline) {
    await new Promise((r) => setTimeout(r, 500));
    let now;
    try { now = await api("/api/effect?" + id); } catch (err) { showError(err); return; }
    fillEffectRow(tr, now, opts);
    if (now.state !== "pending") break;
  }
  loadStats().catch(showError);
}

// --- inspect ---

function detailList(pairs) {
  const dl = el("dl", { class: "detail" });
  for (const [k, v] of pairs) dl.append(el("dt", { text: k }), el("dd", { text: v }));
  return dl;
}

function responseText(r) {
  if (!r) return null;
  const names = Object.keys(r.headers || {}).sort();
  const body = r.body_ref ? "by reference " + show(r.body_ref) : r.body_bytes + " bytes (not shown)";
  return r.status + ", body " + body + ", headers " + (names.length ? names.map(show).join(", ") : "-");
}

async function openInboxKey(k, into) {
  const rec = await api("/api/inbox/key?" + query({ consumer: k.consumer, tenant: k.tenant, key: k.key }));
  const pairs = [
    ...(sharded() ? [["Shard", show(rec.shard)]] : []),
    ["Consumer", show(rec.consumer)], ["Tenant", show(rec.tenant)], ["Key", show(rec.key)],
    ["State", rec.state], ["Fingerprint", rec.fingerprint], ["Attempts", String(rec.attempts)],
    ["Received", fmtTime(rec.received_at)], ["Completed", fmtTime(rec.completed_at)], ["Expires", fmtTime(rec.expires_at)],
  ];
  if (rec.state === "failed") pairs.push(["Error", show((rec.error_code || "") + ": " + (rec.error || ""))]);
  if (rec.lease_until) pairs.push(["Lease until", fmtTime(rec.lease_until)]);
  if (rec.response) pairs.push(["Response", responseText(rec.response)]);
  const effects = el("table", { class: "effects" },
    el("thead", {}, el("tr", {}, ...heads(["Tenant", "Kind", "Key", "State", "Attempts", "Created", "Last error", ""]))),
    el("tbody"));
  for (const e of rec.effects) effects.tBodies[0].append(effectRow(e, { requeue: true }));
  into.replaceChildren(...present(el("h3", { text: "Inbox key" }), detailList(pairs),
    el("h3", { text: "Effects made by it: " + rec.effects.length }), rec.effects.length ? effects : null));
}

async function inspect(key, tenant) {
  const params = { key };
  if (tenant !== "") params.tenant = tenant;
  const found = await api("/api/find?" + query(params));
  const out = document.getElementById("inspect-result");
  const detail = el("div", { id: "inspect-detail" });
  const inboxTable = el("table", { id: "found-inbox" },
    el("thead", {}, el("tr", {}, ...heads(["Consumer", "Tenant", "Key", "State", "Received", "Expires", "Response / error", ""]))),
    el("tbody"));
  for (const k of found.inbox) {
    const extra = k.response ? responseText(k.response) : (k.state === "failed" ? show(k.error_code + ": " + k.error) : "-");
    inboxTable.tBodies[0].append(el("tr", {}, ...present(shardCell(k.shard),
      td(show(k.consumer)), td(show(k.tenant)), td(show(k.key), "mono"), stateCell(k.state),
      td(fmtTime(k.received_at), "time"), td(fmtTime(k.expires_at), "time"), td(extra, "err"),
      el("td", {}, el("button", { type: "button", text: "Open", onclick: () => openInboxKey(k, detail).catch(showError) })))));
  }
  const effectsTable = el("table", { id: "found-effects", class: "effects" },
    el("thead", {}, el("tr", {}, ...heads(["Tenant", "Kind", "Key", "State", "Attempts", "Created", "Last error", ""]))),
    el("tbody"));
  for (const e of found.effects) effectsTable.tBodies[0].append(effectRow(e, { requeue: true }));
  out.replaceChildren(...present(
    el("h3", { text: "Inbox keys: " + found.inbox.length }), found.inbox.length ? inboxTable : null,
    el("h3", { text: "Effects: " + found.effects.length }), found.effects.length ? effectsTable : null,
    detail));
}

// --- activity charts (plain SVG) ---

const charts = [
  { id: "inbox", title: "Inbox keys settled", series: [["completed", "completed"], ["failed", "failed"]] },
  { id: "effects", title: "Effects", series: [["sent", "sent"], ["dead", "dead"]] },
  { id: "backlog", title: "Pending effects (backlog at each minute's end)", series: [["pending", "pending"]] },
  { id: "oldest", title: "Oldest pending effect, age", series: [["oldest_pending_seconds", "oldest"]], age: true },
];

const svgNS = "http://www.w3.org/2000/svg";

function svgEl(tag, attrs, ...children) {
  const e = document.createElementNS(svgNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  for (const c of children) e.append(typeof c === "string" ? document.createTextNode(c) : c);
  return e;
}

function fmtMinute(iso) {
  const d = new Date(iso);
  return d.toISOString().slice(11, 16) + "Z";
}

// drawChart draws one chart: a line per series over the window's minutes, and a
// dot with a tooltip (and data-at, data-value) on each minute that is not 0.
function drawChart(spec, minutes) {
  const W = 640, H = 170, left = 48, right = 8, top = 10, bottom = 22;
  const values = spec.series.map(([field]) => minutes.map((m) => m[field]));
  const top_ = Math.max(1, ...values.flat());
  const x = (i) => left + (minutes.length > 1 ? i * (W - left - right) / (minutes.length - 1) : 0);
  const y = (v) => top + (H - top - bottom) * (1 - v / top_);
  const label = (v) => spec.age ? fmtAge(v) : String(v);
  const svg = svgEl("svg", { class: "chart", id: "chart-" + spec.id, viewBox: "0 0 " + W + " " + H, role: "img", "aria-labelledby": "chart-" + spec.id + "-title" },
    svgEl("title", { id: "chart-" + spec.id + "-title" }, spec.title + ", per minute from " + fmtMinute(minutes[0].at) + " to " + fmtMinute(minutes[minutes.length - 1].at)),
    svgEl("line", { class: "axis", x1: left, y1: H - bottom, x2: W - right, y2: H - bottom }),
    svgEl("line", { class: "axis", x1: left, y1: top, x2: left, y2: H - bottom }),
    svgEl("text", { x: left - 4, y: top + 8, "text-anchor": "end", class: "ymax" }, label(top_)),
    svgEl("text", { x: left - 4, y: H - bottom, "text-anchor": "end" }, "0"),
    svgEl("text", { x: left, y: H - 6 }, fmtMinute(minutes[0].at)),
    svgEl("text", { x: W - right, y: H - 6, "text-anchor": "end" }, fmtMinute(minutes[minutes.length - 1].at)));
  spec.series.forEach(([field, name], s) => {
    const g = svgEl("g", { class: "s-" + name, "data-series": name });
    g.append(svgEl("polyline", { points: values[s].map((v, i) => x(i).toFixed(1) + "," + y(v).toFixed(1)).join(" ") }));
    values[s].forEach((v, i) => {
      if (!v) return;
      g.append(svgEl("circle", { cx: x(i).toFixed(1), cy: y(v).toFixed(1), r: minutes.length > 120 ? 1.5 : 2.5, "data-at": minutes[i].at, "data-value": v },
        svgEl("title", {}, fmtMinute(minutes[i].at) + " " + name + ": " + label(v))));
    });
    svg.append(g);
  });
  const legend = el("div", { class: "legend" }, ...spec.series.map(([, name]) => el("span", { class: "s-" + name, text: name })));
  return el("figure", { class: "chart" }, el("figcaption", { text: spec.title }), svg, legend);
}

async function loadActivity() {
  const a = await api("/api/activity?" + query({ window: state.window }));
  document.getElementById("charts").replaceChildren(...charts.map((spec) => drawChart(spec, a.minutes)));
  document.getElementById("charts").dataset.window = state.window;
}

function chooseWindow(w) {
  state.window = w;
  for (const b of document.querySelectorAll(".window button")) b.setAttribute("aria-pressed", String(b.dataset.window === w));
  loadActivity().catch(showError);
}

// --- failures ---

const verbs = {
  retry: { button: "Retry", title: "Retry this group's dead effects?", plan: "requeue {n} dead effect(s): back to pending with their attempts reset, due now; a dispatcher sends them again with the same keys", done: "Requeued {n} dead effect(s)" },
  discard: { button: "Discard", title: "Discard this group's dead effects?", plan: "discard {n} dead effect(s): they are never sent, and the janitor deletes them after the retention", done: "Discarded {n} dead effect(s)" },
  release: { button: "Release", title: "Release this group's failed inbox keys?", plan: "release {n} failed inbox key(s): the next delivery or a republish of each runs the handler again", done: "Released {n} failed inbox key(s)" },
};

function sayN(text, n) { return text.replace("{n}", String(n)); }

async function loadGroups(more) {
  // More continues the list on screen: the filters it was listed with, not what
  // the form holds now (a cursor is valid only for its own list).
  let params = state.groupParams;
  if (!more || !params) {
    params = { limit: "50", order: document.getElementById("groups-order").value };
    // Empty fields do not filter (the tenant field cannot pick the unscoped
    // tenant). A consumer alone lists inbox groups only, a kind alone effects
    // groups only; the code matches exactly; the window counts only the failures
    // in it.
    for (const name of ["source", "consumer", "kind", "tenant", "code", "since"]) {
      const v = document.getElementById("groups-" + name).value.trim();
      if (v) params[name] = v;
    }
    state.groupParams = params;
  }
  if (more) params = { ...params, after: state.cursors.groups };
  const page = await api("/api/failures?" + query(params));
  // The server reads an age (since=1h) against its clock on every request: More
  // sends the times the first page counted from, so that it lists the same window.
  if (!more) {
    for (const name of ["since", "until"]) if (page[name]) params[name] = page[name];
  }
  const body = document.querySelector("#groups tbody");
  if (!more) body.replaceChildren();
  for (const g of page.groups) {
    body.append(el("tr", { class: "group" + (g.id === state.group ? " selected" : ""), "data-group": g.id, "data-source": g.source },
      ...present(shardCell(g.shard), td(g.id, "mono"), td(g.source === "inbox" ? "failed keys" : "dead effects"),
      td(show(g.consumer || g.kind)), td(show(g.tenant)), td(show(g.code)), td(String(g.count), "num count"),
      td(fmtTime(g.last_seen), "time"), td(show(g.masked_error), "err"),
      el("td", {}, el("button", { type: "button", class: "open", text: "Open", onclick: () => openGroup(g.id).catch(showError) })))));
  }
  if (!more && page.groups.length === 0) {
    const filtered = ["consumer", "kind", "tenant", "code", "since"].some((n) => document.getElementById("groups-" + n).value.trim());
    body.append(emptyRow(body, filtered ? "no failure group matches these filters" : "no failures: no failed inbox keys and no dead effects"));
  }
  state.cursors.groups = page.next || "";
  document.getElementById("groups-more").hidden = !page.next;
}

// openGroup shows one group: its counts, texts, sample keys, attempts and the
// actions taken on it, with its repair buttons.
async function openGroup(id) {
  state.group = id;
  for (const tr of document.querySelectorAll("#groups tr.group")) tr.classList.toggle("selected", tr.dataset.group === id);
  const g = await api("/api/failures/group?" + query({ id }));
  const out = document.getElementById("group-detail");
  const effects = g.source === "effects";
  const pairs = [
    ["Group", g.id], ["Source", effects ? "dead effects" : "failed inbox keys"],
    [effects ? "Kind" : "Consumer", show(g.consumer || g.kind)], ["Tenant", show(g.tenant)],
    ["Count", String(g.count)],
  ];
  // Over a shard map: each shard's part of the group.
  if (g.parts && g.parts.length) pairs.push(["Shards", g.parts.map((p) => show(p.shard) + ": " + p.count).join(", ")]);
  if (g.count > 0) {
    pairs.push(["Code", show(g.code)], ["First seen", fmtTime(g.first_seen)], ["Last seen", fmtTime(g.last_seen)],
      ["Error (masked)", show(g.masked_error)], ["Example (newest)", show(g.example_error)]);
  }
  const parts = [el("h3", { text: "Group " + g.id }), detailList(pairs)];
  const dl = parts[1];
  dl.id = "group-facts";
  if (g.count === 0) parts.push(el("p", { class: "muted", text: "This group holds no failures now." }));
  if (g.count > 0 && state.session && !state.session.read_only) {
    const buttons = el("div", { class: "buttons" });
    for (const action of effects ? ["retry", "discard"] : ["release"]) {
      buttons.append(el("button", { type: "button", class: "action-" + action + (action === "discard" ? " danger" : ""),
        text: verbs[action].button + "…", onclick: () => planAction(g, action).catch(showError) }));
    }
    parts.push(buttons);
  }
  if (g.sample_keys.length) {
    parts.push(el("h3", { text: "Sample keys (newest first)" }), el("p", { class: "mono sample-keys", text: g.sample_keys.map(show).join(", ") }));
  }
  if (g.attempts && g.attempts.length) {
    const t = el("table", { class: "attempts" }, el("thead", {}, el("tr", {}, el("th", { class: "num", text: "Attempts made" }), el("th", { class: "num", text: "Effects" }))), el("tbody"));
    for (const a of g.attempts) t.tBodies[0].append(el("tr", {}, td(String(a.attempts), "num"), td(String(a.effects), "num")));
    parts.push(el("h3", { text: "Attempts" }), t);
  }
  if (g.actions && g.actions.length) {
    const t = el("table", { id: "group-actions" },
      el("thead", {}, el("tr", {}, ...["At", "Action", "Rows", "Through", "By", "Note"].map((h) => el("th", { text: h })))), el("tbody"));
    for (const x of g.actions) {
      t.tBodies[0].append(el("tr", {}, td(fmtTime(x.at), "time"), td(x.action), td(String(x.rows), "num"),
        td(fmtTime(x.through), "time"), td(show(x.who)), td(show(x.why), "err")));
    }
    parts.push(el("h3", { text: "Actions taken (newest first)" }), t);
  }
  const followed = state.followed && state.followed.group === id ? state.followed.node : null;
  out.replaceChildren(...present(...parts, followed));
}

// planAction asks for the dry run of an action, bound to the group's last
// failure as it was shown, and opens the confirmation with what it would touch.
async function planAction(g, action) {
  const plan = await api("/api/failures/action", {
    method: "POST",
    headers: { "Content-Type": "application/json", "X-Idem-Token": state.session.token },
    body: JSON.stringify({ id: g.id, action, through: g.last_seen, dry_run: true }),
  });
  if (plan.rows === 0) {
    showError(new Error("group " + g.id + " has no failures up to " + fmtTime(plan.through) + ": nothing to " + action));
    return;
  }
  state.action = { g, action, plan };
  document.getElementById("failure-confirm-title").textContent = verbs[action].title;
  document.getElementById("failure-confirm-plan").textContent =
    "This will " + sayN(verbs[action].plan, plan.rows) + ". Only the group's failures up to " + fmtTime(plan.through) +
    " are taken; if more arrived since, nothing is changed and you are asked to look again.";
  const more = plan.rows > plan.keys.length ? ", and " + (plan.rows - plan.keys.length) + " more" : "";
  document.getElementById("failure-confirm-keys").textContent = "Keys: " + plan.keys.map(show).join(", ") + more;
  document.getElementById("failure-note").value = "";
  document.getElementById("failure-ok").textContent = verbs[action].button + " " + plan.rows;
  const dialog = document.getElementById("failure-confirm");
  dialog.dataset.rows = String(plan.rows);
  dialog.showModal();
}

async function takeAction(p) {
  const { g, action, plan } = p;
  const res = await api("/api/failures/action", {
    method: "POST",
    headers: { "Content-Type": "application/json", "X-Idem-Token": state.session.token },
    body: JSON.stringify({
      id: g.id, action, through: plan.through, at_most: plan.rows,
      who: document.getElementById("failure-who").value, why: document.getElementById("failure-note").value,
    }),
  });
  showError(null);
  state.followed = null;
  if (action === "retry" && res.keys.length) {
    // Follow the requeued effects (the first ones the plan names) until sent.
    const t = el("table", { id: "followed", class: "effects" },
      el("thead", {}, el("tr", {}, ...heads(["Tenant", "Kind", "Key", "State", "Attempts", "Created", "Last error"]))), el("tbody"));
    const node = el("div", {}, el("h3", { text: sayN(verbs[action].done, res.rows) + ": following them" }), t);
    state.followed = { group: g.id, node };
    for (const key of res.keys) {
      t.tBodies[0].append(effectRow({ tenant: g.tenant, kind: g.kind, key, state: "pending", attempts: 0, max_attempts: "?", created_at: null, last_error: "" }, {}));
    }
    followRetried(g, t);
  }
  const note = el("p", { id: "action-result", class: "result", text: sayN(verbs[action].done, res.rows) + " (action " + res.action_id + ")" });
  await Promise.all([loadGroups(false), openGroup(g.id)]);
  document.getElementById("group-detail").prepend(note);
}

// followRetried polls the retried effects until none is pending, for up to two
// minutes.
async function followRetried(g, table) {
  const deadline = Date.now() + 120000;
  while (Date.now() < deadline) {
    await new Promise((r) => setTimeout(r, 500));
    let pending = 0;
    for (const tr of table.tBodies[0].rows) {
      let e;
      try { e = await api("/api/effect?" + query({ tenant: tr.dataset.tenant, kind: tr.dataset.kind, key: tr.dataset.key })); } catch (err) { showError(err); return; }
      fillEffectRow(tr, e, {});
      if (e.state === "pending") pending++;
    }
    if (pending === 0) break;
  }
  loadStats().catch(showError);
}

// --- pages ---

function showView() {
  const view = location.hash === "#failures" ? "failures" : "overview";
  document.body.dataset.view = view;
  for (const v of ["overview", "failures"]) {
    const a = document.getElementById("nav-" + v);
    if (v === view) a.setAttribute("aria-current", "page"); else a.removeAttribute("aria-current");
  }
  if (view === "failures") loadGroups(false).catch(showError);
}

// --- start ---

async function refreshAll() {
  try {
    const loads = [loadStats(), loadActivity(), loadEffects("dead", false), loadEffects("stuck", false)];
    if (document.body.dataset.view === "failures") {
      loads.push(loadGroups(false));
      if (state.group) loads.push(openGroup(state.group));
    }
    await Promise.all(loads);
    showError(null);
  } catch (err) {
    showError(err);
  }
}

// login trades the access token of a console run with --allow-remote for its
// session cookie (HttpOnly: this script never sees it).
async function login(token) {
  const res = await fetch("/api/login", { method: "POST", headers: { "Authorization": "Bearer " + token } });
  if (!res.ok) {
    let body = null;
    try { body = await res.json(); } catch (e) { /* not JSON */ }
    throw new Error((body && body.detail) || ("HTTP " + res.status));
  }
}

// tokenFromFragment takes the token out of a URL such as http://host:8080/#token=…
// (the fragment never reaches a server), and out of the address bar and history.
function tokenFromFragment() {
  const m = /(?:^#|&)token=([^&]*)/.exec(location.hash);
  if (!m) return "";
  history.replaceState(null, "", location.pathname + location.search);
  return decodeURIComponent(m[1]);
}

// askForToken shows the sign-in form and resolves once a token was accepted.
function askForToken() {
  const section = document.getElementById("login-section");
  section.hidden = false;
  document.body.setAttribute("data-login", "1");
  return new Promise((resolve) => {
    const form = document.getElementById("login-form");
    const submit = async (ev) => {
      ev.preventDefault();
      const input = document.getElementById("login-token");
      try {
        await login(input.value);
      } catch (err) {
        showError(err);
        return;
      }
      input.value = "";
      form.removeEventListener("submit", submit);
      section.hidden = true;
      document.body.removeAttribute("data-login");
      showError(null);
      resolve();
    };
    form.addEventListener("submit", submit);
  });
}

async function start() {
  try {
    const token = tokenFromFragment();
    if (token) await login(token);
  } catch (err) {
    showError(err);
  }
  for (;;) {
    try {
      state.session = await api("/api/session");
      break;
    } catch (err) {
      if (err.status !== 401) {
        showError(err);
        return;
      }
      await askForToken();
    }
  }
  const shards = state.session.shards || [];
  document.getElementById("schema").textContent = shards.length ? "shards " + shards.join(", ") : "schema " + state.session.schema;
  if (shards.length) {
    // The lists of the page itself get their shard column; those the script
    // builds get it from heads.
    for (const row of document.querySelectorAll("#dead thead tr, #stuck thead tr, #groups thead tr")) {
      row.prepend(el("th", { class: "shard", text: "Shard" }));
    }
  }
  const mode = document.getElementById("mode");
  mode.textContent = state.session.read_only ? "read-only" : "read-write";
  if (state.session.read_only) mode.classList.add("ro");
  document.getElementById("refresh").addEventListener("click", refreshAll);
  document.getElementById("dead-more").addEventListener("click", () => loadEffects("dead", true).catch(showError));
  document.getElementById("stuck-more").addEventListener("click", () => loadEffects("stuck", true).catch(showError));
  document.getElementById("inspect-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    inspect(document.getElementById("inspect-key").value, document.getElementById("inspect-tenant").value).catch(showError);
  });
  const dialog = document.getElementById("confirm");
  dialog.addEventListener("close", () => {
    const p = state.pending;
    state.pending = null;
    if (p && dialog.returnValue === "ok") requeue(p);
  });
  const failureDialog = document.getElementById("failure-confirm");
  failureDialog.addEventListener("close", () => {
    const p = state.action;
    state.action = null;
    if (p && failureDialog.returnValue === "ok") takeAction(p).catch((err) => { showError(err); openGroup(p.g.id).catch(showError); });
  });
  document.getElementById("groups-filter").addEventListener("submit", (ev) => {
    ev.preventDefault();
    loadGroups(false).catch(showError);
  });
  document.getElementById("groups-more").addEventListener("click", () => loadGroups(true).catch(showError));
  for (const b of document.querySelectorAll(".window button")) b.addEventListener("click", () => chooseWindow(b.dataset.window));
  window.addEventListener("hashchange", showView);
  showView();
  await refreshAll();
  document.body.setAttribute("data-ready", "1");
  setInterval(() => loadStats().catch(showError), 10000);
  // The hour's charts follow; the day's (a heavier read) change on Refresh.
  setInterval(() => { if (document.body.dataset.view !== "failures" && state.window === "hour") loadActivity().catch(showError); }, 30000);
}

document.addEventListener("DOMContentLoaded", start);
