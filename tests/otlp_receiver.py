"""A real OTLP/HTTP trace receiver for tests: ``POST /v1/traces`` with an
``ExportTraceServiceRequest`` in protobuf (as the OpenTelemetry exporter sends it),
decoded with the ``opentelemetry-proto`` package; every span kept, flattened."""

from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

__all__ = ["OtlpReceiver", "Span"]


@dataclass(frozen=True)
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    service: str
    attributes: dict[str, Any] = field(default_factory=dict)
    error: bool = False
    start_ns: int = 0
    end_ns: int = 0
    kind: int = 0  # SpanKind: 1 internal, 2 server
    message: str = ""  # the status message


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.paths: list[str] = []
        self.headers: list[dict[str, str]] = []  # of each post, names in lower case
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._add(self.path, request)
                with receiver._lock:
                    receiver.headers.append({k.lower(): v for k, v in self.headers.items()})
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def _add(self, path: str, request: ExportTraceServiceRequest) -> None:
        found = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    found.append(
                        Span(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            service=str(resource.get("service.name")),
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            error=span.status.code == 2,  # STATUS_CODE_ERROR
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            kind=span.kind,
                            message=span.status.message,
                        )
                    )
        with self._lock:
            self.paths.append(path)
            self.spans.extend(found)

    def wait(self, predicate: Any, what: str, timeout: float = 30) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                spans = list(self.spans)
            found = predicate(spans)
            if found:
                return found
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}: {[s.name for s in self.spans]}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
