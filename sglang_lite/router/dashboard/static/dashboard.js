"use strict";
// The live cluster page: polls the router's /dashboard/data every interval (asking only for the samples it has
// not seen), fills the tables and redraws the charts. It loads nothing else: no CDN, no fonts, works offline.
(function () {
  const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
    "#17becf", "#bcbd22", "#7f7f7f"];
  const DATA_URL = location.pathname.replace(/\/$/, "") + "/data";
  const CHART_HEIGHT = 220;
  // the page's state, readable from the console (and by the browser test)
  const state = { samples: [], seq: 0, last: null, updates: 0, errors: 0, keys: [], charts: {} };
  window.dashboard = state;

  const $ = (id) => document.getElementById(id);
  const num = (x, digits) => (x === null || x === undefined ? "–" : Number(x).toFixed(digits));
  const ms = (x) => (x === null || x === undefined ? "–" : (1000 * x).toFixed(1));
  const shortKey = (key) => key.replace(/^https?:\/\//, "");

  function setStatus(text, bad) {
    const el = $("status");
    el.textContent = text;
    el.className = bad ? "status error" : "status";
  }

  async function poll() {
    try {
      const resp = await fetch(DATA_URL + "?since=" + state.seq, { cache: "no-store" });
      if (!resp.ok) throw new Error("HTTP " + resp.status);
      const data = await resp.json();
      if (!ingest(data)) return;  // the router restarted: ask again for all its samples
      render(data);
      state.updates += 1;
      const failed = data.servers.filter((s) => s.loads_error).map((s) => shortKey(s.url) + ": " + s.loads_error);
      const now = "updated " + new Date().toLocaleTimeString();
      setStatus(failed.length ? now + "; loads failed: " + failed.join("; ") : "live, " + now, failed.length > 0);
    } catch (err) {
      state.errors += 1;
      setStatus("no data: " + err.message, true);
    } finally {
      setTimeout(poll, 1000 * (state.last ? state.last.interval_secs : 1));
    }
  }

  function ingest(data) {
    if (state.last && data.now < state.last.now) {  // a restarted router numbers its samples from 1 again
      state.samples = [];
      state.seq = 0;
      state.last = null;
      return false;
    }
    state.samples.push(...data.samples);
    if (data.samples.length) state.seq = data.samples[data.samples.length - 1].seq;
    const oldest = data.now - data.history_secs;
    while (state.samples.length && state.samples[0].t < oldest) state.samples.shift();
    state.last = data;
    return true;
  }

  function render(data) {
    renderSummary(data);
    renderBalance(data.groups);
    renderRanks(data.servers);
    renderCharts(data);
  }

  function renderSummary(data) {
    const policies = Object.entries(data.policies).map(([role, p]) => (role === "regular" ? p : role + " " + p));
    $("policy").textContent = policies.join(", ") || "–";
    $("rate").textContent = num(data.request_rate, 1);
    const lat = (p) => [p.p50, p.p90, p.p99].map(ms).join(" / ") + " (" + p.count + ")";
    $("ttft").textContent = lat(data.latency.ttft);
    $("duration").textContent = lat(data.latency.duration);
    $("window").textContent = data.window_secs + " s";
  }

  function cell(row, text, field, cls) {
    const td = row.insertCell();
    td.textContent = text;
    if (field) td.dataset.field = field;
    if (cls) td.className = cls;
    return td;
  }

  function renderBalance(groups) {
    const body = $("balance").tBodies[0];
    body.replaceChildren();
    for (const g of groups) {
      const row = body.insertRow();
      row.className = "balance-row";
      row.dataset.role = g.role;
      const b = g.balance || {};
      cell(row, g.role + ": " + g.ranks.length + " ranks", null, "text");
      cell(row, num(b.outstanding_cv, 3), "outstanding_cv");
      cell(row, num(b.running_cv, 3), "running_cv");
      cell(row, num(b.busiest_batch, 3), "busiest_batch");
      cell(row, num(b.busiest_over_mean_kv, 3), "busiest_over_mean_kv");
      cell(row, b.num_samples === undefined ? "0" : String(b.num_samples), "num_samples");
    }
  }

  function pdText(rank) {
    const q = rank.pd;
    if (rank.mode === "prefill") return "bootstrap " + q.prefill_prealloc_queue_reqs + ", sending " + q.prefill_inflight_queue_reqs;
    if (rank.mode === "decode") {
      return "prealloc " + q.decode_prealloc_queue_reqs + ", transfer " + q.decode_transfer_queue_reqs +
        ", retracted " + q.decode_retracted_queue_reqs;
    }
    return "–";
  }

  function renderRanks(servers) {
    const body = $("ranks").tBodies[0];
    body.replaceChildren();
    for (const s of servers) {
      for (const r of s.ranks) {
        const row = body.insertRow();
        row.className = "rank-row";
        row.dataset.key = r.key;
        cell(row, shortKey(s.url) + (s.role === "regular" ? "" : " (" + s.role + ")"), null, "text");
        cell(row, String(r.dp_rank), "dp_rank");
        const up = s.healthy && r.rank_up !== false && r.reported;
        const health = !s.healthy ? "unhealthy" : r.rank_up === false ? "rank down" : r.reported ? "up" : "no loads";
        cell(row, health, "health", "text " + (up ? "ok" : "bad"));
        cell(row, s.breaker, "breaker", "text " + (s.breaker === "closed" ? "muted" : "warn"));
        cell(row, r.in_flight === null ? "–" : String(r.in_flight), "in_flight");
        cell(row, r.reported ? String(r.running) : "–", "running");
        cell(row, r.reported ? String(r.waiting) : "–", "waiting");
        cell(row, r.reported ? String(r.outstanding) : "–", "outstanding");
        cell(row, r.reported ? pdText(r) : "–", "pd", "text");
        cell(row, r.reported ? String(r.kv_tokens) : "–", "kv_tokens");
        const usage = cell(row, "", "token_usage");
        if (r.reported) {
          const bar = document.createElement("span");
          bar.className = "bar";
          const fill = document.createElement("i");
          fill.style.width = Math.min(100, 100 * r.token_usage).toFixed(1) + "%";
          bar.appendChild(fill);
          usage.append(bar, (100 * r.token_usage).toFixed(1) + "%");
        } else {
          usage.textContent = "–";
        }
      }
    }
  }

  // ---- charts ------------------------------------------------------------------------------------------------
  function rankSeries(field) {
    return state.keys.map((k) => state.samples.map((s) => (s.ranks[k] ? s.ranks[k][field] : null)));
  }

  function busiestSeries(groups) {
    const busiest = groups.map((g) => state.samples.map((s) => {
      const values = g.ranks.filter((k) => s.ranks[k]).map((k) => s.ranks[k].running);
      return values.length === g.ranks.length && values.length ? Math.max(...values) : null;
    }));
    const rate = state.samples.map((s, i) => {
      if (i === 0) return null;
      const prev = state.samples[i - 1];
      return s.t > prev.t ? (s.requests - prev.requests) / (s.t - prev.t) : null;
    });
    return [...busiest, rate];
  }

  function chartOptions(el, series, axes) {
    return {
      width: Math.max(300, el.clientWidth),
      height: CHART_HEIGHT,
      scales: { x: { time: false }, rate: { auto: true } },
      legend: { show: true },
      axes: [{ label: "router uptime (s)" }, ...axes],
      series: [{ label: "t" }, ...series],
    };
  }

  function lineSeries(labels) {
    return labels.map((label, i) => ({ label: label, stroke: PALETTE[i % PALETTE.length], width: 2 }));
  }

  function buildCharts(groups) {
    for (const chart of Object.values(state.charts)) chart.destroy();
    const keys = state.keys.map(shortKey);
    const make = (id, series, axes) => {
      const el = $(id);
      el.replaceChildren();
      return new uPlot(chartOptions(el, series, axes), [[]].concat(series.map(() => [])), el);
    };
    const busiest = lineSeries(groups.map((g) => "busiest batch (" + g.role + ")"));
    busiest.push({ label: "requests/s", stroke: "#7f7f7f", width: 1, dash: [4, 3], scale: "rate" });
    state.charts = {
      outstanding: make("chart-outstanding", lineSeries(keys), [{ label: "requests" }]),
      running: make("chart-running", lineSeries(keys), [{ label: "requests" }]),
      busiest: make("chart-busiest", busiest, [{ label: "batch" }, { scale: "rate", side: 1, label: "req/s" }]),
    };
  }

  function renderCharts(data) {
    const keys = data.groups.flatMap((g) => g.ranks);
    const layout = keys.join(" ") + "|" + data.groups.map((g) => g.role).join(" ");
    if (layout !== state.layout) {
      state.keys = keys;
      state.layout = layout;
      buildCharts(data.groups);
    }
    const xs = state.samples.map((s) => s.t);
    state.charts.outstanding.setData([xs, ...rankSeries("outstanding")]);
    state.charts.running.setData([xs, ...rankSeries("running")]);
    state.charts.busiest.setData([xs, ...busiestSeries(data.groups)]);
  }

  window.addEventListener("resize", () => {
    for (const chart of Object.values(state.charts)) {
      chart.setSize({ width: Math.max(300, chart.root.parentElement.clientWidth), height: CHART_HEIGHT });
    }
  });
  poll();
})();
