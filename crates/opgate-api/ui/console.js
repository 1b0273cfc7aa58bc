// opgate console: plain JavaScript over the /v1 API, no build step.
//
// Pages (the part after '#'): /overview, /operations (filters in the query),
// /approvals, /attention, /operations/<id>. Every value is written with textContent,
// never as markup. The token lives in sessionStorage (this tab only) and is sent as a
// bearer token; a 401 signs the person out.
"use strict";

const TOKEN_KEY = "opgate.console.token";
const REFRESH_MS = 2000;
const STATES = [
  "awaiting_approval", "pending_dispatch", "dispatched", "acknowledged",
  "completed_success", "completed_noop", "failed_retryable", "failed_permanent",
  "unknown_outcome", "needs_attention", "rejected", "cancelled", "compensating", "compensated",
];
// Which commands each state accepts (the ledger checks again: this only hides buttons).
const ACTIONS = {
  awaiting_approval: ["approve", "reject", "cancel"],
  pending_dispatch: ["cancel"],
  failed_retryable: ["cancel"],
  unknown_outcome: ["resolve"],
  acknowledged: ["resolve"],
  needs_attention: ["resolve"],
  completed_success: ["compensate"],
};
const RESOLUTIONS = {
  succeeded: "succeeded: it took effect (record the result)",
  noop: "noop: it took effect before, nothing to do",
  failed: "failed: it did not take effect and must not be retried",
  redispatch: "redispatch: it did not take effect, send it again with the same key",
};

let me = null;          // GET /v1/me
let timers = [];        // refresh timers of the page on screen
let page = 0;           // bumped on every navigation: a late answer for an earlier page is dropped
let tools = null;       // GET /v1/tools, by name
const samples = [];     // overview samples kept while the tab is open

// ---------- small helpers ----------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c === undefined || c === null || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function svgEl(tag, attrs, ...children) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function status(s) {
  return el("span", { class: "status " + s, text: s });
}

// Ids are time-ordered (UUIDv7): ids made in the same minute share 8 characters, 13
// reach the millisecond.
function opLink(id, label) {
  return el("a", { href: "#/operations/" + encodeURIComponent(id), class: "mono", title: id, text: label || id.slice(0, 13) });
}

function when(rfc3339) {
  if (!rfc3339) return "";
  const d = new Date(rfc3339);
  return isNaN(d) ? rfc3339 : d.toISOString().replace("T", " ").replace("Z", "");
}

function ago(rfc3339) {
  const s = (Date.now() - new Date(rfc3339).getTime()) / 1000;
  if (!isFinite(s)) return "";
  if (s < 60) return Math.max(0, Math.round(s)) + " s ago";
  if (s < 3600) return Math.round(s / 60) + " min ago";
  if (s < 86400) return Math.round(s / 3600) + " h ago";
  return Math.round(s / 86400) + " d ago";
}

function json(value) {
  return el("pre", { text: JSON.stringify(value, null, 2) });
}

function clearTimers() {
  timers.forEach(clearTimeout);
  timers = [];
}

// Runs `fn` again `ms` after the previous run finished (never two at once), for as long
// as the page that asked is on screen.
function every(ms, fn) {
  const mine = page;
  const tick = async () => {
    if (mine !== page) return;
    try { await fn(); } finally {
      if (mine === page) timers.push(setTimeout(tick, ms));
    }
  };
  timers.push(setTimeout(tick, ms));
}

// ---------- the API ----------

class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

async function api(path, options = {}) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const headers = { Authorization: "Bearer " + token };
  if (options.body !== undefined) headers["Content-Type"] = "application/json";
  const res = await fetch(path, {
    method: options.method || "GET",
    headers,
    body: options.body === undefined ? undefined : JSON.stringify(options.body),
  });
  const text = await res.text();
  let body = null;
  try { body = text ? JSON.parse(text) : null; } catch { body = null; }
  if (!res.ok) {
    const err = (body && body.error) || {};
    if (res.status === 401) signOut("Your token was refused: sign in again.");
    throw new ApiError(res.status, err.code || "http_" + res.status, err.message || text || res.statusText);
  }
  return body;
}

