"""What the status API answers: pydantic models, and the mapping from store rows to them.

Store rows are plain dicts whose keys are SQLite column names; the API's names
are camelCase (``buildTag``, ``runId``, ``lastSync``) and its times are RFC 3339
UTC strings (``2026-12-01T10:00:00.123Z``). Each model's ``from_row`` names
every field it takes, so a column rename or a new column never leaks out.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from ..state.store import BUILD_PHASES, FUNCTION_PHASES, JOB_PHASES, LOG_TAIL_CHARS
from ..timestamps import rfc3339

__all__ = [
    "Build",
    "Environment",
    "ErrorReply",
    "Function",
    "FunctionDetail",
    "Health",
    "Invocation",
    "JobRun",
    "LogChunk",
    "Status",
    "Sync",
    "SyncAccepted",
    "WebhookReply",
    "rfc3339",
]

# Progressing: a rollout under way (both revisions serve); RolledBack: the new revision
# failed its rollout, the one before serves
# the store's own lists, one place for each (a phase added there is in the API's schema)
FunctionPhase = Literal[FUNCTION_PHASES]  # type: ignore[valid-type]
JobPhase = Literal[JOB_PHASES]  # type: ignore[valid-type]
BuildPhase = Literal[BUILD_PHASES]  # type: ignore[valid-type]
# Succeeded: every function serves its commit; Progressing: builds, jobs or secrets are
# awaited; Invalid: a manifest is broken; Degraded: a function or job failed; Failed: the
# pass itself could not run (fetch, refused prune)
SyncResult = Literal["Running", "Succeeded", "Progressing", "Invalid", "Degraded", "Failed"]

Timestamp = Annotated[
    str,
    Field(
        pattern=r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$",
        json_schema_extra={"format": "date-time"},
        examples=["2026-12-01T10:00:00.123Z"],
    ),
]


class ApiModel(BaseModel):
    """Python names in snake_case, JSON names in camelCase."""

    model_config = ConfigDict(
        alias_generator=to_camel, validate_by_name=True, serialize_by_alias=True, frozen=True
    )


class ErrorReply(ApiModel):
    error: str = Field(description="what went wrong, for a person to read")


class Health(ApiModel):
    status: Literal["ok"]


class Readiness(ApiModel):
    status: Literal["ready", "not ready"]
    reason: str = Field(description="what this replica serves from, or what it waits for")


class Sync(ApiModel):
    """One reconcile pass; repeated passes that changed nothing share one row."""

    id: int
    env: str = Field(description="the environment it reconciled: the tracked branch's, or pr-N")
    trigger: str = Field(description="what started it: startup, poll, api, webhook:<forge>")
    started: Timestamp
    finished: Timestamp | None
    revision: str | None = Field(description="the commit it fetched, when the fetch worked")
    result: SyncResult
    error: str | None
    count: int = Field(description="how many passes this row stands for")
    last_seen: Timestamp | None = Field(description="the latest of them; null when count is 1")

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Sync:
        count = int(row.get("count") or 1)
        return cls(
            id=row["id"],
            env=row["env"],
            trigger=row["trigger"],
            started=rfc3339(row["started"]),
            finished=rfc3339(row["finished"]),
            revision=row["revision"],
            result=row["result"],
            error=row["error"],
            count=count,
            last_seen=rfc3339(row.get("last_seen")) if count > 1 else None,
        )


def _sync_or_none(row: dict[str, Any] | None) -> Sync | None:
    return Sync.from_row(row) if row else None


class Scaling(ApiModel):
    """An autoscaled function's replicas, load and cold starts, as the autoscaler sees them."""

    min: int
    max: int
    target: int = Field(description="in-flight calls per replica the autoscaler aims for")
    idle_sec: float = Field(description="with min 0: seconds without a call before zero")
    desired: int | None = Field(description="replicas the autoscaler decided (null: not yet)")
    ready: int = Field(description="replicas serving now")
    floor: int = Field(description="the fewest replicas allowed now: min, raised by warm")
    concurrency: float = Field(description="calls in flight, averaged over the stable window")
    panicking: bool = Field(description="a burst: scaling up fast, never down for a window")
    in_flight: int = Field(description="calls through the proxy now, waiting ones included")
    waiting: int = Field(description="of those, calls held for a replica or a free slot")
    last_cold_start_ms: float | None = Field(
        description="how long the last call that waited for a replica to start waited"
    )
    cold_start_p50_ms: float | None = Field(description="median cold start, the last hour")
    cold_start_p95_ms: float | None = Field(description="95th percentile, the last hour")
    cold_starts: int = Field(description="calls that waited for a start, the last hour")


