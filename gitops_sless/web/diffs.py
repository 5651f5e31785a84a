"""What ``gitops-sless diff`` sends (the desired state it loaded) and what the server
answers (what a sync would change), as the API's models."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from functools import cache
from typing import Any

import jsonschema
from pydantic import ConfigDict, Field

from ..errors import ManifestError, ManifestProblem
from ..manifests import model, runtimes
from ..manifests.identity import build_tag
from ..manifests.schema import load_schema
from ..plan.diff import Diff, FunctionChange
from .models import ApiModel, JobPhase
from .replies import inline_refs

__all__ = [
    "CronSpec",
    "DiffBuild",
    "DiffField",
    "DiffFunction",
    "DiffInvalid",
    "DiffJob",
    "DiffReply",
    "DiffRequest",
    "DiffWaiting",
    "EnvSpecValue",
    "FunctionSpec",
    "InvalidSpec",
    "JobSpec",
    "JobValue",
    "ProblemSpec",
    "RateLimitSpec",
    "ScaleSpec",
    "SecretValue",
    "WarmSpec",
    "read_request",
    "request_schema",
]


# --- diff: what the CLI sends ----------------------------------------------------------------


class _Request(ApiModel):
    model_config = ConfigDict(extra="forbid")


class SecretValue(_Request):
    secret: str
    key: str


class JobValue(_Request):
    job: str


EnvSpecValue = str | SecretValue | JobValue


def _env_spec(values: Mapping[str, model.EnvValue]) -> dict[str, EnvSpecValue]:
    def one(value: model.EnvValue) -> EnvSpecValue:
        if isinstance(value, model.SecretRef):
            return SecretValue(secret=value.secret, key=value.key)
        if isinstance(value, model.JobRef):
            return JobValue(job=value.job)
        return value

    return {name: one(value) for name, value in values.items()}


def _env_values(values: Mapping[str, EnvSpecValue]) -> dict[str, model.EnvValue]:
    def one(value: EnvSpecValue) -> model.EnvValue:
        if isinstance(value, SecretValue):
            return model.SecretRef(value.secret, value.key)
        if isinstance(value, JobValue):
            return model.JobRef(value.job)
        return value

    return {name: one(value) for name, value in sorted(values.items())}


class CronSpec(_Request):
    schedule: str
    event: dict[str, Any] = {}


class JobSpec(_Request):
    name: str
    run_id: int
    event: dict[str, Any] = {}


class WarmSpec(_Request):
    cron: str
    for_sec: float
    min: int


class ScaleSpec(_Request):
    """A function's replicas policy (``scale`` of its manifest, defaults filled in)."""

    min: int
    max: int
    target: int
    idle_sec: float
    warm: list[WarmSpec] = []

    @classmethod
    def of(cls, scale: model.Scale | None) -> ScaleSpec | None:
        if scale is None:
            return None
        warm = [WarmSpec(cron=w.cron, for_sec=w.for_sec, min=w.min) for w in scale.warm]
        return cls(
            min=scale.min, max=scale.max, target=scale.target, idle_sec=scale.idle_sec, warm=warm
        )

    def scale(self) -> model.Scale:
        warm = tuple(model.Warm(w.cron, w.for_sec, w.min) for w in self.warm)
        return model.Scale(self.min, self.max, self.target, self.idle_sec, warm)


class RateLimitSpec(_Request):
    rps: float
    burst: int


class StreamSpec(_Request):
    idle_sec: int
    max_sec: int
    drain_sec: int = 30
    request: bool = False


class WebSocketSpec(_Request):
    on_connect: str | None = None
    on_disconnect: str | None = None
    max_message_bytes: int = 1048576


