"""The view's stylesheet and the index's script, written beside the pages (`view.css`,
`view.js`): no file from elsewhere, so a page opens from file:// with no network."""

from __future__ import annotations

__all__ = ["CSS", "CSS_FILE", "JS", "JS_FILE"]

CSS_FILE, JS_FILE = "view.css", "view.js"

CSS = """\
body { font: 14px/1.45 system-ui, sans-serif; margin: 1.5em auto; max-width: 72em;
       padding: 0 1em; color: #1d1d1f; }
h1 { font-size: 1.5em; margin: 0.2em 0; } h2 { font-size: 1.2em; margin-top: 1.6em; }
h3 { font-size: 1em; margin: 1em 0 0.3em; }
a { color: #0b57d0; }
nav.pager { display: flex; gap: 1.2em; margin-bottom: 0.8em; }
.facts { color: #555; } .facts b { color: #1d1d1f; }
.none { color: #777; font-style: italic; }
.ctx { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 13px;
       margin: 2px 0; display: flex; gap: 0.8em; align-items: baseline; }
.ctx .val { min-width: 5.5em; text-align: right; color: #333; flex: none; }
.ctx .where { min-width: 8em; color: #888; font-size: 12px; flex: none; }
.toks { white-space: pre-wrap; word-break: break-all; }
.toks > span { border-radius: 2px; padding: 0 1px; }
.toks > span.max { outline: 2px solid #c03000; outline-offset: -1px; }
.ws { color: #999; }
table { border-collapse: collapse; }
th, td { padding: 2px 8px; text-align: left; vertical-align: top; }
thead th { border-bottom: 1px solid #ccc; }
tbody tr:nth-child(even) { background: #f6f6f8; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
th[data-sort] { cursor: pointer; user-select: none; white-space: nowrap; }
th[data-sort]::after { content: " ↕"; color: #aaa; }
th[aria-sort=ascending]::after { content: " ▲"; color: #333; }
th[aria-sort=descending]::after { content: " ▼"; color: #333; }
td.text { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 12px;
          white-space: pre-wrap; word-break: break-all; }
td.text b { outline: 1px solid #c03000; font-weight: normal; }
#search { font-size: 15px; padding: 4px 8px; width: 24em; }
.patches { display: flex; flex-wrap: wrap; gap: 12px; }
.patches figure { margin: 0; text-align: center; font-size: 12px; color: #444; }
.patches img, img.thumb { image-rendering: pixelated; border: 1px solid #ccc; }
.histogram rect.bar { fill: #ff6a00; } .histogram .axis { stroke: #444; }
.histogram text { font-size: 10px; fill: #444; }
.logits { display: flex; gap: 3em; }
"""

# Sorting and searching the index's tables, on the rows the page already holds (no data
# fetched: Chromium refuses fetch() of a file:// URL). Ties keep the units' order.
JS = """\
(function () {
  "use strict";
  function num(row, key) { return parseFloat(row.getAttribute("data-" + key)); }
  function sortTable(table, th) {
    var key = th.getAttribute("data-sort");
    var dir = th.getAttribute("aria-sort") === "ascending" ? "descending" : "ascending";
    table.querySelectorAll("th[data-sort]").forEach(function (o) {
      o.removeAttribute("aria-sort");
    });
    th.setAttribute("aria-sort", dir);
    var sign = dir === "ascending" ? 1 : -1;
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (a, b) {
      var x = num(a, key), y = num(b, key);
      var xn = isNaN(x), yn = isNaN(y);
      if (xn || yn) {
        if (xn !== yn) { return xn ? 1 : -1; }
      } else if (x !== y) {
        return x < y ? -sign : sign;
      }
      return num(a, "unit") - num(b, "unit");
    });
    var frag = document.createDocumentFragment();
    rows.forEach(function (r) { frag.appendChild(r); });
    body.appendChild(frag);
  }
  document.querySelectorAll("table.units").forEach(function (table) {
    table.querySelectorAll("th[data-sort]").forEach(function (th) {
      th.addEventListener("click", function () { sortTable(table, th); });
    });
  });
  var box = document.getElementById("search");
  var shown = document.getElementById("shown");
  function filter() {
    var q = box.value.trim().toLowerCase();
    var n = 0;
    document.querySelectorAll("table.units tbody tr").forEach(function (row) {
      var hit = !q || row.getAttribute("data-unit") === q ||
        row.getAttribute("data-search").indexOf(q) >= 0;
      row.hidden = !hit;
      if (hit) { n += 1; }
    });
    shown.textContent = String(n);
  }
  if (box) { box.addEventListener("input", filter); filter(); }
})();
"""