class Function(ApiModel):
    name: str
    phase: FunctionPhase
    build_tag: str | None = Field(description="the image or artifact it runs")
    revision: str | None = Field(description="the commit whose code it serves")
    url: str | None
    message: str | None = Field(description="why it is in this phase")
    manifest: str | None = Field(description="the sless.yaml that declares it")
    updated: Timestamp
    restarts: int = Field(
        description="times its process was restarted, or its deploy tried again, in a row"
    )
    last_exit: str | None = Field(description="how its process last ended")
    next_retry: Timestamp | None = Field(
        default=None, description="when a deploy that failed is tried again (backing off)"
    )
    scaling: Scaling | None = Field(
        default=None, description="replicas and cold starts of an autoscaled function"
    )
    serving_revision: str | None = Field(
        default=None, description="the revision taking its traffic (r1, r2, ...)"
    )
    open_streams: int = Field(
        default=0, description="streamed responses under way through this server's proxy"
    )
    open_sockets: int = Field(default=0, description="WebSockets open through this server's proxy")
    pinned: str | None = Field(
        default=None,
        description="the revision a rollback holds it at, differing from git on purpose "
        "until a commit changes it or an unpin; null: it follows git",
    )

    @classmethod
    def fields_from_row(cls, row: dict[str, Any]) -> dict[str, Any]:
        return {
            "name": row["name"],
            "phase": row["phase"],
            "build_tag": row["build_tag"],
            "revision": row["revision"],
            "url": row["url"],
            "message": row["message"],
            "manifest": row["manifest"],
            "updated": rfc3339(row["updated"]),
            "restarts": row.get("restarts") or 0,
            "last_exit": row.get("last_exit"),
            "next_retry": rfc3339(row["next_retry"]) if row.get("next_retry") else None,
            "serving_revision": row.get("serving_revision"),
            "pinned": row.get("pinned"),
        }

    @classmethod
    def from_row(cls, row: dict[str, Any], **extra: Any) -> Function:
        return cls(**cls.fields_from_row(row), **extra)


class Build(ApiModel):
    tag: str
    phase: BuildPhase
    started: Timestamp
    finished: Timestamp | None
    error: str | None
    log_tail: str = Field(description=f"the last {LOG_TAIL_CHARS} characters of the build log")
    image: str | None = Field(
        None,
        description="what the build made, by digest (image@sha256:...; Kubernetes); "
        "null for local artifacts and unfinished builds",
    )

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Build:
        return cls(
            tag=row["tag"],
            phase=row["phase"],
            started=rfc3339(row["started"]),
            finished=rfc3339(row["finished"]),
            error=row["error"],
            log_tail=(row["log"] or "")[-LOG_TAIL_CHARS:],
            image=row.get("image"),
        )


class JobRun(ApiModel):
    name: str
    run_id: int
    function: str = Field(description="the function whose code the job runs")
    phase: JobPhase
    result: str | None = Field(description="the handler's JSON result, once it succeeded")
    error: str | None
    started: Timestamp | None
    finished: Timestamp | None
    attempts: int

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> JobRun:
        return cls(
            name=row["name"],
            run_id=row["run_id"],
            function=row["function"],
            phase=row["phase"],
            result=row["result"],
            error=row["error"],
            started=rfc3339(row["started"]),
            finished=rfc3339(row["finished"]),
            attempts=row.get("attempts") or 0,
        )


class Invocation(ApiModel):
    method: str = Field(description="the HTTP method, or CRON for a scheduled call")
    path: str
    path_truncated: bool = Field(description="the path was cut to its first 256 bytes")
    status: int
    duration_ms: float = Field(description="milliseconds, to one decimal")
    time: Timestamp
    request_id: str
    trace_id: str = Field(description="the trace the call belongs to (W3C trace id)")
    cold_start_ms: float | None = Field(
        description="how long it waited for a replica to start; null when one was ready"
    )
    bytes: int | None = Field(
        default=None,
        description="a streamed response's or a WebSocket's bytes to the client (duration_ms:"
        " how long it was open); null for an ordinary call",
    )
    chunks: int | None = Field(
        default=None, description="a streamed response's chunks; null for anything else"
    )

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Invocation:
        return cls(
            method=row["method"],
            path=row["path"],
            path_truncated=bool(row.get("truncated")),
            status=row["status"],
            # the clock gives nanoseconds of noise: a tenth of a millisecond is what matters
            duration_ms=round(row["duration_ms"], 1),
            time=rfc3339(row["time"]),
            request_id=row["request_id"],
            # the proxy's own trace is named by the request id (the one it made)
            trace_id=row.get("trace_id") or row["request_id"],
            cold_start_ms=None if row.get("cold_ms") is None else round(row["cold_ms"], 1),
            bytes=row.get("bytes"),
            chunks=row.get("chunks"),
        )


