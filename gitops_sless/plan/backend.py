"""The boundary between deciding and doing: what every backend (local, Kubernetes) offers.

The planner decides with the data types here; a backend builds, applies,
observes and removes. Backends know nothing of HTTP or of the status store.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import PermanentError, TransientError
from ..manifests.model import Function, Job, JobRef, Scale, SecretRef, env_as_written
from ..source.snapshot import Snapshot

__all__ = [
    "ApplyFailed",
    "Backend",
    "BuildFailed",
    "CronRun",
    "Deployment",
    "Health",
    "JobFailed",
    "JobRecord",
    "KeptRevision",
    "SecretUnavailable",
    "deployment_for",
]

EnvValue = str | SecretRef


class BuildFailed(PermanentError):
    """A build of one tag failed; the same content would fail the same way."""

    def __init__(
        self, tag: str, reason: str, log_tail: str = "", summary: str | None = None
    ) -> None:
        """``summary``: all the function's status says (its output stays in ``log_tail``,
        which only readers of the build log see); None: the reason and the log's cause."""
        super().__init__(f"build {tag} failed: {reason}")
        self.tag = tag
        self.reason = reason
        self.log_tail = log_tail
        self.summary = summary


class JobFailed(PermanentError):
    """A job run ended without a result; its error is kept as the run's message."""

    def __init__(self, message: str, summary: str | None = None) -> None:
        """``summary``: what the reconciler's log may say, never what the job printed (its
        output stays in the message, read through the API); None: the message is all ours."""
        super().__init__(message)
        self.summary = message if summary is None else summary


class SecretUnavailable(TransientError):
    """A secret a function or job names cannot be read yet: it waits (Pending), as a pod does
    for a missing Secret, and starts as soon as the secret appears, with no new commit."""


class ApplyFailed(TransientError):
    """A deployment could not be brought up this time (a replica failed its health check)."""


@dataclass(frozen=True)
class CronRun:
    """One firing of a cron trigger, for the status store."""

    env: str
    function: str
    index: int
    ok: bool
    duration_ms: float
    output: str
    at: float | None = None  # when it ended, if not just now (a run seen after a restart)


@dataclass(frozen=True)
class Health:
    """A function as the backend sees it running (a backend that runs it elsewhere reports)."""

    phase: str  # Ready, Pending, Failed, Disabled, or Idle (autoscaled, at zero replicas)
    message: str | None = None
    last_exit: str | None = None  # why the last container or process ended
    restarts: int = 0
    revision: str | None = None  # the commit its running objects were written at
    build_tag: str | None = None
    settling: bool = False  # expected to change on its own soon (a rollout in progress)


@dataclass(frozen=True)
class JobRecord:
    """A job run the backend remembers (in the cluster), for a reconciler with no history."""

    name: str
    run_id: int
    function: str
    phase: str  # Succeeded or Failed
    result: str | None = None
    error: str | None = None
    finished: float | None = None


@dataclass(frozen=True)
class Deployment:
    """One function as an environment should run it, env resolved except secrets."""

    env: str
    function: Function
    env_vars: Mapping[str, EnvValue]
    spec_hash: str

    @property
    def name(self) -> str:
        return self.function.name


@dataclass(frozen=True)
class KeptRevision:
    """A revision of a function that stays runnable (see ``state.revisions``)."""

    label: str  # r3
    id: str  # from its spec hash
    deployment: Deployment


def _replicas(scale: Scale) -> dict[str, Any]:
    """A fixed count as it always was (``replicas``), so those hashes stay; else the policy."""
    if not scale.autoscaled:
        return {"replicas": scale.min}
    warm = [{"cron": w.cron, "forSec": float(w.for_sec), "min": w.min} for w in scale.warm]
    policy = {"min": scale.min, "max": scale.max, "target": scale.target, "warm": warm}
    return {"scale": {**policy, "idleSec": float(scale.idle_sec)}}


def _limits(fn: Function) -> dict[str, Any]:
    """The proxy's limits of ``fn``, each only when set."""
    rate = fn.rate_limit
    return {
        **({"concurrency": fn.concurrency} if fn.concurrency else {}),
        **({"rateLimit": {"rps": float(rate.rps), "burst": rate.burst}} if rate else {}),
        **({"maxBodyBytes": fn.max_body_bytes} if fn.max_body_bytes is not None else {}),
    }


