// gpuherd dashboard: one page, a view per hash route, redrawn from /api/ whenever the server says the
// log moved (server-sent events). Every value from the log goes into the page as text (textContent),
// never as markup: job names, users, commands and output are the submitters' words.
"use strict";

const $view = document.getElementById("view");
const $live = document.getElementById("live");
const $flash = document.getElementById("flash");
const $token = document.getElementById("token");
let session = { actions: false };
let current = null; // { name, arg, params }
let drawing = false;
let dirty = false;
let charts = [];

// -- small helpers -----------------------------------------------------------------------------------

function h(tag, props, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "text") el.textContent = String(v);
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "style") el.setAttribute("style", v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

function svg(tag, attrs) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  return el;
}

async function api(path, options) {
  const res = await fetch(path, options);
  const body = await res.json().catch(() => null);
  if (!res.ok) throw new Error((body && body.error) || `${res.status} ${res.statusText}`);
  return { body, res };
}

function fmtTime(ts) {
  if (ts === null || ts === undefined) return "";
  const d = new Date(ts * 1000);
  return d.toISOString().replace("T", " ").slice(0, 19);
}

function fmtDur(s) {
  if (s === null || s === undefined || !isFinite(s)) return "";
  if (s < 1) return `${(s * 1000).toFixed(0)} ms`;
  if (s < 120) return `${s.toFixed(1)} s`;
  if (s < 7200) return `${(s / 60).toFixed(1)} min`;
  if (s < 172800) return `${(s / 3600).toFixed(1)} h`;
  return `${(s / 86400).toFixed(1)} d`;
}

function num(n, digits = 0) {
  return n === null || n === undefined ? "" : Number(n).toLocaleString(undefined, { maximumFractionDigits: digits });
}

function table(columns, rows, rowFn, attrs) {
  return h("table", attrs || {},
    h("thead", {}, h("tr", {}, columns.map((c) => h("th", { class: c.num ? "num" : "" }, c.label || c)))),
    h("tbody", {}, rows.map((r) => h("tr", {}, rowFn(r).map((cell, i) =>
      h("td", { class: columns[i].num ? "num" : "" }, cell))))));
}

function jobLink(id) { return h("a", { href: `#/job/${encodeURIComponent(id)}`, class: "joblink" }, id); }
function badge(status) { return h("span", { class: `badge ${status}` }, status); }
function card(k, v, cls, testid) { return h("div", { class: `card ${cls || ""}`, "data-testid": testid }, h("div", { class: "k" }, k), h("div", { class: "v" }, v)); }

function flash(message, error) {
  $flash.textContent = message;
  $flash.className = error ? "error" : "";
  $flash.hidden = false;
  clearTimeout(flash.timer);
  flash.timer = setTimeout(() => { $flash.hidden = true; }, 5000);
}

// Every operator action (cancel, drain, undrain, running the audit) sends the token typed into the
// page as a header, never a cookie: another site cannot make the browser send it.
function operatorHeaders() {
  return { "Content-Type": "application/json", Authorization: `Bearer ${$token.value.trim()}` };
}

async function act(path, reason) {
  flash("sending…"); // (with NATS away the server answers only after its timeout: say something meanwhile)
  try {
    const { body } = await api(path, { method: "POST", headers: operatorHeaders(), body: JSON.stringify({ reason }) });
    flash(body.done);
  } catch (err) {
    flash(err.message, true);
  }
}

function hue(text) { // a stable colour per job on the heatmap
  let x = 0;
  for (const ch of text) x = (x * 31 + ch.charCodeAt(0)) >>> 0;
  return x % 360;
}

function spark(values) {
  const s = svg("svg", { class: "spark", viewBox: "0 0 60 18", preserveAspectRatio: "none" });
  const ys = values.filter((v) => v !== null && v !== undefined);
  if (ys.length < 2) return s;
  const lo = Math.min(...ys), hi = Math.max(...ys), span = hi - lo || 1;
  const pts = values.map((v, i) => v === null || v === undefined ? null
    : `${(i / (values.length - 1)) * 60},${17 - ((v - lo) / span) * 16}`).filter(Boolean);
  s.append(svg("polyline", { points: pts.join(" ") }));
  return s;
}