// ---------- sign-in ----------

function show(section) {
  document.getElementById("sign-in").hidden = section !== "sign-in";
  document.getElementById("view").hidden = section !== "view";
  document.getElementById("nav").hidden = section !== "view";
  document.getElementById("who").hidden = section !== "view";
}

function signOut(message) {
  clearTimers();
  sessionStorage.removeItem(TOKEN_KEY);
  me = null;
  tools = null;
  show("sign-in");
  document.getElementById("sign-in-error").textContent = message || "";
}

async function signIn(token) {
  sessionStorage.setItem(TOKEN_KEY, token);
  try {
    me = await api("/v1/me");
  } catch (e) {
    // Only a refused token is forgotten; a network error or a 5xx keeps it for a retry.
    if (e.status === 401) {
      sessionStorage.removeItem(TOKEN_KEY);
      throw new Error("This token was refused: " + e.message);
    }
    throw e;
  }
  if (me.role === "agent") {
    sessionStorage.removeItem(TOKEN_KEY);
    me = null;
    throw new Error("This is an agent token: the console needs a viewer or operator token.");
  }
  document.getElementById("who-name").textContent = me.name + " (" + me.role + ")";
  show("view");
}

// ---------- router ----------

function route() {
  clearTimers();
  page += 1;
  if (!me) return;
  const hash = location.hash.replace(/^#/, "") || "/overview";
  const [path, query] = hash.split("?");
  const params = new URLSearchParams(query || "");
  const parts = path.split("/").filter(Boolean);
  const name = parts[0] || "overview";
  document.querySelectorAll("nav a").forEach((a) => {
    a.classList.toggle("active", a.dataset.page === name && parts.length < 2);
  });
  const view = document.getElementById("view");
  view.replaceChildren();
  if (name === "operations" && parts[1]) {
    let id = parts[1];
    try { id = decodeURIComponent(id); } catch { /* shown as typed; the API says what is wrong */ }
    return operationPage(view, id);
  }
  if (name === "operations") return listPage(view, "Operations", params, true);
  if (name === "approvals") {
    return listPage(view, "Approvals", new URLSearchParams({ status: "awaiting_approval" }), false,
      "Irreversible or approval-required operations wait here for an operator. The one who proposed an operation cannot approve it.");
  }
  if (name === "attention") {
    return listPage(view, "Needs attention", new URLSearchParams({ status: "needs_attention" }), false,
      "Outcomes the reconciler could not settle: look at the provider, then resolve each one with what happened.");
  }
  return overviewPage(view);
}

// Queue counts in the navigation, from the overview.
async function refreshCounts() {
  try {
    const o = await api("/v1/overview?window=5m");
    const live = Object.fromEntries(o.live.map((c) => [c.name, c.count]));
    for (const [id, state] of [["count-approvals", "awaiting_approval"], ["count-attention", "needs_attention"]]) {
      const n = live[state] || 0;
      const badge = document.getElementById(id);
      badge.textContent = String(n);
      badge.classList.toggle("hot", n > 0);
    }
  } catch { /* the page on screen shows errors */ }
}

// ---------- operations list ----------

function listPage(view, title, params, withFilters, help) {
  const filters = ["status", "tool", "entity", "idempotency_key", "namespace", "agent_id"];
  const state = { cursor: null, live: true };
  const error = el("p", { class: "error", role: "alert" });
  const tbody = el("tbody");
  const more = el("button", { type: "button", id: "ops-more", hidden: true, text: "Next page" });
  const counter = el("span", { id: "ops-count" });
  view.append(el("h1", { text: title }));
  if (help) view.append(el("p", { class: "muted", text: help }));
  if (withFilters) {
    const inputs = {};
    const form = el("form", { class: "filters", id: "ops-filters" });
    for (const f of filters) {
      const input = f === "status"
        ? el("select", { name: f, id: "filter-" + f }, el("option", { value: "", text: "any" }),
          STATES.map((s) => el("option", { value: s, text: s })))
        : el("input", { name: f, id: "filter-" + f, size: f === "idempotency_key" ? 28 : 14,
          placeholder: f === "entity" ? "type:id" : "" });
      input.value = params.get(f) || "";
      inputs[f] = input;
      form.append(el("label", {}, f.replace("_", " "), input));
    }
    const find = el("input", { id: "find-id", size: 14, placeholder: "id or its start" });
    form.append(el("button", { type: "submit", class: "primary", text: "Filter" }));
    form.append(el("label", {}, "go to operation", find));
    form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      if (find.value.trim()) {
        location.hash = "#/operations/" + encodeURIComponent(find.value.trim());
        return;
      }
      const q = new URLSearchParams();
      for (const f of filters) if (inputs[f].value.trim()) q.set(f, inputs[f].value.trim());
      location.hash = "#/operations" + (q.toString() ? "?" + q : "");
    });
    view.append(form);
  }
  const liveBox = el("input", { type: "checkbox", id: "live", checked: true,
    onchange: (ev) => { state.live = ev.target.checked; } });
  view.append(el("div", { class: "toolbar" }, el("label", { class: "inline" }, el("span", {}, liveBox, " live refresh")), counter));
  view.append(error);
  view.append(el("table", { id: "ops-table" },
    el("thead", {}, el("tr", {}, ["id", "status", "tool", "entity", "namespace", "agent", "attempts", "updated"].map((h) => el("th", { text: h })))),
    tbody));
  view.append(el("p", {}, more));

  const query = (cursor) => {
    const q = new URLSearchParams();
    for (const f of filters) if (params.get(f)) q.set(f, params.get(f));
    q.set("limit", "50");
    if (cursor) q.set("cursor", cursor);
    return "/v1/operations?" + q;
  };
  const row = (op) => el("tr", { "data-op-id": op.operation_id },
    el("td", {}, opLink(op.operation_id)),
    el("td", {}, status(op.status)),
    el("td", { text: op.tool }),
    el("td", { class: "mono", text: op.entity.type + ":" + op.entity.id }),
    el("td", { text: op.namespace }),
    el("td", { text: op.agent_id || "" }),
    el("td", { text: String(op.attempt_count) }),
    el("td", { title: op.updated_at, text: ago(op.updated_at) }));
  const mine = page;
  const load = async (append) => {
    try {
      const answer = await api(query(append ? state.cursor : null));
      if (mine !== page) return;
      error.textContent = "";
      if (!append) tbody.replaceChildren();
      answer.operations.forEach((op) => tbody.append(row(op)));
      state.cursor = answer.next_cursor;
      more.hidden = !answer.next_cursor;
      counter.textContent = tbody.children.length + (answer.next_cursor ? "+" : "") + " operations";
      if (!tbody.children.length) tbody.append(el("tr", {}, el("td", { colspan: 8, class: "muted", text: "No operations." })));
    } catch (e) {
      error.textContent = e.message;
    }
  };
  more.addEventListener("click", () => load(true));
  load(false);
  // Live refresh reloads the first page; it pauses once a further page was loaded.
  every(REFRESH_MS, () => { if (state.live && tbody.children.length <= 50) load(false); });
}

