// The NATS pipelines view: reads the plugin's JSON (same origin, the user's Airflow session
// cookie) and draws plain tables. No build step, no framework. The page's state is in its
// URL (?conn=&stream=&group=&dag_id=&run_id=), so a link shows the same group and DAG run;
// body[data-state] says "ready" once the data is drawn (the browser tests wait on it).
"use strict";

const params = new URLSearchParams(location.search);
const state = { conn: params.get("conn") || "", stream: params.get("stream") || "",
                group: params.get("group") || "", dagId: params.get("dag_id") || "",
                runId: params.get("run_id") || "" };
const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k.startsWith("data-")) e.setAttribute(k, v);
    else if (k === "onclick") e.addEventListener("click", v);
    else e[k] = v;
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function table(columns, rows, rowAttrs) {
  // columns: [header, field, {num, fmt}]; rows: objects
  const head = el("tr", {}, ...columns.map(([h]) => el("th", {}, h)));
  const body = rows.map((r, i) => el("tr", rowAttrs ? rowAttrs(r, i) : {},
    ...columns.map(([, f, o]) => {
      const v = typeof f === "function" ? f(r) : r[f];
      const shown = o && o.fmt ? o.fmt(v, r) : v;
      return el("td", { class: o && o.num ? "num" : "", "data-field": typeof f === "string" ? f : "" },
        shown === null || shown === undefined ? "-" : shown);
    })));
  return el("table", {}, el("thead", {}, head), el("tbody", {}, ...body));
}

function setUrl() {
  const q = new URLSearchParams();
  if (state.conn) q.set("conn", state.conn);
  if (state.stream) q.set("stream", state.stream);
  if (state.group) q.set("group", state.group);
  if (state.dagId) q.set("dag_id", state.dagId);
  if (state.runId) q.set("run_id", state.runId);
  history.replaceState(null, "", "?" + q.toString());
}

async function getJson(path, init) {
  const r = await fetch(path, Object.assign({ credentials: "same-origin",
    headers: { "Accept": "application/json", "Content-Type": "application/json" } }, init || {}));
  let body = null;
  try { body = await r.json(); } catch (e) { body = null; }
  if (!r.ok) {
    const detail = body && body.detail ? (typeof body.detail === "string" ? body.detail
      : JSON.stringify(body.detail)) : r.statusText;
    const err = new Error(r.status + ": " + detail);
    err.status = r.status;
    throw err;
  }
  return body;
}

const enc = encodeURIComponent;
const connPath = () => "api/connections/" + enc(state.conn);
const groupPath = () => connPath() + "/streams/" + enc(state.stream) + "/groups/" + enc(state.group);
const age = (s) => (s === null || s === undefined) ? "-" : s.toFixed(1) + " s ago";
const when = (t) => t ? new Date(t * 1000).toISOString().replace("T", " ").slice(0, 19) + " UTC" : "-";

function showError(e) { $("error").textContent = e ? String(e.message || e) : ""; }

async function loadConnections() {
  const data = await getJson("api/connections");
  const sel = $("conn");
  sel.replaceChildren(...data.connections.map((c) =>
    el("option", { value: c.connection_id }, c.connection_id)));
  if (!state.conn && data.connections.length) state.conn = data.connections[0].connection_id;
  if (state.conn && !data.connections.some((c) => c.connection_id === state.conn))
    sel.append(el("option", { value: state.conn }, state.conn));
  sel.value = state.conn;
  if (!data.connections.length && !state.conn)
    throw new Error("no Airflow connection of type 'nats': add one under Admin > Connections");
}