function lineChart(title, xs, series, opts) {
  const el = h("div", { class: "chart", "data-testid": opts && opts.testid });
  if (!xs.length) { el.append(h("p", { class: "dim" }, `${title}: nothing yet`)); return el; }
  const palette = ["#4fa3ff", "#f0ad4e", "#5cb85c", "#d9534f", "#9b6bff", "#5bc0de", "#e83e8c", "#aaa"];
  // A chart in a two-column grid (a job's progress) gets half the page: the full width put two
  // 1100px charts side by side, twice as wide as the page. (Below 720px the grid is one column.)
  const full = $view.clientWidth - 40;
  const half = opts && opts.half && window.innerWidth > 720;
  const width = Math.max(280, Math.min(1100, half ? full / 2 - 24 : full));
  const plot = new uPlot({
    title, width, height: (opts && opts.height) || 260,
    scales: { x: { time: !(opts && opts.xNotTime) } },
    axes: [{ stroke: "#8a96a3", grid: { stroke: "#2a323c" } }, { stroke: "#8a96a3", grid: { stroke: "#2a323c" }, size: 64 }], // (room for "20,000")
    series: [{}, ...series.map((s, i) => ({ label: s.label, stroke: palette[i % palette.length], width: 1.5 }))],
  }, [xs, ...series.map((s) => s.values)], el);
  charts.push(plot);
  return el;
}

// -- views -------------------------------------------------------------------------------------------

const views = {};

views.overview = async () => {
  const { body: o } = await api("/api/overview");
  const g = o.gpus;
  const audit = o.audit;
  const auditCard = audit === null ? card("last audit", "not run", "", "audit")
    : card("last audit", audit.ok ? "clean" : "MISMATCHES", audit.ok ? "good" : "bad", "audit");
  const racks = o.racks.map((rack) => h("div", { class: "rack" },
    h("div", { class: "label" }, `rack ${rack.rack}`),
    h("div", { class: "nodes" }, rack.nodes.map((node) => h("div", { class: `hnode ${node.status}`, title: `${node.node} (${node.status})`, "data-node": node.node },
      node.islands.map((island) => h("div", { class: "island" }, island.map(([index, state, job]) => {
        const title = `${node.node} GPU ${index}: ${state}${job ? ` (${job})` : ""}`;
        const style = state === "busy" && job ? `background: hsl(${190 + (hue(job) % 110)} 70% 58%)` : null; // blues to violets: never a state's colour
        return h("span", { class: `gpu state-${state}`, title, style, "data-job": job || null });
      }))))))));
  return h("section", {},
    h("h1", {}, "Overview"),
    h("div", { class: "cards" },
      card("GPUs free", num(g.free), "", "gpus-free"), card("GPUs busy", num(g.busy), "", "gpus-busy"),
      card("unhealthy", num(g.unhealthy), g.unhealthy ? "bad" : ""), card("drained", num(g.drained)),
      card("powered off", num(g.powered_off)), card("lost", num(g.lost), g.lost ? "bad" : ""),
      card("jobs running", num(o.jobs.running + o.jobs.placed), "", "jobs-running"),
      card("jobs waiting", num(o.jobs.waiting), "", "jobs-waiting"),
      card("placements / min", num(o.placements_per_min, 1)),
      card("decision latency p50 / p99", `${fmtDur(o.decision_latency_s.p50)} / ${fmtDur(o.decision_latency_s.p99)}`),
      auditCard),
    h("h2", {}, "GPUs by rack, node and NVLink island"),
    h("div", { class: "legend" }, ["free", "busy", "unhealthy", "drained", "powered_off", "lost"].map((s) =>
      h("span", {}, h("span", { class: `gpu state-${s}` }), ` ${s.replace("_", " ")}`))),
    h("div", { class: "racks", "data-testid": "heatmap" }, racks),
    h("p", { class: "dim" }, `log position ${num(o.seq)}, newest event ${fmtTime(o.now)}`));
};

views.queue = async () => {
  const { body: q } = await api("/api/queue");
  const cols = [{ label: "#", num: true }, "job", "name", "user", "VC", { label: "GPUs", num: true },
    { label: "waiting", num: true }, "expected start", "why it waits"];
  return h("section", {},
    h("h1", {}, `Queue: ${q.waiting.length} waiting, in ${q.policy} order`),
    q.waiting.length === 0 ? h("p", { class: "dim" }, "No job waits.") :
      table(cols, q.waiting, (w) => [w.position, jobLink(w.job), w.name, w.user, w.vc, w.gpus, fmtDur(w.waiting_s),
        w.estimated_start == null ? h("span", { class: "dim" }, "no forecast") : `${fmtTime(w.estimated_start)} (in ${fmtDur(Math.max(0, w.estimated_start - q.now))})`,
        h("span", {}, h("b", {}, w.kind), `: ${w.why}`)], { "data-testid": "queue-table" }));
};