// ---------- one operation ----------

async function loadTools() {
  if (!tools) {
    const t = await api("/v1/tools");
    tools = Object.fromEntries(t.tools.map((x) => [x.name, x]));
  }
  return tools;
}

function timelineOf(events, attempts, results) {
  const items = [];
  for (const e of events) {
    const ambiguous = e.to === "unknown_outcome" || e.from === "unknown_outcome";
    const detail = [];
    if (e.detail && e.detail.unknown_for_ms !== undefined) detail.push("unknown for " + e.detail.unknown_for_ms + " ms");
    if (e.detail && e.detail.compensation) detail.push(el("span", {}, "compensation ", opLink(e.detail.compensation)));
    if (e.detail && e.detail.compensates) detail.push(el("span", {}, "compensates ", opLink(e.detail.compensates)));
    if (e.detail && e.detail.lease_owner) detail.push("lease of " + e.detail.lease_owner + " ran out");
    items.push({
      at: e.at, order: 1, kind: ambiguous ? "ambiguity" : "state",
      body: el("div", {},
        e.from ? status(e.from) : "", e.from ? " → " : "", status(e.to), " ",
        el("span", { class: "mono", text: e.reason }),
        e.actor ? el("span", { class: "muted", text: " by " + e.actor }) : "",
        detail.length ? el("div", { class: "muted" }, detail.map((d, i) => [i ? "; " : "", d])) : ""),
    });
  }
  for (const a of attempts) {
    items.push({
      at: a.started_at, order: 0, kind: "attempt",
      body: el("div", {}, "attempt " + a.number + " sent by " + a.worker + " (epoch " + a.epoch + ")",
        el("div", { class: "muted mono", text: "attempt_id " + a.attempt_id })),
    });
    if (a.finished_at) {
      const bits = [a.outcome || "no outcome recorded"];
      if (a.http_status) bits.push("HTTP " + a.http_status);
      if (a.error_category) bits.push(a.error_category);
      if (a.latency_ms !== null && a.latency_ms !== undefined) bits.push(a.latency_ms + " ms");
      if (a.provider_request_id) bits.push("provider request " + a.provider_request_id);
      items.push({ at: a.finished_at, order: 2, kind: "attempt", body: el("div", { text: "attempt " + a.number + " answered: " + bits.join(", ") }) });
    }
  }
  for (const r of results) {
    items.push({
      at: r.published_at || r.created_at, order: 3, kind: "result",
      body: el("div", {}, "result " + r.seq + " ", status(r.status), " ",
        r.published_at ? "published " + Math.max(0, new Date(r.published_at) - new Date(r.created_at)) + " ms after it was written"
          : el("span", { class: "error", text: "not yet published" })),
    });
  }
  // By time (the API's timestamps drop trailing zeros, so compare instants, not text),
  // then sent before recorded before published.
  items.sort((x, y) => (new Date(x.at) - new Date(y.at)) || x.order - y.order);
  return el("ol", { class: "timeline", id: "timeline" }, items.map((i) =>
    el("li", {}, el("span", { class: "mono", text: when(i.at) }), el("span", { class: "kind " + i.kind, text: i.kind }), i.body)));
}

