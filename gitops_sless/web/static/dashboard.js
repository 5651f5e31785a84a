// gitops-sless dashboard: keeps an open page current without reloading it.
// Every few seconds it fetches the page again and patches the regions marked
// data-live in place, node by node, so focus, selection and scroll positions
// survive; only what changed is touched. No dependencies, no build step.
"use strict";

(function () {
  const every = Number(document.body.dataset.refreshMs) || 2500;
  const notice = document.getElementById("live-status");
  let timer = 0;

  function sameShape(a, b) {
    return a.nodeType === b.nodeType && a.nodeName === b.nodeName &&
      (a.nodeType !== Node.ELEMENT_NODE || a.id === b.id);
  }

  function copyAttributes(old, fresh) {
    for (const { name } of Array.from(old.attributes)) {
      if (!fresh.hasAttribute(name)) old.removeAttribute(name);
    }
    for (const { name, value } of Array.from(fresh.attributes)) {
      if (old.getAttribute(name) !== value) old.setAttribute(name, value);
    }
  }

  function patch(old, fresh) {
    if (old.isEqualNode(fresh)) return;
    if (old.nodeType !== Node.ELEMENT_NODE) {
      old.nodeValue = fresh.nodeValue;
      return;
    }
    copyAttributes(old, fresh);
    const before = old.childNodes;
    const after = fresh.childNodes;
    const same = before.length === after.length &&
      Array.from(before).every((node, i) => sameShape(node, after[i]));
    if (!same) {
      old.replaceChildren(...Array.from(after, (node) => document.importNode(node, true)));
      return;
    }
    for (let i = 0; i < before.length; i++) patch(before[i], after[i]);
  }

  // what to focus again if the focused element was replaced: its id, or its link
  function focusKey() {
    const el = document.activeElement;
    if (!el || el === document.body) return null;
    if (el.id) return "#" + CSS.escape(el.id);
    const href = el.getAttribute("href");
    return href ? 'a[href="' + CSS.escape(href) + '"]' : null;
  }

  function atBottom(el) {
    return el.scrollHeight - el.scrollTop - el.clientHeight < 4;
  }

  function stickLogsToBottom(previous) {
    for (const log of document.querySelectorAll("pre.log[id]")) {
      if (previous === undefined || previous.has(log.id)) log.scrollTop = log.scrollHeight;
    }
  }

  function apply(doc) {
    const key = focusKey();
    const following = new Set(
      Array.from(document.querySelectorAll("pre.log[id]")).filter(atBottom).map((el) => el.id)
    );
    for (const region of document.querySelectorAll("[data-live]")) {
      const fresh = doc.getElementById(region.id);
      if (fresh) patch(region, fresh);
    }
    if (document.title !== doc.title) document.title = doc.title;
    stickLogsToBottom(following);
    if (key && (!document.activeElement || document.activeElement === document.body)) {
      const again = document.querySelector(key);
      if (again) again.focus({ preventScroll: true });
    }
  }

  function say(text) {
    if (notice.textContent !== text) notice.textContent = text;
    document.body.classList.toggle("stale", text !== "");
  }

  let busy = false;

  async function refresh() {
    clearTimeout(timer);
    if (busy) return;
    busy = true;
    try {
      if (!document.hidden) {
        const response = await fetch(location.href, {
          headers: { Accept: "text/html" },
          cache: "no-store",
        });
        // signed out meanwhile (the session expired, or signed out in another tab): the
        // page itself now answers with the sign-in form
        if (response.status === 401) {
          location.reload();
          return;
        }
        const type = response.headers.get("content-type") || "";
        if (!type.startsWith("text/html")) throw new Error("status " + response.status);
        apply(new DOMParser().parseFromString(await response.text(), "text/html"));
        say("");
      }
    } catch (error) {
      say("Cannot reach the server (" + error.message + "); retrying.");
    } finally {
      busy = false;
      timer = setTimeout(refresh, every);
    }
  }

  // The session reads the pages, not /api/: an API link is fetched with the session's
  // CSRF token (carried by the sign-out form) and its JSON shown.
  function csrfHeaders() {
    const form = document.querySelector("form.signout[data-csrf]");
    return form ? { [form.dataset.csrfHeader]: form.dataset.csrf } : null;
  }

  document.addEventListener("click", async (event) => {
    const link = event.target.closest && event.target.closest("a[data-api]");
    const headers = link && csrfHeaders();
    if (!headers || event.button !== 0 || event.ctrlKey || event.metaKey || event.shiftKey) {
      return;
    }
    event.preventDefault();
    try {
      const response = await fetch(link.href, {
        headers: { ...headers, Accept: "application/json" },
        cache: "no-store",
      });
      const blob = new Blob([await response.text()], { type: "application/json" });
      location.assign(URL.createObjectURL(blob));
    } catch (error) {
      say("Cannot reach the server (" + error.message + ").");
    }
  });

  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) refresh();
  });
  stickLogsToBottom();
  timer = setTimeout(refresh, every);
})();
