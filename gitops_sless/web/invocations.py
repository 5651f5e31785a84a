"""The API of asynchronous invocations: read them, redrive them, publish events.

Each route answers under ``/api/v1/`` like the rest of the API, and under ``/api/``
too, where a 202's ``Location`` points (``/api/invocations/{id}``). Reads need a read
token, as job results do: a record holds the function's output. Redrives and events
need the API token. A record's ``Authorization``, ``Cookie`` and
``Proxy-Authorization`` values are never shown (they still reach the function).
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Path, Query, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import Field

from ..invocations import model
from ..invocations.engine import EngineUnavailable
from ..invocations.service import Invocations
from ..timestamps import rfc3339
from . import replies
from .models import ApiModel, Timestamp

__all__ = ["InvocationDetail", "InvocationSummary", "router"]

Status = Literal["queued", "running", "succeeded", "failed", "dead"]
SUBJECT = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")
SUBJECT_HINT = "tokens of letters, digits, '-' and '_' separated by dots, without wildcards"
_HIDDEN = frozenset({"authorization", "cookie", "proxy-authorization"})
MAX_LIST = 1000
_bearer = HTTPBearer(auto_error=False)
_READ = [Security(_bearer)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]


class AttemptView(ApiModel):
    number: int = Field(description="1 for the first; a redrive goes on counting")
    started: Timestamp
    ended: Timestamp | None = None
    status_code: int | None = Field(None, description="the function's (or the proxy's) answer")
    error: str | None = Field(None, description="why it failed; null when it did not")
    counted: bool = Field(
        description="false: cut short by the reconciler's own stop, not counted against retries"
    )


class Body(ApiModel):
    body: str = Field(description="the bytes as UTF-8 text, or base64 (bodyEncoding)")
    body_encoding: Literal["utf-8", "base64"]


class RequestView(Body):
    method: str
    path: str = Field(description="the sub-path and query sent to the function")
    headers: list[tuple[str, str]]


class ResponseView(Body):
    status_code: int
    headers: list[tuple[str, str]]
    truncated: bool = Field(description=f"only the first {model.MAX_RESPONSE_BYTES} bytes kept")


class CallbackView(ApiModel):
    url: str
    state: Literal["waiting", "pending", "delivered", "failed"]
    attempts: int
    error: str | None = None


class InvocationSummary(ApiModel):
    id: str
    env: str
    function: str
    status: Status
    created: Timestamp
    ended: Timestamp | None = None
    attempts: int = Field(description="attempts started")
    next_attempt: Timestamp | None = Field(None, description="queued: not before")
    error: str | None = Field(None, description="why the last attempt failed, or why it ended")
    subject: str | None = Field(None, description="the queue trigger's subject, if one made it")

    @classmethod
    def of(cls, inv: model.Invocation) -> InvocationSummary:
        return cls(
            id=inv.id,
            env=inv.env,
            function=inv.function,
            status=inv.status,  # type: ignore[arg-type]
            created=rfc3339(inv.created),  # type: ignore[arg-type]
            ended=rfc3339(inv.ended),
            attempts=inv.attempt,
            next_attempt=rfc3339(inv.next_at) if inv.status == model.QUEUED else None,
            error=inv.error,
            subject=inv.subject,
        )


class InvocationDetail(InvocationSummary):
    request: RequestView
    attempt_log: list[AttemptView] = Field(description="every attempt, oldest first")
    response: ResponseView | None = Field(None, description="the last answer")
    callback: CallbackView | None = None
    idempotency_key: str | None = None

    @classmethod
    def of(cls, inv: model.Invocation) -> InvocationDetail:
        summary = InvocationSummary.of(inv).model_dump(by_alias=False)
        response = inv.response
        return cls(
            **summary,
            request=RequestView(
                method=inv.method, path=inv.path, headers=_shown(inv.headers), **_body(inv.body)
            ),
            attempt_log=[
                AttemptView(
                    number=a.number,
                    started=rfc3339(a.started),  # type: ignore[arg-type]
                    ended=rfc3339(a.ended),
                    status_code=a.status_code,
                    error=a.error,
                    counted=a.counted,
                )
                for a in inv.attempts
            ],
            response=None
            if response is None
            else ResponseView(
                status_code=response.status_code,
                headers=list(response.headers),
                truncated=response.truncated,
                **_body(response.body),
            ),
            callback=None
            if inv.callback is None
            else CallbackView(
                url=inv.callback.url,
                state=inv.callback.state,  # type: ignore[arg-type]
                attempts=inv.callback.attempts,
                error=inv.callback.error,
            ),
            idempotency_key=inv.idempotency_key,
        )


class Redriven(ApiModel):
    redriven: int = Field(description="dead invocations queued again")


class Published(ApiModel):
    subject: str
    invocations: list[str] = Field(
        description="the invocations made now, one per subscribed function (with NATS they "
        "are made as the event is read, and this list is empty)"
    )


def _body(data: bytes) -> dict[str, Any]:
    try:
        return {"body": data.decode("utf-8"), "body_encoding": "utf-8"}
    except UnicodeDecodeError:
        return {"body": base64.b64encode(data).decode("ascii"), "body_encoding": "base64"}


def _shown(headers: tuple[tuple[str, str], ...]) -> list[tuple[str, str]]:
    return [(k, "<hidden>" if k.lower() in _HIDDEN else v) for k, v in headers]


def router(
    service: Invocations, authorize: Callable[[HTTPAuthorizationCredentials | None], None]
) -> APIRouter:
    """The routes; ``authorize(credentials)`` raises unless they may write."""
    routes = APIRouter(tags=["invocations"])

    def engine_needed() -> None:
        if not service.enabled:
            raise HTTPException(
                503, service.submitter.unavailable or "asynchronous invocations are off"
            )

    @routes.get("/api/v1/invocations", dependencies=_READ, responses=replies.errors(401, 422, 503))
    @routes.get("/api/invocations", include_in_schema=False)
    async def invocations(
        env: Annotated[str | None, Query(description="only this environment's")] = None,
        function: Annotated[str | None, Query(description="only this function's")] = None,
        status: Annotated[Status | None, Query(description="only in this status")] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_LIST, description="at most this many")] = 100,
        after: Annotated[str | None, Query(description="the next page: the last id seen")] = None,
    ) -> list[InvocationSummary]:
        """Invocations, oldest first (ids sort by submission time)."""
        engine_needed()
        which = model.Filter(env=env, function=function, status=status, limit=limit, after=after)
        return [InvocationSummary.of(i) for i in await _unavailable_is_503(service.list(which))]

    @routes.get(
        "/api/v1/invocations/{invocation_id}",
        dependencies=_READ,
        responses=replies.errors(401, 404, 503),
    )
    @routes.get("/api/invocations/{invocation_id}", include_in_schema=False)
    async def invocation(invocation_id: str) -> InvocationDetail:
        """One invocation: its request, every attempt, the last response, its callback."""
        engine_needed()
        found = await _unavailable_is_503(service.get(invocation_id))
        if found is None:
            raise HTTPException(404, f"no invocation {invocation_id!r}")
        return InvocationDetail.of(found)

    @routes.post(
        "/api/v1/invocations/{invocation_id}/redrive",
        responses=replies.errors(401, 403, 404, 409, 503),
    )
    @routes.post("/api/invocations/{invocation_id}/redrive", include_in_schema=False)
    async def redrive(invocation_id: str, credentials: Credentials) -> InvocationDetail:
        """Queue a dead or failed invocation again, due now, for a new round of attempts."""
        authorize(credentials)
        engine_needed()
        before = await _unavailable_is_503(service.get(invocation_id))
        if before is None:
            raise HTTPException(404, f"no invocation {invocation_id!r}")
        if before.status not in (model.DEAD, model.FAILED):
            raise HTTPException(
                409, f"invocation {invocation_id} is {before.status}: only a dead or failed one"
            )
        after = await _unavailable_is_503(service.redrive(invocation_id))
        return InvocationDetail.of(after or before)

    @routes.post("/api/v1/invocations/redrive", responses=replies.errors(401, 403, 422, 503))
    @routes.post("/api/invocations/redrive", include_in_schema=False)
    async def redrive_dead(
        env: Annotated[str, Query(description="the function's environment")],
        function: Annotated[str, Query(description="whose dead invocations")],
        credentials: Credentials,
    ) -> Redriven:
        """Queue every dead invocation of a function again."""
        authorize(credentials)
        engine_needed()
        return Redriven(redriven=await _unavailable_is_503(service.redrive_dead(env, function)))

    @routes.post(
        "/api/v1/environments/{env}/events/{subject}",
        status_code=202,
        responses=replies.errors(401, 403, 404, 413, 503),
    )
    @routes.post(
        "/api/environments/{env}/events/{subject}", include_in_schema=False, status_code=202
    )
    async def publish(
        env: str,
        subject: Annotated[str, Path(pattern=f"^{SUBJECT.pattern}$", description=SUBJECT_HINT)],
        request: Request,
        credentials: Credentials,
    ) -> Published:
        """Publish an event: every function of the environment with a queue trigger on the
        subject gets an asynchronous invocation (POST /, this body and Content-Type)."""
        authorize(credentials)
        engine_needed()
        if not service.routes.all_declared().get(env):
            raise HTTPException(404, f"no environment {env!r}")
        body = await request.body()
        if len(body) > service.submitter.max_body_bytes:
            raise HTTPException(413, f"event larger than {service.submitter.max_body_bytes} bytes")
        # the event's type and CloudEvents attributes; the caller's credentials never
        kept = tuple(
            (k, v) for k, v in request.headers.items() if k == "content-type" or k.startswith("ce-")
        )
        client = request.client.host if request.client else None
        made = await _unavailable_is_503(service.publish(env, subject, body, kept, client))
        return Published(subject=subject, invocations=[i.id for i in made])

    return routes


async def _unavailable_is_503(work: Any) -> Any:
    try:
        return await work
    except EngineUnavailable as exc:
        raise HTTPException(503, f"the queue cannot answer now: {exc}") from exc
