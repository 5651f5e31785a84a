"""The status API, webhooks and health endpoints (FastAPI). The /fn/ proxy is not here.

Reads come from the status store; the only writes are "sync now" requests,
which need the bearer token, and webhooks, which need a valid signature.
With no token or secret configured those calls are refused, never open.
Every answer is a model from :mod:`api_models` (camelCase keys, RFC 3339
times) and every error is ``{"error": "..."}``. ``/docs`` serves Swagger UI
from assets installed with the package, so it works without the internet.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request, Response, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from . import logs, webhooks
from .api_models import (
    Environment,
    ErrorReply,
    Function,
    FunctionDetail,
    Health,
    JobRun,
    Status,
    Sync,
    SyncAccepted,
    WebhookReply,
)
from .dashboard import router as dashboard_router
from .metrics import METRICS
from .reconciler import Reconciler
from .store import MAX_SYNCS, Store

__all__ = ["DOCS_ASSETS", "MAX_WEBHOOK_BYTES", "create_api"]

log = logging.getLogger(__name__)

MAX_WEBHOOK_BYTES = 1 << 20
MAX_WAIT_SEC = 600
DOCS_ASSETS = "/docs/assets"  # Swagger UI's JavaScript and CSS, from the fastapi-offline package
CLIENT_CLOSED = 499  # nginx's code for a client that went away before the answer

_ERROR_TEXT = {
    400: "the payload is malformed",
    401: "the token or signature is missing or wrong",
    403: "refused: no token or secret is configured",
    404: "no such thing",
    413: "the body is too large",
    422: "a parameter is not valid",
}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for error codes, all answered as ``{"error": ...}``."""
    return {code: {"model": ErrorReply, "description": _ERROR_TEXT[code]} for code in codes}


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(ErrorReply(error=message).model_dump(), status_code=status, headers=headers)


def _invalid_parameters(exc: RequestValidationError) -> str:
    return "; ".join(
        f"{err['loc'][0]} parameter {str(err['loc'][-1])!r}: {err['msg']}"
        if len(err["loc"]) > 1
        else str(err["msg"])
        for err in exc.errors()
    )


