// fleetserve's live dashboard: polls dashboard/api/snapshot every second and draws the
// fleet. No dependencies; every server string reaches the page through textContent.
"use strict";

(() => {
  const POLL_MS = 1000;
  const HISTORY_S = 300; // what the charts keep
  const MIN_SPAN_S = 60; // the narrowest time axis, while the page has watched less
  const KEY_STORE = "fleetserve.apiKey";
  const SVG = "http://www.w3.org/2000/svg";
  const COLORS = ["#2f6fde", "#e07b00", "#1f9e6e", "#9b51e0", "#d43f8d", "#6b7280"];
  const ERROR_COLOR = "#c4321c";

  let apiKey = sessionStorage.getItem(KEY_STORE) || "";
  const history = new Map(); // model name -> [{t, ...figures}]
  const $ = (id) => document.getElementById(id);

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v !== undefined && v !== null) node.setAttribute(k, v);
    }
    for (const c of children) {
      if (c !== undefined && c !== null) node.append(c instanceof Node ? c : String(c));
    }
    return node;
  }

  function svg(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    return node;
  }

  // ---------------------------------------------------------------- formatting
  const dash = "–";
  function num(x, digits = 1) {
    if (x === null || x === undefined) return dash;
    if (Math.abs(x) >= 1e6) return (x / 1e6).toFixed(digits) + "M";
    if (Math.abs(x) >= 1e4) return (x / 1e3).toFixed(digits) + "k";
    return Number.isInteger(x) ? String(x) : x.toFixed(digits);
  }
  function seconds(x) {
    if (x === null || x === undefined) return dash;
    if (x < 1e-3) return (x * 1e6).toFixed(0) + " µs";
    if (x < 1) return (x * 1e3).toFixed(x < 0.1 ? 1 : 0) + " ms";
    return x.toFixed(2) + " s";
  }
  const pct = (x) => (x === null || x === undefined ? dash : (100 * x).toFixed(1) + "%");
  const counts = (obj) =>
    Object.entries(obj).filter(([, v]) => v > 0).map(([k, v]) => `${k} ${num(v, 0)}`)
      .join(", ") || "none";
  const className = (name) => name || "(one queue)";

  // ---------------------------------------------------------------- status and key
  function setStatus(kind, text) {
    const pill = $("status");
    pill.className = "pill " + kind;
    pill.textContent = text;
  }

  function showKeyForm(show) {
    $("key-form").hidden = !show;
    if (show) $("key").focus();
  }

  $("key-toggle").addEventListener("click", () => showKeyForm($("key-form").hidden));
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    apiKey = $("key").value.trim();
    if (apiKey) sessionStorage.setItem(KEY_STORE, apiKey);
    else sessionStorage.removeItem(KEY_STORE);
    $("key").value = "";
    showKeyForm(false);
    poll();
  });

  // ---------------------------------------------------------------- polling
  let timer = null;
  async function poll() {
    clearTimeout(timer);
    try {
      const headers = apiKey ? { Authorization: "Bearer " + apiKey } : {};
      const res = await fetch("dashboard/api/snapshot", { headers, cache: "no-store" });
      if (res.status === 401) {
        // Polling again with the same key would only fail again: wait for a new one.
        setStatus("key", "needs the API key");
        showKeyForm(true);
        return;
      } else if (!res.ok) {
        setStatus("error", "HTTP " + res.status);
      } else {
        render(await res.json());
        setStatus("live", "live");
      }
    } catch (e) {
      setStatus("error", "server unreachable");
    }
    timer = setTimeout(poll, POLL_MS);
  }

  // ---------------------------------------------------------------- rendering
  function tile(label, value, figure) {
    return el("div", { class: "tile", "data-figure": figure },
      el("div", { class: "v" }, value), el("div", { class: "k" }, label));
  }

  function render(snap) {
    $("updated").textContent = "updated " + new Date(snap.time * 1000).toLocaleTimeString();
    $("rate-window").textContent = num(snap.rate_window_s, 0);
    $("latency-window").textContent = num(snap.latency_window_s, 0);
    const f = snap.fleet;
    $("fleet").replaceChildren(
      tile("models", num(f.num_models), "num_models"),
      tile("replicas ready", `${f.num_replicas_ready} / ${f.num_replicas}`, "replicas"),
      tile("requests / s", num(f.requests_per_s, 2), "requests_per_s"),
      tile("errors / s", num(f.errors_per_s, 2), "errors_per_s"),
      tile("generated tokens / s", num(f.generation_tokens_per_s), "generation_tokens_per_s"),
      tile("waiting", num(f.waiting), "waiting"),
      tile("migrations", num(f.migrations_total), "migrations_total"),
      tile("replica events", num(f.replica_events_total), "replica_events_total"),
    );
    const now = snap.time;
    const cards = snap.models.map((m) => {
      remember(m, now);
      return modelCard(m, now);
    });
    $("models").replaceChildren(...cards);
  }

  function remember(m, t) {
    const points = history.get(m.name) || [];
    const classes = {};
    for (const c of m.classes) {
      classes[c.name] = {
        rps: c.requests_per_s, eps: c.errors_per_s, waiting: c.waiting,
        ttft50: c.ttft.p50, ttft99: c.ttft.p99, e2e99: c.e2e.p99,
      };
    }
    points.push({
      t, classes, eps: m.errors_per_s, pt: m.prompt_tokens_per_s,
      gt: m.generation_tokens_per_s, kv: m.kv_cache_usage, hit: m.prefix_cache_hit_rate,
      batches: m.batches_per_s, batch99: m.batch_seconds_p99,
    });
    while (points.length && points[0].t < t - HISTORY_S) points.shift();
    history.set(m.name, points);
  }

  function modelCard(m, now) {
    const generate = m.kind === "generate";
    const figures = generate
      ? [
          tile("requests", num(m.requests_total), "requests_total"),
          tile("requests / s", num(m.requests_per_s, 2), "requests_per_s"),
          tile("errors / s", num(m.errors_per_s, 2), "errors_per_s"),
          tile("generated tokens", num(m.generation_tokens_total), "generation_tokens_total"),
          tile("tokens / s (gen)", num(m.generation_tokens_per_s), "generation_tokens_per_s"),
          tile("waiting", num(m.waiting), "waiting"),
          tile("running", num(m.running), "running"),
          tile("KV cache", pct(m.kv_cache_usage), "kv_cache_usage"),
          tile("prefix hits", pct(m.prefix_cache_hit_rate), "prefix_cache_hit_rate"),
        ]
      : [
          tile("requests", num(m.requests_total), "requests_total"),
          tile("requests / s", num(m.requests_per_s, 2), "requests_per_s"),
          tile("errors / s", num(m.errors_per_s, 2), "errors_per_s"),
          tile("waiting", num(m.waiting), "waiting"),
          tile("batches / s", num(m.batches_per_s, 2), "batches_per_s"),
          tile("batch size p50", num(m.batch_size_p50), "batch_size_p50"),
          tile("batch time p99", seconds(m.batch_seconds_p99), "batch_seconds_p99"),
        ];
    return el("section", { class: "model", "data-model": m.name },
      el("div", {},
        el("h2", {}, m.name), el("span", { class: "kind" }, m.kind),
        el("span", { class: "state " + m.state, title: m.dead_reason || "" }, m.state)),
      el("div", { class: "tiles" }, ...figures),
      el("div", { class: "charts" }, ...charts(m, now)),
      classTable(m),
      generate ? replicaTable(m) : null,
      el("div", { class: "events" },
        `migrations: ${counts(m.migrations)} · replica events: ${counts(m.replica_events)}` +
        ` · finished: ${counts(m.finished)}`),
    );
  }

  function charts(m, now) {
    const points = history.get(m.name) || [];
    const names = m.classes.map((c) => c.name);
    const perClass = (key, suffix = "") => names.map((name, i) => ({
      name: className(name) + suffix, color: COLORS[i % COLORS.length],
      values: points.map((p) => [p.t, p.classes[name] ? p.classes[name][key] : null]),
    }));
    const one = (name, key, color, dashed) => ({
      name, color, dashed, values: points.map((p) => [p.t, p[key]]),
    });
    const out = [
      chart("Requests / s by class", now,
        [...perClass("rps"), one("errors", "eps", ERROR_COLOR)], (v) => num(v, 2)),
      chart("Queue depth by class", now, perClass("waiting"), (v) => num(v, 0)),
    ];
    if (m.kind === "generate") {
      const ttft = perClass("ttft99", " p99");
      const ttft50 = perClass("ttft50", " p50").map((s) => ({ ...s, dashed: true }));
      out.push(
        chart("Tokens / s", now,
          [one("generated", "gt", COLORS[0]), one("prompt", "pt", COLORS[1])], (v) => num(v)),
        chart("Time to first token", now, [...ttft, ...ttft50], seconds),
        chart("End-to-end latency p99", now, perClass("e2e99"), seconds),
        chart("KV cache use / prefix-cache hits", now,
          [one("KV use", "kv", COLORS[2]), one("prefix hits", "hit", COLORS[3], true)], pct,
          1),
      );
    } else {
      out.push(
        chart("Batches / s", now, [one("batches", "batches", COLORS[0])], (v) => num(v, 2)),
        chart("Batch time p99", now, [one("p99", "batch99", COLORS[1])], seconds),
      );
    }
    return out;
  }

  // A line chart of what the page has watched (MIN_SPAN_S to HISTORY_S seconds back);
  // gaps where a value is null.
  function chart(title, now, series, format, fixedMax) {
    const W = 300, H = 110, L = 4, R = 4, T = 14, B = 14;
    const all = series.flatMap((s) => s.values.map((v) => v[1]))
      .filter((v) => v !== null && v !== undefined);
    const top = fixedMax || Math.max(...all, 0) * 1.15 || 1;
    const first = series.length && series[0].values.length ? series[0].values[0][0] : now;
    const span = Math.min(HISTORY_S, Math.max(MIN_SPAN_S, now - first));
    const x = (t) => L + (W - L - R) * (1 - (now - t) / span);
    const y = (v) => T + (H - T - B) * (1 - v / top);
    const box = svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none",
      role: "img", "aria-label": title });
    for (const frac of [0, 0.5, 1]) {
      box.append(svg("line", { x1: L, x2: W - R, y1: y(top * frac), y2: y(top * frac),
        stroke: "#e3e6ec", "stroke-width": 1 }));
    }
    const label = (text, attrs) => {
      const t = svg("text", { "font-size": 10, fill: "#667085", ...attrs });
      t.textContent = text;
      box.append(t);
    };
    label(format(top), { x: L, y: T - 3 });
    label(span >= 120 ? `-${Math.round(span / 60)} min` : `-${Math.round(span)} s`,
      { x: L, y: H - 2 });
    label("now", { x: W - R, y: H - 2, "text-anchor": "end" });
    const legend = el("div", { class: "legend" });
    for (const s of series) {
      let d = "";
      let pen = false;
      for (const [t, v] of s.values) {
        if (v === null || v === undefined) { pen = false; continue; }
        d += `${pen ? "L" : "M"}${x(t).toFixed(1)},${y(Math.min(v, top)).toFixed(1)}`;
        pen = true;
      }
      if (d) {
        const path = svg("path", { d, fill: "none", stroke: s.color, "stroke-width": 1.6,
          "vector-effect": "non-scaling-stroke" });
        if (s.dashed) path.setAttribute("stroke-dasharray", "4 3");
        box.append(path);
      }
      const latest = s.values.length ? s.values[s.values.length - 1][1] : null;
      const swatch = el("i");
      swatch.style.background = s.color;
      legend.append(el("span", {}, swatch, `${s.name} ${format(latest)}`));
    }
    return el("div", { class: "chart" }, el("h3", {}, title), box, legend);
  }

  function table(head, rows) {
    return el("table", {},
      el("thead", {}, el("tr", {}, ...head.map((h) => el("th", {}, h)))),
      el("tbody", {}, ...rows));
  }

  function classTable(m) {
    const generate = m.kind === "generate";
    const head = ["class", "waiting", "req / s", "errors / s", "requests", "shed"];
    if (generate) head.push("TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "E2E p50", "E2E p99");
    const rows = m.classes.map((c) => {
      const cells = [className(c.name), num(c.waiting), num(c.requests_per_s, 2),
        num(c.errors_per_s, 2), num(c.requests_total), num(c.shed_total)];
      if (generate) {
        cells.push(seconds(c.ttft.p50), seconds(c.ttft.p99), seconds(c.tpot.p50),
          seconds(c.tpot.p99), seconds(c.e2e.p50), seconds(c.e2e.p99));
      }
      return el("tr", { "data-class": c.name }, ...cells.map((v) => el("td", {}, v)));
    });
    return table(head, rows);
  }

  function replicaTable(m) {
    const head = ["replica", "pool", "capacity", "state", "health", "requests",
      "step time", "prefix hits", "pid"];
    const rows = m.replicas.map((r) => el("tr", { "data-replica": r.index },
      el("td", {}, `${m.name}:${r.index}`), el("td", {}, r.pool || dash),
      el("td", {}, r.capacity || dash),
      el("td", {}, el("span", { class: "state " + r.state }, r.state)),
      el("td", {}, el("span", { class: r.healthy ? "dot up" : "dot",
        title: r.healthy ? "healthy" : "unhealthy" }), r.straggler ? " straggler" : ""),
      el("td", {}, num(r.num_requests)), el("td", {}, seconds(r.step_latency_s)),
      el("td", {}, pct(r.prefix_cache_hit_rate)), el("td", {}, r.pid ?? dash)));
    return table(head, rows);
  }

  poll();
})();