function drawStreams(streams) {
  if (!streams.length) { $("streams").replaceChildren(el("p", { class: "muted" }, "no partitioned streams on this server")); return; }
  const blocks = [table([
    ["stream", "stream"], ["partitions", "partitions", { num: true }],
    ["layout epoch", "epoch", { num: true }],
    ["earlier layouts", (s) => (s.layouts || []).filter((l) => l.epoch !== s.epoch)
      .map((l) => "epoch " + l.epoch + ": " + l.partitions + " partitions" +
        (l.pending ? " (switch pending)" : " up to seq " + l.switch_seq)).join("; ") || "none"],
    ["messages", "messages", { num: true }], ["replicas", "replicas", { num: true }],
    ["subjects", (s) => s.error ? s.error : s.subjects],
  ], streams, (s) => ({ "data-stream": s.stream }))];
  for (const s of streams) {
    if (s.error) continue;
    blocks.push(el("h3", {}, "Run ledger of " + s.stream));
    blocks.push(s.runs.length ? table([
      ["producer id (DAG id.task id.logical date for an Airflow task)", "producer_id"],
      ["status", "status", { fmt: (v) => el("span", { class: v === "complete" ? "ok" : v === "partial" ? "bad" : "warn" }, v) }],
      ["attempts", "attempts", { num: true }], ["acked", "acked", { num: true }],
      ["failed", "failed", { num: true }], ["refused", "refused", { num: true }],
      ["started", "started", { fmt: when }], ["finished", "finished", { fmt: when }],
      ["error", "error"],
    ], s.runs, (r) => ({ "data-run": r.producer_id })) : el("p", { class: "muted" }, "no named runs published"));
    blocks.push(el("h3", {}, "Global producers of " + s.stream));
    blocks.push(s.producers.length ? table([
      ["producer", "producer"], ["state", "state"], ["watermark (event time)", "watermark"],
      ["seq", "seq"], ["written", "age", { fmt: age }], ["closed by", "closed_by"],
    ], s.producers) : el("p", { class: "muted" }, "no global producers"));
  }
  $("streams").replaceChildren(...blocks);
}

function drawGroups(groups) {
  if (!groups.length) { $("groups").replaceChildren(el("p", { class: "muted" }, "no consumer groups (a group exists once a worker joins it)")); return; }
  $("groups").replaceChildren(table([
    ["stream", "stream"],
    ["group", (g) => el("button", { class: "link", type: "button", "data-open": g.stream + "/" + g.group,
      onclick: () => { state.stream = g.stream; state.group = g.group; setUrl(); refresh(); } }, g.group)],
    ["members", (g) => g.members.length, { num: true }],
    ["partitions owned", (g) => g.owned + "/" + g.partitions],
    ["lag", "total_lag", { num: true }],
    ["drained", (g) => g.drained ? "yes" : "no"],
    ["blocked", (g) => g.blocked.join(", ") || "none"],
    ["dead letters", "dead_letters", { num: true }],
    ["problems", (g) => g.problems.length ? el("span", { class: "bad" }, g.problems.length) : "0"],
  ], groups, (g) => ({ "data-group": g.stream + "/" + g.group,
    class: g.stream === state.stream && g.group === state.group ? "selected" : "" })));
}