// The buttons an operator may press for this state, each asking for a reason; the
// outcome is written to `message`, which outlives the panel (the page redraws it once
// the state changed).
function actionPanel(op, tool, reload, message) {
  const allowed = (ACTIONS[op.status] || []).filter((a) => a !== "compensate" || (tool && tool.compensable));
  const panel = el("div", { class: "card", id: "actions" }, el("h2", { text: "Actions" }));
  if (me.role !== "operator") {
    panel.append(el("p", { class: "muted", text: "Signed in as a viewer: an operator token approves, rejects, cancels, resolves and compensates." }));
    return panel;
  }
  if (!allowed.length) {
    panel.append(el("p", { class: "muted", text: "Nothing to do: " + op.status + " takes no command." }));
    return panel;
  }
  const form = el("form", { class: "action-form", id: "action-form", hidden: true });
  const buttons = el("div", { class: "actions" }, allowed.map((a) => el("button", {
    type: "button", "data-action": a, class: a === "reject" || a === "cancel" ? "danger" : "",
    text: a, onclick: () => openForm(a),
  })));
  panel.append(buttons, form);

  function openForm(action) {
    message.textContent = "";
    message.className = "";
    const reason = el("textarea", { id: "action-reason", placeholder: "why (kept in the history)" });
    const fields = [el("label", {}, "reason", reason)];
    let resolution = null;
    let result = null;
    if (action === "resolve") {
      resolution = el("select", { id: "action-resolution" },
        Object.entries(RESOLUTIONS).map(([v, t]) => el("option", { value: v, text: t })));
      result = el("textarea", { id: "action-result", placeholder: "{\"id\": \"...\"} (optional, for succeeded)" });
      fields.push(el("label", {}, "what happened", resolution), el("label", {}, "result (JSON)", result));
    }
    form.replaceChildren(...fields,
      el("button", { type: "submit", class: "primary", id: "action-confirm", text: "Confirm " + action }),
      el("button", { type: "button", text: "Cancel", onclick: () => { form.hidden = true; } }));
    form.hidden = false;
    form.onsubmit = async (ev) => {
      ev.preventDefault();
      if (!reason.value.trim()) {
        message.className = "error";
        message.textContent = "Give a reason: it is recorded with your name in the operation's history.";
        return;
      }
      const body = { reason: reason.value.trim() };
      if (resolution) {
        body.resolution = resolution.value;
        if (result.value.trim()) {
          try { body.result = JSON.parse(result.value); } catch (e) {
            message.className = "error";
            message.textContent = "The result is not JSON: " + e.message;
            return;
          }
        }
      }
      try {
        const answer = await api("/v1/operations/" + op.operation_id + "/" + action, { method: "POST", body });
        form.hidden = true;
        message.className = "notice";
        const now = answer.operation ? answer.operation.status : answer.status;
        message.textContent = action + " recorded: the operation is now " + now + ".";
        refreshCounts();
        reload();
      } catch (e) {
        message.className = "error";
        message.textContent = action + " refused (" + e.code + "): " + e.message;
      }
    };
  }
  return panel;
}

