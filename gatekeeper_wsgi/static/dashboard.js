"use strict";
(function () {
  // Everything from the server is shown with textContent: never parsed as HTML.
  var body = document.body;
  var jsonUrl = body.dataset.jsonUrl;
  var refreshMs = parseInt(body.dataset.refreshMs, 10) || 2000;
  var HISTORY = 60;
  // Seconds per bar of the rejections chart; the server keeps per-second counts.
  var BIN = Math.max(1, Math.round(refreshMs / 1000));
  var COLORS = {
    "GK-CONCURRENCY-LIMIT": "#d64545", "GK-RATE-LIMIT": "#e0a100", "GK-QUEUE-FULL": "#8e5bd6",
    "GK-QUEUE-TIMEOUT": "#3b7dd8", "GK-CALLER-MISSING": "#6b7487", "GK-BACKEND-UNAVAILABLE": "#1d2433"
  };
  var history = [];
  var adaptiveHistory = [];  // per refresh: {path: [current limit, in flight]}
  var ADAPTIVE_SHOWN = 6;
  var LINE_COLORS = ["#3b7dd8", "#d64545", "#2e9e5b", "#8e5bd6", "#e0a100", "#1d2433"];
  var paused = false;
  var timer = null;
  var limitRows = {};

  function $(id) { return document.getElementById(id); }
  function el(tag, cls, text) {
    var node = document.createElement(tag);
    if (cls) { node.className = cls; }
    if (text !== undefined) { node.textContent = text; }
    return node;
  }
  function fmt(n) { return typeof n === "number" ? n.toLocaleString("en-US") : "–"; }
  function fmtUs(n) {
    return typeof n === "number" ? n.toLocaleString("en-US", { maximumFractionDigits: 1 }) : "–";
  }
  function sum(obj) {
    var total = 0;
    Object.keys(obj || {}).forEach(function (k) { total += obj[k]; });
    return total;
  }
  function colorOf(code) { return COLORS[code] || "#999"; }

  function setState(text, cls) {
    var state = $("state");
    state.textContent = text;
    state.className = "state " + cls;
  }

  function showError(message) {
    var box = $("error");
    if (message) {
      box.textContent = message;
      box.hidden = false;
    } else {
      box.textContent = "";
      box.hidden = true;
    }
  }

  function meterRow(cls, name, tag) {
    var row = el("div", "row " + cls);
    var label = el("div", "name", name);
    label.title = name;
    if (tag) { label.appendChild(el("span", "tag", tag)); }
    var bar = el("div", "bar");
    bar.setAttribute("role", "meter");
    bar.setAttribute("aria-label", name);
    bar.setAttribute("aria-valuemin", "0");
    var fill = el("div", "fill");
    bar.appendChild(fill);
    var count = el("div", "count");
    row.appendChild(label);
    row.appendChild(bar);
    row.appendChild(count);
    return row;
  }

  function setMeter(row, inflight, concurrency, note) {
    var bar = row.querySelector(".bar");
    var fill = row.querySelector(".fill");
    var count = row.querySelector(".count");
    count.textContent = "";
    row.classList.toggle("nobar", typeof concurrency !== "number");
    if (typeof concurrency === "number") {
      var ratio = concurrency > 0 ? Math.min(1, inflight / concurrency) : 1;
      fill.style.width = (ratio * 100).toFixed(1) + "%";
      fill.className = "fill" + (inflight >= concurrency ? " full" : ratio >= 0.75 ? " warn" : "");
      bar.setAttribute("aria-valuenow", String(inflight));
      bar.setAttribute("aria-valuemax", String(concurrency));
      count.appendChild(document.createTextNode(fmt(inflight) + " / " + fmt(concurrency)));
    } else {
      // No concurrency cap to draw against: the number alone tells it.
      fill.style.width = "0%";
      fill.className = "fill none";
      bar.setAttribute("aria-valuenow", String(inflight));
      bar.removeAttribute("aria-valuemax");
      count.appendChild(document.createTextNode(fmt(inflight)));
    }
    if (note) {
      count.appendChild(document.createTextNode(" "));
      count.appendChild(el("small", "", note));
    }
  }

  // "3/5 used · 2 left" for a key of a rate limit (and when the window frees a place).
  function rateNote(entry) {
    if (!entry || typeof entry.used !== "number" || typeof entry.remaining !== "number") {
      return "";
    }
    var text = fmt(entry.used) + "/" + fmt(entry.used + entry.remaining) + " used · " +
      fmt(entry.remaining) + " left";
    if (entry.remaining === 0 && entry.resets_in > 0) {
      text += " · frees in " + Math.ceil(entry.resets_in) + " s";
    }
    return text;
  }

  // A key (or limit) with a rate and no concurrency: its bar is the window's use.
  function setUsage(row, entry, concurrency) {
    var rateOnly = typeof concurrency !== "number" && entry && typeof entry.used === "number";
    if (!rateOnly) {
      setMeter(row, entry ? entry.inflight : 0, concurrency, rateNote(entry));
      return;
    }
    var cap = entry.used + entry.remaining;
    setMeter(row, entry.used, cap, "");
    var count = row.querySelector(".count");
    count.textContent = "";
    count.appendChild(document.createTextNode(fmt(entry.used) + " / " + fmt(cap) + " used "));
    var note = fmt(entry.remaining) + " left";
    if (entry.remaining === 0 && entry.resets_in > 0) {
      note += " · frees in " + Math.ceil(entry.resets_in) + " s";
    }
    if (entry.inflight) { note += " · " + fmt(entry.inflight) + " in flight"; }
    count.appendChild(el("small", "", note));
  }

  function markRate(row, entry) {
    var used = !!entry && typeof entry.used === "number";  // a boolean: toggle(x, undefined) flips
    row.classList.toggle("locked", used && entry.remaining === 0);
    if (used) {
      row.dataset.used = String(entry.used);
      row.dataset.remaining = String(entry.remaining);
    } else {
      delete row.dataset.used;
      delete row.dataset.remaining;
    }
  }

  function describe(limit) {
    var parts = [limit.level];
    if (limit.rate) { parts.push("rate " + limit.rate); }
    if (limit.queue) { parts.push("queue " + limit.queue.size + "×" + limit.queue.wait + "s"); }
    if (limit.key && limit.key !== "caller") { parts.push("by " + limit.key); }
    if (limit.adaptive) { parts.push("auto " + limit.adaptive.algorithm); }
    if (limit.mode === "shadow") { parts.push("shadow"); }
    return parts.join(" · ");
  }

  // An adaptive limit's meter is drawn against its current value, not its max.
  function capOf(path, concurrency, adaptive) {
    var current = adaptive && adaptive[path];
    return current ? current.limit : concurrency;
  }

  function renderLimits(limits, inflight, adaptive) {
    var box = $("limits");
    var seen = {};
    if (!limits.length) {
      box.textContent = "";
      box.appendChild(el("p", "empty", "No limits configured."));
      limitRows = {};
      return;
    }
    var empty = box.querySelector(".empty");
    if (empty) { box.removeChild(empty); }
    var order = [];
    limits.forEach(function (limit) {
      if (limit.concurrency === null && limit.rate === null) { return; }
      var id = "limit:" + limit.path;
      var row = limitRows[id];
      if (!row) {
        row = meterRow("limit", limit.path, describe(limit));
        row.dataset.limit = limit.path;
        row.dataset.testid = "limit-row";
        limitRows[id] = row;
      }
      seen[id] = true;
      order.push(row);
      if (limit.wildcard) {
        var keys = limit.keys === 1 ? "1 key" : fmt(limit.keys) + " keys";
        var tracked = typeof limit.tracked === "number" ? " · " + fmt(limit.tracked) + " tracked" : "";
        setMeter(row, limit.inflight, null, "in " + keys + tracked);
        Object.keys(inflight).filter(function (path) {
          return inflight[path].limit === limit.path;
        }).sort(function (a, b) {
          return inflight[b].inflight - inflight[a].inflight || (a < b ? -1 : 1);
        }).forEach(function (path) {
          var keyId = "key:" + path;
          var keyRow = limitRows[keyId];
          if (!keyRow) {
            keyRow = meterRow("key", path);
            keyRow.dataset.key = path;
            limitRows[keyId] = keyRow;
          }
          seen[keyId] = true;
          setUsage(keyRow, inflight[path], capOf(path, inflight[path].concurrency, adaptive));
          markRate(keyRow, inflight[path]);
          order.push(keyRow);
        });
        if (limit.keys > limit.keys_shown) {
          var moreId = "more:" + limit.path;
          var more = limitRows[moreId] || el("div", "more");
          limitRows[moreId] = more;
          more.textContent = "+ " + fmt(limit.keys - limit.keys_shown) + " more keys in flight";
          seen[moreId] = true;
          order.push(more);
        }
      } else {
        var entry = inflight[limit.path];
        setUsage(row, entry, capOf(limit.path, limit.concurrency, adaptive));
        markRate(row, entry);
      }
    });
    Object.keys(limitRows).forEach(function (id) {
      if (!seen[id]) {
        var gone = limitRows[id];
        if (gone.parentNode) { gone.parentNode.removeChild(gone); }
        delete limitRows[id];
      }
    });
    order.forEach(function (row) { box.appendChild(row); });
  }

  function renderCards(data) {
    var c = data.stats.counters;
    var full = 0;
    Object.keys(data.inflight).forEach(function (path) {
      var entry = data.inflight[path];
      if (typeof entry.concurrency === "number" && entry.inflight >= entry.concurrency) { full += 1; }
    });
    var total = 0;
    data.config.limits.forEach(function (limit) { if (limit.level === "project") { total += limit.inflight; } });
    if (!data.config.limits.some(function (limit) { return limit.level === "project"; })) {
      data.config.limits.forEach(function (limit) { total = Math.max(total, limit.inflight); });
    }
    $("c-inflight").textContent = fmt(total);
    $("c-inflight").title = fmt(full) + " limit(s) at capacity";
    $("c-admitted").textContent = fmt(c.admitted);
    $("c-rejected").textContent = fmt(sum(c.rejected));
    $("c-shadow").textContent = fmt(c.shadow_rejected);
    $("c-delayed").textContent = fmt(c.delayed_pending);
    $("c-reloads").textContent = fmt(c.reloads) + " / " + fmt(c.reload_failed);
    $("c-backend").textContent = fmt(c.backend_errors);
  }

  function renderStages(stages) {
    var tbody = $("stages");
    tbody.textContent = "";
    Object.keys(stages).forEach(function (name) {
      var s = stages[name];
      var tr = el("tr");
      tr.dataset.stage = name;
      tr.appendChild(el("td", "", name));
      tr.appendChild(el("td", "", fmt(s.count)));
      tr.appendChild(el("td", "", fmtUs(s.mean_us)));
      tr.appendChild(el("td", "", fmtUs(s.p99_us)));
      tr.appendChild(el("td", "", fmtUs(s.max_us)));
      tbody.appendChild(tr);
    });
  }

  function renderRejections(counters) {
    var tbody = $("by-limit");
    tbody.textContent = "";
    var byLimit = counters.rejected_by_limit || {};
    var paths = Object.keys(byLimit).sort(function (a, b) { return byLimit[b] - byLimit[a]; });
    if (!paths.length) {
      var tr = el("tr");
      var td = el("td", "", "no rejections yet");
      td.colSpan = 2;
      tr.appendChild(td);
      tbody.appendChild(tr);
    }
    paths.forEach(function (path) {
      var row = el("tr");
      row.dataset.limit = path;
      row.appendChild(el("td", "", path));
      row.appendChild(el("td", "", fmt(byLimit[path])));
      tbody.appendChild(row);
    });
  }

  // The chart is drawn from the server's per-second counts (rejections_recent), so it
  // shows what was refused before the page was opened, not only the changes it saw.
  function recordHistory(recent) {
    history = [];
    for (var i = 0; i < HISTORY; i++) { history.push({ delta: {} }); }
    (recent || []).forEach(function (bucket) {
      var index = HISTORY - 1 - Math.floor(bucket.ago / BIN);
      if (index < 0) { return; }
      var delta = history[index].delta;
      Object.keys(bucket.counts).forEach(function (code) {
        delta[code] = (delta[code] || 0) + bucket.counts[code];
      });
    });
  }

  function svg(tag, attrs) {
    var node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    Object.keys(attrs).forEach(function (k) { node.setAttribute(k, String(attrs[k])); });
    return node;
  }

  function renderChart() {
    var box = $("chart");
    var width = 600;
    var height = 140;
    var top = 10;
    var bottom = 18;
    var chart = svg("svg", { viewBox: "0 0 " + width + " " + height, preserveAspectRatio: "none",
      role: "img", "aria-label": "rejections per refresh interval" });
    var max = 1;
    var codes = {};
    history.forEach(function (h) {
      var total = sum(h.delta);
      if (total > max) { max = total; }
      Object.keys(h.delta).forEach(function (code) { codes[code] = true; });
    });
    var slot = width / HISTORY;
    var plot = height - top - bottom;
    chart.appendChild(svg("line", { x1: 0, y1: height - bottom, x2: width, y2: height - bottom, "class": "axis" }));
    history.forEach(function (h, i) {
      var x = width - (history.length - i) * slot;
      var y = height - bottom;
      Object.keys(h.delta).sort().forEach(function (code) {
        var hgt = (h.delta[code] / max) * plot;
        y -= hgt;
        var rect = svg("rect", { x: x + 1, y: y, width: Math.max(1, slot - 2), height: hgt, fill: colorOf(code) });
        var title = svg("title", {});
        title.textContent = code + ": " + h.delta[code];
        rect.appendChild(title);
        chart.appendChild(rect);
      });
    });
    var label = svg("text", { x: 2, y: top + 2 });
    label.textContent = "max " + max + " per " + BIN + " s";
    chart.appendChild(label);
    var now = svg("text", { x: width - 2, y: height - 4, "text-anchor": "end" });
    now.textContent = "now";
    chart.appendChild(now);
    box.textContent = "";
    box.appendChild(chart);
    var legend = $("legend");
    legend.textContent = "";
    var known = Object.keys(codes).sort();
    if (!known.length) {
      legend.appendChild(el("span", "", "no rejections in the last " + fmt(HISTORY * BIN) + " s"));
    }
    known.forEach(function (code) {
      var item = el("span");
      var swatch = el("i");
      swatch.style.background = colorOf(code);
      item.appendChild(swatch);
      item.appendChild(document.createTextNode(code));
      legend.appendChild(item);
    });
  }

  function recordAdaptive(adaptive, inflight) {
    var paths = Object.keys(adaptive || {}).sort().slice(0, ADAPTIVE_SHOWN);
    var point = {};
    paths.forEach(function (path) {
      point[path] = [adaptive[path].limit, inflight[path] ? inflight[path].inflight : 0];
    });
    adaptiveHistory.push(point);
    if (adaptiveHistory.length > HISTORY) { adaptiveHistory.shift(); }
    return paths;
  }

  function renderAdaptive(paths) {
    var panel = $("adaptive-panel");
    panel.hidden = !paths.length;
    if (!paths.length) { return; }
    var width = 600;
    var height = 140;
    var top = 10;
    var bottom = 18;
    var plot = height - top - bottom;
    var max = 1;
    adaptiveHistory.forEach(function (point) {
      Object.keys(point).forEach(function (path) { max = Math.max(max, point[path][0], point[path][1]); });
    });
    var chart = svg("svg", { viewBox: "0 0 " + width + " " + height, preserveAspectRatio: "none",
      role: "img", "aria-label": "adaptive limits and in-flight per refresh interval" });
    chart.appendChild(svg("line", { x1: 0, y1: height - bottom, x2: width, y2: height - bottom, "class": "axis" }));
    var slot = width / HISTORY;
    var legend = $("adaptive-legend");
    legend.textContent = "";
    paths.forEach(function (path, index) {
      var color = LINE_COLORS[index % LINE_COLORS.length];
      [0, 1].forEach(function (series) {
        var points = [];
        adaptiveHistory.forEach(function (point, i) {
          if (!point[path]) { return; }
          var x = width - (adaptiveHistory.length - i - 0.5) * slot;
          var y = height - bottom - (point[path][series] / max) * plot;
          points.push(x.toFixed(1) + "," + y.toFixed(1));
        });
        var line = svg("polyline", { points: points.join(" "), fill: "none", stroke: color,
          "stroke-width": 2, "stroke-dasharray": series ? "4 3" : "none" });
        line.dataset.path = path;
        line.dataset.series = series ? "inflight" : "limit";
        chart.appendChild(line);
      });
      var last = adaptiveHistory[adaptiveHistory.length - 1][path];
      var item = el("span");
      item.dataset.adaptive = path;
      var swatch = el("i");
      swatch.style.background = color;
      item.appendChild(swatch);
      item.appendChild(document.createTextNode(path + ": limit " + fmt(last[0]) + ", in flight " + fmt(last[1])));
      legend.appendChild(item);
    });
    var label = svg("text", { x: 2, y: top + 2 });
    label.textContent = "max " + max;
    chart.appendChild(label);
    var box = $("adaptive-chart");
    box.textContent = "";
    box.appendChild(chart);
  }

  function render(data) {
    $("project").textContent = data.config.project;
    $("backend").textContent = "backend " + data.config.backend;
    $("mode").textContent = "mode " + data.config.mode;
    $("pid").textContent = "pid " + data.pid;
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
    $("interval").textContent = "(per " + BIN + " s, last " + fmt(HISTORY * BIN) + " s)";
    renderCards(data);
    renderLimits(data.config.limits, data.inflight, data.stats.adaptive);
    renderAdaptive(recordAdaptive(data.stats.adaptive, data.inflight));
    recordHistory(data.rejections_recent);
    renderChart();
    renderRejections(data.stats.counters);
    renderStages(data.stats.stages);
    showError(data.error ? "Backend error: " + data.error : "");
    body.dataset.refreshes = String((parseInt(body.dataset.refreshes || "0", 10)) + 1);
  }

  function refresh() {
    // The token link was exchanged for an HttpOnly cookie (or the framework's own login
    // session): same-origin credentials carry it; the token itself is never in the page.
    var headers = { "Accept": "application/json" };
    return fetch(jsonUrl, { headers: headers, credentials: "same-origin", cache: "no-store" })
      .then(function (response) {
        if (!response.ok) {
          throw new Error("status request failed: HTTP " + response.status +
            (response.status === 401 || response.status === 403 ? " (check the token or your login)" : ""));
        }
        return response.json();
      })
      .then(function (data) {
        if (paused) { return; }
        render(data);
        setState(data.error ? "degraded" : "live", data.error ? "stale" : "ok");
      })
      .catch(function (err) {
        setState("stale", "stale");
        showError(String(err && err.message ? err.message : err));
      });
  }

  function schedule() {
    if (timer !== null) { window.clearTimeout(timer); }
    timer = paused ? null : window.setTimeout(function () { refresh().then(schedule); }, refreshMs);
  }

  $("pause").addEventListener("click", function () {
    paused = !paused;
    $("pause").textContent = paused ? "Resume" : "Pause";
    if (paused) {
      if (timer !== null) { window.clearTimeout(timer); }
      timer = null;
      setState("paused", "paused");
    } else {
      refresh().then(schedule);
    }
  });
  document.addEventListener("visibilitychange", function () {
    if (!document.hidden && !paused) { refresh().then(schedule); }
  });
  refresh().then(schedule);
})();
