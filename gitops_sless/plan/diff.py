"""What a sync of a desired state would change in one environment, from what the store says.

Pure: it reads the desired state (typically the files of a work tree the
server has never seen) and the records of the status store, and returns the
builds, jobs and deploys a pass would do, the way the reconciler decides them:

- a build tag the store has not built (``Succeeded``) needs a build;
- a job whose ``(name, runId)`` has not finished runs, once its function is built;
- a function is (re)deployed when the spec hash of ``deployment_for`` with the
  environment's job results differs from the hash the store recorded when it
  last deployed it, so "no change" is exactly the reconciler's "unchanged";
- a deployed function no manifest declares any more is removed, except the
  names an invalid manifest declares (or declared when it was last valid):
  those keep their last good version.

Which fields changed is told by comparing the new function with the one that
runs (read from the revision the store says it serves). Literal env values are
never shown, only that they changed; secrets are named by reference only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..manifests import durations
from ..manifests.model import (
    DesiredState,
    EnvValue,
    Function,
    Job,
    JobRef,
    Scale,
    SecretRef,
    StreamPolicy,
)
from .backend import deployment_for

__all__ = [
    "BuildNeeded",
    "Diff",
    "FieldChange",
    "FunctionChange",
    "InvalidManifest",
    "JobToRun",
    "compute",
    "job_errors",
    "job_results",
]

FINISHED = ("Succeeded", "Failed", "Skipped")


@dataclass(frozen=True)
class FieldChange:
    field: str  # image, runtime, entrypoint, memoryMB, timeoutSec, replicas (both fixed),
    # scale, concurrency, rateLimit, maxBodyBytes, enabled, triggers, env.NAME, or spec when
    # the running version is not known in detail
    old: str | None
    new: str | None
    detail: str | None = None


@dataclass(frozen=True)
class FunctionChange:
    name: str
    build_tag: str
    fields: tuple[FieldChange, ...] = ()
    note: str | None = None


@dataclass(frozen=True)
class BuildNeeded:
    tag: str
    folder: str
    functions: tuple[str, ...]
    last_error: str | None  # the last build of this tag failed with this


@dataclass(frozen=True)
class JobToRun:
    name: str
    run_id: int
    function: str
    after: str | None  # what it waits for in the same pass: a build, another job's result
    phase: str | None  # the run's phase when the store has one (Pending, Running)


@dataclass(frozen=True)
class InvalidManifest:
    manifest: str
    problems: tuple[str, ...]
    functions: tuple[str, ...]  # names it declares: each keeps its last good version


@dataclass
class Diff:
    env: str
    builds: list[BuildNeeded] = field(default_factory=list)
    added: list[FunctionChange] = field(default_factory=list)
    changed: list[FunctionChange] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    jobs: list[JobToRun] = field(default_factory=list)
    invalid: list[InvalidManifest] = field(default_factory=list)
    waiting: dict[str, str] = field(default_factory=dict)  # not deployable: why
    unchanged: list[str] = field(default_factory=list)

    @property
    def has_changes(self) -> bool:
        return bool(
            self.builds or self.added or self.changed or self.removed or self.jobs or self.invalid
        )


def job_results(jobs: Mapping[str, Job], runs: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """The result each job hands on: its current runId's once it succeeded.

    While the current run is still to come (not started, ``Pending`` or
    ``Running``) a job hands on nothing, so its dependents keep serving what
    they serve and are replaced once, with the new result; handing on the
    older result meanwhile replaced them twice (issue 19). A current run that
    ``Failed`` or was ``Skipped``, or ``runId: 0``, hands on the newest result
    that succeeded: a failed rerun keeps the last good one.

    The rule the reconciler deploys by, for the runs of one environment.
    """
    runs = list(runs)
    results: dict[str, str] = {}
    for run in sorted(runs, key=lambda r: r["run_id"]):  # newest wins
        if run["phase"] == "Succeeded" and run["result"] is not None:
            results[run["name"]] = run["result"]
    current = {job.name: job.run_id for job in jobs.values()}
    now = {r["name"]: r for r in runs if current.get(r["name"]) == r["run_id"]}
    for name, run_id in current.items():
        run = now.get(name)
        if run is not None and run["phase"] == "Succeeded":
            results[name] = run["result"]
        elif run_id > 0 and (run is None or run["phase"] in ("Pending", "Running")):
            results.pop(name, None)  # the new result is coming: nothing older meanwhile
    return results


def job_errors(jobs: Mapping[str, Job], runs: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    current = {job.name: job.run_id for job in jobs.values()}
    return {
        run["name"]: run["error"] or "failed"
        for run in runs
        if run["phase"] == "Failed" and current.get(run["name"]) == run["run_id"]
    }


def _deployed_hash(record: Mapping[str, Any]) -> str | None:
    spec = record.get("spec")
    return spec.get("hash") if isinstance(spec, dict) else None


def _waiting_reason(missing: list[str], jobs: Mapping[str, Job], errors: Mapping[str, str]) -> str:
    never = [name for name in missing if name in jobs and jobs[name].run_id == 0]
    if never:
        return f"waiting for job {', '.join(never)}, which has runId 0 and never runs"
    failed = [name for name in missing if name in errors]
    if failed:
        name = failed[0]
        return (
            f"waiting for job {name}, whose run {jobs[name].run_id} failed: "
            f"{errors[name]} (fix it and bump runId)"
        )
    return f"waiting for the result of job {', '.join(missing)}"


def _not_running(record: Mapping[str, Any]) -> str:
    message = (record.get("message") or "").strip().splitlines()
    return f"not running yet, {record['phase']}" + (f": {message[0]}" if message else "")


def _describe_value(value: EnvValue | None) -> str | None:
    if value is None:
        return None
    if isinstance(value, SecretRef):
        return f"secret {value.secret} key {value.key}"
    if isinstance(value, JobRef):
        return f"result of job {value.job}"
    return "(literal)"


def _describe_triggers(fn: Function) -> str:
    parts = ["http"] if fn.http and fn.plain_http else []
    ws = fn.websocket
    if ws is not None:
        hooks = [
            f"{k} {v}"
            for k, v in (("onConnect", ws.on_connect), ("onDisconnect", ws.on_disconnect))
            if v
        ]
        parts.append(
            f"websocket ({', '.join([*hooks, f'messages up to {ws.max_message_bytes} bytes'])})"
        )
    parts += [f"cron {c.schedule!r}" for c in fn.crons]
    return ", ".join(parts) or "none"


def _triggers(fn: Function) -> tuple[Any, ...]:
    return (fn.http, fn.plain_http, fn.websocket, [(c.schedule, dict(c.event)) for c in fn.crons])


def _describe_scale(scale: Scale) -> str:
    """``3 replicas (fixed)``, or ``0..10 replicas, target 10 in flight, idle 5m, warm 2 from
    '0 8 * * 1-5' for 10h``."""
    if not scale.autoscaled:
        return f"{scale.min} replica{'' if scale.min == 1 else 's'} (fixed)"
    parts = [
        f"{scale.min}..{scale.max} replicas",
        f"target {scale.target} in flight",
        f"idle {durations.shown(scale.idle_sec)}",
    ]
    parts += [f"warm {w.min} from {w.cron!r} for {durations.shown(w.for_sec)}" for w in scale.warm]
    return ", ".join(parts)


def _scale_change(env: str, old: Function, new: Function) -> list[FieldChange]:
    """``replicas`` between two fixed counts (as always), else ``scale``, in ``env``."""
    was, now = old.scale_in(env), new.scale_in(env)
    if not was.autoscaled and not now.autoscaled:
        same = was.min == now.min  # the rest of a fixed count runs nothing differently
        return [] if same else [FieldChange("replicas", str(was.min), str(now.min))]
    return [] if was == now else [FieldChange("scale", _describe_scale(was), _describe_scale(now))]


def _describe_concurrency(fn: Function) -> str:
    return f"{fn.concurrency} in flight per replica" if fn.concurrency else "no limit"


def _describe_rate_limit(fn: Function) -> str:
    rate = fn.rate_limit
    if rate is None:
        return "no limit"
    rps = int(rate.rps) if rate.rps == int(rate.rps) else rate.rps
    return f"{rps} requests/s, burst {rate.burst}"


def _describe_max_body(fn: Function) -> str:
    return "the proxy's limit" if fn.max_body_bytes is None else f"{fn.max_body_bytes} bytes"


def _describe_stream(fn: Function) -> str:
    policy = fn.stream or StreamPolicy()
    said = f"idle {policy.idle_sec}s, at most {policy.max_sec}s, drain {policy.drain_sec}s"
    if policy.request:
        said += ", request bodies read as they come"
    # not named: the runtime's defaults, which the runtime is not told (another spec)
    return said if fn.stream is not None else f"not set (the runtime's {said})"


_LIMITS = (
    ("concurrency", _describe_concurrency),
    ("rateLimit", _describe_rate_limit),
    ("maxBodyBytes", _describe_max_body),
    ("stream", _describe_stream),
)


def _limit_changes(old: Function, new: Function) -> list[FieldChange]:
    """The proxy's limits that differ, in words."""
    changes = []
    for name, describe in _LIMITS:
        was, now = describe(old), describe(new)
        if was != now:
            changes.append(FieldChange(name, was, now))
    return changes