views.jobs = async (arg, params) => {
  const query = new URLSearchParams();
  for (const k of ["status", "user", "vc", "name", "sort"]) if (params.get(k)) query.set(k, params.get(k));
  const limit = Number(params.get("limit") || 200);
  query.set("limit", limit);
  const { body: jobs, res } = await api(`/api/jobs?${query}`);
  const total = Number(res.headers.get("X-Total-Count"));
  const field = (name, placeholder) => h("input", { name, placeholder, value: params.get(name) || "" });
  const status = h("select", { name: "status" }, ["", "pending", "placed", "running", "completed", "failed", "cancelled", "timeout"].map((s) =>
    h("option", { value: s, selected: params.get("status") === s && s !== "" }, s || "any status")));
  const sort = h("select", { name: "sort" }, [["-order", "newest first"], ["order", "oldest first"], ["-gpus", "most GPUs"], ["user", "user"], ["name", "name"], ["vc", "VC"], ["status", "status"]].map(([v, l]) =>
    h("option", { value: v, selected: (params.get("sort") || "-order") === v }, l)));
  const form = h("form", { class: "filters", onsubmit: (e) => {
    e.preventDefault();
    const p = new URLSearchParams();
    for (const [k, v] of new FormData(form)) if (v) p.set(k, v);
    location.hash = `#/jobs?${p}`;
  } }, status, field("user", "user"), field("vc", "VC"), field("name", "name contains"), sort, h("button", { type: "submit" }, "filter"));
  const cols = ["job", "name", "user", "VC", { label: "GPUs", num: true }, "status", { label: "attempt", num: true }, "submitted", "nodes"];
  return h("section", {},
    h("h1", {}, `Jobs: ${num(total)}${total > jobs.length ? ` (showing ${jobs.length})` : ""}`), form,
    table(cols, jobs, (j) => [jobLink(j.job), j.spec.name, j.spec.user, j.spec.vc, j.spec.gpus, badge(j.status), j.attempt,
      fmtTime(j.submitted_at), [...new Set(j.allocations.map((a) => a.node))].join(", ")], { "data-testid": "jobs-table" }),
    total > jobs.length ? h("button", { onclick: () => { params.set("limit", limit + 500); location.hash = `#/jobs?${params}`; } }, "show more") : null);
};

views.job = async (id) => {
  const { body: j } = await api(`/api/jobs/${encodeURIComponent(id)}`);
  const facts = [["status", badge(j.status)], ["name", j.spec.name], ["user", j.spec.user], ["VC", j.spec.vc],
    ["GPUs", j.spec.gpus], ["attempt", j.attempt], ["submitted", fmtTime(j.submitted_at)], ["why", j.why]];
  if (j.status === "pending") {
    facts.push(["position", j.position ?? ""]);
    facts.push(["expected start", j.estimated_start != null ? fmtTime(j.estimated_start) : "no forecast"]);
  }
  if (j.spec.command && j.spec.command.length) facts.push(["command", j.spec.command.join(" ")]);
  if (j.spec.workflow_of) facts.push(["workflow", h("a", { href: `#/workflow/${encodeURIComponent(j.spec.workflow_of.workflow)}` }, `${j.spec.workflow_of.name} (${j.spec.workflow_of.workflow}), step ${j.spec.workflow_of.step}`)]);
  if (j.spec.array_of) facts.push(["array", `element ${j.spec.array_of.index} of ${j.spec.array_of.size} of ${j.spec.array_of.array}` + (j.spec.array_of.max_running ? `, at most ${j.spec.array_of.max_running} at once` : "")]);
  if (j.spec.depends_on) {
    const deps = Object.entries(j.spec.depends_on).filter(([, ids]) => ids.length);
    facts.push(["depends on", h("span", {}, deps.map(([kind, ids]) => h("span", {}, `${kind}: `, ids.map((id) => [jobLink(id), " "]))))]);
  }
  if (j.spec.time_limit_s) facts.push(["time limit", fmtDur(j.spec.time_limit_s)]);
  if (j.locality) facts.push(["locality", j.locality]);
  if (j.allocations.length) facts.push(["placement", j.allocations.map((a) => `${a.node}: GPUs ${a.gpus.join(",")}`).join("; ")]);
  if (j.final_metrics) facts.push(["final metrics", JSON.stringify(j.final_metrics)]);
  const ids = new Set(j.timeline.map((e) => e.id));
  const timeline = table(["time", "event", "detail", "by", "cause", { label: "based on", num: true }, { label: "seq", num: true }], j.timeline, (e) => [
    fmtTime(e.at), h("b", {}, e.what), e.detail, e.source,
    e.cause ? (ids.has(e.cause) ? h("a", { href: `#ev-${e.cause}`, onclick: (ev) => { ev.preventDefault(); document.getElementById(`ev-${e.cause}`)?.scrollIntoView(); } }, e.cause) : h("span", { class: "dim" }, e.cause)) : "",
    e.based_on || "", h("span", { id: `ev-${e.id}` }, e.seq)], { "data-testid": "timeline" });
  const out = jobOutput(id, `${j.status}|${j.attempt}|${j.timeline.length}`);
  const progress = j.progress || [];
  const keys = [...new Set(progress.flatMap((p) => Object.keys(p)))].filter((k) => !["at", "step"].includes(k));
  const charts = h("div", { class: "grid2" }, keys.slice(0, 4).map((k) =>
    lineChart(k, progress.map((p) => p.step), [{ label: k, values: progress.map((p) => p[k] ?? null) }], { xNotTime: true, height: 200, half: true, testid: `progress-${k}` })));
  const canCancel = session.actions && !["completed", "failed", "cancelled", "timeout"].includes(j.status);
  return h("section", {},
    h("h1", {}, `Job ${j.job}`),
    canCancel ? h("button", { class: "danger", "data-testid": "cancel", onclick: () => act(`/api/jobs/${encodeURIComponent(j.job)}/cancel`, "cancelled from the dashboard") }, "cancel job") : null,
    h("dl", { class: "facts" }, facts.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)])),
    h("h2", {}, "Timeline"), timeline,
    j.rescales.length ? [h("h2", {}, "Rescales"), table(["time", "workers", "notice", "quiesce", "re-form", "restore", "first step", "pause", "total"], j.rescales,
      (r) => [fmtTime(r.at), r.failed ? `failed: ${r.failed}` : `${r.world_before} -> ${r.world}`, fmtDur(r.notice_s), fmtDur(r.wait_s), fmtDur(r.reform_s), fmtDur(r.restore_s), fmtDur(r.first_step_s), fmtDur(r.pause_s), fmtDur(r.total_s)])] : null,
    j.leases.length ? [h("h2", {}, "Memory leases"), table(["lease", "state", "granted", "ended", "shares"], j.leases,
      (l) => [l.lease, l.state, fmtTime(l.granted_at), fmtTime(l.ended_at), JSON.stringify(l.shares || [])])] : null,
    keys.length ? [h("h2", {}, "Progress"), charts] : null,
    h("h2", {}, "Output"), out);
};

