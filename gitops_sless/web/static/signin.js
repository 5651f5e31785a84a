// gitops-sless sign-in: a link such as /signin#token=... (the one the server prints at
// start) signs in at once. The token is in the fragment, which a browser never sends, so
// no access log holds it; it leaves the address bar before the form is sent.
"use strict";

(function () {
  const found = /(?:^#|&)token=([^&]+)/.exec(location.hash);
  if (!found) return;
  history.replaceState(null, "", location.pathname + location.search);
  const form = document.querySelector("form.signin");
  const input = document.getElementById("token");
  if (!form || !input) return;
  input.value = decodeURIComponent(found[1]);
  form.requestSubmit();
})();