def _env_changes(
    env: str, old: Function, new: Function, rerun: Mapping[str, JobToRun]
) -> list[FieldChange]:
    before, after = old.env_for(env), new.env_for(env)
    changes = []
    for key in sorted(set(before) | set(after)):
        was, now = before.get(key), after.get(key)
        name = f"env.{key}"
        if was == now:
            if isinstance(now, JobRef) and now.job in rerun:
                run = rerun[now.job]
                changes.append(
                    FieldChange(
                        name,
                        _describe_value(was),
                        f"result of job {now.job} run {run.run_id}",
                        f"job {now.job} runs first; redeployed if its result differs",
                    )
                )
            continue
        detail = None
        if isinstance(was, str) and isinstance(now, str):
            detail = "value changed (literal values are not shown)"
        elif was is None:
            detail = "added"
        elif now is None:
            detail = "removed"
        changes.append(FieldChange(name, _describe_value(was), _describe_value(now), detail))
    return changes


def _field_changes(
    env: str, old: Function, new: Function, rerun: Mapping[str, JobToRun]
) -> list[FieldChange]:
    changes = []
    if old.build_tag != new.build_tag:
        changes.append(FieldChange("image", old.build_tag, new.build_tag))
    for name, attr in (
        ("runtime", "runtime"),
        ("entrypoint", "entrypoint"),
        ("memoryMB", "memory_mb"),
        ("timeoutSec", "timeout_sec"),
        ("enabled", "enabled"),
    ):
        was, now = getattr(old, attr), getattr(new, attr)
        if was != now:
            text = (lambda v: str(v).lower()) if isinstance(now, bool) else str
            changes.append(FieldChange(name, text(was), text(now)))
    changes += _scale_change(env, old, new) + _limit_changes(old, new)
    if _triggers(old) != _triggers(new):
        was, now = _describe_triggers(old), _describe_triggers(new)
        changes.append(
            FieldChange("triggers", was, now, "a cron event changed" if was == now else None)
        )
    return changes + _env_changes(env, old, new, rerun)