// A job's output is kept between redraws of its page: the page redraws at every change of the log or
// of telemetry (several a second on a busy cluster), and fetching it at each asked every agent the
// job ran on for it again and showed "loading output..." in between. It is fetched again when the job
// moves on (status, attempt, timeline) and, while nothing else changes, at most every OUTPUT_REFRESH_MS.
const OUTPUT_REFRESH_MS = 3000;
let kept = { id: null, key: null, at: 0, text: null, el: null, asked: 0 };

function jobOutput(id, key) {
  if (kept.id !== id) kept = { id, key: null, at: 0, text: null, el: null, asked: 0 };
  const out = h("pre", { class: "output", "data-testid": "output" }, kept.text ?? "loading output...");
  kept.el = out; // (an answer still on its way goes into the page shown now)
  if (kept.key !== key || Date.now() - kept.at >= OUTPUT_REFRESH_MS) {
    kept.key = key;
    kept.at = Date.now();
    const mine = kept, n = ++kept.asked;
    const show = (text) => { if (mine.asked === n) { mine.text = text; mine.el.textContent = text; } }; // (the latest answer only)
    api(`/api/jobs/${encodeURIComponent(id)}/output`).then(({ body }) => {
      show(body.map((a) => {
        if (!a.ok) return `== attempt ${a.attempt} on ${a.node}: ${a.error}`;
        const files = (a.attempts || {})[String(a.attempt)] || {};
        const parts = Object.entries(files).map(([name, text]) => `== attempt ${a.attempt} on ${a.node}: ${name}\n${text}`);
        return parts.length ? parts.join("\n") : `== attempt ${a.attempt} on ${a.node}: no output`;
      }).join("\n") || "no output (the job has not run)");
    }).catch((err) => { show(`output unavailable: ${err.message}`); });
  }
  return out;
}

