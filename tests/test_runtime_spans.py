"""With SLESS_OTLP_ENDPOINT, each call is a span the runtime exports itself, in both
runtimes, as real processes: an OTLP/HTTP JSON receiver runs here and records what it is
sent (a real HTTP server, no mocks)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from .test_runtimes import (  # noqa: F401 (fixtures)
    PARENT,
    Server,
    function_dirs,
    log_dir,
    run_runner,
    runtime,
)

TRACE, CALLER_SPAN = PARENT[3:35], PARENT[36:52]
TOKEN = "otlp-t0ken"


class Receiver:
    """An OTLP/HTTP JSON receiver: records each POST (path, headers, decoded body). With
    ``hold_first``, the answer to the first POST waits until ``release`` is set."""

    def __init__(self, status: int = 200, hold_first: bool = False) -> None:
        self.posts: list[tuple[str, dict[str, str], dict]] = []
        self.lock = threading.Lock()
        self.release = threading.Event()
        if not hold_first:
            self.release.set()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with receiver.lock:
                    first = not receiver.posts
                    receiver.posts.append(
                        (self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                    )
                if first:
                    receiver.release.wait(20)
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def spans(self) -> list[dict]:
        with self.lock:
            bodies = [body for _, _, body in self.posts]
        return [
            span
            for body in bodies
            for resource in body["resourceSpans"]
            for scope in resource["scopeSpans"]
            for span in scope["spans"]
        ]

    def wait_for_spans(self, count: int, timeout: float = 15.0) -> list[dict]:
        end = time.monotonic() + timeout
        while len(self.spans()) < count and time.monotonic() < end:
            time.sleep(0.05)
        return self.spans()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    rec = Receiver()
    try:
        yield rec
    finally:
        rec.close()


def exporting(runtime, log_dir, receiver: Receiver, **env: str) -> Server:  # noqa: F811
    env = {"SLESS_OTLP_ENDPOINT": receiver.url, "SLESS_OTLP_TOKEN": TOKEN} | env
    return Server(runtime, log_dir, "handlers.main", SLESS_TIMEOUT_SEC="5", **env).wait_healthy()


def attributes(span_or_resource: dict) -> dict:
    found = {}
    for attribute in span_or_resource["attributes"]:
        (kind, value), *_ = attribute["value"].items()
        found[attribute["key"]] = int(value) if kind == "intValue" else value
    return found


def test_a_call_is_a_span_under_the_callers_and_trace_headers_name_it_as_parent(
    runtime,  # noqa: F811
    log_dir,  # noqa: F811
    receiver,
):
    srv = exporting(runtime, log_dir, receiver, SLESS_OTLP_SERVICE="billing")
    try:
        sent = {"traceparent": PARENT, "x-request-id": "req-span-1"}
        found = httpx.get(f"{srv.url}/trace", headers=sent).json()
        (span,) = receiver.wait_for_spans(1)  # sent within its interval, not only at exit
    finally:
        assert srv.stop() == 0
    outgoing = found["outgoing"]["traceparent"]
    assert outgoing == f"00-{TRACE}-{span['spanId']}-01"  # the handler's calls hang under it
    assert span["traceId"] == TRACE and span["parentSpanId"] == CALLER_SPAN
    assert len(span["spanId"]) == 16 and span["spanId"] not in (CALLER_SPAN, "0" * 16)
    assert span["name"] == "adder" and span["kind"] == 2
    assert "status" not in span or span["status"].get("code", 0) == 0
    start, end = int(span["startTimeUnixNano"]), int(span["endTimeUnixNano"])
    assert span["startTimeUnixNano"] == str(start) and 0 < start <= end
    assert attributes(span) == {
        "faas.invocation_id": "req-span-1",
        "faas.name": "adder",
        "sless.environment": "staging",
        "http.request.method": "GET",
        "http.response.status_code": 200,
    }
    ((path, headers, body),) = receiver.posts
    assert path == "/v1/traces"
    assert headers["authorization"] == f"Bearer {TOKEN}"
    assert headers["content-type"] == "application/json"
    (resource_spans,) = body["resourceSpans"]
    assert attributes(resource_spans["resource"]) == {
        "service.name": "billing",
        "faas.name": "adder",
    }
    assert resource_spans["scopeSpans"][0]["scope"]["name"] == "gitops-sless-runtime"


def test_a_raising_handler_is_an_error_span_and_a_new_trace_a_root(
    runtime,  # noqa: F811
    log_dir,  # noqa: F811
    receiver,
):
    srv = exporting(runtime, log_dir, receiver)
    try:
        failed = httpx.post(f"{srv.url}/boom", headers={"traceparent": PARENT})
        assert failed.status_code == 500
        new_trace = httpx.get(f"{srv.url}/trace", headers={"x-request-id": "req-root"}).json()
    finally:
        assert srv.stop() == 0  # what waits is sent at SIGTERM
    error, root = receiver.spans()
    assert error["status"]["code"] == 2 and "kaboom" in error["status"]["message"]
    assert attributes(error)["http.response.status_code"] == 500
    assert attributes(error)["http.request.method"] == "POST"
    assert error["parentSpanId"] == CALLER_SPAN
    assert root["traceId"] == new_trace["trace_id"]  # the trace the context started
    assert not root.get("parentSpanId")
    assert new_trace["outgoing"]["traceparent"][36:52] == root["spanId"]
    assert attributes(root)["faas.invocation_id"] == "req-root"
    (_, _, body), *_ = receiver.posts
    assert attributes(body["resourceSpans"][0]["resource"])["service.name"] == (
        "gitops-sless-function"
    )


def test_the_handler_sees_no_otlp_settings(runtime, log_dir, receiver):  # noqa: F811
    srv = exporting(runtime, log_dir, receiver, SLESS_OTLP_SERVICE="billing")
    try:
        seen = httpx.get(f"{srv.url}/env-keys").json()
    finally:
        srv.stop()
    assert "SLESS_ENTRYPOINT" in seen
    assert [key for key in seen if key.startswith("SLESS_OTLP")] == []


def test_spans_waiting_at_sigterm_are_sent_before_the_exit(runtime, log_dir):  # noqa: F811
    """The first span's POST is held by the receiver, so the second waits in the queue
    while SIGTERM arrives: it is sent before the process exits."""
    receiver = Receiver(hold_first=True)
    try:
        srv = exporting(runtime, log_dir, receiver)
        try:
            httpx.get(f"{srv.url}/list", headers={"traceparent": PARENT, "x-request-id": "first"})
            receiver.wait_for_spans(1)  # its POST has arrived, and waits for its answer
            httpx.get(f"{srv.url}/list", headers={"traceparent": PARENT, "x-request-id": "second"})
            srv.proc.terminate()
            time.sleep(0.3)  # the signal lands before the held POST is answered
            receiver.release.set()
            assert srv.proc.wait(timeout=15) == 0
        finally:
            srv.stop()
        ids = [attributes(span)["faas.invocation_id"] for span in receiver.spans()]
        assert ids == ["first", "second"]
    finally:
        receiver.close()


def test_an_unsampled_call_exports_nothing(runtime, log_dir, receiver):  # noqa: F811
    srv = exporting(runtime, log_dir, receiver)
    try:
        unsampled = PARENT[:-2] + "00"
        found = httpx.get(f"{srv.url}/trace", headers={"traceparent": unsampled}).json()
        httpx.get(f"{srv.url}/list", headers={"traceparent": PARENT, "x-request-id": "sampled"})
    finally:
        assert srv.stop() == 0
    assert found["outgoing"]["traceparent"].endswith("-00")  # the flag carried on
    assert [attributes(span)["faas.invocation_id"] for span in receiver.spans()] == ["sampled"]


def test_a_failed_post_is_tried_twice_then_dropped_with_one_line(runtime, log_dir):  # noqa: F811
    receiver = Receiver(status=503)
    try:
        srv = exporting(runtime, log_dir, receiver)
        try:
            assert httpx.get(f"{srv.url}/list").status_code == 200
        finally:
            assert srv.stop() == 0
        assert len(receiver.posts) == 2
        assert receiver.posts[0][2] == receiver.posts[1][2]
        failures = [line for line in srv.stderr.splitlines() if "span export" in line]
        assert failures == [
            f"[sless] span export to {receiver.url}/v1/traces failed (HTTP 503): 1 spans dropped"
        ]
    finally:
        receiver.close()


def test_the_runner_leaves_no_otlp_settings_to_the_handler(runtime):  # noqa: F811
    result = run_runner(
        runtime,
        "handlers.main",
        json.dumps({"_path": "/env-keys"}),
        SLESS_OTLP_ENDPOINT="http://127.0.0.1:9",
        SLESS_OTLP_TOKEN=TOKEN,
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert "SLESS_ENTRYPOINT" in seen
    assert [key for key in seen if key.startswith("SLESS_OTLP")] == []
