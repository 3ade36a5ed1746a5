// report.html's tables: click a header to sort (numbers numerically, empty cells last either way), and the filter
// bar hides the rows that do not match. Reads only data-* attributes and text (never innerHTML); inlined by report.py.
(function () {
  "use strict";
  var tables = Array.prototype.slice.call(document.querySelectorAll("table.rows"));

  function num(v) {
    if (v === null || v === undefined || v === "") return null;
    var x = Number(v);
    return isFinite(x) ? x : null;
  }

  function cellKey(row, i, numeric) {
    var cell = row.cells[i];
    var v = cell.hasAttribute("data-v") ? cell.getAttribute("data-v") : cell.textContent;
    if (numeric) return num(v);
    return v === "" ? null : v.toLowerCase();
  }

  function sortBy(table, i, th) {
    var ascending = th.getAttribute("aria-sort") !== "ascending";
    table.querySelectorAll("thead th").forEach(function (h) { h.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
    var numeric = th.getAttribute("data-type") === "num";
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (a, b) {
      var x = cellKey(a, i, numeric), y = cellKey(b, i, numeric);
      if (x === null || y === null) return (x === null) - (y === null);  // empty last, whichever direction
      var c = numeric ? x - y : (x < y ? -1 : x > y ? 1 : 0);
      return ascending ? c : -c;
    });
    rows.forEach(function (r) { body.appendChild(r); });
  }

  tables.forEach(function (table) {
    table.querySelectorAll("thead th").forEach(function (th, i) {
      th.addEventListener("click", function () { sortBy(table, i, th); });
    });
  });

  function field(id) { return document.getElementById(id); }

  function inRange(v, lo, hi) {
    if (lo === null && hi === null) return true;
    if (v === null) return false;
    return (lo === null || v >= lo) && (hi === null || v <= hi);
  }

  function apply() {
    var category = field("f-category").value, family = field("f-family").value, flag = field("f-flag").value;
    var suspiciousOnly = field("f-suspicious").checked;
    var stepMin = num(field("f-step-min").value), stepMax = num(field("f-step-max").value);
    var rewardMin = num(field("f-reward-min").value), rewardMax = num(field("f-reward-max").value);
    tables.forEach(function (table) {
      var rows = table.tBodies[0].rows, shown = 0;
      for (var k = 0; k < rows.length; k++) {
        var r = rows[k];
        var flags = (r.getAttribute("data-flags") || "").split(" ");
        var keep = (!category || r.getAttribute("data-category") === category)
          && (!family || r.getAttribute("data-family") === family)
          && inRange(num(r.getAttribute("data-step")), stepMin, stepMax)
          && inRange(num(r.getAttribute("data-reward")), rewardMin, rewardMax)
          && (!flag || flags.indexOf(flag) >= 0)
          && (!suspiciousOnly || r.getAttribute("data-suspicious") === "1");
        r.hidden = !keep;
        if (keep) shown++;
      }
      var count = document.querySelector('.count[data-for="' + table.id + '"]');
      if (count) count.textContent = shown + " of " + rows.length + " rows shown";
    });
  }

  var bar = field("filters");
  if (bar) {
    bar.querySelectorAll("input, select").forEach(function (e) {
      e.addEventListener("input", apply);
      e.addEventListener("change", apply);
    });
    field("f-reset").addEventListener("click", function () {
      bar.querySelectorAll("input[type=number]").forEach(function (e) { e.value = ""; });
      bar.querySelectorAll("select").forEach(function (e) { e.value = ""; });
      field("f-suspicious").checked = false;
      apply();
    });
    apply();
  }
})();
