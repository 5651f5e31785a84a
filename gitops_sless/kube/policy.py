"""What the proxy needs of a function besides where it answers, kept on its Deployment.

Routes are made from what the cluster holds (a restarted reconciler reads them
back from there, before any pass has loaded the repository), so a function's
replicas policy and call limits travel on its Deployment as one annotation,
``gitops-sless.dev/route``: compact JSON, written only when there is
something to say (an autoscaled function, or ``concurrency``, ``rateLimit``,
``maxBodyBytes``). A function with none of these renders as it always has.

An autoscaled Deployment has no ``spec.replicas`` in what is applied: the
autoscaler owns it, through the ``scale`` subresource (field manager
``gitops-sless-autoscaler``), and server-side apply leaves it alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..manifests.model import Function, RateLimit, Scale, Warm
from .client import AUTOSCALER

__all__ = ["AUTOSCALER", "ROUTE_ANNOTATION", "RoutePolicy", "initial_replicas", "route_policy"]

ROUTE_ANNOTATION = "gitops-sless.dev/route"


@dataclass(frozen=True)
class RoutePolicy:
    """The fields of a function's route that its Deployment's address does not give."""

    scale: Scale | None = None  # autoscaled: no replica means idle, and a call wakes one
    concurrency: int = 0
    rate_limit: RateLimit | None = None
    max_body_bytes: int | None = None
    runtime: str = ""
    websocket: bool = False
    plain: bool = True
    body_streamed: bool = False
    stream_idle_sec: float = 0.0  # the stream block's limits, which the proxy holds too
    stream_max_sec: float = 0.0

    def encode(self) -> str | None:
        """The annotation's value; None when a plain route says it all."""
        if self.scale is None and not (
            self.concurrency
            or self.rate_limit
            or self.max_body_bytes is not None
            or self.websocket
            or not self.plain
            or self.body_streamed
            or self.stream_idle_sec
        ):
            return None
        value: dict[str, Any] = {"runtime": self.runtime}
        if self.scale is not None:
            value["scale"] = _scale_json(self.scale)
        if self.concurrency:
            value["concurrency"] = self.concurrency
        if self.rate_limit is not None:
            value["rateLimit"] = {"rps": self.rate_limit.rps, "burst": self.rate_limit.burst}
        if self.max_body_bytes is not None:
            value["maxBodyBytes"] = self.max_body_bytes
        if self.websocket:
            value["websocket"] = True
        if not self.plain:
            value["plain"] = False
        if self.body_streamed:
            value["bodyStreamed"] = True
        if self.stream_idle_sec:
            value["stream"] = [self.stream_idle_sec, self.stream_max_sec]
        return json.dumps(value, sort_keys=True, separators=(",", ":"))

    def route_fields(self) -> dict[str, Any]:
        """This policy as the fields of a :class:`~gitops_sless.state.routes.Route` (they
        have the same names)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def of(cls, route: Any) -> RoutePolicy:
        """What ``route`` (a Route) says of these fields."""
        return cls(**{name: getattr(route, name) for name in cls.__dataclass_fields__})

    @classmethod
    def decode(cls, obj: dict[str, Any]) -> RoutePolicy | None:
        """The policy an object's annotation holds; None without one (or unreadable)."""
        text = ((obj.get("metadata") or {}).get("annotations") or {}).get(ROUTE_ANNOTATION)
        if not text:
            return None
        try:
            value = json.loads(text)
            scale = value.get("scale")
            limit = value.get("rateLimit")
            body = value.get("maxBodyBytes")
            return cls(
                scale=_scale(scale) if scale else None,
                concurrency=int(value.get("concurrency") or 0),
                rate_limit=RateLimit(float(limit["rps"]), int(limit["burst"])) if limit else None,
                max_body_bytes=int(body) if body is not None else None,
                runtime=str(value.get("runtime") or ""),
                websocket=value.get("websocket") is True,
                plain=value.get("plain") is not False,
                body_streamed=value.get("bodyStreamed") is True,
                stream_idle_sec=float((value.get("stream") or (0, 0))[0]),
                stream_max_sec=float((value.get("stream") or (0, 0))[1]),
            )
        except (ValueError, TypeError, KeyError, AttributeError):
            return None  # written by hand: a plain route, and the next apply puts it back


def route_policy(fn: Function, environment: str) -> RoutePolicy:
    """What ``fn``'s route says in ``environment``; autoscaled only while enabled."""
    policy = fn.scale_in(environment)
    return RoutePolicy(
        scale=policy if policy.autoscaled and fn.enabled else None,
        concurrency=fn.concurrency,
        rate_limit=fn.rate_limit,
        max_body_bytes=fn.max_body_bytes,
        runtime=fn.runtime,
        websocket=fn.websocket is not None,
        plain=fn.plain_http,
        body_streamed=fn.stream is not None and fn.stream.request,
        stream_idle_sec=float(fn.stream.idle_sec) if fn.stream is not None else 0.0,
        stream_max_sec=float(fn.stream.max_sec) if fn.stream is not None else 0.0,
    )


def initial_replicas(scale: Scale, running: int) -> int:
    """Replicas a newly applied autoscaled Deployment starts with: as many as run now, one
    at least (Knative's initial scale, so the deploy shows that it starts), within bounds."""
    return min(max(running, scale.min, 1), scale.max)


def _scale_json(scale: Scale) -> dict[str, Any]:
    warm = [{"cron": w.cron, "forSec": float(w.for_sec), "min": w.min} for w in scale.warm]
    return {
        "min": scale.min,
        "max": scale.max,
        "target": scale.target,
        "idleSec": float(scale.idle_sec),
        "warm": warm,
    }


def _scale(value: dict[str, Any]) -> Scale:
    warm = tuple(
        Warm(str(w["cron"]), float(w["forSec"]), int(w["min"])) for w in value.get("warm") or ()
    )
    return Scale(
        int(value["min"]),
        int(value["max"]),
        int(value["target"]),
        float(value["idleSec"]),
        warm,
    )