async def _read_capped(request: Request, limit: int) -> bytes | None:
    """The body, or None when it exceeds ``limit`` (checked before and while reading)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


def _ignored(push: webhooks.Push) -> str:
    if push.event != "push":
        return f"{push.event} event"
    return f"push to {push.branch}" if push.branch else "push to a ref that is not a branch"


def _install_error_handlers(app: FastAPI) -> None:
    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return _error(exc.status_code, str(exc.detail), exc.headers)

    async def invalid_request(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return _error(422, _invalid_parameters(exc))

    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, invalid_request)


_WEBHOOK_BODY = {
    "requestBody": {
        "required": True,
        "description": "The forge's push event, signed with the webhook secret: "
        "X-Hub-Signature-256 (GitHub), X-Gitea-Signature (Gitea), X-Gitlab-Token (GitLab).",
        "content": {"application/json": {"schema": webhooks.PushPayload.model_json_schema()}},
    }
}

_bearer = HTTPBearer(auto_error=False, description="the server's --api-token")


def create_api(
    reconciler: Reconciler,
    store: Store,
    branch: str,
    repo: str,
    api_token: str | None,
    webhook_secret: str | None,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
    poll_interval: float | None = None,
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        # uvicorn re-raises SIGTERM/SIGINT once it has shut down, so code after
        # server.run() may never run: the lifespan's end is the place to clean up
        if on_shutdown:
            await on_shutdown()

    app = FastAPIOffline(
        docs_url="/docs",
        redoc_url=None,
        static_url=DOCS_ASSETS,
        title="gitops-sless",
        summary="Serverless functions on Kubernetes, deployed by git push.",
        version="0.1.0",
        lifespan=lifespan,
    )
    _install_error_handlers(app)

    def authorize(credentials: HTTPAuthorizationCredentials | None) -> None:
        if not api_token:
            raise HTTPException(403, "mutating API calls are disabled: no API token is configured")
        given = credentials.credentials if credentials else ""
        if not hmac.compare_digest(given.encode(), api_token.encode()):
            raise HTTPException(401, "a valid 'Authorization: Bearer <token>' header is required")

    @app.get("/healthz", tags=["health"])
    def healthz() -> Health:
        return Health(status="ok")

    @app.get("/metrics", tags=["health"], response_class=PlainTextResponse)
    def metrics() -> str:
        return METRICS.render()

    @app.get("/api/v1/status", tags=["status"])
    def status() -> Status:
        env = reconciler.env
        return Status.from_rows(
            repository=repo,
            branch=branch,
            environment=env,
            functions=store.functions(env),
            syncs=store.syncs(MAX_SYNCS, env),
        )

    @app.get("/api/v1/environments", tags=["status"])
    def environments() -> list[Environment]:
        return [
            Environment.from_rows(env, store.functions(env), store.last_sync(env))
            for env in store.environments()
        ]

    @app.get("/api/v1/environments/{env}/functions", tags=["status"], responses=_errors(422))
    def functions(env: str) -> list[Function]:
        return [Function.from_row(row) for row in store.functions(env)]

    @app.get(
        "/api/v1/environments/{env}/functions/{name}", tags=["status"], responses=_errors(404, 422)
    )
    def function(env: str, name: str) -> FunctionDetail:
        row = store.function(env, name)
        if row is None:
            raise HTTPException(404, f"no function {name!r} in environment {env!r}")
        build = store.build(row["build_tag"]) if row["build_tag"] else None
        jobs = [job for job in store.jobs(env) if job["function"] == name]
        return FunctionDetail.from_rows(row, build, jobs, store.invocations(env, name))

    @app.get("/api/v1/environments/{env}/jobs", tags=["status"], responses=_errors(422))
    def jobs(env: str) -> list[JobRun]:
        return [JobRun.from_row(row) for row in store.jobs(env)]

    @app.get("/api/v1/syncs", tags=["status"], responses=_errors(422))
    def syncs(
        limit: Annotated[int, Query(description=f"how many, newest first (1-{MAX_SYNCS})")] = 50,
    ) -> list[Sync]:
        return [Sync.from_row(row) for row in store.syncs(min(max(limit, 1), MAX_SYNCS))]

    @app.post("/api/v1/sync", tags=["sync"], status_code=202, responses=_errors(401, 403, 422))
    def sync(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)],
        wait: Annotated[
            float,
            Query(description=f"seconds to wait for the pass to finish (at most {MAX_WAIT_SEC})"),
        ] = 0,
    ) -> SyncAccepted:
        authorize(credentials)
        before = reconciler.passes
        reconciler.request_sync("api")
        finished = reconciler.wait_for_pass(before, min(wait, MAX_WAIT_SEC)) if wait > 0 else False
        return SyncAccepted.from_rows(store.last_sync(reconciler.env), finished=finished)

    @app.post(
        "/api/v1/webhooks/{forge}",
        tags=["webhooks"],
        status_code=202,
        responses={
            200: {"model": WebhookReply, "description": "another branch or event: ignored"},
            **_errors(400, 401, 403, 404, 413, 422),
        },
        openapi_extra=_WEBHOOK_BODY,
    )
    async def webhook(forge: str, request: Request, response: Response) -> WebhookReply:
        if forge not in webhooks.FORGES:
            raise HTTPException(
                404, f"no webhook for {forge!r}; use one of {', '.join(webhooks.FORGES)}"
            )
        if not webhook_secret:
            raise HTTPException(403, "webhooks are disabled: no webhook secret is configured")
        try:
            body = await _read_capped(request, MAX_WEBHOOK_BYTES)
        except ClientDisconnect:
            logs.event(
                log,
                "webhook.disconnected",
                f"{forge} webhook: the client closed the connection before sending its body",
                level=logging.DEBUG,
            )
            raise HTTPException(CLIENT_CLOSED, "client closed the connection") from None
        if body is None:
            raise HTTPException(413, f"webhook body is larger than {MAX_WEBHOOK_BYTES} bytes")
        headers = {k.lower(): v for k, v in request.headers.items()}
        try:
            webhooks.verify(forge, headers, body, webhook_secret)
            push = webhooks.parse_push(forge, headers, body)
        except webhooks.SignatureError as exc:
            raise HTTPException(401, f"webhook refused: {exc}") from None
        except webhooks.PayloadError as exc:
            raise HTTPException(400, str(exc)) from None
        if push.event != "push" or push.branch != branch:
            response.status_code = 200
            return WebhookReply(accepted=False, ignored=_ignored(push))
        reconciler.request_sync(f"webhook:{forge}")
        return WebhookReply(accepted=True)

    app.include_router(dashboard_router(reconciler, store, repo, branch, poll_interval))
    return app
