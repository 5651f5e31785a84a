"""What serves: a deployment written down when it starts, so a restart starts exactly it.

The repository says what should run; this says what does. They differ while a
manifest is broken, a build or a deploy failed, or a job a function waits for
has not run: the last good version keeps serving, across restarts too. Only a
valid manifest that changes the function, or the deletion of its folder,
replaces or removes it.

A record keeps the function as deployed (every manifest field after defaults),
its env with job results filled in and secrets kept as references (resolved
again at each start, never stored), and the spec hash it was deployed with.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..manifests.model import CronTrigger, Function, Job, env_as_written, read_env
from ..plan.backend import Deployment

__all__ = ["from_record", "to_record"]

FORMAT = 1


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
        },
    }


def from_record(record: Mapping[str, Any]) -> Deployment:
    """The deployment ``to_record`` wrote; KeyError or ValueError if it is not one."""
    if record.get("format") != FORMAT:
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
    )
    return Deployment(record["env"], function, read_env(record["envVars"]), record["specHash"])