def _unexplained(
    env: str, old: Function | None, results: Mapping[str, str], deployed_hash: str
) -> list[FieldChange]:
    """Why the hashes differ when no field does: a job result, or an unknown running spec."""
    if old is not None and old.job_dependencies(env):
        try:
            same = deployment_for(env, old, results).spec_hash == deployed_hash
        except KeyError:
            same = False
        if not same:
            return [
                FieldChange(
                    f"env.{key}",
                    _describe_value(value),
                    _describe_value(value),
                    f"job {value.job} has another result than the one it runs with",
                )
                for key, value in old.env_for(env).items()
                if isinstance(value, JobRef)
            ]
    return [FieldChange("spec", None, None, "differs from the spec that runs")]


def _same(env: str, already: Function, fn: Function, fresh: Mapping[str, JobToRun]) -> bool:
    """Whether ``fn`` is what the server declares already, with no job to run first."""
    same_build = already.build_tag == fn.build_tag
    return not fresh and same_build and not _field_changes(env, already, fn, {})


def compute(
    desired: DesiredState,
    env: str,
    records: Iterable[Mapping[str, Any]],
    builds: Mapping[str, Mapping[str, Any] | None],
    runs: Iterable[Mapping[str, Any]],
    running: Mapping[str, Function] | None = None,
    declared: Mapping[str, Function] | None = None,
) -> Diff:
    """What a pass would do in ``env`` to bring what the store records to ``desired``.

    ``records``: the store's functions of ``env`` (with the ``spec`` column);
    ``builds``: build tag -> the store's build row (or None), for the desired tags;
    ``runs``: the store's job runs of ``env``; ``running``: name -> the function
    as it was declared in the revision that runs (for the changed fields);
    ``declared``: name -> the function as the server's last pass declares it. One
    it declares as ``desired`` does but has never deployed (it waits for a secret)
    is waiting, not a change: a sync would do nothing more for it.
    """
    records = {r["name"]: r for r in records}
    runs = list(runs)
    running = running or {}
    declared = declared or {}
    jobs = desired.jobs
    out = Diff(env)
    deployed = {name: h for name, r in records.items() if (h := _deployed_hash(r))}
    built = {tag for tag, row in builds.items() if row and row["phase"] == "Succeeded"}
    finished = {(r["name"], r["run_id"]) for r in runs if r["phase"] in FINISHED}
    phases = {(r["name"], r["run_id"]): r["phase"] for r in runs}
    results = job_results(jobs, runs)
    errors = job_errors(jobs, runs)
    functions = sorted(desired.functions.values(), key=lambda f: f.name)

    to_build: dict[str, list[Function]] = {}
    for fn in functions:
        if fn.build_tag not in built:
            to_build.setdefault(fn.build_tag, []).append(fn)
    for tag, users in to_build.items():
        row = builds.get(tag)
        error = (row["error"] or "failed") if row and row["phase"] == "Failed" else None
        out.builds.append(BuildNeeded(tag, users[0].folder, tuple(f.name for f in users), error))

    rerun: dict[str, JobToRun] = {}
    for fn in functions:
        for job in fn.jobs:
            if job.run_id == 0 or (job.name, job.run_id) in finished:
                continue
            waits = [j for j in fn.job_dependencies(env) if j not in results]
            after = (
                f"the build {fn.build_tag}"
                if fn.build_tag not in built
                else (f"job {', '.join(waits)}" if waits else None)
            )
            rerun[job.name] = JobToRun(
                job.name, job.run_id, fn.name, after, phases.get((job.name, job.run_id))
            )
    out.jobs = sorted(rerun.values(), key=lambda j: j.name)

    for fn in functions:
        dependencies = fn.job_dependencies(env)
        missing = [j for j in dependencies if j not in results and j not in rerun]
        if missing:
            out.waiting[fn.name] = _waiting_reason(missing, jobs, errors)
            if fn.name not in records:
                out.added.append(FunctionChange(fn.name, fn.build_tag, (), out.waiting[fn.name]))
            continue
        fresh = {j: rerun[j] for j in dependencies if j in rerun}
        known = all(j in results for j in dependencies)
        new_hash = deployment_for(env, fn, results).spec_hash if known else None
        old_hash = deployed.get(fn.name)
        if old_hash is None:
            already = declared.get(fn.name)
            if fn.name in records and already is not None and _same(env, already, fn, fresh):
                out.waiting[fn.name] = _not_running(records[fn.name])
                continue
            notes = [f"after job {', '.join(fresh)}"] if fresh else []
            if fn.name in records:  # declared before, never deployed: tried again
                notes.append(_not_running(records[fn.name]))
            out.added.append(FunctionChange(fn.name, fn.build_tag, (), "; ".join(notes) or None))
            continue
        if new_hash == old_hash and not fresh:
            out.unchanged.append(fn.name)
            continue
        old = running.get(fn.name)
        if old is None:
            fields = [FieldChange("spec", None, None, "the spec that runs is not known in detail")]
        else:
            fields = _field_changes(env, old, fn, fresh)
            if not fields:
                fields = _unexplained(env, old, results, old_hash)
        out.changed.append(FunctionChange(fn.name, fn.build_tag, tuple(fields)))

    invalid_names: dict[str, set[str]] = {}
    for name, path in desired.invalid_names.items():
        invalid_names.setdefault(path, set()).add(name)
    for name, record in records.items():
        if record.get("manifest") in desired.invalid and name not in desired.functions:
            invalid_names.setdefault(record["manifest"], set()).add(name)
    for path, error in sorted(desired.invalid.items()):
        out.invalid.append(
            InvalidManifest(
                path,
                tuple(str(p) for p in error.problems),
                tuple(sorted(invalid_names.get(path, ()))),
            )
        )
    keep = set(desired.functions) | {n for names in invalid_names.values() for n in names}
    out.removed = sorted(name for name in deployed if name not in keep)
    return out
