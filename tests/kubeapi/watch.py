"""WATCH as the real API server serves it (Kubernetes API concepts, "Efficient detection of
changes"): a chunked stream of ``{"type", "object"}`` lines.

* ``resourceVersion`` unset or ``"0"``: synthetic ``ADDED`` events for what is there, then
  the changes; any other value: the changes after it, in order.
* A resourceVersion older than the history kept (``Store.compact``, etcd's compaction) is
  answered 200 with one ``ERROR`` event carrying a ``410 Expired`` Status, then the end of
  the stream, as the watch cache does.
* ``allowWatchBookmarks=true``: a ``BOOKMARK`` event (the kind, its apiVersion and only
  ``metadata.resourceVersion``) after ``Store.bookmark_sec`` without an event sent, and
  one just before the stream ends on its timeout: every change up to that version that the
  watch selects has been sent.
* ``timeoutSeconds`` ends the stream cleanly (default 1800, at most 3600).
* ``Store.drop_watches`` cuts open streams mid-way (no terminating chunk).
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from typing import TYPE_CHECKING, Any

from .resources import ApiError, bad_request
from .store import match_field, matches, parse_field_selector, parse_label_selector

if TYPE_CHECKING:
    from .routes import Route
    from .server import Handler


def _true(value: str | None) -> bool:
    return value is not None and value.lower() in ("true", "1")


class _Dropped(Exception):
    pass


def serve(handler: Handler, r: Route, query: dict[str, str]) -> None:
    """Answer one WATCH request on ``handler``'s connection, until it ends."""
    from .server import present  # the server module imports this one

    store, res = handler.fake.store, r.res
    labels = parse_label_selector(query["labelSelector"]) if query.get("labelSelector") else []
    fields = (
        parse_field_selector(res.kind, query["fieldSelector"]) if query.get("fieldSelector") else []
    )
    timeout = min(float(query.get("timeoutSeconds") or 1800), 3600)
    bookmarks = _true(query.get("allowWatchBookmarks"))
    rv_text = query.get("resourceVersion") or "0"
    if not rv_text.isdigit():
        raise bad_request(f"invalid resource version: {rv_text}")
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Transfer-Encoding", "chunked")
    handler.end_headers()

    def wanted(obj: dict[str, Any]) -> bool:
        meta = obj["metadata"]
        return (
            (r.ns is None or meta.get("namespace") == r.ns)
            and matches(labels, meta.get("labels") or {})
            and all(match_field(obj, f) for f in fields)
        )

    def emit(etype: str, obj: dict[str, Any]) -> None:
        trace = handler.fake.trace
        if trace is not None:
            trace("watch", {"type": etype, "object": obj})
        line = json.dumps({"type": etype, "object": obj}, separators=(",", ":")).encode() + b"\n"
        handler.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
        handler.wfile.flush()

    def bookmark(rv: int) -> None:
        meta = {"resourceVersion": str(rv)}
        emit("BOOKMARK", {"kind": res.kind, "apiVersion": res.api_version, "metadata": meta})

    with store.lock:
        drops = store.watch_drops
        if rv_text == "0":
            rv_now = int(store.resource_version)
            initial = [o for o in store.scan(res.kind, r.ns) if wanted(o)]
        else:
            rv_now, initial = int(rv_text), []
    try:
        for obj in initial:
            emit("ADDED", present(res, obj))
        end = time.monotonic() + timeout
        quiet_since = time.monotonic()
        key = (res.group, res.version, res.plural)
        while not store.closed and time.monotonic() < end:
            gone = key not in store.kinds.paths  # its CRD was deleted: the watch ends
            with store.lock:
                if store.watch_drops != drops:
                    raise _Dropped
                try:
                    events = store.events_after(rv_now, [res.kind])
                except ApiError as err:
                    emit("ERROR", err.status())
                    break
                top = int(store.resource_version)  # every event up to here is in ``events``
            for rv, etype, _, obj in events:
                rv_now = rv
                if wanted(obj):
                    emit(etype, present(res, obj))
                    quiet_since = time.monotonic()
            if gone:
                break
            if bookmarks and time.monotonic() - quiet_since >= store.bookmark_sec:
                rv_now = max(rv_now, top)
                bookmark(rv_now)
                quiet_since = time.monotonic()
            if not events:
                with store.changed:
                    if store.watch_drops == drops and (
                        not store.events or store.events[-1][0] <= rv_now
                    ):
                        left = min(end, quiet_since + store.bookmark_sec) - time.monotonic()
                        store.changed.wait(min(1.0, max(0.0, left)))
        else:
            if bookmarks and not store.closed:  # shortly before the timeout: where to resume
                _last_bookmark(
                    store, res.kind, rv_now, wanted, lambda e, o: emit(e, present(res, o)), bookmark
                )
        handler.wfile.write(b"0\r\n\r\n")
    except _Dropped:
        with contextlib.suppress(OSError):  # cut: the client reads an incomplete chunked body
            handler.connection.shutdown(socket.SHUT_RDWR)
    except (BrokenPipeError, ConnectionResetError):
        pass
    handler.close_connection = True


def _last_bookmark(
    store: Any, kind: str, rv_now: int, wanted: Any, emit: Any, bookmark: Any
) -> None:
    with store.lock:
        try:
            events = store.events_after(rv_now, [kind])
        except ApiError:
            return  # history is gone: the next watch from rv_now gets its 410
        top = int(store.resource_version)
    for _, etype, _, obj in events:
        if wanted(obj):
            emit(etype, obj)
    bookmark(max(rv_now, top))