function operationPage(view, id) {
  const head = el("div");
  const body = el("div");
  const error = el("p", { class: "error", role: "alert" });
  const message = el("p", { id: "action-message", role: "status" });
  view.append(head, error, message, body);
  let lastUpdate = null;
  let keepActions = null;
  const mine = page;

  const load = async () => {
    try {
      const op = await api("/v1/operations/" + encodeURIComponent(id));
      if (mine !== page) return;
      if (op.operation_id !== id) {
        // An id prefix: show the canonical address.
        history.replaceState(null, "", "#/operations/" + op.operation_id);
        id = op.operation_id;
      }
      const [events, attempts, results, toolMap] = await Promise.all([
        api("/v1/operations/" + id + "/events"),
        api("/v1/operations/" + id + "/attempts"),
        api("/v1/operations/" + id + "/results"),
        loadTools().catch(() => ({})),
      ]);
      if (mine !== page) return;
      error.textContent = "";
      const fingerprint = op.updated_at + op.status + events.events.length + results.results.map((r) => r.published_at).join();
      if (fingerprint === lastUpdate) return;
      lastUpdate = fingerprint;
      head.replaceChildren(
        el("h1", {}, "Operation ", el("span", { class: "mono", id: "op-id", text: op.operation_id }), " ", status(op.status)),
        el("p", { class: "muted", id: "op-advice" }, "Agent advice: ", el("b", { text: op.retry_recommendation }), " — " + op.safe_user_message));
      const fields = [
        ["tool", op.tool + " (" + op.side_effect_class + ")"],
        ["entity", op.entity.type + ":" + op.entity.id],
        ["namespace", op.namespace],
        ["idempotency key", op.idempotency_key],
        ["key components", JSON.stringify(op.key_components)],
        ["args fingerprint", op.args_fingerprint],
        ["event id", op.event_id],
        ["agent", op.agent_id || "—"],
        ["intent", op.intent || "—"],
        ["workflow", op.workflow_id ? op.workflow_id + " / " + (op.run_id || "") + " step " + (op.step ?? "") : "—"],
        ["attempts", String(op.attempt_count)],
        ["next attempt", op.next_attempt_at ? when(op.next_attempt_at) : "—"],
        ["lease", op.lease_owner ? op.lease_owner + " (epoch " + op.lease_epoch + ")" : "none (epoch " + op.lease_epoch + ")"],
        ["provider ids", [op.external_id, op.external_request_id].filter(Boolean).join(" / ") || "—"],
        ["created", when(op.created_at)],
        ["updated", when(op.updated_at)],
        ["trace", op.traceparent || "—"],
      ];
      const dl = el("dl", { class: "fields" }, fields.map(([k, v]) => [el("dt", { text: k }), el("dd", { class: "mono", text: v })]));
      if (op.compensates) dl.append(el("dt", { text: "compensates" }), el("dd", {}, opLink(op.compensates, op.compensates)));
      const tool = toolMap[op.tool];
      if (keepActions === null || keepActions.status !== op.status) {
        keepActions = { status: op.status, node: actionPanel(op, tool, () => { lastUpdate = null; load(); }, message) };
      }
      body.replaceChildren(
        el("div", { class: "grid" },
          el("div", { class: "card" }, el("h2", { text: "Operation" }), dl),
          el("div", {},
            keepActions.node,
            el("div", { class: "card" }, el("h2", { text: "Arguments (canonical)" }), json(op.canonical_args)),
            op.result ? el("div", { class: "card" }, el("h2", { text: "Provider result" }), json(op.result)) : "",
            op.error ? el("div", { class: "card" }, el("h2", { text: "Last error" }), json(op.error)) : "")),
        el("div", { class: "card" }, el("h2", { text: "Timeline" }),
          el("p", { class: "muted", text: "State changes, each attempt (written before the call) and its answer, and each result message with when the relay published it." }),
          timelineOf(events.events, attempts.attempts, results.results)));
    } catch (e) {
      error.textContent = e.message;
    }
  };
  load();
  every(REFRESH_MS, load);
}