def _spec(env: str, fn: Function, env_vars: Mapping[str, EnvValue]) -> dict[str, Any]:
    return {
        "tag": fn.build_tag,
        "runtime": fn.runtime,
        "entrypoint": fn.entrypoint,
        "memoryMB": fn.memory_mb,
        "maxProcesses": fn.max_processes,
        "timeoutSec": fn.timeout_sec,
        **_replicas(fn.scale_in(env)),
        "enabled": fn.enabled,
        "http": fn.http,
        # only when set: the spec hash of every function that leaves it out stays as it was
        **({"sameOrigin": True} if fn.same_origin else {}),
        **_limits(fn),
        **({"stream": fn.stream.to_json()} if fn.stream is not None else {}),
        **({"websocket": fn.websocket.to_json()} if fn.websocket is not None else {}),
        **({} if fn.plain_http else {"plainHttp": False}),
        "crons": [{"schedule": c.schedule, "event": dict(c.event)} for c in fn.crons],
        "env": env_as_written(env_vars),
    }


def deployment_for(env: str, fn: Function, job_results: Mapping[str, str]) -> Deployment:
    """``fn`` in ``env`` with job results filled in; every job it names must have one."""
    env_vars: dict[str, EnvValue] = {
        name: job_results[value.job] if isinstance(value, JobRef) else value
        for name, value in fn.env_for(env).items()
    }
    canonical = json.dumps(_spec(env, fn, env_vars), sort_keys=True, separators=(",", ":"))
    return Deployment(env, fn, env_vars, hashlib.sha256(canonical.encode()).hexdigest()[:32])


