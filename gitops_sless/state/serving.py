"""What serves: a deployment written down when it starts, so a restart starts exactly it.

The repository says what should run; this says what does. They differ while a
manifest is broken, a build or a deploy failed, or a job a function waits for
has not run: the last good version keeps serving, across restarts too. Only a
valid manifest that changes the function, or the deletion of its folder,
replaces or removes it.

A record keeps the function as deployed (every manifest field after defaults:
its code and every policy, so what a restart serves scales, limits and retries
as before), its env with job results filled in and secrets kept as references
(resolved again at each start, never stored), and the spec hash it was deployed
with.

Records of format 1 left out the policies (scale, limits, async): one is read
with its spec hash marked, so the first pass deploys the function again as the
repository says.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..manifests.model import (
    DEFAULT_ASYNC,
    AsyncPolicy,
    CronTrigger,
    Function,
    Job,
    RateLimit,
    Rollout,
    Scale,
    StreamPolicy,
    Warm,
    WebSocketTrigger,
    env_as_written,
    read_env,
)
from ..plan.backend import Deployment

__all__ = ["from_record", "rollout_of", "to_record"]

FORMAT = 2
_READ = (1, 2)
STALE = ":format-1"  # appended to a format-1 record's spec hash: never what the plan wants


def to_record(deployment: Deployment) -> dict[str, Any]:
    fn = deployment.function
    return {
        "format": FORMAT,
        "env": deployment.env,
        "specHash": deployment.spec_hash,
        "envVars": env_as_written(deployment.env_vars),
        "function": {
            "name": fn.name,
            "folder": fn.folder,
            "manifest": fn.manifest,
            "runtime": fn.runtime,
            "entrypoint": fn.entrypoint,
            "memoryMB": fn.memory_mb,
            "maxProcesses": fn.max_processes,
            "timeoutSec": fn.timeout_sec,
            "replicas": fn.replicas,
            "enabled": fn.enabled,
            "env": env_as_written(fn.env),
            "previewEnv": env_as_written(fn.preview_env),
            "http": fn.http,
            "sameOrigin": fn.same_origin,
            "crons": [{"schedule": c.schedule, "event": dict(c.event)} for c in fn.crons],
            "jobs": [{"name": j.name, "runId": j.run_id, "event": dict(j.event)} for j in fn.jobs],
            "sourceId": fn.source_id,
            "buildTag": fn.build_tag,
            "scale": _scale(fn.scale),
            "previewScale": _scale(fn.preview_scale),
            "replicasNamed": fn.replicas_named,
            "concurrency": fn.concurrency,
            "rateLimit": None if fn.rate_limit is None else _rate(fn.rate_limit),
            "maxBodyBytes": fn.max_body_bytes,
            "async": fn.async_policy.to_json(),
            "subjects": list(fn.subjects),
            "rollout": None if fn.rollout is None else _rollout(fn.rollout),
            "stream": None if fn.stream is None else fn.stream.to_json(),
            "websocket": None if fn.websocket is None else fn.websocket.to_json(),
            "plainHttp": fn.plain_http,
        },
    }


def _rollout(rollout: Rollout) -> dict[str, Any]:
    return {
        "steps": list(rollout.steps),
        "intervalSec": rollout.interval_sec,
        "minRequests": rollout.min_requests,
        "maxErrorRate": rollout.max_error_rate,
    }


def _read_rollout(raw: Mapping[str, Any] | None) -> Rollout | None:
    if raw is None:
        return None
    return Rollout(tuple(raw["steps"]), raw["intervalSec"], raw["minRequests"], raw["maxErrorRate"])


def _scale(scale: Scale | None) -> dict[str, Any] | None:
    if scale is None:
        return None
    warm = [{"cron": w.cron, "forSec": w.for_sec, "min": w.min} for w in scale.warm]
    return {
        "min": scale.min,
        "max": scale.max,
        "target": scale.target,
        "idleSec": scale.idle_sec,
        "warm": warm,
    }


def _read_scale(raw: Mapping[str, Any] | None) -> Scale | None:
    if raw is None:
        return None
    warm = tuple(Warm(w["cron"], w["forSec"], w["min"]) for w in raw["warm"])
    return Scale(raw["min"], raw["max"], raw["target"], raw["idleSec"], warm)


def _rate(rate: RateLimit) -> dict[str, Any]:
    return {"rps": rate.rps, "burst": rate.burst}


def rollout_of(record: Mapping[str, Any]) -> Rollout | None:
    """The ``rollout`` block of the function a record holds, read without the rest of it
    (a listing of revisions reads it for each)."""
    fn = record.get("function") or {}
    return _read_rollout(fn.get("rollout"))


def _policies(fn: Mapping[str, Any]) -> dict[str, Any]:
    """The Function fields a format-2 record adds (a format-1 record: their defaults)."""
    if "scale" not in fn:
        return {}
    rate = fn["rateLimit"]
    return {
        "scale": _read_scale(fn["scale"]),
        "preview_scale": _read_scale(fn["previewScale"]),
        "replicas_named": fn["replicasNamed"],
        "concurrency": fn["concurrency"],
        "rate_limit": None if rate is None else RateLimit(rate["rps"], rate["burst"]),
        "max_body_bytes": fn["maxBodyBytes"],
        "async_policy": AsyncPolicy.from_json(fn["async"]) if fn["async"] else DEFAULT_ASYNC,
        "subjects": tuple(fn["subjects"]),
        "rollout": _read_rollout(fn.get("rollout")),
        "stream": StreamPolicy.from_json(fn["stream"]) if fn.get("stream") else None,
        "websocket": WebSocketTrigger.from_json(ws) if (ws := fn.get("websocket")) else None,
        "plain_http": fn.get("plainHttp", True),
    }


def from_record(record: Mapping[str, Any]) -> Deployment:
    """The deployment ``to_record`` wrote; KeyError or ValueError if it is not one."""
    if record.get("format") not in _READ:
        raise ValueError(f"unknown serving record format {record.get('format')!r}")
    fn = record["function"]
    function = Function(
        name=fn["name"],
        folder=fn["folder"],
        manifest=fn["manifest"],
        runtime=fn["runtime"],
        entrypoint=fn["entrypoint"],
        memory_mb=fn["memoryMB"],
        max_processes=fn.get("maxProcesses", Function.max_processes),  # older records
        same_origin=fn.get("sameOrigin", False),  # records from before sameOrigin
        timeout_sec=fn["timeoutSec"],
        replicas=fn["replicas"],
        enabled=fn["enabled"],
        env=read_env(fn["env"]),
        preview_env=read_env(fn["previewEnv"]),
        http=fn["http"],
        crons=tuple(CronTrigger(c["schedule"], c["event"]) for c in fn["crons"]),
        jobs=tuple(Job(j["name"], j["runId"], j["event"], fn["name"]) for j in fn["jobs"]),
        source_id=fn["sourceId"],
        build_tag=fn["buildTag"],
        **_policies(fn),
    )
    spec_hash = record["specHash"] + ("" if record["format"] == FORMAT else STALE)
    return Deployment(record["env"], function, read_env(record["envVars"]), spec_hash)
