/* stabmon run report: draws the charts of the embedded data as inline SVG. No network, no library. */
(function () {
  "use strict";
  var NS = "http://www.w3.org/2000/svg";
  var DATA = JSON.parse(document.getElementById("stabmon-data").textContent);
  var PALETTE = ["#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#bcbd22", "#7f7f7f", "#e377c2",
                 "#393b79", "#637939", "#8c6d31", "#843c39"];
  var MARK_COLORS = {anomaly: "#d62728", decision: "#ff7f0e", intervention: "#6a3d9a", rollback: "#000000",
                     outcome: "#2ca02c"};
  var M = {left: 72, right: 16, top: 8, bottom: 26};
  var HEIGHT = 230;
  var tip = document.getElementById("tip");

  function el(name, attrs, parent) {
    var node = document.createElementNS(NS, name);
    for (var k in attrs) { if (Object.prototype.hasOwnProperty.call(attrs, k)) node.setAttribute(k, attrs[k]); }
    if (parent) parent.appendChild(node);
    return node;
  }

  function fmt(v) {
    if (v === null || v === undefined) return "";
    var a = Math.abs(v);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2);
    return String(Math.round(v * 1e4) / 1e4);
  }

  function niceTicks(lo, hi, n) {
    if (hi <= lo) return [lo];
    var raw = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
    var step = [1, 2, 5, 10].map(function (f) { return f * mag; }).filter(function (s) { return s >= raw; })[0];
    var out = [];
    for (var t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(t);
    return out;
  }

  function yExtent(chart) {
    if (chart.y_range) return padded(chart, chart.y_range[0], chart.y_range[1]);  // the kept trajectory's
    var lo = Infinity, hi = -Infinity;
    chart.series.forEach(function (s) {
      [s.values, s.abandoned[1]].forEach(function (vals) {
        vals.forEach(function (v) {
          if (chart.log && v <= 0) return;
          if (v < lo) lo = v;
          if (v > hi) hi = v;
        });
      });
    });
    if (lo === Infinity) { lo = chart.log ? 1 : 0; hi = chart.log ? 10 : 1; }
    return padded(chart, lo, hi);
  }

  function padded(chart, lo, hi) {
    if (chart.log) { lo = Math.log10(lo); hi = Math.log10(hi); }
    if (hi === lo) { hi += 0.5; lo -= 0.5; }
    var pad = (hi - lo) * 0.05;
    return [lo - pad, hi + pad];
  }

  function axes(svg, w, x, y, ext, chart) {
    var g = el("g", {"class": "axis"}, svg);
    niceTicks(DATA.step_range[0], DATA.step_range[1], 8).forEach(function (t) {
      el("line", {x1: x(t), x2: x(t), y1: M.top, y2: HEIGHT - M.bottom, "class": "grid"}, g);
      el("text", {x: x(t), y: HEIGHT - 8, "text-anchor": "middle"}, g).textContent = String(Math.round(t));
    });
    niceTicks(ext[0], ext[1], 4).forEach(function (t) {
      el("line", {x1: M.left, x2: w - M.right, y1: y(t), y2: y(t), "class": "grid"}, g);
      var label = chart.log ? "1e" + fmt(t) : fmt(t);
      el("text", {x: M.left - 6, y: y(t) + 4, "text-anchor": "end"}, g).textContent = label;
    });
    el("rect", {x: M.left, y: M.top, width: w - M.left - M.right, height: HEIGHT - M.top - M.bottom,
                "class": "frame"}, g);
  }

  function line(steps, values, x, y, chart, attrs, svg, ext) {
    var pts = [];
    for (var i = 0; i < steps.length; i++) {
      var v = values[i];
      if (chart.log) { if (v <= 0) continue; v = Math.log10(v); }
      if (ext) v = Math.min(ext[1], Math.max(ext[0], v));  // an abandoned value off the kept scale: at the edge
      pts.push(x(steps[i]).toFixed(1) + "," + y(v).toFixed(1));
    }
    if (pts.length === 1) pts.push(pts[0]);
    if (pts.length) { attrs.points = pts.join(" "); el("polyline", attrs, svg); }
  }

  function drawMarks(svg, x) {
    var g = el("g", {"class": "marks"}, svg);
    DATA.bands.forEach(function (b) {
      var r = el("rect", {x: x(b.start), y: M.top, width: Math.max(1, x(b.stop) - x(b.start)),
                          height: HEIGHT - M.top - M.bottom, "class": "band"}, g);
      r.addEventListener("mousemove", function (ev) { show(ev, "<b>" + esc(b.label) + "</b>"); });
      r.addEventListener("mouseleave", hide);
    });
    DATA.marks.forEach(function (m, i) {
      var px = x(m.step);
      var vis = el("line", {x1: px, x2: px, y1: M.top, y2: HEIGHT - M.bottom, stroke: MARK_COLORS[m.kind],
                            "class": "mark mark-" + m.kind, "data-step": m.step, "data-row": m.row,
                            "data-kind": m.kind, "data-index": i, "data-severity": m.severity || ""}, g);
      var hit = el("line", {x1: px, x2: px, y1: M.top, y2: HEIGHT - M.bottom, "class": "hit"}, g);
      hit.addEventListener("mousemove", function (ev) { show(ev, markHtml(m)); });
      hit.addEventListener("mouseleave", hide);
      hit.addEventListener("click", function () { focusRow(m.row); });
      vis.setAttribute("pointer-events", "none");
    });
  }

  function esc(s) {
    return String(s).replace(/[&<>"]/g, function (c) {
      return {"&": "&amp;", "<": "&lt;", ">": "&gt;", "\"": "&quot;"}[c];
    });
  }

  function markHtml(m) {
    var rows = m.detail.map(function (d) { return "<tr><th>" + esc(d[0]) + "</th><td>" + esc(d[1]) + "</td></tr>"; });
    return "<b style='color:" + MARK_COLORS[m.kind] + "'>" + esc(m.kind) + "</b> at step " + m.step + ": " +
      esc(m.label) + "<table>" + rows.join("") + "</table>";
  }

  function nearest(steps, step) {
    var lo = 0, hi = steps.length - 1;
    if (hi < 0) return -1;
    while (lo < hi) { var mid = (lo + hi) >> 1; if (steps[mid] < step) lo = mid + 1; else hi = mid; }
    if (lo > 0 && Math.abs(steps[lo - 1] - step) <= Math.abs(steps[lo] - step)) lo -= 1;
    return lo;
  }

  function show(ev, html) {
    tip.innerHTML = html;
    tip.style.display = "block";
    tip.style.left = Math.min(ev.pageX + 14, window.scrollX + window.innerWidth - tip.offsetWidth - 8) + "px";
    tip.style.top = (ev.pageY + 14) + "px";
  }

  function hide() { tip.style.display = "none"; }

  function focusRow(id) {
    var row = document.getElementById(id);
    if (!row) return;
    document.querySelectorAll("tr.focus").forEach(function (r) { r.classList.remove("focus"); });
    row.classList.add("focus");
    row.scrollIntoView({block: "center"});
  }

  function hover(svg, chart, x, w) {
    var cross = el("line", {y1: M.top, y2: HEIGHT - M.bottom, "class": "cross", visibility: "hidden"}, svg);
    var area = el("rect", {x: M.left, y: M.top, width: w - M.left - M.right, height: HEIGHT - M.top - M.bottom,
                           "class": "area"}, svg);
    svg.insertBefore(area, svg.querySelector("g.marks"));
    area.addEventListener("mousemove", function (ev) {
      var box = svg.getBoundingClientRect();
      var px = ev.clientX - box.left;
      var step = DATA.step_range[0] + (px - M.left) / (w - M.left - M.right) *
        Math.max(1, DATA.step_range[1] - DATA.step_range[0]);
      cross.setAttribute("x1", px); cross.setAttribute("x2", px); cross.setAttribute("visibility", "visible");
      var rows = chart.series.map(function (s, k) {
        var i = nearest(s.steps, step);
        if (i < 0) return "";
        return "<tr><th style='color:" + PALETTE[k % PALETTE.length] + "'>" + esc(s.name) + "</th><td>" +
          fmt(s.values[i]) + " @ " + s.steps[i] + "</td></tr>";
      });
      show(ev, "step " + Math.round(step) + "<table>" + rows.join("") + "</table>");
    });
    area.addEventListener("mouseleave", function () { cross.setAttribute("visibility", "hidden"); hide(); });
  }

  function drawChart(chart, host) {
    var box = document.createElement("section");
    box.className = "chart";
    box.id = "chart-" + chart.id;
    var h = document.createElement("h3");
    h.textContent = chart.title;
    box.appendChild(h);
    var legend = document.createElement("div");
    legend.className = "legend";
    chart.series.forEach(function (s, k) {
      var span = document.createElement("span");
      span.innerHTML = "<i style='background:" + PALETTE[k % PALETTE.length] + "'></i>" + esc(s.name) +
        (s.nonfinite.length ? " <em>(" + s.nonfinite.length + " non-finite)</em>" : "");
      legend.appendChild(span);
    });
    if (chart.off_scale) {
      var off = document.createElement("span");
      off.className = "off-scale";
      off.textContent = chart.off_scale + " abandoned value(s) off the kept scale, drawn at its edge";
      legend.appendChild(off);
    }
    box.appendChild(legend);
    host.appendChild(box);
    var w = Math.max(480, box.clientWidth || 960);
    var svg = el("svg", {width: w, height: HEIGHT, viewBox: "0 0 " + w + " " + HEIGHT, "data-chart": chart.id,
                         "data-plot-left": M.left, "data-plot-right": w - M.right}, null);
    box.appendChild(svg);
    var span = Math.max(1, DATA.step_range[1] - DATA.step_range[0]);
    var x = function (s) { return M.left + (s - DATA.step_range[0]) / span * (w - M.left - M.right); };
    var ext = yExtent(chart);
    var y = function (v) { return HEIGHT - M.bottom - (v - ext[0]) / (ext[1] - ext[0]) * (HEIGHT - M.top - M.bottom); };
    axes(svg, w, x, y, ext, chart);
    chart.series.forEach(function (s, k) {
      var color = PALETTE[k % PALETTE.length];
      line(s.abandoned[0], s.abandoned[1], x, y, chart, {"class": "abandoned", stroke: color}, svg, ext);
      line(s.steps, s.values, x, y, chart, {"class": "series", stroke: color, "data-series": s.name}, svg);
      s.nonfinite.forEach(function (st) {
        el("path", {d: "M" + x(st) + "," + (M.top + 1) + "l-4,8h8z", "class": "nonfinite"}, svg);
      });
    });
    hover(svg, chart, x, w);
    drawMarks(svg, x);
  }

  var SEVERITY = {"info": 0, "warning": 1, "error": 2, "critical": 3};

  function filterMarks(least) {
    // anomaly marks below the chosen severity are hidden (with their hover target); the runbook's acts stay
    document.querySelectorAll("line.mark-anomaly").forEach(function (m) {
      var hidden = SEVERITY[m.getAttribute("data-severity")] < least;
      m.style.display = hidden ? "none" : "";
      if (m.nextSibling) m.nextSibling.style.display = hidden ? "none" : "";
    });
    document.body.setAttribute("data-mark-filter", String(least));
  }

  function init() {
    var host = document.getElementById("charts");
    DATA.charts.forEach(function (c) { drawChart(c, host); });
    var select = document.getElementById("mark-filter");
    if (select) {
      select.addEventListener("change", function () { filterMarks(Number(select.value)); });
      filterMarks(Number(select.value));
    }
    document.querySelectorAll("tr[data-row]").forEach(function (tr) {
      tr.addEventListener("click", function () {
        document.querySelectorAll("line.mark.lit").forEach(function (m) { m.classList.remove("lit"); });
        document.querySelectorAll("line.mark[data-row='" + tr.getAttribute("data-row") + "']").forEach(
          function (m) { m.classList.add("lit"); });
        var first = document.querySelector("section.chart");
        if (first) first.scrollIntoView({block: "start"});
      });
    });
    document.body.setAttribute("data-drawn", String(DATA.charts.length));
  }

  init();
})();
