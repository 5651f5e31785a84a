"""The exporter of spans at the rate of calls (``gitops_sless.telemetry.export``): the OTLP
protobuf it writes by hand is what ``opentelemetry-proto`` reads, for a call's span
and any other; its batches reach a real OTLP/HTTP receiver, a collector that answers
503 is tried again, and a full queue drops its oldest spans, counted."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from gitops_sless.telemetry import export as spanexport

from .otlp_receiver import OtlpReceiver

TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_the_hand_written_protobuf_is_what_the_otlp_schema_reads():
    values = {"s": "é", "i": 200, "neg": -3, "big": 1 << 40, "b": True, "f": 0.25}
    call = (
        TRACEPARENT,
        b"a3ce929d0e0e4736",
        10,
        20,
        spanexport.call_fields("GET /x", values),
        None,
    )
    other = ("job", 1 << 127 | 5, 7, None, 30, 40, {"sless.job": "j"}, "failed", 1, "prod/fn")
    failed = (TRACEPARENT, None, 50, 60, spanexport.call_fields("POST /y", {}), "HTTP 502")
    request = ExportTraceServiceRequest()
    request.ParseFromString(spanexport.encode([call, other, failed], "gitops-sless"))

    by_service = {
        rs.resource.attributes[0].value.string_value: list(rs.scope_spans[0].spans)
        for rs in request.resource_spans
    }
    assert set(by_service) == {"gitops-sless", "prod/fn"}
    first, second = by_service["gitops-sless"]
    assert first.trace_id.hex() == TRACEPARENT[3:35].decode()
    assert first.span_id.hex() == TRACEPARENT[36:52].decode()
    assert first.parent_span_id.hex() == "a3ce929d0e0e4736"
    assert (first.name, first.kind, first.start_time_unix_nano, first.end_time_unix_nano) == (
        "GET /x",
        2,
        10,
        20,
    )
    got = {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in first.attributes}
    assert got == values and first.status.code == 0
    assert second.parent_span_id == b"" and second.status.code == 2
    assert second.status.message == "HTTP 502"

    (job,) = by_service["prod/fn"]
    assert job.trace_id.hex() == f"{1 << 127 | 5:032x}" and job.span_id.hex() == f"{7:016x}"
    assert (job.name, job.kind, job.status.message) == ("job", 1, "failed")


def test_batches_reach_the_collector_with_the_configured_headers():
    receiver = OtlpReceiver()
    batch = spanexport.SpanBatch(f"{receiver.url}/v1/traces", "svc", {"x-team": "a"})
    try:
        for n in range(1, 1201):  # more than two batches
            fields = spanexport.call_fields("GET /n", {"n": n})
            batch.add((TRACEPARENT[:36] + b"%016x" % n + b"-01", None, n, n + 1, fields, None))
        receiver.wait(lambda spans: len(spans) == 1200, "every span")
        assert sorted(s.attributes["n"] for s in receiver.spans) == list(range(1, 1201))
        assert batch.dropped == 0
        assert all(h["x-team"] == "a" for h in receiver.headers)
        assert {h["content-type"] for h in receiver.headers} == {"application/x-protobuf"}
    finally:
        batch.close()
        receiver.close()


def test_a_collector_that_is_down_for_a_moment_loses_nothing():
    posts: list[int] = []

    class Flaky(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            status = 503 if not posts else 200
            posts.append(status)
            self.send_response(status)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    batch = spanexport.SpanBatch(f"http://127.0.0.1:{server.server_address[1]}/v1/traces", "s")
    try:
        batch.add((TRACEPARENT, None, 1, 2, spanexport.call_fields("GET /", {}), None))
        batch.close(timeout=10)
        assert posts == [503, 200] and batch.dropped == 0
    finally:
        server.shutdown()
        server.server_close()


def test_a_full_queue_drops_its_oldest_and_counts_them(monkeypatch):
    monkeypatch.setattr(spanexport, "MAX_QUEUE", 10)
    monkeypatch.setattr(spanexport, "BATCH", 1000)  # nothing is taken before the end
    receiver = OtlpReceiver()
    batch = spanexport.SpanBatch(f"{receiver.url}/v1/traces", "svc")
    try:
        for n in range(25):
            batch.add((TRACEPARENT, None, n, n, spanexport.call_fields("GET /", {"n": n}), None))
        assert batch.dropped == 15
        batch.close(timeout=10)
        assert sorted(s.attributes["n"] for s in receiver.spans) == list(range(15, 25))
    finally:
        receiver.close()


def test_headers_come_from_the_sdks_variables():
    environ = {
        "OTEL_EXPORTER_OTLP_HEADERS": "Authorization=Basic%20abc, x-team = a",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "x-team=b,broken",
    }
    assert spanexport.headers_from_env(environ) == {"authorization": "Basic abc", "x-team": "b"}


def test_a_span_that_cannot_be_encoded_is_left_out_and_the_rest_go_on():
    receiver = OtlpReceiver()
    batch = spanexport.SpanBatch(f"{receiver.url}/v1/traces", "svc")
    try:
        good = ("ok", 1 << 100, 5, None, 1, 2, {"n": 1}, None, 1, None)
        batch.add(("past int64", 1 << 100, 6, None, 1, 2, {"n": 1 << 70}, None, 1, None))
        batch.add(("negative time", 1 << 100, 7, None, -1, 2, {}, None, 1, None))
        batch.add(("bad message", 1 << 100, 8, None, 1, 2, {}, 123, 1, None))
        batch.add(good)
        receiver.wait(lambda spans: spans, "the good span")
        batch.add(("later", 1 << 100, 9, None, 1, 2, {}, None, 1, None))
        receiver.wait(lambda spans: len(spans) == 2, "a later span: the thread goes on")
        assert [s.name for s in receiver.spans] == ["ok", "later"]
    finally:
        batch.close()
        receiver.close()