// ---------- overview ----------

function barChart(counts, id) {
  const rows = counts.filter((c) => c.count > 0);
  if (!rows.length) return el("p", { class: "muted", id, text: "None in this window." });
  const max = Math.max(...rows.map((c) => c.count));
  const h = 22;
  const svg = svgEl("svg", { class: "chart", id, viewBox: "0 0 520 " + (rows.length * h + 4), role: "img" });
  rows.forEach((c, i) => {
    const y = i * h + 2;
    const w = Math.max(2, (c.count / max) * 250);
    svg.append(svgEl("text", { x: 0, y: y + 14 }, c.name));
    svg.append(svgEl("rect", { class: "bar", x: 220, y: y + 3, width: w, height: h - 8, rx: 2 }));
    svg.append(svgEl("text", { x: 226 + w, y: y + 14 }, String(c.count)));
  });
  return svg;
}

function lineChart(values, unit, id) {
  const W = 520, H = 120, pad = 30;
  const svg = svgEl("svg", { class: "chart", id, viewBox: "0 0 " + W + " " + H, role: "img" });
  const max = Math.max(1, ...values);
  svg.append(svgEl("line", { class: "axis", x1: pad, y1: H - 16, x2: W, y2: H - 16 }));
  svg.append(svgEl("text", { x: 0, y: 12 }, formatNumber(max) + unit));
  svg.append(svgEl("text", { x: 0, y: H - 16 }, "0"));
  svg.append(svgEl("text", { x: pad, y: H - 2 }, "since this page opened, every " + REFRESH_MS / 1000 + " s"));
  if (values.length > 1) {
    const step = (W - pad) / (values.length - 1);
    const pts = values.map((v, i) => (pad + i * step).toFixed(1) + "," + (H - 16 - (v / max) * (H - 30)).toFixed(1));
    svg.append(svgEl("polyline", { class: "line", points: pts.join(" ") }));
  }
  return svg;
}

function formatNumber(n) {
  return n >= 100 ? String(Math.round(n)) : String(Math.round(n * 10) / 10);
}

