"""OpenTelemetry traces of what the reconciler does, exported over OTLP/HTTP when asked.

``serve --otlp-endpoint URL`` (or the standard ``OTEL_EXPORTER_OTLP_ENDPOINT``, with
``OTEL_SERVICE_NAME``, default ``gitops-sless``) calls :func:`configure`, which loads
the OpenTelemetry SDK and sends spans in batches to ``URL/v1/traces``. Without it
nothing of the SDK is imported and every :func:`span` is one shared object that does
nothing: the reconciler's passes, and the proxy's hot path, cost what they did.

A reconcile pass is one trace: a ``sync`` span with children ``fetch``, ``plan``,
``apply`` and ``prune`` for each round, and ``build`` and ``job`` for the work it
started, ended when that work ends (on another thread: :func:`current` is taken where
the work starts and given to :func:`span` as its parent).

Spans at the rate of calls (each call's, each function's own) are not the SDK's:
:func:`record` queues them for :mod:`.export`, which costs a call microseconds.

Its modules: :mod:`.tracecontext`, what a valid W3C ``traceparent`` is (for the proxy,
the queue and the runners); :mod:`.export`, the spans at the rate of calls, encoded and
posted by one thread; :mod:`.relay`, the local runtimes' spans, exported on their
behalf. May import: nothing else of ``gitops_sless`` (every layer uses it).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from . import export, tracecontext

__all__ = [
    "DEFAULT_SERVICE",
    "ON",
    "configure",
    "current",
    "enabled",
    "record",
    "record_call",
    "record_under",
    "shutdown",
    "span",
]

log = logging.getLogger(__name__)

DEFAULT_SERVICE = "gitops-sless"
Attributes = Mapping[str, str | int | float | bool]

_tracer: Any = None  # an opentelemetry Tracer once configured
_provider: Any = None
_batch: Any = None  # export.SpanBatch: the spans recorded at the rate of calls
_lock = threading.Lock()
# whether spans are exported: read on the proxy's hot path, a module attribute and no call
ON = False


def enabled() -> bool:
    return _tracer is not None


def configure(endpoint: str, service_name: str = DEFAULT_SERVICE) -> None:
    """Export spans to the OTLP/HTTP collector at ``endpoint`` (``http://host:4318``; the
    path ``/v1/traces`` is added unless it is there) from now on."""
    global _tracer, _provider, _batch
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    url = endpoint.rstrip("/")
    if not url.endswith("/v1/traces"):
        url += "/v1/traces"
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    batch = export.SpanBatch(url, service_name, export.headers_from_env())
    global ON
    with _lock:
        if _provider is not None:
            _provider.shutdown()
            _batch.close()
        _provider, _batch = provider, batch
        _tracer = provider.get_tracer("gitops_sless")
        ON = True
    log.info("traces are exported to %s as %s", url, service_name)


def shutdown() -> None:
    """Send what is batched and stop exporting (serve's stop)."""
    global _tracer, _provider, _batch, ON
    with _lock:
        provider, batch, _provider, _tracer, _batch = _provider, _batch, None, None, None
        ON = False
    if provider is not None:
        provider.shutdown()
        batch.close()


def current() -> Any:
    """The active span's context, to parent work that runs on another thread; None when
    no trace is exported."""
    if _tracer is None:
        return None
    from opentelemetry import context

    return context.get_current()


class _Nothing:
    """What :func:`span` gives when nothing is exported."""

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def failed(self, description: str) -> None:
        pass

    def traceparent(self) -> str | None:
        return None


class _Span:
    def __init__(self, span: Any) -> None:
        self.span = span

    def set_attribute(self, key: str, value: Any) -> None:
        self.span.set_attribute(key, value)

    def failed(self, description: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        self.span.set_status(Status(StatusCode.ERROR, description))

    def traceparent(self) -> str | None:
        """The W3C traceparent that names this span as the parent of what it starts."""
        found = self.span.get_span_context()
        return f"00-{found.trace_id:032x}-{found.span_id:016x}-{int(found.trace_flags):02x}"


_NOTHING = _Nothing()


@contextlib.contextmanager
def _nothing() -> Iterator[_Nothing]:
    yield _NOTHING


def span(name: str, attributes: Attributes | None = None, parent: Any = None) -> Any:
    """A context manager around one span (a child of the active one, or of ``parent``
    from :func:`current`); it yields something to set attributes or a failure on. An
    exception out of it marks the span failed and goes on."""
    tracer = _tracer
    if tracer is None:
        return _nothing()
    return _exported(tracer, name, attributes, parent)


@contextlib.contextmanager
def _exported(tracer: Any, name: str, attributes: Attributes | None, parent: Any) -> Iterator[Any]:
    with tracer.start_as_current_span(
        name, context=parent, attributes=dict(attributes or {})
    ) as found:
        yield _Span(found)


def record_under(
    name: str,
    traceparent: str,
    parent: str | None,
    start_ns: int,
    end_ns: int,
    attributes: Attributes,
    error: str | None = None,
) -> None:
    """A span of ours that ``traceparent`` named (its trace and span ids) when it was
    sent on, under ``parent``'s span (a traceparent of the same trace; else the root):
    an asynchronous submission under its caller, an attempt under its submission."""
    if _batch is None or not tracecontext.is_valid(traceparent):
        return
    under = None
    if parent and tracecontext.is_valid(parent) and parent[3:35] == traceparent[3:35]:
        under = int(parent[36:52], 16)
    ids = (
        int(traceparent[3:35], 16),
        int(traceparent[36:52], 16),
        under,
        traceparent[54] in "13579bdf",
    )
    record(name, ids, start_ns, end_ns, attributes, error)


def record_call(span: export.CallSpan) -> None:
    """The proxy's span of a call, as cheaply as it can be queued (see
    ``export.CallSpan``)."""
    batch = _batch
    if batch is not None:
        batch.add(span)


def record(
    name: str,
    ids: tuple[int, int, int | None, bool],
    start_ns: int,
    end_ns: int,
    attributes: Attributes,
    error: str | None = None,
    server: bool = False,
    service: str | None = None,
) -> None:
    """A span that has happened already, with the ids it was known by: ``ids`` is (trace
    id, span id, parent span id or None for the root of its trace, sampled); ``server``:
    a span of a call received (kind SERVER); ``service``: the service it belongs to (a
    function's), else the reconciler's. Nothing when no trace is exported, or the trace
    is not sampled: queued, and posted in a batch off the caller's thread."""
    batch = _batch
    trace_id, span_id, parent_id, sampled = ids
    if batch is None or not sampled:
        return
    kind = export.SERVER if server else export.INTERNAL
    batch.add(
        (name, trace_id, span_id, parent_id, start_ns, end_ns, attributes, error, kind, service)
    )