class FunctionDetail(Function):
    build: Build | None = Field(
        description="the build of what the repository asks for, or of what runs if none yet"
    )
    jobs: list[JobRun]
    invocations: list[Invocation] = Field(description="the latest calls, newest first")

    @classmethod
    def from_rows(
        cls,
        row: dict[str, Any],
        build: dict[str, Any] | None,
        jobs: list[dict[str, Any]],
        invocations: list[dict[str, Any]],
    ) -> FunctionDetail:
        return cls(
            **cls.fields_from_row(row),
            build=Build.from_row(build) if build else None,
            jobs=[JobRun.from_row(job) for job in jobs],
            invocations=[Invocation.from_row(call) for call in invocations],
        )


class Preview(ApiModel):
    """The pull request an environment previews."""

    number: int
    title: str | None
    author: str | None
    head: str | None = Field(description="the PR's head commit, which the preview serves")
    head_branch: str | None = Field(None, description="the branch the PR comes from, when known")
    base: str | None = Field(None, description="the branch the PR goes into, when known")
    link: str | None = Field(
        None, description="the PR's page on its forge, when the repository's URL tells it"
    )
    state: Literal["Building", "Ready", "Failed", "Waiting", "TearingDown"]
    reason: str | None = Field(description="why it waits or failed")
    created: Timestamp
    updated: Timestamp
    urls: list[str] = Field(description="the preview's function URLs")

    @classmethod
    def from_row(
        cls, row: dict[str, Any], functions: list[dict[str, Any]], link: str | None = None
    ) -> Preview:
        return cls(
            number=row["number"],
            title=row["title"],
            author=row["author"],
            head=row["head"],
            head_branch=row.get("head_branch"),
            base=row.get("base"),
            link=link,
            state=row["state"],
            reason=row["reason"],
            created=rfc3339(row["created"]),
            updated=rfc3339(row["updated"]),
            urls=[f["url"] for f in functions if f["url"]],
        )


class Environment(ApiModel):
    name: str
    functions: int = Field(description="how many functions it has")
    last_sync: Sync | None
    preview: Preview | None = Field(None, description="the pull request, for pr-N")

    @classmethod
    def from_rows(
        cls,
        name: str,
        functions: list[dict[str, Any]],
        last_sync: dict[str, Any] | None,
        preview: dict[str, Any] | None = None,
        link: str | None = None,
    ) -> Environment:
        return cls(
            name=name,
            functions=len(functions),
            last_sync=_sync_or_none(last_sync),
            preview=Preview.from_row(preview, functions, link) if preview else None,
        )


class Status(ApiModel):
    repository: str
    branch: str
    environment: str
    fetched_revision: str | None = Field(
        description="the revision of the newest pass that fetched one, whatever its result"
    )
    last_good_revision: str | None = Field(
        description="the revision of the newest pass after which every function served it"
    )
    last_sync: Sync | None
    functions: int
    phases: dict[FunctionPhase, int] = Field(description="how many functions are in each phase")
    sandbox: Literal["bubblewrap", "off"] | None = Field(
        None,
        description="local backend: how function processes are confined (off: not at all); "
        "null on Kubernetes",
    )

    @classmethod
    def from_rows(
        cls,
        *,
        repository: str,
        branch: str,
        environment: str,
        functions: list[dict[str, Any]],
        syncs: list[dict[str, Any]],
        sandbox: str | None = None,
    ) -> Status:
        """``syncs`` newest first."""
        phases: dict[str, int] = {}
        for fn in functions:
            phases[fn["phase"]] = phases.get(fn["phase"], 0) + 1
        fetched = (s["revision"] for s in syncs if s["revision"])
        good = (s["revision"] for s in syncs if s["revision"] and s["result"] == "Succeeded")
        return cls(
            repository=repository,
            branch=branch,
            environment=environment,
            fetched_revision=next(fetched, None),
            last_good_revision=next(good, None),
            last_sync=_sync_or_none(syncs[0] if syncs else None),
            functions=len(functions),
            phases=phases,
            sandbox=sandbox,
        )


class SyncAccepted(ApiModel):
    accepted: bool
    finished: bool = Field(description="a pass finished within ?wait= seconds")
    last_sync: Sync | None

    @classmethod
    def from_rows(cls, last_sync: dict[str, Any] | None, *, finished: bool) -> SyncAccepted:
        return cls(accepted=True, finished=finished, last_sync=_sync_or_none(last_sync))


class WebhookReply(ApiModel):
    accepted: bool = Field(description="a sync was requested")
    ignored: str | None = Field(None, description="why nothing was synced")


# --- logs ----------------------------------------------------------------------------------


class LogChunk(ApiModel):
    """A bounded piece of a log file, for reading it page by page or following it."""

    text: str = Field(description="the bytes read, as UTF-8 (never cut inside a character)")
    offset: int = Field(description="byte offset in the log where the text starts")
    next_offset: int = Field(description="the offset to ask for next")
    size: int = Field(description="the log's size in bytes when it was read")
    reset: bool = Field(
        description="the log is shorter than the offset asked for (it was cut or replaced); "
        "the text starts at its beginning"
    )
    finished: bool = Field(
        description="nothing more will be written (a build that ended); false for replica logs"
    )