function overviewPage(view) {
  const windows = { "5m": "5 minutes", "1h": "1 hour", "24h": "24 hours" };
  let win = sessionStorage.getItem("opgate.console.window") || "1h";
  if (!windows[win]) win = "1h";
  const select = el("select", { id: "window" }, Object.entries(windows).map(([v, t]) => el("option", { value: v, text: t })));
  select.value = win;
  select.addEventListener("change", () => { win = select.value; sessionStorage.setItem("opgate.console.window", win); load(); });
  const error = el("p", { class: "error", role: "alert" });
  const body = el("div");
  view.append(el("h1", { text: "Overview" }), el("div", { class: "toolbar" }, el("label", {}, "window", select)), error, body);

  const mine = page;
  const load = async () => {
    try {
      const o = await api("/v1/overview?window=" + win);
      if (mine !== page) return;
      error.textContent = "";
      const queued = o.queue.filter((q) => q.name !== "done").reduce((s, q) => s + q.count, 0);
      samples.push({ queued, lag: o.relay_lag_seconds, pending: o.relay_pending });
      while (samples.length > 90) samples.shift();
      const live = Object.fromEntries(o.live.map((c) => [c.name, c.count]));
      const u = o.unknown;
      const share = u.resolved_without_person === null ? "—" : Math.round(u.resolved_without_person * 1000) / 10 + "%";
      const accepted = o.decisions.filter((d) => d.name === "accepted").reduce((s, d) => s + d.count, 0);
      const deduped = o.decisions.filter((d) => d.name.startsWith("deduplicated")).reduce((s, d) => s + d.count, 0);
      const rejected = o.decisions.filter((d) => d.name.startsWith("rejected")).reduce((s, d) => s + d.count, 0);
      body.replaceChildren(
        el("div", { class: "card" },
          el("div", { class: "stats" },
            stat("awaiting approval", live.awaiting_approval || 0, "#/approvals", "stat-approvals"),
            stat("needs attention", live.needs_attention || 0, "#/attention", "stat-attention"),
            stat("unknown outcome now", live.unknown_outcome || 0, "#/operations?status=unknown_outcome"),
            stat("in the dispatch queue", queued),
            stat("results not yet published", o.relay_pending),
            stat("relay lag", formatNumber(o.relay_lag_seconds) + " s"))),
        el("div", { class: "grid" },
          el("div", { class: "card" }, el("h2", { text: "Proposals in the last " + windows[win] }),
            el("p", { class: "muted", text: accepted + " accepted, " + deduped + " deduplicated, " + rejected + " rejected (event ids first seen in the window; a redelivery of one changes nothing and is not counted)" }),
            barChart(o.decisions, "chart-decisions")),
          el("div", { class: "card" }, el("h2", { text: "Unknown outcomes in the last " + windows[win] }),
            el("div", { class: "stats" },
              stat("became unknown", u.entered),
              stat("resolved without a person", share),
              stat("handed to a person", u.escalated ?? 0),
              stat("mean time unknown", u.mean_ms === null ? "—" : formatNumber(u.mean_ms) + " ms"),
              stat("p99 time unknown", u.p99_ms === null ? "—" : u.p99_ms + " ms")),
            barChart(u.resolved, "chart-unknown")),
          el("div", { class: "card" }, el("h2", { text: "Live operations by state" }),
            barChart(o.live, "chart-live")),
          el("div", { class: "card" }, el("h2", { text: "Dispatch queue depth" }),
            lineChart(samples.map((s) => s.queued), "", "chart-queue")),
          el("div", { class: "card" }, el("h2", { text: "Relay lag (oldest unpublished result)" }),
            lineChart(samples.map((s) => s.lag), " s", "chart-lag"))));
    } catch (e) {
      error.textContent = e.message;
    }
  };
  load();
  every(REFRESH_MS, load);
}

function stat(label, value, href, id) {
  const v = el("div", { class: "big", id, text: String(value) });
  return el("div", {}, el("span", { text: label }), href ? el("a", { href }, v) : v);
}

// ---------- start ----------

document.addEventListener("DOMContentLoaded", async () => {
  document.getElementById("sign-in-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const input = document.getElementById("token");
    try {
      await signIn(input.value.trim());
      input.value = "";
      document.getElementById("sign-in-error").textContent = "";
      refreshCounts();
      route();
    } catch (e) {
      document.getElementById("sign-in-error").textContent = e.message;
    }
  });
  document.getElementById("sign-out").addEventListener("click", () => signOut("Signed out."));
  window.addEventListener("hashchange", route);
  setInterval(() => { if (me) refreshCounts(); }, 5000);
  const saved = sessionStorage.getItem(TOKEN_KEY);
  if (saved) {
    try {
      await signIn(saved);
      refreshCounts();
      route();
      return;
    } catch { /* fall through to the form */ }
  }
  show("sign-in");
});
