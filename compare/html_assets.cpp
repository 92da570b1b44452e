// The HTML reports' inline style and script (compare/html_page.h). The
// script draws the error-growth chart into <svg id="chart"> and the heatmap
// into <canvas id="heatmap"> from the JSON blocks #chart-data and
// #heatmap-data, makes table.sortable sortable, and records on <body> that it
// ran: data-rendered="ok", data-points (chart markers drawn), data-cells
// (heatmap cells drawn), or data-error with the first script error.
#include "compare/html_page.h"

namespace llmdiff::compare::html {

const char* const kStyle = R"CSS(
:root { color-scheme: light dark; --bg: #ffffff; --fg: #1d1f21; --muted: #5f6368; --grid: #dde1e6;
  --border: #d0d7de; --panel: #f6f8fa; --bad: #c62828; --ok: #2e7d32; --accent: #1565c0; --nonfinite: #ff00ff; }
@media (prefers-color-scheme: dark) {
  :root { --bg: #0f1115; --fg: #e6e6e6; --muted: #9aa0a6; --grid: #2b313c; --border: #30363d; --panel: #161b22;
    --bad: #ef5350; --ok: #66bb6a; --accent: #64b5f6; }
}
body { margin: 0; background: var(--bg); color: var(--fg); font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; }
main { max-width: 1160px; margin: 0 auto; padding: 16px 24px 48px; }
h1 { font-size: 22px; margin: 8px 0 4px; } h2 { font-size: 17px; margin: 28px 0 6px; border-bottom: 1px solid var(--border); }
code { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12.5px; overflow-wrap: anywhere; }
.verdict { margin: 14px 0; padding: 10px 14px; border-left: 6px solid var(--muted); background: var(--panel); font-weight: 600; }
.verdict.bad { border-color: var(--bad); } .verdict.ok { border-color: var(--ok); }
dl.facts { display: grid; grid-template-columns: max-content 1fr; gap: 4px 18px; margin: 8px 0; }
dl.facts dt { color: var(--muted); } dl.facts dd { margin: 0; }
table { border-collapse: collapse; width: 100%; margin: 8px 0 16px; font-size: 13px; }
th, td { border-bottom: 1px solid var(--border); padding: 4px 8px; text-align: left; vertical-align: top; }
td code { white-space: nowrap; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
th { cursor: pointer; user-select: none; background: var(--panel); position: sticky; top: 0; }
th[data-sort=asc]::after { content: " \25B2"; } th[data-sort=desc]::after { content: " \25BC"; }
tr.fail td:last-child { color: var(--bad); font-weight: 600; } tr.pass td:last-child { color: var(--ok); }
tr.supported td:nth-child(3) { color: var(--ok); font-weight: 600; }
svg#chart { width: 100%; height: auto; background: var(--panel); border: 1px solid var(--border); }
svg#chart text { fill: var(--fg); font-size: 11px; }
.legend { margin: 6px 0; font-size: 12px; } .legend span { display: inline-block; margin-right: 12px; }
.swatch { display: inline-block; width: 10px; height: 10px; margin-right: 4px; border-radius: 2px; vertical-align: middle; }
canvas { max-width: 100%; vertical-align: middle; }
.note { color: var(--muted); } ul { margin: 4px 0; padding-left: 20px; }
)CSS";

const char* const kScript = R"JS(
(function () {
  'use strict';
  var body = document.body;
  window.onerror = function (msg, src, line) {
    if (!body.hasAttribute('data-error')) body.setAttribute('data-error', String(msg) + ' (line ' + line + ')');
  };
  var palette = ['#1f77b4', '#ff7f0e', '#2ca02c', '#d62728', '#9467bd', '#8c564b', '#e377c2', '#7f7f7f',
                 '#bcbd22', '#17becf', '#3949ab', '#ad494a', '#00897b', '#6d4c41'];
  function data(id) { var e = document.getElementById(id); return e ? JSON.parse(e.textContent) : null; }
  function css(name) { return getComputedStyle(body).getPropertyValue(name).trim(); }
  function fmt(v) { return v === null ? 'off scale' : v === 0 ? '0' : Number(v).toExponential(2); }

  // --- error-growth chart (SVG) ---
  function drawChart() {
    var svg = document.getElementById('chart'), d = data('chart-data');
    if (!svg || !d || !d.points.length) return 0;
    var NS = svg.namespaceURI;
    function el(name, attrs, text) {
      var e = document.createElementNS(NS, name);
      for (var k in attrs) e.setAttribute(k, attrs[k]);
      if (text !== undefined) e.textContent = text;
      svg.appendChild(e);
      return e;
    }
    var W = 1100, H = 440, L = 58, R = 16, T = 26, B = 40, pts = d.points, n = pts.length;
    var lo = 0, hi = 1;
    pts.forEach(function (p) {
      [p.r, p.lr].forEach(function (v) {
        if (typeof v === 'number' && v > 0) {
          var l = Math.log10(v);
          lo = Math.min(lo, Math.floor(l)); hi = Math.max(hi, Math.ceil(l));
        }
      });
    });
    lo = Math.max(lo, -12); hi = Math.min(Math.max(hi, lo + 1), 12);
    // Off-scale values get a row of their own, one decade above the top.
    var off = pts.some(function (p) { return p.r === null || p.lr === null; });
    var top = hi + (off ? 1 : 0);
    function X(i) { return n === 1 ? (L + W - R) / 2 : L + i * (W - L - R) / (n - 1); }
    function Y(v) {
      var l = v === null ? top : v > 0 ? Math.log10(v) : lo;
      l = Math.max(lo, Math.min(v === null ? top : hi, l));
      return T + (top - l) * (H - T - B) / (top - lo);
    }
    var grid = css('--grid'), bad = css('--bad'), fg = css('--fg');
    for (var e = lo; e <= hi; ++e) {
      el('line', {x1: L, x2: W - R, y1: Y(Math.pow(10, e)), y2: Y(Math.pow(10, e)), stroke: grid});
      el('text', {x: L - 6, y: Y(Math.pow(10, e)) + 4, 'text-anchor': 'end'}, '1e' + e);
    }
    if (off) el('text', {x: L - 6, y: Y(null) + 4, 'text-anchor': 'end'}, 'off scale');
    // Step boundaries, labelled where there is room (rope.inv_freq and
    // generated are one name each, outside the steps).
    var labelled = -1e9;
    for (var i = 0; i < n; ++i)
      if (i === 0 || pts[i].st !== pts[i - 1].st) {
        var x0 = i === 0 ? L : (X(i - 1) + X(i)) / 2, right = x0 > W - 160;
        el('line', {x1: x0, x2: x0, y1: T, y2: H - B, stroke: grid, 'stroke-width': 2});
        var next = i + 1 < n && pts[i + 1].st !== pts[i].st ? X(i + 1) : Infinity;
        if (x0 - labelled < 70 || (!right && next - x0 < 70)) continue;
        el('text', {x: right ? x0 - 4 : x0 + 4, y: T - 8, 'text-anchor': right ? 'end' : 'start'},
           pts[i].st >= 0 ? 'step ' + pts[i].st : pts[i].n);
        labelled = x0;
      }
    el('line', {x1: L, x2: W - R, y1: Y(1), y2: Y(1), stroke: bad, 'stroke-dasharray': '6 4', 'stroke-width': 1.5});
    el('text', {x: W - R - 4, y: Y(1) - 5, 'text-anchor': 'end'}, 'threshold (ratio 1)');
    el('text', {x: (L + W - R) / 2, y: H - 10, 'text-anchor': 'middle'}, 'names in canonical order (layer by layer, every step)');
    el('text', {x: 14, y: (T + H - B) / 2, transform: 'rotate(-90 14 ' + (T + H - B) / 2 + ')', 'text-anchor': 'middle'},
       'error / threshold');
    var colour = {}, sites = [];
    pts.forEach(function (p) { if (!(p.s in colour)) { colour[p.s] = palette[sites.length % palette.length]; sites.push(p.s); } });
    // One line per site and step through its layers: how the error grows.
    var lines = {};
    pts.forEach(function (p, i) {
      if (typeof p.r !== 'number') return;
      var key = p.s + '\u0000' + p.st;
      (lines[key] = lines[key] || {s: p.s, xy: []}).xy.push(X(i).toFixed(1) + ',' + Y(p.r).toFixed(1));
    });
    Object.keys(lines).forEach(function (k) {
      if (lines[k].xy.length > 1)
        el('polyline', {points: lines[k].xy.join(' '), fill: 'none', stroke: colour[lines[k].s], 'stroke-opacity': 0.55});
    });
    var drawn = 0;
    pts.forEach(function (p, i) {
      if (p.r !== undefined) {
        var c = el('circle', {cx: X(i), cy: Y(p.r), r: p.f ? 3.6 : 2.4, fill: colour[p.s], stroke: p.f ? bad : 'none'});
        var t = document.createElementNS(NS, 'title');
        t.textContent = p.n + ': error / threshold ' + fmt(p.r) + (p.f ? ' (diverges)' : '');
        c.appendChild(t);
        ++drawn;
      }
      if (p.lr !== undefined) {
        var s = el('rect', {x: X(i) - 3.5, y: Y(p.lr) - 3.5, width: 7, height: 7, fill: 'none', stroke: p.lf ? bad : colour[p.s]});
        var u = document.createElementNS(NS, 'title');
        u.textContent = p.n + ': local error / threshold ' + fmt(p.lr) + (p.lf ? ' (fails locally)' : '');
        s.appendChild(u);
        ++drawn;
      }
    });
    function mark(i, label, dy, value) {
      if (i < 0) return;
      var x = X(i), y = Y(value), up = y - dy - 14 > T, ty = up ? y - dy : y + dy;
      el('circle', {cx: x, cy: y, r: 8, fill: 'none', stroke: fg, 'stroke-width': 2});
      el('line', {x1: x, x2: x, y1: up ? y - 8 : y + 8, y2: ty, stroke: fg});
      el('text', {x: x > W / 2 ? x - 4 : x + 4, y: up ? ty - 3 : ty + 12, 'text-anchor': x > W / 2 ? 'end' : 'start'},
         label + ': ' + pts[i].n);
    }
    if (d.first >= 0) mark(d.first, 'first divergence', 26, pts[d.first].r === undefined ? null : pts[d.first].r);
    if (d.local_first >= 0) mark(d.local_first, 'first local failure', 46, pts[d.local_first].lr === undefined ? null : pts[d.local_first].lr);
    var legend = document.getElementById('chart-legend');
    sites.slice(0, 24).forEach(function (s) {
      var span = document.createElement('span'), sw = document.createElement('i');
      sw.className = 'swatch'; sw.style.background = colour[s];
      span.appendChild(sw); span.appendChild(document.createTextNode(s));
      legend.appendChild(span);
    });
    if (sites.length > 24) legend.appendChild(document.createTextNode('(' + (sites.length - 24) + ' more sites)'));
    return drawn;
  }

  // --- heatmap (canvas) ---
  var stops = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  function ramp(t) {
    t = Math.max(0, Math.min(1, t)) * (stops.length - 1);
    var k = Math.min(Math.floor(t), stops.length - 2), f = t - k, a = stops[k], b = stops[k + 1];
    return 'rgb(' + [0, 1, 2].map(function (j) { return Math.round(a[j] + f * (b[j] - a[j])); }).join(',') + ')';
  }
  function drawHeatmap() {
    var cv = document.getElementById('heatmap'), d = data('heatmap-data');
    if (!cv || !d) return 0;
    var cw = Math.max(3, Math.min(40, Math.floor(1000 / d.cols))), ch = Math.max(3, Math.min(40, Math.floor(480 / d.rows)));
    var padL = 64, padT = 8, padB = 34;
    cv.width = padL + d.cols * cw + 8; cv.height = padT + d.rows * ch + padB;
    var ctx = cv.getContext('2d'), max = d.max || 0, min = Infinity;
    d.values.forEach(function (v) { if (v !== null && v > 0 && v < min) min = v; });
    min = Math.max(min === Infinity ? max : min, max * 1e-6);
    var span = Math.log10(max) - Math.log10(min);
    function t(v) { return v <= 0 || max <= 0 ? 0 : span <= 0 ? 1 : (Math.log10(v) - Math.log10(min)) / span; }
    var cells = 0, nonfinite = css('--nonfinite');
    for (var r = 0; r < d.rows; ++r)
      for (var c = 0; c < d.cols; ++c) {
        var v = d.values[r * d.cols + c];
        ctx.fillStyle = v === null ? nonfinite : ramp(t(v));
        ctx.fillRect(padL + c * cw, padT + r * ch, cw, ch);
        ++cells;
      }
    ctx.fillStyle = css('--fg'); ctx.font = '11px sans-serif';
    ctx.textAlign = 'right';
    ctx.fillText(d.row_label + ' 0', padL - 4, padT + 10);
    ctx.fillText(String(d.src_rows - 1), padL - 4, padT + d.rows * ch);
    ctx.textAlign = 'left';
    ctx.fillText(d.col_label + ' 0', padL, padT + d.rows * ch + 14);
    ctx.textAlign = 'right';
    ctx.fillText(String(d.src_cols - 1), padL + d.cols * cw, padT + d.rows * ch + 14);
    ctx.textAlign = 'center';
    ctx.fillText(d.col_label + ' \u2192', padL + d.cols * cw / 2, padT + d.rows * ch + 28);
    var lg = document.getElementById('heatmap-legend'), lc = lg.getContext('2d');
    for (var x = 0; x < lg.width; ++x) { lc.fillStyle = ramp(x / (lg.width - 1)); lc.fillRect(x, 0, 1, lg.height); }
    document.getElementById('heatmap-scale').textContent =
      'max |candidate - reference|: ' + fmt(min) + ' (log scale) \u2026 ' + fmt(max) + '; magenta: non-finite';
    var tip = document.getElementById('heatmap-tip');
    cv.addEventListener('mousemove', function (ev) {
      var box = cv.getBoundingClientRect(), sx = cv.width / box.width;
      var c = Math.floor(((ev.clientX - box.left) * sx - padL) / cw), r = Math.floor(((ev.clientY - box.top) * sx - padT) / ch);
      if (r < 0 || c < 0 || r >= d.rows || c >= d.cols) return;
      var r0 = r * d.row_step, c0 = c * d.col_step;
      tip.textContent = d.row_label + ' ' + r0 + '..' + (Math.min(r0 + d.row_step, d.src_rows) - 1) + ', ' + d.col_label + ' ' +
        c0 + '..' + (Math.min(c0 + d.col_step, d.src_cols) - 1) + ': ' + fmt(d.values[r * d.cols + c]);
    });
    return cells;
  }

  // --- sortable tables ---
  function sortable(table) {
    var heads = table.tHead.rows[0].cells;
    Array.prototype.forEach.call(heads, function (th, col) {
      th.addEventListener('click', function () {
        var asc = th.getAttribute('data-sort') !== 'asc';
        Array.prototype.forEach.call(heads, function (h) { h.removeAttribute('data-sort'); });
        th.setAttribute('data-sort', asc ? 'asc' : 'desc');
        var tb = table.tBodies[0], rows = Array.prototype.slice.call(tb.rows);
        rows.sort(function (a, b) {
          var x = a.cells[col], y = b.cells[col], vx = x.getAttribute('data-v'), vy = y.getAttribute('data-v'), k;
          if (vx !== null && vy !== null) {
            var fx = parseFloat(vx), fy = parseFloat(vy);
            k = fx === fy ? 0 : isNaN(fx) ? 1 : isNaN(fy) ? -1 : fx < fy ? -1 : 1;
          } else {
            k = x.textContent.localeCompare(y.textContent);
          }
          return asc ? k : -k;
        });
        rows.forEach(function (row) { tb.appendChild(row); });
      });
    });
  }

  try {
    var points = drawChart(), cells = drawHeatmap();
    Array.prototype.forEach.call(document.querySelectorAll('table.sortable'), sortable);
    body.setAttribute('data-points', String(points));
    body.setAttribute('data-cells', String(cells));
    body.setAttribute('data-rendered', 'ok');
  } catch (err) {
    body.setAttribute('data-error', String(err && err.stack || err));
    throw err;
  }
})();
)JS";

}  // namespace llmdiff::compare::html