views.nodes = async () => {
  const { body: nodes } = await api("/api/nodes");
  return h("section", {},
    h("h1", {}, `Nodes: ${nodes.length}`),
    h("div", { class: "nodecards", "data-testid": "nodes" }, nodes.map((n) => h("div", { class: "nodecard", "data-node": n.node },
      h("h3", {}, n.node, badge(n.status), n.power !== "on" ? badge(`power ${n.power}`) : null, h("span", { class: "dim" }, `${n.rack} / ${n.executor}`),
        session.actions ? (n.status === "drained"
          ? h("button", { "data-testid": `undrain-${n.node}`, onclick: () => act(`/api/nodes/${encodeURIComponent(n.node)}/undrain`, "") }, "undrain")
          : h("button", { class: "danger", "data-testid": `drain-${n.node}`, onclick: () => act(`/api/nodes/${encodeURIComponent(n.node)}/drain`, "drained from the dashboard") }, "drain")) : null),
      n.reason ? h("div", { class: "dim" }, n.reason) : null,
      h("div", { class: "gpurow dim" }, ["GPU", "state", "job", "util %", "mem MB", "power W", "temp C"].map((t) => h("span", {}, t))),
      n.gpus.map((g) => {
        const s = g.samples || [];
        const last = s.length ? s[s.length - 1] : null;
        const col = (i) => h("span", { title: last && last[i] !== null ? String(last[i]) : "no samples" }, spark(s.map((x) => x[i])));
        return h("div", { class: "gpurow" }, h("span", {}, `GPU ${g.info.index}`), h("span", { class: `badge` }, h("span", { class: `gpu state-${g.state}` }), ` ${g.state}`),
          h("span", {}, g.job ? jobLink(g.job) : "", g.healthy ? "" : h("span", { class: "dim" }, ` ${g.health_reason}`)), col(1), col(2), col(3), col(4));
      })))));
};

views.vcs = async () => {
  const { body: vcs } = await api("/api/vcs");
  const top = Math.max(1, ...vcs.map((v) => Math.max(v.gpu_quota || 0, v.in_use + v.waiting_gpus)));
  const bar = (v) => {
    const pct = (x) => `${(100 * x) / top}%`;
    return h("div", { class: "bar", title: `${v.in_use} in use (${v.borrowed} borrowed), quota ${v.gpu_quota ?? "none"}, ${v.waiting_gpus} GPUs asked by waiting jobs` },
      h("span", { class: "used", style: `left:0;width:${pct(v.in_use - v.borrowed)}` }),
      h("span", { class: "borrowed", style: `left:${pct(v.in_use - v.borrowed)};width:${pct(v.borrowed)}` }),
      v.gpu_quota !== null ? h("span", { class: "quota", style: `left:0;width:${pct(v.gpu_quota)}` }) : null);
  };
  return h("section", {},
    h("h1", {}, "Virtual clusters"),
    table(["VC", { label: "quota", num: true }, { label: "in use", num: true }, { label: "borrowed", num: true }, { label: "waiting jobs", num: true },
      { label: "waiting GPUs", num: true }, { label: "fair-share use (GPU-h, decayed)", num: true }, "in use / quota"], vcs,
      (v) => [v.vc, v.gpu_quota ?? "none", v.in_use, v.borrowed, v.waiting_jobs, v.waiting_gpus, num(v.fair_share_gpu_s / 3600, 1), bar(v)], { "data-testid": "vcs-table" }),
    h("p", { class: "dim" }, "bars: blue in use within quota, violet borrowed beyond it, the white line the quota"));
};

views.history = async () => {
  const { body: hist } = await api("/api/history");
  const vcs = Object.keys(hist.busy);
  return h("section", {},
    h("h1", {}, "History"),
    lineChart("busy GPUs by VC", hist.at, vcs.map((vc) => ({ label: vc, values: hist.busy[vc] })), { testid: "history-busy" }),
    lineChart("waiting jobs", hist.at, [{ label: "queue", values: hist.queue }], { testid: "history-queue", height: 200 }),
    h("p", { class: "dim" }, `one point per ${hist.bucket_s} s of log time`));
};

views.usage = async () => {
  const { body: u } = await api("/api/usage");
  const outcomes = ["completed", "failed", "cancelled", "timeout"];
  const vcs = Object.keys(u.by_vc), users = Object.keys(u.by_user);
  return h("section", {},
    h("h1", {}, `Usage: ${num(u.total.gpu_hours, 2)} GPU-hours`),
    lineChart("GPU-hours per hour, by VC", u.at, vcs.map((vc) => ({ label: vc, values: u.by_vc[vc] })), { testid: "usage-vc" }),
    lineChart(`GPU-hours per hour, by user (${users.length < u.users ? `the ${users.length} heaviest of ${u.users}` : "all"})`, u.at,
      users.map((user) => ({ label: user, values: u.by_user[user] })), { testid: "usage-user", height: 220 }),
    table(["VC", "user", { label: "GPU-hours", num: true }, ...outcomes.map((o) => ({ label: o, num: true })), { label: "avg queue", num: true }], u.rows,
      (r) => [r.vc, r.user, num(r.gpu_hours, 3), ...outcomes.map((o) => num(r.jobs[o] || 0)), fmtDur(r.avg_queue_s)], { "data-testid": "usage-table" }),
    h("p", { class: "dim" }, `exact GPU-seconds from the log (gpuherd usage gives the same); ${u.running} jobs still running count up to ${fmtTime(u.log_end)}`));
};

