"""What a repository declares, as typed values: functions, their jobs, cron triggers and
environment values, and the desired state of one revision."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ..errors import ManifestError, ManifestProblem

__all__ = [
    "DEFAULT_ASYNC",
    "AsyncPolicy",
    "CronTrigger",
    "DesiredState",
    "EnvValue",
    "Function",
    "Job",
    "JobRef",
    "RateLimit",
    "Scale",
    "SecretRef",
    "StreamPolicy",
    "Warm",
    "WebSocketTrigger",
    "env_as_written",
    "is_preview",
    "read_env",
]


@dataclass(frozen=True)
class SecretRef:
    secret: str
    key: str


@dataclass(frozen=True)
class JobRef:
    job: str


EnvValue = str | SecretRef | JobRef


@dataclass(frozen=True)
class CronTrigger:
    schedule: str
    event: Mapping[str, Any]


@dataclass(frozen=True)
class Warm:
    """A floor on a schedule: from each time ``cron`` fires (UTC), ``min`` replicas for
    ``for_sec`` seconds."""

    cron: str
    for_sec: float
    min: int


# the schema's defaults for a ``scale`` block (schemas/sless.schema.json)
DEFAULT_MAX = 10
DEFAULT_TARGET = 10
DEFAULT_IDLE_SEC = 300.0


@dataclass(frozen=True)
class Scale:
    """How many replicas serve a function's http trigger in one environment.

    ``replicas: N`` is ``Scale(N, N)``: fixed, never autoscaled. Otherwise the
    autoscaler keeps ``ceil(observed in-flight / target)`` within ``[min, max]``
    (``min`` raised by ``warm`` floors while they hold), and with ``min`` 0 stops
    the last replica after ``idle_sec`` without a request.
    """

    min: int
    max: int
    target: int = DEFAULT_TARGET
    idle_sec: float = DEFAULT_IDLE_SEC
    warm: tuple[Warm, ...] = ()

    @classmethod
    def fixed(cls, replicas: int) -> Scale:
        return cls(replicas, replicas)

    @property
    def autoscaled(self) -> bool:
        """False for a fixed count (``replicas: N``, or min = max and no warm floor):
        the backends then run exactly ``min`` replicas, as they always have."""
        return self.min != self.max or bool(self.warm)


@dataclass(frozen=True)
class RateLimit:
    """A token bucket per function and environment: ``rps`` tokens a second, at most
    ``burst`` saved up."""

    rps: float
    burst: int


@dataclass(frozen=True)
class StreamPolicy:
    """A function's ``stream`` block: the limits of its streamed responses, which its
    runtime enforces (the schema's defaults)."""

    idle_sec: int = 30  # longest between two chunks
    max_sec: int = 900  # longest in all
    drain_sec: int = 30  # how long open streams and sockets go on when their replica must go
    request: bool = False  # the handler reads the request body as it comes

    def to_json(self) -> dict[str, Any]:
        value: dict[str, Any] = {"idleSec": self.idle_sec, "maxSec": self.max_sec}
        # only when not the default: a block without them keeps the spec hash it had
        if self.drain_sec != StreamPolicy.drain_sec:
            value["drainSec"] = self.drain_sec
        if self.request:
            value["request"] = True
        return value

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> StreamPolicy:
        drain = value.get("drainSec", cls.drain_sec)  # written before drainSec: its default
        request = value.get("request") is True
        return cls(int(value["idleSec"]), int(value["maxSec"]), int(drain), request)

    def runtime_env(self) -> dict[str, str]:
        """What tells the runtime these limits."""
        env = {
            "SLESS_STREAM_IDLE_SEC": str(self.idle_sec),
            "SLESS_STREAM_MAX_SEC": str(self.max_sec),
        }
        if self.drain_sec != StreamPolicy.drain_sec:  # the runtimes' default otherwise
            env["SLESS_STREAM_DRAIN_SEC"] = str(self.drain_sec)
        if self.request:
            env["SLESS_STREAM_REQUEST"] = "1"
        return env


@dataclass(frozen=True)
class WebSocketTrigger:
    """A function's ``{type: websocket}`` trigger: WebSocket connections at its URL, each
    message a call of the entrypoint (the schema's defaults)."""

    on_connect: str | None = None  # a function of the entrypoint's file, or None
    on_disconnect: str | None = None
    max_message_bytes: int = 1048576

    def to_json(self) -> dict[str, Any]:
        value: dict[str, Any] = {"maxMessageBytes": self.max_message_bytes}
        if self.on_connect is not None:
            value["onConnect"] = self.on_connect
        if self.on_disconnect is not None:
            value["onDisconnect"] = self.on_disconnect
        return value

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> WebSocketTrigger:
        return cls(
            value.get("onConnect"),
            value.get("onDisconnect"),
            int(value.get("maxMessageBytes", cls.max_message_bytes)),
        )

    def runtime_env(self) -> dict[str, str]:
        """What tells the runtime to take upgrades, and how."""
        env = {"SLESS_WEBSOCKET": "1", "SLESS_WS_MAX_MESSAGE_BYTES": str(self.max_message_bytes)}
        if self.on_connect is not None:
            env["SLESS_WS_ON_CONNECT"] = self.on_connect
        if self.on_disconnect is not None:
            env["SLESS_WS_ON_DISCONNECT"] = self.on_disconnect
        return env


@dataclass(frozen=True)
class AsyncPolicy:
    """A function's ``async`` block: what happens to an asynchronous invocation that
    fails (the schema's defaults)."""

    retries: int = 2  # attempts after the first
    backoff_sec: float = 1.0  # the first delay, doubled each time ...
    max_backoff_sec: float = 300.0  # ... up to this
    max_age_sec: float = 6 * 3600.0  # no attempt starts on an older invocation
    concurrency: int = 10  # this function's invocations running at once

    def to_json(self) -> dict[str, Any]:
        """As a Function resource's spec and a serving record write it."""
        return {
            "retries": self.retries,
            "backoffSec": self.backoff_sec,
            "maxBackoffSec": self.max_backoff_sec,
            "maxAgeSec": self.max_age_sec,
            "concurrency": self.concurrency,
        }

    @classmethod
    def from_json(cls, found: Mapping[str, Any]) -> AsyncPolicy:
        """What :meth:`to_json` wrote; a field left out (an older writer): its default."""
        return cls(
            retries=int(found.get("retries", cls.retries)),
            backoff_sec=float(found.get("backoffSec", cls.backoff_sec)),
            max_backoff_sec=float(found.get("maxBackoffSec", cls.max_backoff_sec)),
            max_age_sec=float(found.get("maxAgeSec", cls.max_age_sec)),
            concurrency=int(found.get("concurrency", cls.concurrency)),
        )


DEFAULT_ASYNC = AsyncPolicy()  # async: {} (the schema's defaults)


@dataclass(frozen=True)
class Rollout:
    """A function's ``rollout`` block: a change takes the calls step by step, judged by the
    new revision's own answers (the schema's defaults)."""

    steps: tuple[int, ...] = (10, 50)  # percent of the calls, increasing; then 100
    interval_sec: float = 30.0  # the least time at each step
    min_requests: int = 20  # calls a step needs before its verdict
    max_error_rate: float = 0.05  # 5xx and timeouts of the new revision's calls in a step


@dataclass(frozen=True)
class Job:
    name: str
    run_id: int
    event: Mapping[str, Any]
    function: str


@dataclass(frozen=True)
class Function:
    """One function of the desired state, with its defaults filled in."""

    name: str
    folder: str
    manifest: str
    runtime: str
    entrypoint: str
    memory_mb: int
    timeout_sec: int
    replicas: int
    enabled: bool
    env: Mapping[str, EnvValue]
    preview_env: Mapping[str, EnvValue]
    http: bool
    crons: tuple[CronTrigger, ...]
    jobs: tuple[Job, ...]
    source_id: str
    build_tag: str
    max_processes: int = 256  # the schema's default
    same_origin: bool = False  # the http trigger's sameOrigin: no sandboxing CSP
    # the replicas of the http trigger outside previews and in them (see scale_in); None:
    # ``replicas`` fixed outside previews, and in previews too when the manifest names
    # ``replicas``, else Scale(0, max(replicas, 1)) there (a preview nobody calls costs
    # nothing)
    scale: Scale | None = None
    preview_scale: Scale | None = None
    replicas_named: bool = False  # the manifest says ``replicas`` (not the default)
    concurrency: int = 0  # in-flight calls per replica at most; 0: no limit
    rate_limit: RateLimit | None = None
    max_body_bytes: int | None = None  # None: the proxy's own limit
    async_policy: AsyncPolicy = DEFAULT_ASYNC
    subjects: tuple[str, ...] = ()  # the queue triggers' subjects
    # how a change reaches its callers (None: all at once); not part of a revision: it
    # says how the next one is delivered, so it is left out of the spec hash
    rollout: Rollout | None = None
    stream: StreamPolicy | None = None  # None: not named, the runtime's defaults
    websocket: WebSocketTrigger | None = None  # None: no websocket trigger
    plain_http: bool = True  # plain calls are served (an http or queue trigger, or none)

    def runtime_env(self) -> dict[str, str]:
        """The runtime's settings from the manifest besides the timeout (none unless named:
        what leaves them out runs as it always did)."""
        env = self.stream.runtime_env() if self.stream is not None else {}
        if self.websocket is not None:
            env.update(self.websocket.runtime_env())
        return env

    @property
    def drain_sec(self) -> int:
        """How long a replica that must go lets its open streams and sockets go on after
        SIGTERM: the stream block's drainSec; without one, the runtime's default (30 s)
        for a function that takes WebSockets, else 0 (nothing to wait for but calls)."""
        if self.stream is not None:
            return self.stream.drain_sec
        return StreamPolicy.drain_sec if self.websocket is not None else 0

    @property
    def stop_grace_sec(self) -> int:
        """SIGTERM to SIGKILL for a replica that must go: its calls end (``timeoutSec``), its
        streams and sockets drain (``drainSec``); then a socket still open gets its close
        handshake (5 s) and its onDisconnect (``timeoutSec``); and 5 s to exit."""
        if self.websocket is not None:
            return self.drain_sec + 5 + self.timeout_sec + 5
        return max(self.timeout_sec, self.drain_sec) + 5

    def scale_in(self, environment: str) -> Scale:
        """The replicas policy of this function in ``environment``."""
        if is_preview(environment):
            if self.preview_scale is not None:
                return self.preview_scale
            if self.scale is not None:
                return self.scale
            if self.replicas_named:
                return Scale.fixed(self.replicas)
            return Scale(0, max(self.replicas, 1))
        return self.scale if self.scale is not None else Scale.fixed(self.replicas)

    def env_for(self, environment: str) -> dict[str, EnvValue]:
        """Env of this function in ``environment``: preview overrides apply in ``pr-*``."""
        env = dict(self.env)
        if is_preview(environment):
            env.update(self.preview_env)
        return dict(sorted(env.items()))

    def job_dependencies(self, environment: str) -> list[str]:
        return list(self._job_dependencies[is_preview(environment)])

    @cached_property
    def _job_dependencies(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The jobs whose results the env names, outside previews and in them: a pass asks
        for every function's, so they are worked out once (a Function never changes)."""

        def named(env: Mapping[str, EnvValue]) -> tuple[str, ...]:
            return tuple(sorted({v.job for v in env.values() if isinstance(v, JobRef)}))

        return named(self.env), named({**self.env, **self.preview_env})


@dataclass
class DesiredState:
    """What a snapshot asks for: valid functions by name, and every invalid manifest."""

    revision: str
    functions: dict[str, Function] = field(default_factory=dict)
    invalid: dict[str, ManifestError] = field(default_factory=dict)
    # names declared by invalid manifests, as far as they could be read: the
    # last good version of these keeps running
    invalid_names: dict[str, str] = field(default_factory=dict)

    # worked out once: a loaded state's functions do not change, and a pass asks often
    @cached_property
    def jobs(self) -> dict[str, Job]:
        return {job.name: job for fn in self.functions.values() for job in fn.jobs}

    @cached_property
    def ordered(self) -> list[Function]:
        """The functions by name."""
        return sorted(self.functions.values(), key=lambda f: f.name)

    @property
    def problems(self) -> list[ManifestProblem]:
        return [p for err in self.invalid.values() for p in err.problems]


# an environment's name: a DNS-1123 label short enough to prefix into a namespace's
ENV_NAME = re.compile(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?")


def is_preview(environment: str) -> bool:
    return environment.startswith("pr-")


def read_env(values: Mapping[str, Any]) -> dict[str, EnvValue]:
    """An env as sless.yaml writes it (a string, ``{secret, key}`` or ``{job}``), as values."""

    def one(value: Any) -> EnvValue:
        if isinstance(value, str):
            return value
        if "job" in value:
            return JobRef(value["job"])
        return SecretRef(value["secret"], value["key"])

    return {name: one(value) for name, value in sorted(values.items())}


def env_as_written(values: Mapping[str, EnvValue]) -> dict[str, Any]:
    """The inverse of :func:`read_env`: what a manifest (or a stored record) says."""

    def one(value: EnvValue) -> Any:
        if isinstance(value, SecretRef):
            return {"secret": value.secret, "key": value.key}
        if isinstance(value, JobRef):
            return {"job": value.job}
        return value

    return {name: one(value) for name, value in sorted(values.items())}
