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
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["DEFAULT_SERVICE", "configure", "current", "enabled", "shutdown", "span"]

log = logging.getLogger(__name__)

DEFAULT_SERVICE = "gitops-sless"
Attributes = Mapping[str, str | int | float | bool]

_tracer: Any = None  # an opentelemetry Tracer once configured
_provider: Any = None
_lock = threading.Lock()


def enabled() -> bool:
    return _tracer is not None


def configure(endpoint: str, service_name: str = DEFAULT_SERVICE) -> None:
    """Export spans to the OTLP/HTTP collector at ``endpoint`` (``http://host:4318``; the
    path ``/v1/traces`` is added unless it is there) from now on."""
    global _tracer, _provider
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    url = endpoint.rstrip("/")
    if not url.endswith("/v1/traces"):
        url += "/v1/traces"
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    with _lock:
        if _provider is not None:
            _provider.shutdown()
        _provider = provider
        _tracer = provider.get_tracer("gitops_sless")
    log.info("traces are exported to %s as %s", url, service_name)


def shutdown() -> None:
    """Send what is batched and stop exporting (serve's stop)."""
    global _tracer, _provider
    with _lock:
        provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


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


class _Span:
    def __init__(self, span: Any) -> None:
        self.span = span

    def set_attribute(self, key: str, value: Any) -> None:
        self.span.set_attribute(key, value)

    def failed(self, description: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        self.span.set_status(Status(StatusCode.ERROR, description))


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
