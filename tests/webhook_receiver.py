"""A real HTTP receiver of notifications for tests: every POST kept with its path,
headers and body, answered with the statuses it is told to answer (200 once those run
out), and held, when asked, until released (a slow receiver)."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Delivery", "WebhookReceiver"]


@dataclass(frozen=True)
class Delivery:
    path: str
    headers: dict[str, str]  # names in lower case
    body: bytes
    status: int  # what the receiver answered

    @property
    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def events(self) -> list[dict[str, Any]]:
        """A generic webhook's events (empty for Slack's and Teams' messages)."""
        data = self.json
        return data.get("events", []) if isinstance(data, dict) else []

    def signed_by(self, key: bytes) -> bool:
        want = "sha256=" + hmac.new(key, self.body, hashlib.sha256).hexdigest()
        return hmac.compare_digest(self.headers.get("x-signature", ""), want)


class WebhookReceiver:
    def __init__(self) -> None:
        self.deliveries: list[Delivery] = []  # every request, answered 2xx or not
        self.answers: list[int] = []  # statuses to answer next, in order
        self.holding = threading.Event()  # set: requests wait until released
        self.released = threading.Event()
        self.held = 0  # requests waiting now
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                receiver._hold()
                with receiver._lock:
                    status = receiver.answers.pop(0) if receiver.answers else 200
                    headers = {k.lower(): v for k, v in self.headers.items()}
                    receiver.deliveries.append(Delivery(self.path, headers, body, status))
                self.send_response(status)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def _hold(self) -> None:
        if not self.holding.is_set():
            return
        with self._lock:
            self.held += 1
        self.released.wait(120)
        with self._lock:
            self.held -= 1

    def accepted(self, path: str) -> list[Delivery]:
        with self._lock:
            return [d for d in self.deliveries if d.path == path and d.status < 300]

    def events(self, path: str) -> list[dict[str, Any]]:
        """Every event a generic webhook at ``path`` accepted, in order."""
        return [event for d in self.accepted(path) for event in d.events]

    def wait(self, predicate: Any, what: str, timeout: float = 60) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = predicate()
            if found:
                return found
            time.sleep(0.05)
        with self._lock:
            got = [(d.path, d.status, d.body[:300]) for d in self.deliveries]
        raise AssertionError(f"timed out waiting for {what}; received {got}")

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()