views.workflows = async () => {
  const { body: wfs } = await api("/api/workflows");
  return h("section", {},
    h("h1", {}, `Workflows: ${wfs.length}`),
    wfs.length === 0 ? h("p", { class: "dim" }, "No workflow yet: gpuherd submit examples/workflow.yaml") :
      table(["workflow", "name", "user", "submitted", { label: "steps", num: true }, { label: "jobs", num: true }, "status", "jobs by state"], wfs,
        (w) => [h("a", { href: `#/workflow/${encodeURIComponent(w.workflow)}` }, w.workflow), w.name, w.user, fmtTime(w.submitted), w.steps, w.jobs, badge(w.status),
          Object.entries(w.states).map(([s, n]) => `${s} ${n}`).join(", ")], { "data-testid": "workflows-table" }));
};

views.workflow = async (id) => {
  const { body: wf } = await api(`/api/workflows/${encodeURIComponent(id)}`);
  // Layers: a step sits one right of the deepest step it depends on.
  const depth = {};
  const byName = Object.fromEntries(wf.steps.map((s) => [s.step, s]));
  const level = (name, seen = new Set()) => {
    if (depth[name] !== undefined) return depth[name];
    if (seen.has(name)) return 0;
    seen.add(name);
    const ups = byName[name].depends.filter((d) => d.step && byName[d.step]).map((d) => level(d.step, seen) + 1);
    return (depth[name] = Math.max(0, ...ups));
  };
  wf.steps.forEach((s) => level(s.step));
  const columns = {};
  for (const s of wf.steps) (columns[depth[s.step]] = columns[depth[s.step]] || []).push(s.step);
  const W = 170, H = 54, GX = 60, GY = 24;
  const pos = {};
  Object.entries(columns).forEach(([d, names]) => names.forEach((n, i) => { pos[n] = { x: 20 + Number(d) * (W + GX), y: 20 + i * (H + GY) }; }));
  const width = 40 + (Math.max(...Object.keys(columns).map(Number)) + 1) * (W + GX) - GX;
  const height = 40 + Math.max(...Object.values(columns).map((c) => c.length)) * (H + GY) - GY;
  const g = svg("svg", { class: "wfgraph", width, height, viewBox: `0 0 ${width} ${height}`, "data-testid": "workflow-graph" });
  const defs = svg("defs");
  const marker = svg("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 10, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" });
  marker.append(svg("path", { d: "M 0 0 L 10 5 L 0 10 z", fill: "#8a96a3" }));
  defs.append(marker);
  g.append(defs);
  for (const s of wf.steps) for (const d of s.depends) if (d.step && pos[d.step]) {
    const a = pos[d.step], b = pos[s.step];
    const line = svg("line", { x1: a.x + W, y1: a.y + H / 2, x2: b.x, y2: b.y + H / 2, "marker-end": "url(#arrow)" });
    const title = svg("title"); title.textContent = `${s.step} ${d.kind} ${d.step}`; line.append(title);
    g.append(line);
  }
  for (const s of wf.steps) {
    const p = pos[s.step];
    const link = svg("a", { href: `#/job/${encodeURIComponent(s.jobs[0].job)}`, "data-step": s.step, "data-status": s.status });
    link.append(svg("rect", { x: p.x, y: p.y, width: W, height: H, class: s.status }));
    const name = svg("text", { x: p.x + 10, y: p.y + 22 }); name.textContent = s.step;
    const done = s.jobs.filter((j) => ["completed", "failed", "cancelled", "timeout"].includes(j.status)).length;
    const note = svg("text", { x: p.x + 10, y: p.y + 40, class: "dim" });
    note.textContent = s.jobs.length > 1 ? `${s.status}: ${done}/${s.jobs.length} ended` : s.status;
    const tip = svg("title"); tip.textContent = `${s.step}: ${Object.entries(s.states).map(([k, n]) => `${k} ${n}`).join(", ")}`;
    link.append(name, note, tip);
    g.append(link);
  }
  return h("section", {},
    h("h1", {}, `Workflow ${wf.name} (${wf.workflow})`),
    g,
    table(["step", "status", { label: "GPUs", num: true }, "time limit", "depends on", "jobs"], wf.steps, (s) => [s.step, badge(s.status), s.gpus, fmtDur(s.time_limit_s),
      s.depends.map((d) => `${d.kind}:${d.step || d.job}`).join(", "), h("span", {}, s.jobs.map((j) => [jobLink(j.job), " ", badge(j.status), " "]))], { "data-testid": "workflow-steps" }));
};

