// The onward dashboard page. It reads only the public JSON API of the server that served it.
// Every text that comes from the store (task names, notes, errors, results, journal details, hosts) is put
// into the page with textContent or as an SVG text node, never parsed as HTML: a task named
// <img src=x onerror=alert(1)> is shown as those characters. And it is shown through `shown`, which escapes
// what the command line escapes (onward.log.printable): a name ending in U+202E "txt.exe" is not shown as
// one ending in "exe.txt".
"use strict";

(() => {
  const TOKEN_KEY = "onward-dashboard-token";
  const PAGE_SIZE = 50;
  const $ = (id) => document.getElementById(id);

  // --- the token: taken once from ?token=, kept in this tab's sessionStorage, removed from the address bar.
  const here = new URL(window.location.href);
  if (here.searchParams.has("token")) {
    sessionStorage.setItem(TOKEN_KEY, here.searchParams.get("token") || "");
    here.searchParams.delete("token");
    history.replaceState(null, "", here.pathname + here.search + here.hash);
  }

  function authHeaders(extra) {
    const headers = Object.assign({}, extra || {});
    const token = sessionStorage.getItem(TOKEN_KEY);
    if (token) headers.Authorization = "Bearer " + token;
    return headers;
  }

  class TokenNeeded extends Error {}

  async function answer(response) {
    if (response.status === 401) {
      $("token-needed").hidden = false;
      throw new TokenNeeded("this dashboard needs its token");
    }
    let body = null;
    try { body = await response.json(); } catch (e) { body = null; }
    if (!response.ok) throw new Error((body && body.error) || response.statusText);
    return body;
  }

  async function getJSON(path) {
    return answer(await fetch(path, { headers: authHeaders(), cache: "no-store" }));
  }

  async function postJSON(path, body) {
    return answer(await fetch(path, {
      method: "POST", cache: "no-store",
      headers: authHeaders({ "Content-Type": "application/json" }),
      body: JSON.stringify(body),
    }));
  }

  // --- small DOM helpers: text only ---------------------------------------------------------------------
  // The characters onward.log.printable escapes, for the same reasons: C0 and C1 controls and DEL
  // (invisible, or a line break inside a name), line and paragraph separators, bidi embeddings, overrides
  // and isolates (they reorder what is shown around them) and lone surrogates (with the u flag, a pair is
  // one code point and does not match). A block (an error, a result) keeps its tabs and line breaks.
  const UNPRINTABLE = /[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]/gu;
  const UNPRINTABLE_IN_BLOCK = /[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]/gu;

  function escaped(c) {
    const code = c.codePointAt(0);
    return code < 0x100 ? "\\x" + code.toString(16).padStart(2, "0") : "\\u" + code.toString(16).padStart(4, "0");
  }

  // A text from the store as the page shows it (ESC as \x1b, U+202E as \u202e); the data stays raw.
  function shown(text) {
    return String(text).replace(UNPRINTABLE, escaped);
  }

  function shownBlock(text) {
    return String(text).replace(UNPRINTABLE_IN_BLOCK, escaped);
  }

  function el(tag, text, className) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = shown(text);
    if (className) node.className = className;
    return node;
  }

  function row(cells) {
    const tr = document.createElement("tr");
    for (const cell of cells) tr.appendChild(cell instanceof Node ? wrapCell(cell) : el("td", cell));
    return tr;
  }

  function wrapCell(node) {
    if (node.tagName === "TD") return node;
    const td = document.createElement("td");
    td.appendChild(node);
    return td;
  }

  function fill(tableId, rows, emptyText) {
    const body = $(tableId).tBodies[0];
    const columns = $(tableId).tHead.rows[0].cells.length;
    body.replaceChildren(...rows);
    if (!rows.length && emptyText) {
      const td = el("td", emptyText, "muted");
      td.colSpan = columns;
      const tr = document.createElement("tr");
      tr.appendChild(td);
      body.appendChild(tr);
    }
  }

  function say(text, isError) {
    const node = $("message");
    node.textContent = shown(text);
    node.className = isError ? "error" : "";
    node.parentElement.hidden = !text;
  }

  function duration(seconds) {
    if (seconds === null || seconds === undefined) return "–";
    const s = Math.floor(seconds);
    if (s < 120) return s + "s";
    if (s < 7200) return Math.floor(s / 60) + "m" + String(s % 60).padStart(2, "0") + "s";
    return Math.floor(s / 3600) + "h" + String(Math.floor((s % 3600) / 60)).padStart(2, "0") + "m";
  }

  function taskButton(name) {
    const button = el("button", name, "link task-name");
    button.type = "button";
    button.title = shown(name);
    button.addEventListener("click", () => openDetail(name));
    return button;
  }

  // --- status ---------------------------------------------------------------------------------------------
  let lastStatus = null;

  function renderStatus(s) {
    lastStatus = s;
    $("token-needed").hidden = true;
    $("store").textContent = shown(s.store);
    $("job").textContent = s.job ? "job " + shown(s.job) : "";
    for (const state of ["total", "pending", "running", "waiting", "done", "failed", "cancelled"]) {
      $("count-" + state).textContent = String(s[state] === undefined ? 0 : s[state]);
    }
    const total = s.total || 0;
    const share = (n) => (total ? (100 * (n || 0)) / total : 0);
    $("bar-done").style.width = share(s.done) + "%";
    $("bar-failed").style.width = share(s.failed) + "%";
    $("bar-cancelled").style.width = share(s.cancelled) + "%";
    const finished = (s.done || 0) + (s.failed || 0) + (s.cancelled || 0);
    $("progress-text").textContent = finished + " of " + total + " finished (" + share(finished).toFixed(1) + "%)";
    $("rate").textContent = Number(s.rate_per_second).toFixed(1);
    $("eta").textContent = s.eta_seconds === null && !s.workers_alive ? "no worker running"
      : "eta " + (s.eta_seconds === null ? "–" : duration(s.eta_seconds));
    $("restarts").textContent = String(s.restarts);
    $("paused-badge").hidden = !s.paused;
    $("pause-toggle").textContent = s.paused ? "Resume claiming" : "Pause claiming";
    $("retry-failed").disabled = !s.failed;

    $("running-count").textContent = "(" + s.tasks_running.length + ")";
    fill("running", s.tasks_running.map((t) => row([
      taskButton(t.task), t.attempt, t.worker_pid === null ? "–" : t.worker_pid,
      t.heartbeat_age === null ? "–" : t.heartbeat_age + "s ago",
      t.steps ? t.steps.recorded + " recorded" + (t.steps.replayed ? ", " + t.steps.replayed + " replayed" : "") : "",
      t.note || "",
    ])), "nothing running");
    $("workers-alive").textContent = "(" + s.workers_alive + " alive)";
    fill("workers", s.workers.map((w) => row([
      w.id, w.host, w.pid, w.heartbeat_age + "s ago", w.running, w.done,
      w.alive === true ? "yes" : w.alive === false ? "no (dead)" : "?",
    ])), "no worker");
    fill("failures", s.errors.map((e) => row([e.at, e.kind, taskButton(e.task || ""), e.attempt, e.error])),
      "no failures");
    onStatusChange();
  }

  // --- the event stream: server-sent events read with fetch, so that it can carry the token header --------
  function setLive(live) {
    const badge = $("live");
    badge.textContent = live ? "live" : "reconnecting…";
    badge.className = "badge " + (live ? "live" : "stale");
  }

  function dispatch(block) {
    let type = "message";
    const data = [];
    for (const line of block.split("\n")) {
      if (!line || line.startsWith(":")) continue;
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      let value = colon < 0 ? "" : line.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "event") type = value;
      else if (field === "data") data.push(value);
    }
    if (type === "status") renderStatus(JSON.parse(data.join("\n")));
    else if (type === "trouble") say("store: " + JSON.parse(data.join("\n")).error, true);
  }

  async function stream() {
    for (;;) {
      try {
        const response = await fetch("/api/events", { headers: authHeaders(), cache: "no-store" });
        if (response.status === 401) {
          $("token-needed").hidden = false;
          setLive(false);
          return; // started again when a token is given
        }
        if (!response.ok || !response.body) throw new Error(response.statusText);
        setLive(true);
        const reader = response.body.getReader();
        const decoder = new TextDecoder();
        let buffer = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
          let end;
          while ((end = buffer.indexOf("\n\n")) >= 0) {
            dispatch(buffer.slice(0, end));
            buffer = buffer.slice(end + 2);
          }
        }
      } catch (e) {
        // the server restarted or the network dropped: try again shortly
      }
      setLive(false);
      await new Promise((resolve) => setTimeout(resolve, 2000));
    }
  }

  // --- what follows a change of status: the chart, the visible task page, the open detail ------------------
  let lastFinished = -1;
  let chartAt = 0;
  let chartGap = 5000; // ms before the chart is read again: 5 s, or 20 times its last read (a big job's scan)
  let chartTimer = null;
  let refreshTimer = null;

  function onStatusChange() {
    const s = lastStatus;
    const finished = (s.done || 0) + (s.failed || 0) + (s.cancelled || 0);
    const now = Date.now();
    if (finished !== lastFinished && chartTimer === null) {
      // read the chart again once its gap since the last read has passed (at once the first time)
      chartTimer = setTimeout(() => {
        chartTimer = null;
        chartAt = Date.now();
        loadChart();
      }, Math.max(0, chartAt + chartGap - now));
    }
    lastFinished = finished;
    if (refreshTimer === null) {
      // at most one refresh of the table and the detail every two seconds, however often the status moves
      refreshTimer = setTimeout(() => {
        refreshTimer = null;
        loadTasks(false);
        if (openName !== null) loadDetail(openName);
      }, 2000);
    }
  }

  // --- the chart: completions (up) and failed attempts (down) per minute, drawn as SVG --------------------
  const SVG = "http://www.w3.org/2000/svg";
  const MIN_SLOTS = 10;

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
    if (text !== undefined) node.textContent = text;
    return node;
  }

  async function loadChart() {
    let data;
    const started = performance.now();
    try { data = await getJSON("/api/activity?bucket=60"); } catch (e) { return; }
    chartGap = Math.max(5000, 20 * (performance.now() - started));
    drawChart(data.buckets, data.bucket_seconds);
  }

  function drawChart(buckets, width) {
    const chart = $("chart");
    const W = 900, H = 180, left = 40, right = 10, mid = 110, bottom = 160;
    const nodes = [];
    if (!buckets.length) {
      nodes.push(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "muted" }, "nothing finished yet"));
      chart.replaceChildren(...nodes);
      $("chart-span").textContent = "";
      return;
    }
    // At least the last ten minutes, so that a young job's minutes are bars, not a wall.
    const last = Math.max(buckets[buckets.length - 1][0], Math.floor(Date.now() / 1000 / width) * width);
    const first = Math.min(buckets[0][0], last - (MIN_SLOTS - 1) * width);
    const slots = Math.round((last - first) / width) + 1;
    const maxUp = Math.max(1, ...buckets.map((b) => b[1]));
    const maxDown = Math.max(1, ...buckets.map((b) => b[2]));
    const step = (W - left - right) / slots;
    const barWidth = Math.max(1, step * 0.8);
    const upScale = (mid - 10) / maxUp;
    const downScale = (bottom - mid - 4) / maxDown;
    nodes.push(svg("line", { x1: left, y1: mid, x2: W - right, y2: mid, class: "axis" }));
    nodes.push(svg("text", { x: left - 4, y: 14, "text-anchor": "end", class: "tick" }, String(maxUp)));
    nodes.push(svg("text", { x: left - 4, y: mid + 4, "text-anchor": "end", class: "tick" }, "0"));
    nodes.push(svg("text", { x: left - 4, y: bottom, "text-anchor": "end", class: "tick" }, String(maxDown)));
    for (const [start, done, failed] of buckets) {
      const x = left + Math.round((start - first) / width) * step;
      const time = new Date(start * 1000).toISOString().slice(11, 16);
      if (done) {
        const bar = svg("rect", { x, y: mid - done * upScale, width: barWidth, height: done * upScale, class: "done" });
        bar.appendChild(svg("title", {}, time + " UTC: " + done + " done"));
        nodes.push(bar);
      }
      if (failed) {
        const bar = svg("rect", { x, y: mid + 1, width: barWidth, height: failed * downScale, class: "failed" });
        bar.appendChild(svg("title", {}, time + " UTC: " + failed + " failed attempts"));
        nodes.push(bar);
      }
    }
    const label = (t) => new Date(t * 1000).toISOString().slice(0, 16).replace("T", " ");
    const busy = buckets.length + " busy minute" + (buckets.length === 1 ? "" : "s");
    nodes.push(svg("text", { x: left, y: H - 2, class: "tick" }, label(first)));
    nodes.push(svg("text", { x: W - right, y: H - 2, "text-anchor": "end", class: "tick" }, label(last) + " UTC"));
    chart.replaceChildren(...nodes);
    $("chart-span").textContent = "· " + busy;
  }

  // --- the task table: searched, filtered and paged on the server ------------------------------------------
  const pages = [0]; // the `after` of each page shown so far; the last one is the current page
  let nextAfter = null;
  let tasksSeq = 0;

  function tasksQuery(after) {
    const params = new URLSearchParams();
    const search = $("search").value;
    const state = $("state-filter").value;
    if (search) params.set("q", search);
    if (state) params.set("state", state);
    params.set("after", String(after));
    params.set("limit", String(PAGE_SIZE));
    return "/api/tasks?" + params.toString();
  }

  async function loadTasks(announce) {
    const seq = ++tasksSeq;
    let data;
    try {
      data = await getJSON(tasksQuery(pages[pages.length - 1]));
    } catch (e) {
      if (!(e instanceof TokenNeeded)) say("tasks: " + e.message, true);
      return;
    }
    if (seq !== tasksSeq) return; // a newer search answered first
    if (data.tasks.length === 0 && data.next_after !== null) {
      // A search answers a window of ids at a time: nothing matched in this one, so look further on
      // from the same page, each request staying quick.
      pages[pages.length - 1] = data.next_after;
      $("page-info").textContent = "searching… (looked up to task #" + data.searched_to + ")";
      return loadTasks(announce);
    }
    nextAfter = data.next_after;
    fill("tasks", data.tasks.map((t) => {
      const tr = row([t.id, taskButton(t.task), el("span", t.state, "state " + t.state), t.attempts,
        t.finished_at || "–", t.seconds === null ? "–" : t.seconds.toFixed(1), t.error || ""]);
      tr.dataset.state = t.state;
      return tr;
    }), "no task matches");
    $("prev-page").disabled = pages.length < 2;
    $("first-page").disabled = pages.length < 2;
    $("next-page").disabled = nextAfter === null;
    $("page-info").textContent = "page " + pages.length + (data.tasks.length ? ", tasks #" + data.tasks[0].id + "–#" +
      data.tasks[data.tasks.length - 1].id : "");
    if (announce) say("");
  }

  function restartPaging() {
    pages.length = 1;
    pages[0] = 0; // a search may have moved the first page on past windows without a match
    loadTasks(true);
  }

  let searchTimer = null;
  $("search").addEventListener("input", () => {
    clearTimeout(searchTimer);
    searchTimer = setTimeout(restartPaging, 250);
  });
  $("state-filter").addEventListener("change", restartPaging);
  $("first-page").addEventListener("click", restartPaging);
  $("prev-page").addEventListener("click", () => { if (pages.length > 1) { pages.pop(); loadTasks(true); } });
  $("next-page").addEventListener("click", () => { if (nextAfter !== null) { pages.push(nextAfter); loadTasks(true); } });

  // --- a task's detail -----------------------------------------------------------------------------------
  let openName = null;

  function openDetail(name) {
    openName = name;
    $("detail").hidden = false;
    $("detail-name").textContent = shown(name);
    loadDetail(name);
  }

  async function loadDetail(name) {
    let t;
    try {
      t = await getJSON("/api/tasks/" + encodeURIComponent(name));
    } catch (e) {
      if (!(e instanceof TokenNeeded)) say("task: " + e.message, true);
      return;
    }
    if (name !== openName) return;
    $("detail-name").textContent = shown(t.task);
    const facts = $("detail-facts");
    const pairs = [["state", t.state], ["attempts", t.attempts], ["added", t.added_at], ["started", t.started_at || "–"],
      ["finished", t.finished_at || "–"], ["seconds", t.seconds === null ? "–" : t.seconds]];
    facts.replaceChildren(...pairs.flatMap(([key, value]) => [el("dt", key), el("dd", value, key === "state" ? "state " + value : "")]));
    facts.dataset.state = t.state;
    $("detail-error").textContent = shownBlock(t.error || "–");
    if (t.result) {
      $("detail-result").textContent = shownBlock(t.result.preview);
      $("detail-result-size").textContent = "(" + t.result.kind + ", " + t.result.bytes + " bytes" +
        (t.result.truncated ? ", first " + new TextEncoder().encode(t.result.preview).length + " shown" : "") + ")";
    } else {
      $("detail-result").textContent = "–";
      $("detail-result-size").textContent = "";
    }
    $("detail-retry").disabled = !(t.state === "failed" || t.state === "cancelled");
    $("detail-cancel").disabled = !(t.state === "pending" || t.state === "running");
    fill("detail-attempts", t.attempt_history.map((a) => row([a.attempt, a.started_at, a.seconds === null ? "–" : a.seconds,
      a.outcome, a.detail || ""])), "no attempt in the journal");
    fill("detail-steps", t.steps.map((s) => row([s.index, s.name, s.kind, s.bytes, s.at])), "no recorded steps");
    fill("detail-events", t.events.map((e) => row([e.at, e.kind, e.attempt === null ? "" : e.attempt,
      e.pid === null ? "" : e.pid, e.detail || ""])), "no events");
  }

  $("detail-close").addEventListener("click", () => { openName = null; $("detail").hidden = true; });
  document.addEventListener("keydown", (e) => { if (e.key === "Escape") $("detail-close").click(); });

  // --- actions: each a POST with a JSON body ---------------------------------------------------------------
  async function act(path, body, describe) {
    try {
      const result = await postJSON(path, body);
      say(describe(result), false);
    } catch (e) {
      if (!(e instanceof TokenNeeded)) say(e.message, true);
    }
    loadTasks(false);
    if (openName !== null) loadDetail(openName);
  }

  const outcome = (result) => Object.entries(result.tasks || {}).map(([name, what]) => name + ": " + what).join("; ");

  $("detail-retry").addEventListener("click", () =>
    act("/api/retry", { tasks: [openName] }, (r) => "retry " + outcome(r)));
  $("detail-cancel").addEventListener("click", () =>
    act("/api/cancel", { tasks: [openName] }, (r) => "cancel " + outcome(r)));
  $("retry-failed").addEventListener("click", () =>
    act("/api/retry", { failed: true }, (r) => r.retried + " failed task" + (r.retried === 1 ? "" : "s") + " back to pending"));
  $("pause-toggle").addEventListener("click", () => {
    const pausing = !(lastStatus && lastStatus.paused);
    act(pausing ? "/api/pause" : "/api/resume", {}, (r) => (r.paused ? "paused: workers claim nothing new" : "resumed"));
  });

  $("token-use").addEventListener("click", () => {
    const token = $("token-input").value.trim();
    if (!token) return;
    sessionStorage.setItem(TOKEN_KEY, token);
    $("token-input").value = "";
    $("token-needed").hidden = true;
    start();
  });

  // The chart is first read once the first status is in (see onStatusChange): on a big job its read is the
  // slowest call, and the counts come first.
  function start() {
    stream();
    loadTasks(true);
  }

  start();
})();