function drawGroup(st, letters) {
  $("group").hidden = false;
  $("group-title").textContent = "Group " + st.group + " of " + st.stream;
  $("group-summary").replaceChildren(el("p", {},
    "generation " + (st.generation ?? "-") + ", leader " + (st.leader || "-") + ", " +
    st.members.length + " member(s), lag " + st.total_lag + (st.drained ? ", drained" : "") +
    ", layout epoch " + st.epoch + (st.stream_epoch !== st.epoch ? " (stream at epoch " +
      st.stream_epoch + ", " + st.later_layout_messages + " records of later layouts waiting)" : "")));
  $("partitions").replaceChildren(table([
    ["partition", "partition", { num: true }], ["owner", "owner"],
    ["fencing token", "fencing_token", { num: true }], ["committed", "committed", { num: true }],
    ["last", "last", { num: true }], ["lag", "lag", { num: true }],
    ["blocked", "blocked", { fmt: (v) => v ? el("span", { class: "bad" }, v) : "no" }],
  ], st.partitions, (p) => ({ "data-partition": String(p.partition) })));
  $("members").replaceChildren(st.members.length ? table([
    ["member", "member"], ["host", "host"], ["pid", "pid", { num: true }],
    ["partitions", (m) => m.partitions.join(", ") || "none"],
    ["heartbeat", "heartbeat_age", { fmt: age }],
    ["health", (m) => m.heartbeat_age < 30 ? el("span", { class: "ok" }, "alive")
      : el("span", { class: "bad" }, "no heartbeat for " + Math.round(m.heartbeat_age) + " s")],
  ], st.members, (m) => ({ "data-member": m.member })) : el("p", { class: "bad" }, "no live members"));
  const g = st.global_order;
  $("global-order").replaceChildren(...(g ? [el("h3", {}, "Global-order reader"), table([
    ["position", (x) => x.position_time || x.position], ["order", "order"],
    ["fencing token", "fencing_token", { num: true }], ["written by", "member"],
    ["written", "written_age", { fmt: age }], ["late records", "late", { num: true }],
    ["reader", (x) => x.reader || "none running"],
    ["held back by", (x) => x.held_back_by.join(", ") || "-"], ["error", "error"],
  ], [g])] : []));
  $("problems").replaceChildren(st.problems.length
    ? el("ul", {}, ...st.problems.map((p) => el("li", { class: "bad" }, p)))
    : el("p", { class: "ok" }, "none"));
  const dl = st.dead_letters;
  const rows = letters ? letters.dead_letters : [];
  $("dead-letters").replaceChildren(
    el("p", { class: "muted" }, dl.exists ? dl.messages + " in stream " + dl.stream + " (" + dl.subjects + ")"
      : "none (stream " + dl.stream + " does not exist)"),
    ...(rows.length ? [table([
      ["seq", "seq", { num: true }], ["partition", "partition", { num: true }],
      ["origin seq", "origin_seq", { num: true }], ["key", "key"], ["reason", "reason"],
      ["time", "time"],
      ["", (x) => el("button", { class: "link", type: "button", onclick: () => showLetter(x.seq) }, "show")],
    ], rows, (x) => ({ "data-dead-letter": String(x.seq) }))] : []));
  document.body.dataset.group = st.stream + "/" + st.group;
}

function drawDagRun(d) {
  // one block per drain sensor: what it is, then each mark against the group's position
  const blocks = [];
  if (!d.sensors.length) blocks.push(el("p", { class: "muted" }, "no NatsGroupDrainSensor in this DAG run"));
  for (const s of d.sensors) {
    const id = s.task_id + (s.map_index >= 0 ? "[" + s.map_index + "]" : "");
    blocks.push(el("h3", {}, "Sensor " + id));
    blocks.push(table([
      ["task", () => id], ["state", "state"], ["stream", "stream"], ["group", "group"],
      ["marks from", (x) => x.marks_source || (x.run ? "run " + x.run : x.high_water_marks) || "-"],
      ["connection", "connection_id"], ["try", "try_number", { num: true }],
    ], [s], () => ({ "data-sensor": id })));
    const w = s.wait;
    if (s.error) blocks.push(el("p", { class: "bad" }, s.error));
    if (!s.marks) {
      blocks.push(el("p", { class: "muted" }, s.rendered ? "no marks resolved yet"
        : "not started yet: its marks are resolved at its first poke"));
      continue;
    }
    if (!w) continue;
    blocks.push(el("p", { class: w.drained ? "ok" : "warn", "data-sensor-drained": id },
      w.drained ? "drained up to its marks" : "still waiting on partition(s) " +
        (w.behind.join(", ") || "-") + (w.group_exists ? "" : " (the group has no state yet: no worker has joined it)")));
    for (const why of w.waiting_for) blocks.push(el("p", { class: "bad" }, why));
    blocks.push(table([
      ["partition", "partition", { num: true }], ["mark", "mark", { num: true }],
      ["committed", "committed", { num: true }],
      ["lag to mark", "lag_to_mark", { num: true }],
      ["behind", "behind", { fmt: (v, r) => r.earlier_layout ? "no (earlier layout)"
        : v ? el("span", { class: "bad" }, "yes") : el("span", { class: "ok" }, "no") }],
      ["blocked", "blocked", { fmt: (v) => v ? el("span", { class: "bad" }, v) : "no" }],
    ], w.marks, (m) => ({ "data-sensor-mark": id + "/" + m.partition })));
  }
  $("dagrun").replaceChildren(...blocks);
  document.body.dataset.dagrun = d.dag_id + "/" + d.run_id;
}