views.services = async () => {
  const { body: s } = await api("/api/services");
  return h("section", {},
    h("h1", {}, "Services"),
    table(["service", "instance", "role", { label: "folded", num: true }, { label: "lag", num: true }, { label: "decisions", num: true }, { label: "dead letters", num: true }, "seen"],
      s.services, (x) => [x.service, x.instance, x.role, num(x.seq), num(x.lag), num(x.decisions), num(x.dead_letters), `${fmtDur(Math.max(0, s.now - x.updated_at))} ago`], { "data-testid": "services-table" }),
    (s.unreadable || []).length ? h("p", { class: "error" }, `Unreadable status entries: ${s.unreadable.map((u) => `${u.key} (${u.error})`).join("; ")}`) : null,
    h("h2", {}, `NATS: ${s.nats.server || "?"} ${s.nats.version || ""} ${s.nats.cluster ? `(cluster ${s.nats.cluster})` : "(a single server)"}`),
    table(["stream", { label: "messages", num: true }, { label: "bytes", num: true }, { label: "replicas", num: true }, "leader", "peers"], s.nats.streams,
      (st) => [st.name, num(st.messages), num(st.bytes), st.replicas, st.leader, st.peers.map((p) => `${p.name} (${p.current && !p.offline ? "current" : "behind"}, lag ${p.lag})`).join(", ")]),
    h("h2", {}, `Dead letters: ${s.dead_letter_count}`),
    s.dead_letters.length ? table(["by", "subject", "reason"], s.dead_letters, (d) => [d.consumer, d.subject, d.reason]) : h("p", { class: "dim" }, "none"));
};

views.audit = async () => {
  const { body: last } = await api("/api/audit");
  const { body: reports } = await api("/api/reports");
  const result = h("div", { "data-testid": "audit-result" }, last === null ? h("p", { class: "dim" }, "No audit has run since this dashboard started.") : auditView(last));
  // Running it is an operator action (it re-runs every decision of the log): offered with the token only.
  const run = !session.actions ? h("p", { class: "dim", "data-testid": "run-audit-read-only" },
    "Running the audit is an operator action: this dashboard is read-only (start it with --operator-token-file).")
    : h("button", { "data-testid": "run-audit", onclick: async () => {
      run.disabled = true; result.textContent = "re-running every decision...";
      try { const { body } = await api("/api/audit", { method: "POST", headers: operatorHeaders() }); result.replaceChildren(auditView(body)); }
      catch (err) { result.textContent = err.message; flash(err.message, true); } // (the flash outlives a redraw)
      finally { run.disabled = false; }
    } }, "run the audit");
  const pick = (n) => h("select", { onchange: (e) => { frames[n].src = e.target.value ? `/reports/${encodeURIComponent(e.target.value)}` : "about:blank"; } },
    h("option", { value: "" }, "choose a report"), reports.map((r) => h("option", { value: r }, r)));
  const frames = [h("iframe", { class: "report", title: "report A" }), h("iframe", { class: "report", title: "report B" })];
  return h("section", {},
    h("h1", {}, "Audit"),
    h("p", { class: "dim" }, "The audit folds the log again and re-runs every decider at every decision: a mismatch is a decision the code would not make again."),
    run, result,
    h("h2", {}, "Reports, side by side"),
    reports.length ? h("div", { class: "grid2" }, h("div", {}, pick(0), frames[0]), h("div", {}, pick(1), frames[1]))
      : h("p", { class: "dim" }, "No report here: start the dashboard with --report-dir (gpuherd report and gpuherd sim write them)."));
};

function auditView(a) {
  return h("div", {},
    h("p", {}, h("b", {}, a.ok ? "Clean: every decision would be made again." : "Mismatches found."), ` ${num(a.events)} events, ${fmtDur(a.took_s)}.`),
    table(["decider", "batches", "decisions", "answers", "mismatches"], Object.entries(a.deciders), ([name, r]) => [name, num(r.batches_checked), num(r.decisions_checked), num(r.answers_checked), r.mismatches.length]),
    Object.values(a.deciders).some((r) => r.mismatches.length) ? table(["seq", "event", "kind", "detail"], Object.values(a.deciders).flatMap((r) => r.mismatches), (m) => [m.seq, m.event_id, m.kind, m.detail]) : null);
}

// -- routing and live updates ------------------------------------------------------------------------