class FunctionSpec(_Request):
    """One valid function as a manifest declares it; the server computes its build tag."""

    name: str
    folder: str
    manifest: str
    runtime: str
    entrypoint: str
    memory_mb: int = Field(alias="memoryMB")
    timeout_sec: int
    replicas: int
    enabled: bool
    env: dict[str, EnvSpecValue] = {}
    preview_env: dict[str, EnvSpecValue] = {}
    http: bool
    crons: list[CronSpec] = []
    jobs: list[JobSpec] = []
    source_id: str = Field(description="the git tree id of the function's folder")
    scale: ScaleSpec | None = None
    preview_scale: ScaleSpec | None = None
    replicas_named: bool = Field(False, description="whether the manifest writes replicas")
    concurrency: int = 0
    rate_limit: RateLimitSpec | None = None
    max_body_bytes: int | None = None
    stream: StreamSpec | None = None
    websocket: WebSocketSpec | None = None
    plain_http: bool = True

    @classmethod
    def from_function(cls, fn: model.Function) -> FunctionSpec:
        return cls(
            name=fn.name,
            folder=fn.folder,
            manifest=fn.manifest,
            runtime=fn.runtime,
            entrypoint=fn.entrypoint,
            memory_mb=fn.memory_mb,
            timeout_sec=fn.timeout_sec,
            replicas=fn.replicas,
            enabled=fn.enabled,
            env=_env_spec(fn.env),
            preview_env=_env_spec(fn.preview_env),
            http=fn.http,
            crons=[CronSpec(schedule=c.schedule, event=dict(c.event)) for c in fn.crons],
            jobs=[JobSpec(name=j.name, run_id=j.run_id, event=dict(j.event)) for j in fn.jobs],
            source_id=fn.source_id,
            scale=ScaleSpec.of(fn.scale),
            preview_scale=ScaleSpec.of(fn.preview_scale),
            replicas_named=fn.replicas_named,
            concurrency=fn.concurrency,
            rate_limit=RateLimitSpec(rps=fn.rate_limit.rps, burst=fn.rate_limit.burst)
            if fn.rate_limit
            else None,
            max_body_bytes=fn.max_body_bytes,
            stream=StreamSpec(
                idle_sec=fn.stream.idle_sec,
                max_sec=fn.stream.max_sec,
                drain_sec=fn.stream.drain_sec,
                request=fn.stream.request,
            )
            if fn.stream
            else None,
            websocket=WebSocketSpec(
                on_connect=fn.websocket.on_connect,
                on_disconnect=fn.websocket.on_disconnect,
                max_message_bytes=fn.websocket.max_message_bytes,
            )
            if fn.websocket
            else None,
            plain_http=fn.plain_http,
        )

    def function(self) -> model.Function:
        """The function, with the build tag this server's runtimes give its folder."""
        return model.Function(
            name=self.name,
            folder=self.folder,
            manifest=self.manifest,
            runtime=self.runtime,
            entrypoint=self.entrypoint,
            memory_mb=self.memory_mb,
            timeout_sec=self.timeout_sec,
            replicas=self.replicas,
            enabled=self.enabled,
            env=_env_values(self.env),
            preview_env=_env_values(self.preview_env),
            http=self.http,
            crons=tuple(model.CronTrigger(c.schedule, c.event) for c in self.crons),
            jobs=tuple(model.Job(j.name, j.run_id, j.event, self.name) for j in self.jobs),
            source_id=self.source_id,
            build_tag=build_tag(self.source_id, runtimes.get(self.runtime)),
            scale=self.scale.scale() if self.scale else None,
            preview_scale=self.preview_scale.scale() if self.preview_scale else None,
            replicas_named=self.replicas_named,
            concurrency=self.concurrency,
            rate_limit=model.RateLimit(self.rate_limit.rps, self.rate_limit.burst)
            if self.rate_limit
            else None,
            max_body_bytes=self.max_body_bytes,
            stream=model.StreamPolicy(
                self.stream.idle_sec,
                self.stream.max_sec,
                self.stream.drain_sec,
                self.stream.request,
            )
            if self.stream
            else None,
            websocket=model.WebSocketTrigger(
                self.websocket.on_connect,
                self.websocket.on_disconnect,
                self.websocket.max_message_bytes,
            )
            if self.websocket
            else None,
            plain_http=self.plain_http,
        )


class ProblemSpec(_Request):
    line: int
    field: str
    reason: str


class InvalidSpec(_Request):
    manifest: str
    problems: list[ProblemSpec]
    functions: list[str] = Field([], description="the function names it declares, if readable")


class DiffRequest(_Request):
    """A desired state as the CLI loaded it: valid functions and invalid manifests."""

    revision: str | None = Field(None, description="what was read: a commit, or dir:<tree id>")
    functions: list[FunctionSpec] = []
    invalid: list[InvalidSpec] = []

    @classmethod
    def from_state(cls, state: model.DesiredState) -> DiffRequest:
        return cls(
            revision=state.revision,
            functions=[FunctionSpec.from_function(fn) for fn in state.functions.values()],
            invalid=[
                InvalidSpec(
                    manifest=path,
                    problems=[
                        ProblemSpec(line=p.line, field=p.field, reason=p.reason)
                        for p in error.problems
                    ],
                    functions=sorted(
                        name for name, where in state.invalid_names.items() if where == path
                    ),
                )
                for path, error in state.invalid.items()
            ],
        )

    def desired_state(self) -> model.DesiredState:
        """Raises RuntimeNotFound for a runtime this server does not have."""
        state = model.DesiredState(self.revision or "")
        for spec in self.functions:
            state.functions[spec.name] = spec.function()
        for invalid in self.invalid:
            state.invalid[invalid.manifest] = ManifestError(
                [
                    ManifestProblem(invalid.manifest, p.line, p.field, p.reason)
                    for p in invalid.problems
                ]
            )
            for name in invalid.functions:
                state.invalid_names.setdefault(name, invalid.manifest)
        return state


# the fields of a posted function that sless.yaml writes: the manifest schema's rules
# for them (the runtime enum, the name and entrypoint patterns, the bounds) are the
# request's too, so the schema the server publishes is the one it enforces
_MANIFEST_FIELDS = ("name", "runtime", "entrypoint", "memoryMB", "timeoutSec", "replicas")
_RULES = ("enum", "pattern", "minLength", "maxLength", "minimum", "maximum")


