"""What a local function's route says besides where its replicas listen."""

from __future__ import annotations

from dataclasses import dataclass

from ..manifests.model import Function, RateLimit, Scale

__all__ = ["HttpTrigger", "trigger"]


def trigger(fn: Function, scale: Scale | None) -> HttpTrigger:
    return HttpTrigger(
        float(fn.timeout_sec),
        fn.same_origin,
        scale,
        fn.concurrency,
        fn.rate_limit,
        fn.max_body_bytes,
        fn.runtime,
        fn.websocket is not None,
        fn.plain_http,
        fn.stream is not None and fn.stream.request,
        float(fn.stream.idle_sec) if fn.stream is not None else 0.0,
        float(fn.stream.max_sec) if fn.stream is not None else 0.0,
    )


@dataclass(frozen=True)
class HttpTrigger:
    """What the route of an http function says besides where its replicas listen."""

    timeout_sec: float
    same_origin: bool
    scale: Scale | None  # autoscaled: no replica means idle, and a call wakes one
    concurrency: int
    rate_limit: RateLimit | None
    max_body_bytes: int | None
    runtime: str
    websocket: bool = False
    plain: bool = True
    body_streamed: bool = False
    stream_idle_sec: float = 0.0  # the stream block's, which the proxy holds too (0: none)
    stream_max_sec: float = 0.0