function route() {
  const [path, query] = location.hash.replace(/^#\/?/, "").split("?");
  const [name, ...rest] = path.split("/");
  return { name: views[name] ? name : "overview", arg: decodeURIComponent(rest.join("/")), params: new URLSearchParams(query || "") };
}

async function draw() {
  if (drawing) { dirty = true; return; }
  drawing = true;
  try {
    do {
      dirty = false;
      const r = route();
      const fresh = !current || current.name !== r.name || current.arg !== r.arg || String(current.params) !== String(r.params);
      current = r;
      for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.view === r.name || (r.name === "job" && a.dataset.view === "jobs") || (r.name === "workflow" && a.dataset.view === "workflows"));
      // The charts on the page now are destroyed once the new page replaces it; the ones the view
      // draws for the new page (lineChart adds them to `charts`) stay. (Destroying every chart in
      // `charts` after drawing removed the new ones too: History, Usage and a job's progress showed
      // empty boxes.)
      const shown = charts;
      charts = [];
      let node;
      try { node = await views[r.name](r.arg, r.params); }
      catch (err) { node = h("section", {}, h("h1", {}, "Cannot show this"), h("p", { class: "error" }, err.message)); }
      const focused = document.activeElement && $view.contains(document.activeElement) ? document.activeElement.name : null;
      if (!fresh && focused) { // someone is typing in a filter: keep the form, redraw on the next change
        for (const c of charts) c.destroy();
        charts = shown;
        continue;
      }
      const scroll = window.scrollY;
      for (const c of shown) c.destroy();
      $view.replaceChildren(node);
      $view.dataset.view = r.name;
      if (!fresh) window.scrollTo(0, scroll);
    } while (dirty);
  } finally {
    drawing = false;
  }
}

// The badge says "live" only while fresh word comes: the server sends a change or, failing one, a beat
// every beat_s, each saying how long NATS has been silent. A frozen NATS (or a frozen server, or a
// proxy holding the stream) keeps every connection open, and the badge stayed "live" through it.
const STALE_BEATS = 3; // no word for this many beats: the page's data may be old
const RECONNECT_BEATS = 10; // and for this many: open the stream again (a silent one never errors)
let source = null;
let heard = { at: 0, beatMs: 1000 };

function showLive(state, text) {
  $live.textContent = text;
  $live.className = `live ${state === "live" ? "on" : "off"}`;
  $live.dataset.state = state;
}

function onWord(info) {
  heard = { at: Date.now(), beatMs: (info.beat_s || 1) * 1000 };
  document.body.dataset.seq = info.seq;
  if (info.stale) showLive("stale", `stale: NATS silent for ${fmtDur(info.nats_silent_s)}`);
  else if (!info.ready) showLive("catching-up", `catching up (${num(info.seq)})`);
  else showLive("live", `live, log at ${num(info.seq)}`);
}

function connect() {
  if (source) source.close();
  source = new EventSource("/api/stream");
  heard = { at: Date.now(), beatMs: heard.beatMs };
  source.addEventListener("change", (e) => { onWord(JSON.parse(e.data)); draw(); });
  source.addEventListener("beat", (e) => onWord(JSON.parse(e.data)));
  source.onerror = () => showLive("reconnecting", "reconnecting");
}

function watchWord() {
  const quiet = Date.now() - heard.at;
  if (quiet >= RECONNECT_BEATS * heard.beatMs) { showLive("reconnecting", "reconnecting"); connect(); }
  else if (quiet >= STALE_BEATS * heard.beatMs && $live.dataset.state !== "reconnecting") {
    showLive("stale", `stale: no word from the dashboard for ${fmtDur(quiet / 1000)}`);
  }
}

// Sticky table headers stick just below the sticky page header, whose height is measured, not
// assumed: its nav wraps to two rows at about 1,280 px (with the token field), and the badge's words
// and the window's width change it (a fixed 45px put the header cells under it).
function followHeader() {
  const header = document.querySelector("header");
  const set = () => document.documentElement.style.setProperty("--header-h", `${header.getBoundingClientRect().height}px`);
  set();
  if (window.ResizeObserver) new ResizeObserver(set).observe(header);
}

async function start() {
  followHeader();
  try { session = (await api("/api/session")).body; } catch (err) { session = { actions: false }; }
  document.getElementById("operator").hidden = !session.actions;
  $token.value = sessionStorage.getItem("gpuherd-token") || "";
  $token.addEventListener("change", () => sessionStorage.setItem("gpuherd-token", $token.value.trim()));
  window.addEventListener("hashchange", draw);
  await draw();
  connect();
  setInterval(watchWord, 1000);
}

start();