class Backend(ABC):
    """Where functions are built and run.

    A backend whose state lives elsewhere (a cluster) reads it once per plan in
    :meth:`refresh` and answers the other questions from what it read.
    """

    publishes = False  # True: :meth:`report` keeps a view of the status (after every pass)
    rollouts = False  # True: :meth:`canary` runs a new revision beside what serves
    # "": builds shared by every environment of this scope; another value (a backend for
    # untrusted code): its builds are its own, and never satisfy a trusted environment
    build_scope = ""

    def for_untrusted(self) -> Backend:
        """This backend for an environment whose code nobody vouched for (a fork's preview):
        one that builds apart, where that makes a difference (by default, itself)."""
        return self

    def refresh(self, env: str) -> None:  # noqa: B027 - optional hook
        """Read what runs in ``env``; called before every plan."""

    def health(self, env: str) -> Mapping[str, Health]:
        """Deployed functions whose phase the backend observes; empty: the reconciler's own."""
        return {}

    def settling(self, env: str) -> bool:
        """Whether what runs in ``env`` is expected to change on its own soon (a rollout in
        progress): the reconciler then looks again shortly."""
        return any(h.settling for h in self.health(env).values())

    def health_version(self, env: str) -> object | None:
        """Something that changes whenever :meth:`health` may answer differently, or None
        when the backend cannot tell (then the reconciler derives phases on every pass)."""
        return None

    def report(  # noqa: B027 - optional hook
        self,
        env: str,
        records: list[dict[str, Any]],
        functions: Mapping[str, Function],
        runs: Callable[[], list[dict[str, Any]]],
    ) -> None:
        """Publish the status store's view of ``env`` where the backend keeps one.

        ``runs()`` reads the job runs: only a backend that publishes pays for it.
        """

    def unavailable(self, env: str, env_vars: Mapping[str, EnvValue]) -> str | None:
        """Why a process with ``env_vars`` cannot start yet (a secret it names), or None.

        A backend whose workloads wait for their secrets themselves says None.
        """
        return None

    def function_log(self, env: str, name: str) -> str | None:
        """What ``name``'s replicas printed, each line naming its replica, where the
        backend keeps it (None: the reconciler's log files are the record)."""
        return None

    def job_runs(self, env: str) -> list[JobRecord]:
        """Finished job runs recorded by the backend itself (empty: the store is the record)."""
        return []

    @abstractmethod
    def is_built(self, fn: Function) -> bool: ...

    @abstractmethod
    def build(self, fn: Function, snapshot: Snapshot) -> str:
        """Build ``fn.build_tag``; returns the log. Raises BuildFailed."""

    def image(self, fn: Function) -> str | None:
        """What ``fn``'s workloads run here, named so that it cannot change (an image by its
        digest); None where a build is not an image."""
        return None

    @abstractmethod
    def deployed(self, env: str) -> dict[str, str]:
        """Functions running in ``env``: name -> spec hash."""

    @abstractmethod
    def apply(self, deployment: Deployment, revision: str | None = None) -> None:
        """Start or replace a function; the old version serves until the new one is healthy.

        ``revision`` is the commit being deployed, for a backend that records it.
        """

    def adopt(self, deployment: Deployment) -> None:  # noqa: B027 - optional hook
        """``deployment`` still runs as the last process left it (:meth:`deployed` says
        so at start-up): serve it as if applied, starting nothing. By default, nothing
        to take over (what runs in a cluster serves on by itself)."""

    def restoring(self, deployment: Deployment) -> None:  # noqa: B027 - optional hook
        """``deployment`` is about to be started again as it last served (start-up, after
        a stop): its calls wait for it from now on, rather than being refused. By default
        nothing (what runs in a cluster serves on by itself)."""

    def keep_revisions(  # noqa: B027 - optional hook
        self, env: str, name: str, serving: KeptRevision, others: list[KeptRevision]
    ) -> None:
        """``name`` serves ``serving`` (applied), and ``others`` stay runnable beside it,
        each reached by its own URL (``/fn/{env}/{name}@{label or id}/``) and started on
        its first call; revisions kept before and not in ``others`` go. By default,
        nothing (a backend without revision URLs)."""

    def switch_to(self, env: str, target: KeptRevision, retired: KeptRevision | None) -> None:
        """All of the function's traffic to ``target``, a kept revision, at once (a
        rollback); ``retired`` is the revision that served until now, kept from here on.
        By default ``target`` is applied as a deploy is (started, then switched to)."""
        self.apply(target.deployment)

    def canary(self, env: str, name: str, candidate: KeptRevision | None, percent: int) -> None:
        """A rollout: ``candidate`` runs beside what serves ``name`` (started, and healthy,
        before this returns: ApplyFailed if it cannot be) and takes ``percent`` of its
        calls from now on; None: no candidate any more (its replicas stop)."""
        raise NotImplementedError(f"{type(self).__name__} has no rollouts")

    def canary_counts(self, env: str, name: str) -> tuple[int, int] | None:
        """(calls sent as the candidate's share, of them answered 5xx or timed out) so far,
        by this process; None: no candidate runs."""
        return None

    def canary_failure(self, env: str, name: str) -> str | None:
        """Why a rollout's candidate cannot serve (its replicas keep ending), or None."""
        return None

    def hand_over(self) -> object:
        """Stop as :meth:`close` does, but leave running what the next image of this
        process adopts (a restart in place); what it needs to, or None."""
        self.close()
        return None

    @abstractmethod
    def remove(self, env: str, name: str) -> None: ...

    @abstractmethod
    def run_job(self, env: str, fn: Function, job: Job, env_vars: Mapping[str, EnvValue]) -> str:
        """Run one job to completion; returns its result (JSON text). Raises JobFailed."""

    def public_url(self) -> str | None:
        """Where callers reach ``/fn/`` when not through this process (a cluster's Gateway);
        None: the reconciler's own address."""
        return None

    def scale(self, env: str, name: str, replicas: int) -> None:
        """Run ``replicas`` of an applied, autoscaled function from now on (the
        autoscaler's decision, or 1 to wake it from zero); no spec change, no pass."""
        raise NotImplementedError(f"{type(self).__name__} does not scale functions")

    def busy(self, env: str, name: str) -> float | None:
        """Call-seconds ``name``'s replicas report having served so far (never going
        down), for the autoscaler; None: they report nothing (the proxy's count serves)."""
        return None

    def remove_environment(self, env: str) -> None:  # noqa: B027 - optional hook
        """Whatever holds ``env`` once its functions are removed (a namespace)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop everything this backend started."""
