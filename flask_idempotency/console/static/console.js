// Refreshes the overview's figures every few seconds (the page works without it).
"use strict";
(function () {
  var box = document.getElementById("overview");
  if (!box || !window.fetch) return;
  var seconds = Number(box.getAttribute("data-refresh")) || 5;
  function refresh() {
    fetch(window.location.href, { credentials: "same-origin", headers: { Accept: "text/html" } })
      .then(function (response) { return response.ok ? response.text() : null; })
      .then(function (html) {
        if (html === null) return;
        var fresh = new DOMParser().parseFromString(html, "text/html").getElementById("overview");
        if (fresh) box.replaceChildren.apply(box, Array.from(fresh.childNodes));
      })
      .catch(function () {})
      .finally(function () { window.setTimeout(refresh, seconds * 1000); });
  }
  window.setTimeout(refresh, seconds * 1000);
})();