async function loadDagRun() {
  if (!(state.dagId && state.runId)) return;
  const q = "?dag_id=" + enc(state.dagId) + "&run_id=" + enc(state.runId) +
    (state.conn ? "&conn=" + enc(state.conn) : "");
  try {
    drawDagRun(await getJson("api/dagrun" + q));
  } catch (e) {
    $("dagrun").replaceChildren(el("p", { class: "bad", "data-dagrun-error": "1" }, e.message));
    document.body.dataset.dagrun = "error";
  }
}

async function showLetter(seq) {
  try {
    const d = await getJson(groupPath() + "/dead-letters/" + seq);
    const pre = $("dead-letter");
    pre.hidden = false;
    pre.dataset.seq = String(seq);
    pre.textContent = JSON.stringify(d, null, 2);
  } catch (e) { showError(e); }
}

async function act(action, body) {
  const out = $("action-result");
  out.hidden = false;
  out.dataset.state = "running";
  out.textContent = action + "...";
  try {
    const d = await getJson(groupPath() + "/actions/" + action, {
      method: "POST", body: JSON.stringify(Object.assign({ confirm: $("confirm").value }, body || {})) });
    out.textContent = action + " done:\n" + JSON.stringify(d, null, 2);
    out.dataset.state = "done";
    await refresh();
  } catch (e) {
    out.textContent = action + " refused: " + e.message;
    out.dataset.state = "refused";
  }
}

async function refresh() {
  document.body.dataset.state = "loading";
  showError(null);
  try {
    await loadDagRun();  // its own errors in its panel: the rest is drawn anyway
    if (!$("conn").options.length) await loadConnections();
    if (!state.conn) { document.body.dataset.state = "ready"; return; }
    setUrl();
    const ov = await getJson(connPath() + "/overview");
    drawStreams(ov.streams);
    drawGroups(ov.groups);
    if (state.stream && state.group) {
      const [st, letters] = await Promise.all([getJson(groupPath()),
        getJson(groupPath() + "/dead-letters").catch(() => null)]);
      drawGroup(st, letters);
    } else {
      $("group").hidden = true;
    }
    $("updated").textContent = "updated " + new Date().toISOString().slice(11, 19) + " UTC";
    document.body.dataset.state = "ready";
  } catch (e) {
    showError(e);
    document.body.dataset.state = "error";
  }
}

$("conn").addEventListener("change", () => {
  state.conn = $("conn").value; state.stream = ""; state.group = ""; refresh();
});
$("refresh").addEventListener("click", () => refresh());
$("dag-id").value = state.dagId;
$("run-id").value = state.runId;
$("dagrun-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  state.dagId = $("dag-id").value.trim(); state.runId = $("run-id").value.trim();
  setUrl(); refresh();
});
$("act-rebalance").addEventListener("click", () => act("rebalance"));
$("act-reset-earliest").addEventListener("click", () => act("reset", { to: "earliest" }));
$("act-reset-latest").addEventListener("click", () => act("reset", { to: "latest" }));
$("act-replay").addEventListener("click", () => act("replay-dead-letters"));
refresh();