@cache
def _request_schema() -> dict[str, Any]:
    schema = inline_refs(DiffRequest.model_json_schema(by_alias=True))
    manifest = load_schema()
    written = manifest["$defs"]["function"]["properties"]
    posted = schema["properties"]["functions"]["items"]["properties"]
    for name in _MANIFEST_FIELDS:
        rule = written[name]
        if "$ref" in rule:
            rule = manifest["$defs"][rule["$ref"].removeprefix("#/$defs/")]
        posted[name].update({key: rule[key] for key in _RULES if key in rule})
    names = {k: v for k, v in manifest["$defs"]["env"]["propertyNames"].items() if k in _RULES}
    for env in ("env", "previewEnv"):
        posted[env]["propertyNames"] = names
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def request_schema() -> dict[str, Any]:
    """The JSON Schema of a diff's body, as the API publishes it and checks each body."""
    return copy.deepcopy(_request_schema())


@cache
def _request_validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(_request_schema())


def read_request(body: bytes) -> DiffRequest:
    """A posted body checked against :func:`request_schema` first, so nothing it refuses
    is taken and nothing it allows is refused; ValueError says where and why."""
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise ValueError(f"the body is not JSON: {exc}") from None
    # the most precise first: a wrong field before the fields missing around it
    errors = sorted(
        _request_validator().iter_errors(data), key=lambda e: (-len(e.path), str(e.path))
    )
    if errors:
        shown = "; ".join(
            f"body field {'.'.join(str(p) for p in e.path) or '(root)'!r}: {e.message}"
            for e in errors[:5]
        )
        raise ValueError(shown + (f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""))
    return DiffRequest.model_validate(data)


# --- diff: what the server answers -------------------------------------------------------------


class DiffField(ApiModel):
    field: str = Field(
        description="image, runtime, entrypoint, memoryMB, timeoutSec, replicas, enabled, "
        "triggers, env.NAME, or spec when the running version is not known in detail"
    )
    old: str | None = Field(description="what runs (literal env values are never shown)")
    new: str | None
    detail: str | None


class DiffFunction(ApiModel):
    name: str
    build_tag: str
    fields: list[DiffField] = Field(description="what changes (empty for an added function)")
    note: str | None = Field(description="what it waits for, if anything")


class DiffBuild(ApiModel):
    tag: str
    folder: str
    functions: list[str]
    last_error: str | None = Field(description="why the last build of this tag failed")


class DiffJob(ApiModel):
    name: str
    run_id: int
    function: str
    after: str | None = Field(description="what it waits for in the same pass")
    phase: JobPhase | None = Field(description="the run's phase, when it has started before")


class DiffInvalid(ApiModel):
    manifest: str
    problems: list[str] = Field(description="one line per problem: file:line: field: reason")
    functions: list[str] = Field(
        description="functions it declares: Invalid, each keeps running its last good version"
    )


class DiffWaiting(ApiModel):
    name: str
    reason: str


class DiffReply(ApiModel):
    """What a sync of the posted state would change in the environment."""

    environment: str
    revision: str | None
    has_changes: bool = Field(description="anything to build, run, deploy or remove, or invalid")
    builds: list[DiffBuild]
    added: list[DiffFunction]
    changed: list[DiffFunction]
    removed: list[str]
    jobs: list[DiffJob] = Field(description="job runs that would run")
    invalid: list[DiffInvalid]
    waiting: list[DiffWaiting] = Field(
        description="functions that would wait: for a job's result, or, declared already and"
        " never started, for what they wait for now (a secret); not a change"
    )
    unchanged: list[str]

    @classmethod
    def from_diff(cls, diff: Diff, revision: str | None) -> DiffReply:
        def function(change: FunctionChange) -> DiffFunction:
            return DiffFunction(
                name=change.name,
                build_tag=change.build_tag,
                fields=[
                    DiffField(field=f.field, old=f.old, new=f.new, detail=f.detail)
                    for f in change.fields
                ],
                note=change.note,
            )

        return cls(
            environment=diff.env,
            revision=revision,
            has_changes=diff.has_changes,
            builds=[
                DiffBuild(
                    tag=b.tag, folder=b.folder, functions=list(b.functions), last_error=b.last_error
                )
                for b in diff.builds
            ],
            added=[function(c) for c in diff.added],
            changed=[function(c) for c in diff.changed],
            removed=list(diff.removed),
            jobs=[
                DiffJob(
                    name=j.name, run_id=j.run_id, function=j.function, after=j.after, phase=j.phase
                )
                for j in diff.jobs
            ],
            invalid=[
                DiffInvalid(
                    manifest=i.manifest, problems=list(i.problems), functions=list(i.functions)
                )
                for i in diff.invalid
            ],
            waiting=[DiffWaiting(name=n, reason=r) for n, r in sorted(diff.waiting.items())],
            unchanged=list(diff.unchanged),
        )
